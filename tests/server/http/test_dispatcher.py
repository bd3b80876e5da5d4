"""Waitress's handler threads in the GuardedServer: woken last-in first-out, so that requests one
after the other run on one or two of its many threads (the stock dispatcher took them in turn:
every thread, each keeping what its last request left), and none keeps a served request's
connection alive once it is done (issue 48's soak)."""

from __future__ import annotations

import gc
import threading

import pytest
import requests

from toppings.server.http.waitress_server import GuardedServer, HeaderTimedChannel, LifoCondition

BOUND_S = 30
NUM_THREADS = 8
NUM_REQUESTS = 40


@pytest.fixture
def server_and_threads():
    """A GuardedServer of NUM_THREADS handler threads whose app records the thread of each
    request; yields its URL and that list."""
    seen: list[int] = []

    def app(environ, start_response):
        seen.append(threading.get_ident())
        start_response("200 OK", [("Content-Type", "text/plain")])
        return [b"ok"]

    server = GuardedServer(app, 10, host="127.0.0.1", port=0, threads=NUM_THREADS)
    threading.Thread(target=server.run, daemon=True).start()
    yield f"http://127.0.0.1:{server.effective_port}", seen
    server.task_dispatcher.shutdown()
    server.trigger.pull_trigger(server.close)


def test_requests_one_after_the_other_use_few_handler_threads(server_and_threads):
    url, seen = server_and_threads
    for _ in range(NUM_REQUESTS):  # a new connection each (no session)
        assert requests.get(url, timeout=BOUND_S).text == "ok"
    assert len(seen) == NUM_REQUESTS
    # The thread that served one request is the last idle one when the next arrives; or, when the
    # next arrives before it is back waiting, the one idle before it.
    assert len(set(seen)) <= 2, f"{len(set(seen))} of {NUM_THREADS} threads served them"


def test_no_handler_thread_keeps_a_served_connection(server_and_threads):
    url, _ = server_and_threads
    for _ in range(NUM_REQUESTS):
        with requests.Session() as session:  # closed: the server ends the connection
            assert session.get(url, timeout=BOUND_S).text == "ok"
    pause = threading.Event()
    for _ in range(100):  # waitress's loop closes a channel soon after its client went away
        gc.collect()
        # Their reprs, not the channels: a list of them kept to the next turn would keep them alive.
        alive = [repr(o) for o in gc.get_objects() if isinstance(o, HeaderTimedChannel)]
        if not alive:
            break
        pause.wait(0.05)
    assert alive == []


def test_lifo_condition_wakes_the_newest_waiter():
    cv = LifoCondition()
    woken: list[int] = []
    waiting = threading.Semaphore(0)

    def waiter(idx: int) -> None:
        with cv:
            waiting.release()  # released under the lock: it is in the waiters once cv is free
            cv.wait(BOUND_S)
            woken.append(idx)

    threads = []
    for idx in range(3):
        threads.append(threading.Thread(target=waiter, args=(idx,)))
        threads[-1].start()
        assert waiting.acquire(timeout=BOUND_S)
    for expected in ([2], [2, 1], [2, 1, 0]):
        with cv:
            cv.notify()
        threads[expected[-1]].join(BOUND_S)
        assert woken == expected
