"""A multi-adapter pipeline (issue 46): activated LoRA against the same weights as plain LoRA.

Each of `--conversations` conversations (default 16, all at once; `--min-tokens` to
`--max-tokens` tokens of history, random token ids) runs `--turns` turns: a user message
(`--user-tokens`) is appended, the base model answers (`--answer-tokens`), then a "checker"
adapter judges the conversation (`--check-tokens`; its prompt is the conversation followed by
the checker's invocation sequence), and the conversation goes on with the answer. There are
`--checkers` checker adapters; conversation c's turn t asks checker (c + t) mod checkers, so a
checker sees a given conversation again only every `--checkers` turns.

One in-process engine (SmolLM2 by default, prefix cache on) registers every checker twice,
with the same weights: as an activated LoRA (`alora_invocation_tokens` in its config: the
conversation before the invocation is the base model's KV, found in the prefix tree) and as
plain LoRA (no invocation tokens: the adapter's KV differs from the first token, so its whole
prompt is computed under it, less what the prefix cache holds of its own earlier turns). Rounds
alternate between the two modes (`--rounds` each), each round on fresh conversations whose
history the base model first prefills (not timed: the history a real pipeline has already
computed). Per round: the median end-to-end time of a turn (base answer + checker) and the
median checker TTFT; ratios per pair of rounds, reported as median and spread.

An activated round ends with a probe: every conversation's checker, all at once, then a base
request on the very same prompts, all at once: the checker's TTFT against a base-model request
on the same cached prefix (`ttft_ratio_alora_vs_base_cached`).

    GOMP_SPINCOUNT=30000 python -m bench.bench_alora
    python -m bench.bench_alora --quick  # checks the driver (writes to /tmp)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import threading
import time
from pathlib import Path

import torch

from bench.common import write_random_adapter
from bench.envelope import describe_device, write_result
from toppings.server.config import EngineConfig
from toppings.server.model.loader import resolve_model_dir
from toppings.server.requests.request import GenerationRequest, SamplingParams
from toppings.server.runtime import build_engine

log = logging.getLogger("bench_alora")
MODES = ("alora", "lora")
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
QUICK = {"conversations": 4, "min_tokens": 96, "max_tokens": 160, "turns": 2, "rounds": 1,
         "answer_tokens": 8, "user_tokens": 16}  # fmt: skip


def make_checkers(root: Path, model_dir: str, count: int, rank: int) -> dict[str, str]:
    """`count` random adapters, each saved twice with the same weights: `chk{i}` activated by
    its own invocation sequence (token ids 1000 + 10 i ...), `chk{i}-lora` plain."""
    paths = {}
    for i in range(count):
        plain = root / f"chk{i}-lora"
        if not (plain / "adapter_config.json").is_file():
            write_random_adapter(plain, model_dir, rank, TARGETS, seed=200 + i)
        activated = root / f"chk{i}"
        shutil.copytree(plain, activated, dirs_exist_ok=True)
        config = json.loads((activated / "adapter_config.json").read_text())
        config.update(alora_invocation_tokens=invocation(i), task_type="CAUSAL_LM")
        (activated / "adapter_config.json").write_text(json.dumps(config))
        paths[f"chk{i}"], paths[f"chk{i}-lora"] = str(activated), str(plain)
    return paths


def invocation(i: int) -> list[int]:
    """Checker i's invocation sequence: token ids no conversation draws (they draw >= 2000)."""
    return [1000 + 10 * i, 1001 + 10 * i, 1002 + 10 * i]


class Pipeline:
    """One round: every conversation's turns, each conversation in its own thread."""

    def __init__(self, engine, args, mode: str, seed: int, probe_base_first: bool = False):
        self.engine, self.args, self.mode = engine, args, mode
        self.probe_base_first = probe_base_first
        self.gen = torch.Generator().manual_seed(seed)
        vocab = min(engine.model_config.vocab_size, 40000)
        self.vocab = vocab
        lengths = torch.randint(args.min_tokens, args.max_tokens + 1, (args.conversations,),
                                generator=self.gen).tolist()  # fmt: skip
        self.convs = [self.draw(n) for n in lengths]
        self.users = [[self.draw(args.user_tokens) for _ in range(args.turns)] for _ in lengths]
        self.turn_s: list[float] = []
        self.checker_ttft_s: list[float] = []
        self.checker_cached: list[int] = []
        self.lock = threading.Lock()

    def draw(self, n: int) -> list[int]:
        return torch.randint(2000, self.vocab, (n,), generator=self.gen).tolist()

    def ask(self, prompt: list[int], adapter: str | None, new_tokens: int):
        params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
        ref = self.engine.resolve_adapter(adapter)
        return self.engine.submit(GenerationRequest(list(prompt), params, ref)).result(3600)

    def checker(self, c: int, t: int) -> tuple[str, list[int]]:
        """The checker of conversation c's turn t: its served name and its invocation."""
        i = (c + t) % self.args.checkers
        return (f"chk{i}" if self.mode == "alora" else f"chk{i}-lora"), invocation(i)

    def prefill_history(self) -> None:
        """The base model computes every conversation's history (cached for the turns)."""
        handles = [
            self.engine.submit(
                GenerationRequest(list(conv), SamplingParams(max_new_tokens=1), None)
            )  # fmt: skip
            for conv in self.convs
        ]
        for h in handles:
            h.result(3600)

    def run_conversation(self, c: int) -> None:
        conv = self.convs[c]
        for t in range(self.args.turns):
            started = time.perf_counter()
            conv = conv + self.users[c][t]
            answer = self.ask(conv, None, self.args.answer_tokens)
            name, invoke = self.checker(c, t)
            check = self.ask(conv + answer.new_token_ids + invoke, name, self.args.check_tokens)
            conv = conv + answer.new_token_ids
            with self.lock:
                self.turn_s.append(time.perf_counter() - started)
                self.checker_ttft_s.append(check.ttft_s)
                self.checker_cached.append(check.cached_tokens)
        self.convs[c] = conv

    def run(self) -> dict:
        self.prefill_history()
        threads = [threading.Thread(target=self.run_conversation, args=(c,))
                   for c in range(len(self.convs))]  # fmt: skip
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        out = {
            "turn_e2e_ms_p50": 1000 * statistics.median(self.turn_s),
            "checker_ttft_ms_p50": 1000 * statistics.median(self.checker_ttft_s),
            "checker_cached_tokens_mean": statistics.mean(self.checker_cached),
        }
        if self.mode == "alora":
            out.update(self.probe())
        return out

    def probe(self) -> dict:
        """Every conversation's checker at once, and base requests on the same prompts at
        once (which first alternates by round): both find the same cached prefix (the blocks
        before the invocation)."""
        prompts, names = [], []
        for c, conv in enumerate(self.convs):
            name, invoke = self.checker(c, self.args.turns)
            prompts.append(conv + invoke + self.draw(2))
            names.append(name)

        def batch(adapters: list[str | None]) -> list:
            params = SamplingParams(max_new_tokens=self.args.check_tokens, temperature=0.0,
                                    ignore_eos=True)  # fmt: skip
            handles = [
                self.engine.submit(
                    GenerationRequest(list(p), params, self.engine.resolve_adapter(a))
                )
                for p, a in zip(prompts, adapters)
            ]
            return [h.result(3600) for h in handles]

        if self.probe_base_first:
            bases = batch([None] * len(prompts))
            checks = batch(names)
        else:
            checks = batch(names)
            bases = batch([None] * len(prompts))
        return {
            "probe_checker_ttft_ms_p50": 1000 * statistics.median(o.ttft_s for o in checks),
            "probe_base_ttft_ms_p50": 1000 * statistics.median(o.ttft_s for o in bases),
            "probe_cached_tokens_checker": statistics.mean(o.cached_tokens for o in checks),
            "probe_cached_tokens_base": statistics.mean(o.cached_tokens for o in bases),
        }


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "rounds": values}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--conversations", type=int, default=16)
    p.add_argument("--min-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=1536)
    p.add_argument("--turns", type=int, default=2)
    p.add_argument("--user-tokens", type=int, default=32)
    p.add_argument("--answer-tokens", type=int, default=24)
    p.add_argument("--check-tokens", type=int, default=3)
    p.add_argument("--checkers", type=int, default=3)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2, help="rounds per mode, alternating")
    p.add_argument("--kernel", default="mbgmv")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: the engine's own)")
    p.add_argument("--adapter-dir", default="/tmp/toppings-bench-alora")
    p.add_argument("--label", default="", help="a note stored in the config (e.g. shared VM)")
    p.add_argument("--quick", action="store_true", help="a tiny run that checks the driver")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    return args


def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    model_dir = str(resolve_model_dir(args.model))
    adapters = make_checkers(Path(args.adapter_dir), model_dir, args.checkers, args.rank)
    # Room for every conversation twice over (the base chain, plain LoRA's own copies).
    max_total = 3 * args.conversations * (args.max_tokens + args.turns * 64 + 64)
    config = EngineConfig(dtype=args.dtype, kernel=args.kernel, prefix_cache=True,
                          max_total_tokens=max_total, max_batch_size=2 * args.conversations,
                          num_threads=args.threads)  # fmt: skip
    load_before = os.getloadavg()[0]
    engine = build_engine(model_dir, config, adapters)
    rounds: dict[str, list[dict]] = {m: [] for m in MODES}
    try:
        Pipeline(engine, QUICK_WARMUP, "alora", seed=1).run()  # compiles, touches every path
        for r in range(args.rounds):
            order = MODES if r % 2 == 0 else MODES[::-1]
            for mode in order:
                seed = 100 + r * 2 + MODES.index(mode)
                result = Pipeline(engine, args, mode, seed, probe_base_first=r % 2 == 1).run()
                log.info("round %d %s: %s", r, mode, result)
                rounds[mode].append(result)
        device = describe_device("cpu")
    finally:
        engine.shutdown()
    load_after = os.getloadavg()[0]

    def ratios(key: str) -> list[float]:
        return [a[key] / b[key] for a, b in zip(rounds["alora"], rounds["lora"])]

    metrics = {
        "checker_ttft_ratio_alora_vs_lora": spread(ratios("checker_ttft_ms_p50")),
        "turn_e2e_ratio_alora_vs_lora": spread(ratios("turn_e2e_ms_p50")),
        "ttft_ratio_alora_vs_base_cached": spread(
            [r["probe_checker_ttft_ms_p50"] / r["probe_base_ttft_ms_p50"] for r in rounds["alora"]]
        ),
        "rounds": rounds,
    }
    metrics["ttft_ratio_alora_vs_lora"] = metrics["checker_ttft_ratio_alora_vs_lora"]["median"]
    out = args.out or ("/tmp/alora_pipeline.json" if args.quick else "bench/results/"
                       "alora_pipeline.json")  # fmt: skip
    cfg = {k: v for k, v in vars(args).items() if k not in ("out",)}
    cfg.update(
        engine="in-process engine (server.runtime.build_engine), prefix cache on",
        conversations_tokens="random token ids; history prefilled by the base model, not timed",
        checker_choice="conversation c, turn t: checker (c + t) mod checkers",
        targets=list(TARGETS),
        load_average_1min_before_after=[load_before, load_after],
    )
    result = write_result(out, "alora_pipeline", "bench_alora", device=device, config=cfg,
                          metrics=metrics, argv=argv)  # fmt: skip
    log.info("wrote %s: %s", out, json.dumps({k: v for k, v in metrics.items() if k != "rounds"}))
    return result


# The warm-up round before the measured ones (compiles, touches every path once).
QUICK_WARMUP = argparse.Namespace(conversations=2, min_tokens=48, max_tokens=64, turns=1,
                                  user_tokens=8, answer_tokens=2, check_tokens=2,
                                  checkers=1)  # fmt: skip


if __name__ == "__main__":
    main()
