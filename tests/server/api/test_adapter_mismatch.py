"""An adapter trained on a base of other shapes is refused, naming the projection, the shapes
and the base width it was likely trained on: a 400 at /v1/load_lora_adapter (the server keeps
serving) or one error line at start-up."""

from __future__ import annotations

import pytest

from toppings.server.api.app import ApiOptions, create_app


@pytest.fixture(scope="module")
def roots(tmp_path_factory, tiny_model_dir):
    """Adapters made with PEFT: one for the tiny base (H 64), one for a base with H 32."""
    from toppings.scripts.make_adapters import make_random_adapter
    from toppings.scripts.make_tiny_llama import make_tiny_llama

    tmp = tmp_path_factory.mktemp("mismatch")
    narrow = make_tiny_llama(tmp / "narrow_base", hidden_size=32, num_heads=2, num_kv_heads=1)
    make_random_adapter(tmp / "loras" / "fits", tiny_model_dir, rank=4, seed=1)
    make_random_adapter(tmp / "loras" / "narrow", narrow, rank=4, seed=2)
    return tmp / "loras"


@pytest.fixture(scope="module")
def client(roots, tiny_engine):
    with tiny_engine({"fits": str(roots / "fits")}, max_total_tokens=1024) as engine:
        yield create_app(engine, ApiOptions(lora_roots=(str(roots),))).test_client()


def test_an_adapter_of_another_hidden_size_gets_400_naming_the_mismatch(client, roots):
    body = {"lora_name": "narrow", "lora_path": str(roots / "narrow")}
    response = client.post("/v1/load_lora_adapter", json=body)
    assert response.status_code == 400, response.get_data(as_text=True)
    message = response.get_json()["error"]["message"]
    assert "\n" not in message
    for words in (
        "model.layers.0.",
        "_proj.lora_",
        "has shape",
        "expected",
        "hidden size 32, not 64",
    ):
        assert words in message, message
    names = {m["id"] for m in client.get("/v1/models").get_json()["data"]}
    assert "narrow" not in names and "fits" in names
    body = {"model": "fits", "prompt": [5, 6, 7], "max_tokens": 3, "ignore_eos": True}
    served = client.post("/v1/completions", json=body)
    assert served.status_code == 200 and served.get_json()["usage"]["completion_tokens"] == 3


def test_serve_refuses_it_at_start_up_in_one_line(roots, tiny_model_dir):
    from tests.server.api.test_cli_errors import assert_refused, run

    result = run("toppings-serve", "--model", str(tiny_model_dir), "--port", "0",
                 "--lora", f"narrow={roots / 'narrow'}")  # fmt: skip
    assert_refused(result, "toppings-serve", "narrow", "hidden size 32, not 64")
