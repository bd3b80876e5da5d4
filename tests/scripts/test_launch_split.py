"""toppings-launch with a device/host split: each server's --device-cores and --cpu-cores are
disjoint and both inside the core set the server is bound to."""

from __future__ import annotations

import pytest

from toppings.scripts.launch.cli import parse_args
from toppings.scripts.launch.plan import plan_servers, serve_command


def flags_of(cmd: list[str]) -> dict[str, str]:
    return dict(zip(cmd[3::2], cmd[4::2]))


def test_each_server_splits_its_own_cores(tmp_path):
    args = parse_args(
        ["--model", "m", "--cores", "0-7", "--num-servers", "2", "--device-cores-per-server", "3"]
    )
    servers = plan_servers(args, tmp_path)
    for server, device, host in zip(servers, ["0,1,2", "4,5,6"], ["3", "7"]):
        flags = flags_of(serve_command(args, server))
        assert flags["--device-cores"] == device and flags["--cpu-cores"] == host
        assert flags["--cpu-workers"] == "1"  # one per host core
        used = {int(c) for c in (device + "," + host).split(",")}
        assert used == set(server.cores)  # inside the set the server is bound to


def test_no_split_keeps_the_whole_set_for_workers(tmp_path):
    args = parse_args(["--model", "m", "--cores", "0-3"])
    flags = flags_of(serve_command(args, plan_servers(args, tmp_path)[0]))
    assert flags["--cpu-cores"] == "0,1,2,3" and "--device-cores" not in flags


def test_a_split_without_host_cores_or_given_twice_is_refused(tmp_path):
    args = parse_args(["--model", "m", "--cores", "0-3", "--device-cores-per-server", "4"])
    with pytest.raises(ValueError, match="leaves no host core"):
        plan_servers(args, tmp_path)
    args = parse_args(["--model", "m", "--cores", "0-3", "--", "--device-cores", "0"])
    with pytest.raises(ValueError, match="--device-cores-per-server"):
        plan_servers(args, tmp_path)
    args = parse_args(
        ["--model", "m", "--cores", "0-3", "--device-cores-per-server", "2", "--cpu-workers", "3"]
    )
    with pytest.raises(ValueError, match="cpu-workers"):
        plan_servers(args, tmp_path)
