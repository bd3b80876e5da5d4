"""A full /dev/shm at an adapter load: the load gets 507 with the reason, the server keeps
serving its other adapters and the base model, and a later load succeeds.

/dev/shm is not filled: the arena's reservation of the new adapter's block is asked for more
bytes than the whole tmpfs holds, which the kernel refuses (ENOSPC) as it would a full one.
"""

from __future__ import annotations

import os

import pytest
import waitress

from toppings.cpu_lora import shm
from toppings.server.api.app import ApiOptions, create_app
from toppings.server.config import WORKER_SPINCOUNT


@pytest.fixture(scope="module")
def adapters_dir(tmp_path_factory, tiny_model_dir):
    from toppings.scripts.make_adapters import make_random_adapter

    root = tmp_path_factory.mktemp("shm_full")
    for i, name in enumerate(("old", "new")):
        make_random_adapter(root / name, tiny_model_dir, rank=8, seed=i)
    return root


@pytest.fixture(scope="module")
def engine(adapters_dir, tiny_engine):
    loras = {"old": str(adapters_dir / "old")}
    with tiny_engine(
        loras, max_total_tokens=2048, lora_mode="cpu-assisted", num_cpu_workers=1
    ) as eng:
        yield eng


def generate(client, adapter: str | None):
    body = {"prompt": "hi", "max_new_tokens": 3, "ignore_eos": True}
    if adapter is not None:
        body["adapter"] = adapter
    return client.post("/generate", json=body)


def test_load_with_dev_shm_full_is_507_and_the_server_keeps_serving(
    engine, adapters_dir, monkeypatch
):
    assert engine.lora.host.repository is not None  # the workers' shared arena is in use
    client = create_app(engine, ApiOptions(lora_roots=(str(adapters_dir),))).test_client()
    st = os.statvfs(shm.SHM_DIR)
    beyond = st.f_blocks * st.f_frsize + (1 << 30)
    real = shm.reserve_shm
    monkeypatch.setattr(shm, "reserve_shm", lambda name, at, n: real(name, at, n + beyond))
    load = {"lora_name": "new", "lora_path": str(adapters_dir / "new")}
    refused = client.post("/v1/load_lora_adapter", json=load)
    assert refused.status_code == 507, refused.get_data(as_text=True)
    error = refused.get_json()["error"]
    assert error["type"] == "insufficient_storage" and error["code"] == 507
    assert "shared memory is full" in error["message"] and shm.SHM_DIR in error["message"]
    assert [a["name"] for a in engine.adapters()] == ["old"]
    assert engine.is_healthy()
    for adapter in ("old", None):
        ok = generate(client, adapter)
        assert ok.status_code == 200 and len(ok.get_json()["token_ids"]) == 3
    monkeypatch.setattr(shm, "reserve_shm", real)
    loaded = client.post("/v1/load_lora_adapter", json=load)
    assert loaded.status_code == 200, loaded.get_data(as_text=True)
    ok = generate(client, "new")
    assert ok.status_code == 200 and len(ok.get_json()["token_ids"]) == 3


def started(*args, **kwargs):
    raise AssertionError("the server started")


def test_dev_shm_full_at_start_up_is_one_error_line(tiny_model_dir, monkeypatch, capsys):
    """The workers' arena cannot be made: `toppings-serve` says so in one line and exits 2."""
    from toppings.server import cli

    st = os.statvfs(shm.SHM_DIR)
    beyond = st.f_blocks * st.f_frsize + (1 << 30)
    real = shm.create_shm
    monkeypatch.setattr(
        shm, "create_shm", lambda name, size, reserve=None: real(name, beyond, reserve=beyond)
    )
    monkeypatch.setattr(waitress, "create_server", started)  # a start that passes ends here
    monkeypatch.setenv("GOMP_SPINCOUNT", "0")
    monkeypatch.delenv("GOMP_SPINCOUNT")  # cli sets it for the workers; unset after the test
    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    before = shm.leftovers()
    argv = ["--model", str(tiny_model_dir), "--port", "0", "--dtype", "float32",
            "--lora-mode", "cpu-assisted", "--cpu-workers", "1"]  # fmt: skip
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "toppings-serve: error:" in line]
    assert len(lines) == 1 and "shared memory is full" in lines[0], err
    assert "Traceback" not in err
    assert shm.leftovers() == before
    # with workers, a short spin for the engine's OpenMP threads, not PASSIVE (a slow decode)
    assert os.environ.get("GOMP_SPINCOUNT") == WORKER_SPINCOUNT
    assert "OMP_WAIT_POLICY" not in os.environ
