"""A client that leaves mid-stream is logged at DEBUG by the waitress front end, not INFO."""

from __future__ import annotations

import logging
import socket
import threading
import time

from toppings.server.http.frontend import waitress_settings
from toppings.server.http.waitress_server import DISCONNECT_LINE, GuardedServer

BOUND_S = 30  # bounded waits: a broken build fails instead of hanging


def test_a_client_leaving_mid_stream_is_a_debug_line(caplog):
    def app(environ, start_response):
        start_response("200 OK", [("Content-Type", "text/event-stream")])

        def body():
            for _ in range(int(BOUND_S / 0.01)):  # until its writes find the client gone
                yield b"data: x\n\n"
                time.sleep(0.01)

        return body()

    server = GuardedServer(app, 10, host="127.0.0.1", port=0, **waitress_settings(2, 1, 10))
    threading.Thread(target=server.run, daemon=True).start()
    caplog.set_level(logging.DEBUG, logger="waitress")
    try:
        with socket.create_connection(("127.0.0.1", server.effective_port), BOUND_S) as sock:
            sock.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(64)  # the stream has started
        deadline = time.monotonic() + BOUND_S
        lines = []
        while not lines and time.monotonic() < deadline:
            lines = [r for r in caplog.records if r.getMessage().startswith(DISCONNECT_LINE)]
            time.sleep(0.05)
    finally:
        server.task_dispatcher.shutdown()
        server.trigger.pull_trigger(server.close)
    assert lines, "waitress never noticed the client leave"
    assert [r.levelno for r in lines] == [logging.DEBUG]
