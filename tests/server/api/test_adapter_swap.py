"""A file of an adapter directory swapped for a symlink out of the allowed root between the path
check and the load is refused: the loader opens the files without following a symlink."""

from __future__ import annotations

import json
import os
import time

import pytest

from toppings.server.api.admin.lifecycle import AdapterPaths
from toppings.server.api.app import ApiOptions, create_app

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory, tiny_model_dir):
    """`root/good`, and outside the root a config that would load too, with another alpha."""
    from toppings.scripts.make_adapters import make_random_adapter

    tmp = tmp_path_factory.mktemp("swap")
    good = make_random_adapter(tmp / "root" / "good", tiny_model_dir, rank=8, seed=1)
    outside = tmp / "outside"
    outside.mkdir()
    cfg = json.loads((good / CONFIG).read_text())
    (outside / CONFIG).write_text(json.dumps(cfg | {"lora_alpha": 777}))
    (outside / WEIGHTS).write_bytes((good / WEIGHTS).read_bytes())
    return {"root": tmp / "root", "good": good, "outside": outside}


@pytest.fixture(scope="module")
def engine(tiny_engine):
    with tiny_engine(max_total_tokens=512) as eng:
        yield eng


@pytest.mark.parametrize("name", [CONFIG, WEIGHTS])
def test_a_file_swapped_for_a_symlink_after_the_path_check_is_refused(
    engine, dirs, monkeypatch, name
):
    checked = AdapterPaths.resolve

    def resolve_then_swap(self, raw):
        real = checked(self, raw)  # the path check passes on the regular file
        os.replace(os.path.join(real, name), os.path.join(real, name + ".orig"))
        os.symlink(dirs["outside"] / name, os.path.join(real, name))
        return real

    monkeypatch.setattr(AdapterPaths, "resolve", resolve_then_swap)
    client = create_app(engine, ApiOptions(lora_roots=(str(dirs["root"]),))).test_client()
    try:
        answer = client.post("/v1/load_lora_adapter",
                             json={"lora_name": "swapped", "lora_path": "good"})  # fmt: skip
        assert answer.status_code == 400, answer.get_data(as_text=True)
        assert f"{name} is a symlink" in answer.get_json()["error"]["message"]
        assert "swapped" not in {a["name"] for a in engine.adapters()}
    finally:
        os.replace(dirs["good"] / (name + ".orig"), dirs["good"] / name)


def test_a_config_swapped_between_symlink_and_file_during_loads_gives_4xx_only(dirs, engine):
    # Issue 48: 1 load in 300 answered 500 (OSError from realpath's readlink of an entry that
    # had just become a regular file). A thread swaps adapter_config.json between a symlink
    # (inside the root) and a regular file while loads run; every answer is a 200 or a 4xx.
    import threading

    racing = dirs["root"] / "racing"
    racing.mkdir()
    (racing / WEIGHTS).write_bytes((dirs["good"] / WEIGHTS).read_bytes())
    (racing / "real.json").write_bytes((dirs["good"] / CONFIG).read_bytes())
    target, stop = racing / CONFIG, threading.Event()

    def swap() -> None:
        # Each state is held for a moment (the sleeps give the loads the interpreter in it):
        # without them the loads, run on the server's adapter thread, met the link nearly always.
        while not stop.is_set():
            os.symlink("real.json", racing / "link.tmp")
            os.replace(racing / "link.tmp", target)
            time.sleep(0.0005)
            (racing / "file.tmp").write_bytes((racing / "real.json").read_bytes())
            os.replace(racing / "file.tmp", target)
            time.sleep(0.0005)

    client = create_app(engine, ApiOptions(lora_roots=(str(dirs["root"]),))).test_client()
    swapper = threading.Thread(target=swap)
    swapper.start()
    statuses = []
    try:
        for i in range(300):
            answer = client.post("/v1/load_lora_adapter",
                                 json={"lora_name": f"race{i}", "lora_path": "racing"})  # fmt: skip
            statuses.append(answer.status_code)
            if answer.status_code == 200:
                client.post("/v1/unload_lora_adapter", json={"lora_name": f"race{i}"})
    finally:
        stop.set()
        swapper.join()
    assert all(s == 200 or 400 <= s < 500 for s in statuses), sorted(set(statuses))
    assert 200 in statuses


def test_an_entry_that_changes_under_realpath_is_a_409(dirs, engine, monkeypatch):
    # The race above made deterministic: readlink finds no symlink where lstat saw one.
    def readlink(path, *args, **kwargs):
        raise OSError(22, "Invalid argument", path)

    client = create_app(engine, ApiOptions(lora_roots=(str(dirs["root"]),))).test_client()
    (dirs["root"] / "link").symlink_to("good")
    monkeypatch.setattr(os, "readlink", readlink)
    answer = client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "link"})
    assert answer.status_code == 409
    assert "changed while it was being read" in answer.get_json()["error"]["message"]
