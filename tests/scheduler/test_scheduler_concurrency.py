"""Streams through a real `toppings-scheduler` process: its front end must not cap the batch of
the servers behind it (it ran 32 waitress threads, one per proxied stream, and so capped every
server's batch at 32 while its own /stats went unanswered)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import requests

from tests.server.api.test_frontend_concurrency import REPO, Streamer, start_server, stop

NUM_CLIENTS = 48
OLD_THREAD_CAP = 32


def test_48_streams_through_the_scheduler_share_one_batch(tmp_path, tiny_model_dir, free_port):
    server_port, port = free_port(), free_port()
    server = start_server(tmp_path, tiny_model_dir, server_port)
    url, server_url = f"http://127.0.0.1:{port}", f"http://127.0.0.1:{server_port}"
    log = tmp_path / "scheduler.log"
    cmd = [sys.executable, "-m", "toppings.scheduler.cli", "--registry",
           str(tmp_path / "reg.sqlite"), "--port", str(port)]  # fmt: skip
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    scheduler = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log.open("w"),
                                 stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while True:
            assert scheduler.poll() is None, log.read_text()
            try:
                added = requests.post(url + "/admin/servers", json={"url": server_url}, timeout=10)
                assert added.status_code == 201, added.text
                break
            except requests.ConnectionError:
                assert time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
        clients = [Streamer(url) for _ in range(NUM_CLIENTS)]
        for c in clients:
            c.start()
        max_running = 0
        while any(c.is_alive() for c in clients):
            assert requests.get(url + "/stats", timeout=30).status_code == 200
            stats = requests.get(server_url + "/stats", timeout=30).json()
            max_running = max(max_running, len(stats["running"]))
            time.sleep(0.05)
        for c in clients:
            c.join()
            c.assert_finished()
        assert max_running > OLD_THREAD_CAP, f"the running batch never exceeded {max_running}"
    finally:
        scheduler.terminate()
        scheduler.wait(timeout=60)
        stop(server)
