"""A request that asks vLLM's `truncate_prompt_tokens` is routed by the prompt the server will
prefill: its last k tokens (the count the perf models read, the prefix key's blocks), estimated
or exact; -1, the server's own context, is left whole here."""

from __future__ import annotations

from toppings.scheduler.kv_index.prefix_key import PrefixKey
from toppings.scheduler.registry import ServerRecord


def test_the_routed_prompt_is_the_truncated_one(tmp_path, scheduler_parts):
    with scheduler_parts(tmp_path, lambda url: {}) as (registry, _, router):
        registry.put_server(ServerRecord("http://s1", "llama", "bgmv", "cpu"), [])
        ids = list(range(10, 90))  # 80 token ids: counted exactly, hashed for prefix routing
        whole = router.route_request({"model": "llama", "prompt": ids}, "completions")
        cut = router.route_request(
            {"model": "llama", "prompt": ids, "truncate_prompt_tokens": 20, "n": 2}, "completions"
        )
        assert (whole.prompt_tokens, cut.prompt_tokens) == (80, 40)  # 20 tokens, 2 choices
        assert cut.prefix == PrefixKey.of(ids[-20:], None, ())
        texts = {"model": "llama", "prompt": ["x" * 400, "y" * 40], "truncate_prompt_tokens": 30}
        assert router.route_request(texts, "completions").prompt_tokens == 60  # estimated, cut
        context = {"model": "llama", "prompt": ids, "truncate_prompt_tokens": -1}
        assert router.route_request(context, "completions").prompt_tokens == 80
