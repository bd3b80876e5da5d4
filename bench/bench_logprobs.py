"""What logprobs cost a CPU engine: decode with `logprobs` and a scored prompt, the native pass
against torch's ops; writes bench/results/logprobs.json.

Each round, on one engine, the same work three ways: without logprobs (`none`), with them from
the native pass (`native`: server/native/csrc/logits.c's `logits_logprobs`, what the server runs
on a CPU) and with them from torch's ops (`torch`: the sampling module's native library taken
away, what it ran before). The work: `--streams` greedy streams decoding `--tokens` tokens each
with `--logprobs` alternatives (their output tokens a second from the moment every stream has
its first token), then one prompt of `--prompt` tokens scored with `prompt_logprobs` 1 (its
request's time). The kinds' order alternates between rounds. Reported per kind: the medians and
each round; and the ratios native / torch and native / none, per round, median and range.

    python -m bench.bench_logprobs [--streams 64] [--tokens 48] [--prompt 2000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import threading
import time

import torch

from bench.common import alternating, medians
from bench.envelope import describe_device, write_result
from toppings.server.config import EngineConfig
from toppings.server.model.loader import resolve_model_dir
from toppings.server.requests.request import GenerationRequest, SamplingParams
from toppings.server.runtime import build_engine
from toppings.server.sampling import logits as logits_module

log = logging.getLogger(__name__)

KINDS = ("none", "native", "torch")
STREAM_PROMPT = 32  # tokens of each stream's prompt


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(vocab // 4, vocab - 1, (n,), generator=gen).tolist()


def decode_tokens_per_s(engine, kind: str, args, seed: int) -> float:
    """Output tokens a second of the streams once every one has its first token."""
    vocab = engine.model_config.vocab_size
    k = None if kind == "none" else args.logprobs
    params = SamplingParams(max_new_tokens=args.tokens, temperature=0.0, ignore_eos=True,
                            logprobs=k)  # fmt: skip
    handles = [engine.submit(GenerationRequest(_ids(STREAM_PROMPT, seed * 1000 + i, vocab),
                                               params)) for i in range(args.streams)]  # fmt: skip
    stamps: list[list[tuple[float, int]]] = [[] for _ in handles]  # (when, new tokens)
    scored = [0] * len(handles)  # logprobs each stream received

    def read(i: int) -> None:
        for out in handles[i].events(timeout_s=600):
            stamps[i].append((time.perf_counter(), len(out.new_token_ids)))
            scored[i] += len(out.logprobs or ())

    readers = [threading.Thread(target=read, args=(i,)) for i in range(len(handles))]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join()
    if k is not None and any(n != args.tokens for n in scored):
        raise RuntimeError("a stream came back without its logprobs")
    end = max(s[-1][0] for s in stamps)
    start = max(s[0][0] for s in stamps)  # every stream decoding from here
    if start >= end:  # a stream admitted last, after the others had finished (tiny runs)
        start = min(s[0][0] for s in stamps)
    tokens = sum(n for s in stamps for t, n in s if t > start)
    return tokens / (end - start)


def scored_prompt_s(engine, kind: str, args, seed: int) -> float:
    """The time of one request scoring a prompt of `--prompt` tokens (one new token)."""
    params = SamplingParams(max_new_tokens=1, prompt_logprobs=None if kind == "none" else 1)
    prompt = _ids(args.prompt, seed, engine.model_config.vocab_size)  # its own: nothing cached
    started = time.perf_counter()
    result = engine.submit(GenerationRequest(prompt, params)).result(timeout_s=600)
    seconds = time.perf_counter() - started
    if kind != "none" and len(result.prompt_logprobs) != args.prompt:
        raise RuntimeError("the scored prompt came back without its logprobs")
    return seconds


def one_round(engine, kind: str, args, seed: int) -> dict:
    """Both measurements with the logprobs path of `kind`."""
    native = logits_module.native_library
    if kind == "torch":
        logits_module.native_library = lambda: None
    try:
        return {"decode_tokens_per_s": round(decode_tokens_per_s(engine, kind, args, seed), 1),
                "scored_prompt_s": round(scored_prompt_s(engine, kind, args, seed), 3)}  # fmt: skip
    finally:
        logits_module.native_library = native


def _spread(values: list[float]) -> dict:
    return {"median": round(statistics.median(values), 3), "min": round(min(values), 3),
            "max": round(max(values), 3)}  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="model directory or a known name")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--streams", type=int, default=64, help="decoding streams")
    p.add_argument("--tokens", type=int, default=48, help="new tokens of each stream")
    p.add_argument("--logprobs", type=int, default=5, help="alternatives a decoded token")
    p.add_argument("--prompt", type=int, default=2000, help="tokens of the scored prompt")
    p.add_argument("--rounds", type=int, default=3, help="rounds, the order alternating")
    p.add_argument("--quick", action="store_true", help="4 streams, 6 tokens, 100-token prompt")
    p.add_argument("--out", default="bench/results/logprobs.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    if args.quick:
        args.streams, args.tokens, args.prompt, args.rounds = 4, 6, 100, 1
    tokens = 2 * args.prompt + args.streams * (STREAM_PROMPT + args.tokens) + 64
    config = EngineConfig(dtype=args.dtype, max_total_tokens=tokens,
                          max_batch_size=max(args.streams, 8))  # fmt: skip
    engine = build_engine(str(resolve_model_dir(args.model)), config)
    rounds: dict[str, list[dict]] = {k: [] for k in KINDS}
    try:
        for kind in KINDS:  # warm-up: every shape of every kind once
            one_round(engine, kind, args, seed=0)
        for r, kind in alternating(KINDS, args.rounds):
            seed = 1 + len(KINDS) * r + KINDS.index(kind)
            rounds[kind].append(one_round(engine, kind, args, seed=seed))
            log.info("round %d, %s: %s", r, kind, rounds[kind][-1])
    finally:
        engine.shutdown()
    metrics: dict = medians(rounds)
    for other in ("torch", "none"):
        pairs = list(zip(rounds["native"], rounds[other]))
        metrics[f"decode_ratio_native_vs_{other}"] = _spread(
            [n["decode_tokens_per_s"] / o["decode_tokens_per_s"] for n, o in pairs]
        )
        metrics[f"scored_prompt_ratio_native_vs_{other}"] = _spread(
            [n["scored_prompt_s"] / o["scored_prompt_s"] for n, o in pairs]
        )
    return write_result(args.out, "logprobs", "bench_logprobs", device=describe_device("cpu"),
                        config={"model": args.model, "dtype": args.dtype,
                                "streams": args.streams, "tokens": args.tokens,
                                "logprobs": args.logprobs, "prompt": args.prompt,
                                "rounds": args.rounds},
                        metrics=metrics, argv=argv)  # fmt: skip


if __name__ == "__main__":
    main()
