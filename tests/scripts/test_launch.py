"""toppings-launch without servers: core splitting, flags and TOML, the server command line."""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
import time

import pytest

from toppings.scripts.launch.cli import parse_args
from toppings.scripts.launch.plan import numactl_usable, plan_servers, serve_command, split_cores
from toppings.scripts.launch.procs import ServerProc, spawn_server, stop_servers
from toppings.scripts.launch.report import _cores_text


@pytest.mark.parametrize(
    "num_cores, num_sets", [(16, 1), (16, 2), (16, 3), (7, 7), (10, 4), (2, 2)]
)
def test_split_cores_is_disjoint_balanced_and_complete(num_cores, num_sets):
    cores = list(range(100, 100 + num_cores))[::-1]  # any ids, any order
    sets = split_cores(cores, num_sets)
    assert len(sets) == num_sets and all(sets)
    for a, b in itertools.combinations(sets, 2):
        assert not set(a) & set(b)
    assert sorted(c for s in sets for c in s) == sorted(cores)
    sizes = [len(s) for s in sets]
    assert max(sizes) - min(sizes) <= 1
    for s in sets:  # contiguous runs of ids
        assert list(s) == list(range(s[0], s[0] + len(s)))


def test_split_cores_refuses_what_cannot_be_disjoint():
    with pytest.raises(ValueError, match="disjoint"):
        split_cores([0, 1], 3)
    with pytest.raises(ValueError):
        split_cores([0, 1], 0)
    assert split_cores([3, 3, 4], 2) == [(3,), (4,)]  # duplicates count once


def test_cores_text():
    assert _cores_text((0, 1, 2, 5, 7, 8)) == "0-2,5,7-8"
    assert _cores_text((4,)) == "4"


def test_flags_toml_and_serve_args(tmp_path):
    config = tmp_path / "node.toml"
    config.write_text(
        'model = "/models/base"\nnum-servers = 2\ncores = "0-5"\nlora_dir = ["/loras"]\n'
        'serve_args = ["--lora-mode", "cpu-assisted"]\nbase_port = 9000\n'
    )
    args = parse_args(["--config", str(config), "--base-port", "9100", "--", "--kernel", "bgmv"])
    assert args.model == "/models/base" and args.num_servers == 2
    assert args.base_port == 9100  # the flag wins over the file
    assert args.serve_args == ("--lora-mode", "cpu-assisted", "--kernel", "bgmv")
    servers = plan_servers(args, tmp_path)
    assert [s.cores for s in servers] == [(0, 1, 2), (3, 4, 5)]
    assert [s.url for s in servers] == ["http://127.0.0.1:9100", "http://127.0.0.1:9101"]
    cmd = serve_command(args, servers[1])
    assert cmd[:3] == [sys.executable, "-m", "toppings.server.cli"]
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert flags["--cpu-cores"] == "3,4,5" and flags["--cpu-workers"] == "3"
    assert flags["--port"] == "9101" and flags["--lora-dir"] == "/loras"
    assert cmd[-4:] == ["--lora-mode", "cpu-assisted", "--kernel", "bgmv"]


def test_bad_configs_are_refused(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text('model = "m"\nnum_servrs = 2\n')
    with pytest.raises(SystemExit):
        parse_args(["--config", str(config)])
    with pytest.raises(SystemExit):
        parse_args([])  # no model
    args = parse_args(
        ["--model", "m", "--cores", "0-3", "--num-servers", "2", "--cpu-workers", "3"]
    )
    with pytest.raises(ValueError, match="cpu-workers"):
        plan_servers(args, tmp_path)
    args = parse_args(["--model", "m", "--device", "cuda", "--gpus", "0,1", "--num-servers", "3"])
    with pytest.raises(ValueError, match="GPUs"):
        plan_servers(args, tmp_path)
    args = parse_args(["--model", "m", "--device", "cuda", "--gpus", "2,3", "--cores", "0-7"])
    assert [(s.gpu, s.cores) for s in plan_servers(args, tmp_path)] == [
        (2, (0, 1, 2, 3)),
        (3, (4, 5, 6, 7)),
    ]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
@pytest.mark.parametrize("use_numactl", [False, True])
def test_spawned_process_is_bound_and_stopped(tmp_path, use_numactl):
    core = sorted(os.sched_getaffinity(0))[-1]
    if use_numactl and not numactl_usable((core,)):
        pytest.skip("numactl is not installed or may not bind here")
    server = ServerProc(0, "http://127.0.0.1:1", (core,), 1, None, tmp_path / "s.log")
    # A stand-in that ignores SIGTERM, so stopping must escalate to SIGKILL.
    ready = tmp_path / "ready"
    script = (
        "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        f"open({str(ready)!r}, 'w').close(); time.sleep(60)"
    )
    spawn_server(server, [sys.executable, "-c", script], use_numactl=use_numactl)
    pid = server.proc.pid
    deadline = time.monotonic() + 30
    while not ready.exists():
        assert time.monotonic() < deadline and server.proc.poll() is None
        time.sleep(0.05)
    assert os.sched_getaffinity(pid) == {core}
    assert os.getpgid(pid) == pid  # its own session: a terminal's Ctrl-C goes to the launcher
    stop_servers([server], timeout_s=1.0)
    assert server.state == "stopped" and server.last_exit == -9 and server.proc is None
    with pytest.raises(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)
    assert subprocess.run(["kill", "-0", str(pid)], capture_output=True).returncode != 0


def test_launcher_runs_its_own_scheduler(tmp_path, tiny_model_dir, free_port):
    """--start-scheduler: the scheduler comes up (with an admin key: the launcher's probe of its
    /admin carries it, and the key is not in the launcher's log), the server registers, a
    request is routed through it; a hung scheduler (SIGSTOP) is killed and restarted and routes
    again; SIGTERM stops the scheduler with the servers."""
    import re
    import signal
    import threading

    import requests

    sched_port, server_port = free_port(), free_port()
    ADMIN = {"Authorization": "Bearer s3cret-admin"}  # noqa: N806
    cmd = [sys.executable, "-m", "toppings.scripts.launch.cli", "--model", str(tiny_model_dir),
           "--num-servers", "1", "--cpu-workers", "0", "--base-port", str(server_port),
           "--start-scheduler", "--scheduler-port", str(sched_port),
           "--scheduler-arg=--policy=least-loaded", "--unhealthy-timeout", "3",
           "--scheduler-arg=--admin-api-key=s3cret-admin",
           "--log-dir", str(tmp_path / "logs")]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True).start()
    scheduler = f"http://127.0.0.1:{sched_port}"

    def registered_state() -> dict:
        deadline = time.monotonic() + 120
        while True:  # registered: the scheduler lists the server
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines[-20:])
            try:
                state = requests.get(scheduler + "/admin/state", timeout=2, headers=ADMIN).json()
                if state.get("servers"):
                    return state
            except requests.RequestException:
                pass
            time.sleep(0.3)

    def scheduler_pids() -> list[int]:
        return [
            int(m.group(1))
            for line in list(lines)
            if (m := re.search(r"scheduler: pid (\d+)", line))
        ]

    try:
        state = registered_state()
        assert state["policy"] == "least-loaded"  # --scheduler-arg reached it
        models = requests.get(scheduler + "/v1/models", timeout=5).json()["data"]
        body = {"model": models[0]["id"], "prompt": "abc", "max_tokens": 3}
        answer = requests.post(scheduler + "/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        assert (tmp_path / "logs" / "registry.sqlite").is_file()

        first = scheduler_pids()[-1]
        os.kill(first, signal.SIGSTOP)  # alive, but answers nothing
        deadline = time.monotonic() + 60
        while scheduler_pids()[-1] == first:
            assert time.monotonic() < deadline, "".join(lines[-20:])
            time.sleep(0.3)
        with pytest.raises(ProcessLookupError):
            os.kill(first, 0)  # the hung one was killed and reaped
        registered_state()
        answer = requests.post(scheduler + "/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        assert any("scheduler unhealthy for 3 s; killing it" in line for line in lines)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    with pytest.raises(requests.ConnectionError):
        requests.get(scheduler + "/health", timeout=2)
    assert not any("s3cret-admin" in line for line in lines)  # the command lines logged: KEY


def test_a_hung_server_is_restarted(tmp_path, tiny_model_dir, free_port):
    """A server that stops answering /health (SIGSTOP) is killed and started again."""
    import re
    import signal
    import threading

    port = free_port()
    cmd = [sys.executable, "-m", "toppings.scripts.launch.cli", "--model", str(tiny_model_dir),
           "--num-servers", "1", "--cpu-workers", "0", "--base-port", str(port),
           "--unhealthy-timeout", "3", "--restart-backoff", "0.1",
           "--log-dir", str(tmp_path / "logs")]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()

    def healthy_pid(not_pid: int | None = None) -> int:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            for line in reversed(list(lines)):
                m = re.search(r"server=0 .* pid=(\d+) .* state=healthy", line)
                if m and int(m.group(1)) != not_pid:
                    return int(m.group(1))
            assert proc.poll() is None, "".join(lines)
            time.sleep(0.2)
        raise AssertionError("no healthy server: " + "".join(lines[-20:]))

    try:
        first = healthy_pid()
        os.kill(first, signal.SIGSTOP)  # alive, but answers nothing
        second = healthy_pid(not_pid=first)
        assert second != first
        with pytest.raises(ProcessLookupError):
            os.kill(first, 0)  # the hung one was killed and reaped
        assert any("unhealthy for 3 s; killing it" in line for line in lines)
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0


def test_a_registration_refused_for_its_key_names_the_key(monkeypatch, caplog):
    """A scheduler with an admin key the launcher was not given: the warning says where the
    key goes (it said only UNAUTHORIZED, every few seconds)."""
    import requests

    from toppings.scripts.launch import node

    class Refused:
        status_code, text = 401, '{"error": {"message": "a valid admin key is required"}}'

    monkeypatch.setattr(requests, "request", lambda *args, **kwargs: Refused())
    assert not node.scheduler_call("post", "http://127.0.0.1:9", "http://127.0.0.1:8")
    assert "$TOPPINGS_ADMIN_API_KEY, or --scheduler-arg=--admin-api-key=KEY" in caplog.text
