"""Adapter rank and size limits over HTTP (issue 33): a rank above --max-lora-rank is a 400
naming the limit, an adapter larger than the whole adapter budget a 507 naming bytes and budget;
both are refused before any tensor is read or any pool memory allocated, and the server keeps
serving its other adapters."""

from __future__ import annotations

import re
import shutil

import pytest

from tests.gpu_lora.peft_dirs import write_peft_adapter
from tests.server.api.test_cli_errors import assert_refused, run
from toppings.gpu_lora.peft.adapter import AdapterError
from toppings.gpu_lora.targets import LORA_TARGETS
from toppings.server.adapters import reader as adapter_reader
from toppings.server.adapters.reader import derived_max_rank
from toppings.server.api.admin.files import adapter_digest
from toppings.server.api.app import ApiOptions, create_app
from toppings.server.config import EngineConfig
from toppings.server.model.loader import load_checkpoint
from toppings.server.runtime import build_engine


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_checkpoint(str(tiny_model_dir)).config


@pytest.fixture(scope="module")
def budget(model) -> int:
    """Adapter cache bytes: 100 rows of the projection of smallest rows (float32), so that the
    derived rank limit is 64."""
    return 100 * min(model.num_layers * sum(model.projection_shape(m)) * 4 for m in LORA_TARGETS)


@pytest.fixture(scope="module")
def root(tmp_path_factory, model):
    """Adapters beside the served one: over the rank limit, over the budget, and fitting."""
    root = tmp_path_factory.mktemp("limits")
    write_peft_adapter(root / "small", model, rank=8, seed=1)
    write_peft_adapter(root / "rank128", model, rank=128, layers=(0,), seed=2)
    write_peft_adapter(root / "huge", model, rank=64, modules=("q_proj", "up_proj"), seed=3)
    write_peft_adapter(root / "fits", model, rank=16, modules=("v_proj",), layers=(1,), seed=4)
    return root


@pytest.fixture(scope="module")
def engine(tiny_engine, root, budget):
    loras = {"small": str(root / "small")}
    with tiny_engine(
        loras, max_total_tokens=2048, lora_mode="on-demand", adapter_cache_bytes=budget
    ) as eng:
        yield eng


@pytest.fixture(scope="module")
def client(engine, root):
    return create_app(engine, ApiOptions(lora_roots=(str(root),))).test_client()


def load(client, name: str, root):
    return client.post(
        "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(root / name)}
    )


def assert_serving(client) -> None:
    ok = client.post("/generate", json={"adapter": "small", "prompt": "hi", "max_new_tokens": 3})
    assert ok.status_code == 200, ok.get_json()
    assert len(ok.get_json()["token_ids"]) <= 3


def test_the_default_limit_is_derived_from_the_budget(engine, budget):
    pool = engine.lora.pool
    assert engine.lora.max_lora_rank == derived_max_rank(pool, budget) == 64
    assert derived_max_rank(pool, None) == 256


def test_rank_above_the_limit_is_a_400_naming_it_and_allocates_nothing(client, engine, root):
    assert_serving(client)
    before = engine.lora.pool.nbytes
    reply = load(client, "rank128", root)
    assert reply.status_code == 400
    error = reply.get_json()["error"]
    assert "128" in error["message"] and "64" in error["message"]
    assert "--max-lora-rank" in error["message"]
    assert engine.lora.pool.nbytes == before
    assert "rank128" not in [a["name"] for a in engine.adapters()]
    assert_serving(client)


def test_adapter_larger_than_the_budget_is_a_507_naming_bytes(client, engine, root, budget):
    before = engine.lora.pool.nbytes
    reply = load(client, "huge", root)
    assert reply.status_code == 507
    error = reply.get_json()["error"]
    assert error["type"] == "insufficient_storage"
    need = engine.lora.pool.bytes_for(64, ("q_proj", "up_proj"))
    assert str(need) in error["message"] and str(budget) in error["message"]
    assert engine.lora.pool.nbytes == before
    assert "huge" not in [a["name"] for a in engine.adapters()]
    assert_serving(client)


def test_an_adapter_that_fits_is_charged_its_rows_and_the_pool_stays_in_budget(
    client, engine, root, budget
):
    assert load(client, "fits", root).status_code == 200
    ok = client.post("/generate", json={"adapter": "fits", "prompt": "hi", "max_new_tokens": 2})
    assert ok.status_code == 200
    lora = engine.lora
    assert lora.bytes_of(engine.resolve_adapter("fits")) == lora.pool.bytes_for(16, ("v_proj",))
    assert lora.pool.nbytes <= budget
    assert_serving(client)


def in_store(store, root, name: str) -> str:
    """Put an adapter where a peer fetch of it with its digest finds it already fetched (the
    same register path as a download, without a peer to download from)."""
    digest = adapter_digest(root / name)
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)[:100]
    shutil.copytree(root / name, store / f"{safe}-{digest[:16]}")
    return digest


@pytest.mark.parametrize("name, status", [("rank128", 400), ("huge", 507)])
def test_peer_fetch_with_a_caller_supplied_hash_is_refused_alike(
    engine, root, tmp_path, name, status
):
    store = tmp_path / "store"
    store.mkdir()
    options = ApiOptions(adapter_store=str(store), peers=("http://127.0.0.1:9",))
    fetching = create_app(engine, options).test_client()
    digest = in_store(store, root, name)
    before = engine.lora.pool.nbytes
    body = {"lora_name": name, "sha256": digest, "peers": ["http://127.0.0.1:9"]}
    reply = fetching.post("/v1/load_lora_adapter", json=body)
    assert reply.status_code == status, reply.get_json()
    message = reply.get_json()["error"]["message"]
    assert ("--max-lora-rank" if status == 400 else "bytes") in message
    assert engine.lora.pool.nbytes == before
    assert name not in [a["name"] for a in engine.adapters()]
    assert_serving(fetching)


def test_nothing_is_read_before_the_limits_pass(engine, root, monkeypatch):
    def no_read(*args, **kwargs):
        raise AssertionError("tensors read before the limits were checked")

    monkeypatch.setattr(adapter_reader, "load_peft_adapter", no_read)
    with pytest.raises(AdapterError, match="--max-lora-rank"):
        engine.add_adapter("rank128", str(root / "rank128"))


def test_an_explicit_limit_refuses_adapters_given_at_start_up(tiny_model_dir, root):
    config = EngineConfig(dtype="float32", max_total_tokens=256, max_lora_rank=4)
    with pytest.raises(AdapterError, match=r"limit of 4 \(--max-lora-rank\)"):
        build_engine(str(tiny_model_dir), config, {"small": str(root / "small")})


@pytest.mark.parametrize(
    "flags, adapter, words",
    [
        (("--max-lora-rank", "4"), "small", ("limit of 4", "--max-lora-rank")),
        (("--adapter-cache-bytes", "1000", "--max-lora-rank", "64", "--lora-mode",
          "on-demand"), "small", ("needs", "1000 bytes")),
    ],
)  # fmt: skip
def test_start_up_refusals_are_one_error_line(tiny_model_dir, root, flags, adapter, words):
    result = run("toppings-serve", "--model", str(tiny_model_dir), "--port", "0",
                 "--lora", f"{adapter}={root / adapter}", *flags)  # fmt: skip
    assert_refused(result, "toppings-serve", *words)
