"""A trace replayed against llama.cpp's `llama-server`: each request streamed, timed as it
comes, for the benches that set a toppings engine beside it (bench_chunked_prefill).

Each entry is sent at its arrival time (a thread per request) to `/completion` with its prompt
as token ids, greedy, exactly its max tokens (`ignore_eos`), and `cache_prompt` off; an event
carries the tokens its `tokens_predicted` count grew by (llama-server holds a token back while
the text ends in a partial UTF-8 character, then sends it with the next). Times are the client's
(`time.monotonic()` as each event is read): TTFT from the send to the first event with tokens
(its first text: `ttft_text_s` too, which the toppings side's records time to its first text),
the gaps between events with tokens (an event of k tokens: k gaps of gap/k, bench_chunked_prefill's
`token_gaps`). The adapter of an entry is not sent: llama-server serves the base model (a
toppings engine beside it serves the entry's adapter, so it does more work). The server itself is
started by bench_long_prompt's `start_llama_server` (its GGUF made as bench/README.md says).
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence

import requests

from toppings.scripts.loadgen.workload import TraceEntry


def stream_one(url: str, entry: TraceEntry, timeout_s: float = 3600.0) -> tuple[float, list, list]:
    """Send `entry` and read its stream: (send time, event times, tokens per event), events
    without tokens left out. A failed request raises (it is a bug of the run, not a point)."""
    body = {"prompt": list(entry.prompt), "n_predict": entry.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "cache_prompt": False, "stream": True}  # fmt: skip
    times: list[float] = []
    counts: list[int] = []
    decoded = 0
    sent = time.monotonic()
    with requests.post(url + "/completion", json=body, stream=True, timeout=timeout_s) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: "):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"llama-server: {event['error']}")
            num = event.get("tokens_predicted", decoded) - decoded
            if num > 0:
                decoded += num
                times.append(time.monotonic())
                counts.append(num)
    return sent, times, counts


def replay_llama(
    url: str,
    trace: Sequence[TraceEntry],
    token_gaps: Callable[[Sequence[float], Sequence[int]], list[float]],
    burst: bool = False,
) -> list[dict]:
    """bench_chunked_prefill.replay_timed's records for `trace` served by llama-server at
    `url`: TTFT, E2E, tokens, rank, size, prompt length, token gaps, untimed (0), span."""
    start = time.monotonic()
    results: list[tuple | BaseException | None] = [None] * len(trace)

    def one(i: int) -> None:
        try:
            results[i] = stream_one(url, trace[i])
        except BaseException as exc:  # noqa: BLE001 - raised below, in the caller's thread
            results[i] = exc

    threads = []
    for i, e in enumerate(trace):
        if not burst:
            time.sleep(max(0.0, start + e.arrival_s - time.monotonic()))
        threads.append(threading.Thread(target=one, args=(i,), daemon=True))
        threads[-1].start()
    for t in threads:
        t.join()
    span = time.monotonic() - start
    records = []
    for e, got in zip(trace, results):
        if isinstance(got, BaseException) or got is None:
            raise RuntimeError(f"llama-server failed request {e.idx} of the trace: {got}")
        sent, times, counts = got
        if sum(counts) != e.max_tokens:
            raise RuntimeError(f"llama-server gave {sum(counts)} tokens of {e.max_tokens}")
        # its first event is its first text too: it holds a token whose text is incomplete
        records.append({"ttft_s": times[0] - sent, "ttft_text_s": times[0] - sent,
                        "e2e_s": times[-1] - sent,
                        "tokens": sum(counts), "rank": e.rank,
                        "size": len(e.prompt) + e.max_tokens, "prompt_len": len(e.prompt),
                        "gaps_s": token_gaps(times, counts), "untimed": 0,
                        "span_s": span})  # fmt: skip
    return records
