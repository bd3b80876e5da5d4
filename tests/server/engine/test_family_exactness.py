"""Every served family (tests/server/model/tiny_families.py) with PEFT adapters of odd ranks on
all seven targets (one rsLoRA) gives, in mixed-adapter batches, the tokens and logprobs of
transformers + PEFT.

Two waves per engine: a mixed batch scored prompt and output (logprobs within the tolerance of
test_logprobs_exactness.py), then each request's follow-up turn (its prompt, its answer and
three more tokens), which reuses the first turn's cached KV under its own adapter. Greedy tokens
are checked teacher-forced: at every position our token must be transformers + PEFT's argmax
given the same ids before it, unless the reference's top-2 margin there is below 1e-4 (the near
tie rule of test_exactness.py). Llama 3's RoPE runs far past its 16-token pre-training context.
Llama 3 runs every kernel x LoRA mode; the other checkpoints one pair each, together covering
every kernel, mode and the CPU worker processes.
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import running_engine
from tests.server.engine.test_exactness import MARGIN
from tests.server.engine.test_logprobs_exactness import (
    TOL,
    TOP,
    check_against_reference,
    reference_logprobs,
)
from tests.server.model.family_checkpoints import ADAPTERS, family_with_adapters
from tests.server.model.tiny_families import make_tiny_family
from toppings.server.requests.request import GenerationRequest, SamplingParams

NEW_TOKENS = 12
LORA_MODES = ("cached", "on-demand", "cpu-assisted")
KERNELS = ("mbgmv", "bgmv")

# (checkpoint, kernel, lora mode, CPU worker processes)
CASES = [("llama3", k, m, 0) for k in KERNELS for m in LORA_MODES] + [
    ("llama-linear", "bgmv", "on-demand", 0),
    ("llama-dynamic", "mbgmv", "cached", 0),
    ("llama-bias", "bgmv", "cpu-assisted", 0),
    ("mistral", "mbgmv", "on-demand", 0),
    ("qwen2", "bgmv", "cached", 0),
    ("qwen2", "mbgmv", "cpu-assisted", 2),
    ("qwen3", "mbgmv", "cached", 0),
    ("qwen3", "bgmv", "cpu-assisted", 2),
]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (model dir, {adapter: path}), made once per module on first use."""
    made: dict = {}

    def get(name: str):
        if name not in made:
            made[name] = family_with_adapters(tmp_path_factory.mktemp(name), name)
        return made[name]

    return get


def first_turn_prompts(vocab: int) -> list[tuple[list[int], str | None]]:
    """Two requests per adapter and two for the base model, of different lengths."""
    gen = torch.Generator().manual_seed(11)
    names = [*ADAPTERS, *ADAPTERS, None, None]
    lengths = [5, 17, 9, 33, 12, 3, 21, 8]
    return [
        (torch.randint(3, vocab, (n,), generator=gen).tolist(), name)
        for n, name in zip(lengths, names)
    ]


def check_greedy_teacher_forced(model_dir, adapters, prompt, out, name, what: str) -> None:
    """Each output token is the reference's argmax after the same ids (near ties aside), and
    its logprob is the reference's within TOL."""
    ids = prompt + out.new_token_ids
    ref = reference_logprobs(model_dir, adapters, ids, name)  # [len, V]
    for j, token in enumerate(out.new_token_ids):
        row = ref[len(prompt) - 1 + j]
        top2 = row.topk(2)
        if token != int(top2.indices[0]):
            margin = float(top2.values[0] - top2.values[1])
            assert margin < MARGIN, f"{what}: token {j} is {token}, reference argmax differs"
        assert abs(out.logprobs[j].logprob - float(row[token])) < TOL, (what, j)


def run(engine, prompts, params):
    handles = [
        engine.submit(GenerationRequest(list(p), params, engine.resolve_adapter(a)))
        for p, a in prompts
    ]
    return [h.result(timeout_s=300) for h in handles]


@pytest.mark.parametrize(("name", "kernel", "lora_mode", "num_cpu_workers"), CASES)
def test_family_matches_peft(checkpoints, name, kernel, lora_mode, num_cpu_workers):
    model_dir, adapters = checkpoints(name)
    # A slow emulated link keeps loads in flight (~1 s an adapter of rank 7, ~200 in + out
    # features, 7 projections, 2 layers, float32): cpu-assisted runs layers on the host.
    link = 7 * 200 * 4 * 7 * 2 * 8 / 1.0 / 1e9 if lora_mode != "cached" else 0.0
    scored = SamplingParams(
        max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=TOP,
        prompt_logprobs=TOP,
    )  # fmt: skip
    greedy = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=1)
    with running_engine(
        model_dir, adapters, kernel=kernel, lora_mode=lora_mode, max_total_tokens=4096,
        max_batch_size=16, link_gbps=link, num_cpu_workers=num_cpu_workers, prefix_cache=True,
    ) as engine:  # fmt: skip
        prompts = first_turn_prompts(engine.model_config.vocab_size)
        first = run(engine, prompts, scored)
        if lora_mode == "cpu-assisted":
            assert engine.lora.host_stats.calls > 0, "no layer ran on the host"
        hits = engine.stats().to_json()["memory"]["prefix_hit_tokens"]
        follow = [(p + out.new_token_ids + [7, 8, 9], a) for (p, a), out in zip(prompts, first)]
        second = run(engine, follow, greedy)
        reused = engine.stats().to_json()["memory"]["prefix_hit_tokens"] - hits
    assert reused > 0, "the follow-up turns reused no cached prefix"
    check_against_reference(model_dir, adapters, prompts, first)
    for (prompt, a), out in zip(prompts, first):
        check_greedy_teacher_forced(model_dir, adapters, prompt, out, a, f"{name}, {a}")
    for (prompt, a), out in zip(follow, second):
        what = f"{name}, {a}, follow-up of {len(prompt)} tokens"
        check_greedy_teacher_forced(model_dir, adapters, prompt, out, a, what)


def test_llama3_positions_pass_the_original_context(checkpoints):
    """The follow-up turns above reach positions far past llama3's pre-training context."""
    from transformers import AutoConfig

    model_dir, _ = checkpoints("llama3")
    original = AutoConfig.from_pretrained(model_dir).rope_parameters[
        "original_max_position_embeddings"
    ]
    longest = max(len(p) for p, _ in first_turn_prompts(256)) + 2 * NEW_TOKENS + 3
    assert longest > 3 * original


def test_sliding_window_caps_the_served_context(tmp_path):
    """Mistral with a 40-token window: the engine serves 40 positions, where attention with
    the window is full causal attention (its tokens equal transformers' with the window), and
    refuses a request that would need more."""
    from transformers import AutoModelForCausalLM

    from toppings.server.requests.request import RequestError

    model_dir = make_tiny_family(tmp_path / "m", "mistral", sliding_window=40)
    prompt = list(range(5, 33))  # 28 tokens + 12 = 40
    params = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    with running_engine(model_dir, max_total_tokens=1024) as engine:
        assert engine.max_model_len == 40
        out = engine.submit(GenerationRequest(prompt, params)).result(timeout_s=120)
        with pytest.raises(RequestError, match="exceeds the context of 40 tokens"):
            engine.submit(GenerationRequest(prompt + [5], params))
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.inference_mode():
        want = ref.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False)
    assert out.new_token_ids == want[0, len(prompt) :].tolist()
