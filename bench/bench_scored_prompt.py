"""Decoding streams beside a long prompt that is scored (`prompt_logprobs`), against the same
prompt unscored; writes bench/results/scored_prompt.json.

A request scoring its prompt (lm-eval's loglikelihood, `echo` + `logprobs`, vLLM's
`prompt_logprobs`) was prefilled whole, in one step past the chunked-prefill budget that every
running stream waited for; its chunks are now scored as they are computed. Each round, on one
engine (chunked prefill on, the step budget the engine derives), `--streams` greedy streams
decode; once each has a few tokens, one prompt of `--prompt` tokens arrives, scored (prompt logprobs
at 1 alternative, one new token) or plain (one new token), the two alternating. Reported per
kind: the streams' largest gap between two tokens while the prompt was computed (what a reader
of a stream sees), their median gap, and the prompt request's time; and the ratio of the scored
prompt's largest gap to the plain one's (1.0: scoring stalls no one more than any prompt).

    python -m bench.bench_scored_prompt [--prompt 6000] [--streams 8] [--rounds 3]
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

log = logging.getLogger(__name__)

KINDS = ("scored", "plain")
STREAM_PROMPT = 32  # tokens of each decoding stream's prompt
SETTLED_TOKENS = 4  # every stream has this many tokens before the prompt arrives


def _ids(n: int, seed: int, vocab: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(vocab // 4, vocab - 1, (n,), generator=gen).tolist()


def one_round(engine, kind: str, args, seed: int) -> dict:
    """Streams decoding, then the long prompt (scored or plain) beside them: their gaps while
    it was computed and its time."""
    vocab = engine.model_config.vocab_size
    stamps: list[list[float]] = [[] for _ in range(args.streams)]
    handles = []
    decode = SamplingParams(max_new_tokens=args.stream_tokens, temperature=0.0, ignore_eos=True)
    for i in range(args.streams):
        prompt = _ids(STREAM_PROMPT, seed * 1000 + i, vocab)
        handles.append(engine.submit(GenerationRequest(prompt, decode)))

    def read(i: int) -> None:
        for _ in handles[i].events(timeout_s=600):
            stamps[i].append(time.perf_counter())

    readers = [threading.Thread(target=read, args=(i,)) for i in range(args.streams)]
    for reader in readers:
        reader.start()
    deadline = time.monotonic() + 600
    while min(len(s) for s in stamps) < SETTLED_TOKENS and time.monotonic() < deadline:
        time.sleep(0.001)
    params = SamplingParams(max_new_tokens=1, prompt_logprobs=1 if kind == "scored" else None)
    started = time.perf_counter()
    out = engine.submit(GenerationRequest(_ids(args.prompt, seed, vocab), params))  # its own
    result = out.result(timeout_s=600)
    ended = time.perf_counter()
    for handle in handles:
        handle.abort()
    for reader in readers:
        reader.join()
    if kind == "scored" and len(result.prompt_logprobs) != args.prompt:
        raise RuntimeError("the scored prompt came back without its logprobs")
    gaps = [b - a for s in stamps for a, b in zip(s, s[1:]) if started <= b <= ended]
    if not gaps:
        raise RuntimeError("no stream token while the prompt was computed: streams too short")
    return {"max_gap_ms": round(max(gaps) * 1e3, 1),
            "median_gap_ms": round(statistics.median(gaps) * 1e3, 1),
            "request_s": round(ended - started, 3)}  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2", help="model directory or a known name")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--prompt", type=int, default=6000, help="tokens of the long prompt")
    p.add_argument("--streams", type=int, default=8, help="decoding streams beside it")
    p.add_argument("--stream-tokens", type=int, default=1000,
                   help="each stream's most tokens (aborted once the prompt is done)")  # fmt: skip
    p.add_argument("--budget", type=int, default=0,
                   help="--max-num-batched-tokens (0: the engine derives it)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=3, help="rounds, the order alternating")
    p.add_argument("--quick", action="store_true", help="300 tokens, 2 streams, budget 64, 1 round")
    p.add_argument("--out", default="bench/results/scored_prompt.json")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args = parse_args(argv)
    if args.quick:
        args.prompt, args.streams, args.budget, args.rounds = 300, 2, 64, 1
        args.stream_tokens = 400
    tokens = 2 * args.prompt + args.streams * (STREAM_PROMPT + args.stream_tokens)
    sizes = {"max_batch_size": args.streams + 2} if args.budget else {}  # under the budget
    config = EngineConfig(dtype=args.dtype, chunked_prefill=True, max_total_tokens=tokens,
                          max_num_batched_tokens=args.budget, **sizes)  # fmt: skip
    engine = build_engine(str(resolve_model_dir(args.model)), config)
    rounds: dict[str, list[dict]] = {k: [] for k in KINDS}
    try:
        one_round(engine, "scored", args, seed=0)  # warm-up: the shapes of both kinds
        for r, kind in alternating(KINDS, args.rounds):  # a prompt of its own each time
            seed = 1 + 2 * r + KINDS.index(kind)
            rounds[kind].append(one_round(engine, kind, args, seed=seed))
            log.info("round %d, %s: %s", r, kind, rounds[kind][-1])
        budget = engine.step_budget
    finally:
        engine.shutdown()
    metrics: dict = medians(rounds)
    ratios = [s["max_gap_ms"] / p["max_gap_ms"] for s, p in zip(rounds["scored"], rounds["plain"])]
    metrics["max_gap_ratio_scored_vs_plain"] = {
        "median": round(statistics.median(ratios), 3), "min": round(min(ratios), 3),
        "max": round(max(ratios), 3),
    }  # fmt: skip
    return write_result(args.out, "scored_prompt", "bench_scored_prompt",
                        device=describe_device("cpu"),
                        config={"model": args.model, "dtype": args.dtype, "prompt": args.prompt,
                                "streams": args.streams, "rounds": args.rounds,
                                "step_budget": budget.how if budget is not None else None},
                        metrics=metrics, argv=argv)  # fmt: skip


if __name__ == "__main__":
    main()
