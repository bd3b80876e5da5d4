"""Open-loop sending of a trace over HTTP, and the resumable JSONL journal of the results.

Each trace entry is sent at its arrival offset, whatever the answers of earlier requests (open
loop), as a streamed `POST /v1/completions` with `ignore_eos: true`, so that every request
produces exactly `max_tokens` tokens. The client clock measures:
- TTFT: from sending to the first streamed event with a choice (toppings-serve sends one for
  every token as it is made, its text empty while that is an incomplete UTF-8 sequence, as vLLM
  does, and vLLM's `bench serve` times the same event), and `ttft_text_s`, to the first event
  with text (what a server that holds such tokens back, as llama.cpp's does, gives as its
  first event; the bench's random prompts of byte tokens make that 2.5 tokens on average);
- E2E: from sending to `data: [DONE]`;
- time per token: E2E / output tokens (the Toppings paper's TPT: all tokens, prefill included),
  the output tokens being the server's `usage.completion_tokens`.
`lag_s` is how late the request left compared with its arrival offset (a busy client).
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests

from toppings.scripts.loadgen.workload import TraceEntry
from toppings.server.requests.errors import bearer_header

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0


def request_config(entry: TraceEntry) -> dict:
    """What identifies a request in the journal (the prompt by its length and digest)."""
    prompt = json.dumps(entry.prompt, separators=(",", ":"))
    return {
        "idx": entry.idx,
        "arrival_s": round(entry.arrival_s, 6),
        "model": entry.model,
        "rank": entry.rank,
        "prompt_len": len(entry.prompt),
        "prompt_sha1": hashlib.sha1(prompt.encode()).hexdigest()[:16],
        "max_tokens": entry.max_tokens,
    }


def request_body(entry: TraceEntry, temperature: float) -> dict:
    return {
        "model": entry.model,
        "prompt": entry.prompt,
        "max_tokens": entry.max_tokens,
        "temperature": temperature,
        "ignore_eos": True,  # the server's own field; outputs get exactly max_tokens tokens
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _events(answer: requests.Response) -> Iterator[dict | None]:
    """JSON objects of an SSE body as they arrive; None for `[DONE]`."""
    for line in answer.iter_lines(chunk_size=None):
        if not line.startswith(b"data: "):
            continue
        data = line[6:]
        yield None if data.strip() == b"[DONE]" else json.loads(data)


def send(
    session: requests.Session,
    url: str,
    entry: TraceEntry,
    temperature: float,
    timeout_s: float,
    scheduled_unix: float,
) -> dict:
    """Send one request and time it; never raises (a failure is a result with ok false)."""
    start = time.time()
    result: dict = {
        "ok": False,
        "error": None,
        "start_unix": start,
        "lag_s": max(0.0, start - scheduled_unix),
    }
    text: list[str] = []
    first = first_text = None
    usage = None
    try:
        body = request_body(entry, temperature)
        timeout = (CONNECT_TIMEOUT_S, timeout_s)
        with session.post(
            url + "/v1/completions", json=body, stream=True, timeout=timeout
        ) as answer:
            result["status"] = answer.status_code
            if answer.status_code != 200:
                result["error"] = answer.text[:500]
                return result
            for event in _events(answer):
                if event is None:
                    break
                if "error" in event:
                    result["error"] = str(event["error"].get("message", event["error"]))[:500]
                    return result
                usage = event.get("usage") or usage
                for choice in event.get("choices") or ():
                    first = first or time.time()
                    text.append(choice.get("text") or "")
                    if first_text is None and text[-1]:
                        first_text = time.time()
            else:
                result["error"] = "the stream ended without [DONE]"
                return result
    except (requests.RequestException, ValueError) as e:
        result["error"] = f"{type(e).__name__}: {e}"[:500]
        return result
    end = time.time()
    if usage is None or first is None or not usage.get("completion_tokens"):
        result["error"] = "the stream carried no choice or no usage"
        return result
    num_out = int(usage["completion_tokens"])
    result.update(
        ok=True,
        end_unix=end,
        ttft_s=first - start,
        ttft_text_s=None if first_text is None else first_text - start,
        e2e_s=end - start,
        tpt_s=(end - start) / num_out,
        output_tokens=num_out,
        prompt_tokens=usage.get("prompt_tokens"),
        text="".join(text),
    )
    return result


class Journal:
    """The JSONL file of `{config, result}` lines; requests already in it are skipped on rerun."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.records: dict[int, dict] = {}
        if self.path.exists():
            with open(self.path) as f:
                for line in f:
                    if line.strip():
                        record = json.loads(line)
                        self.records[record["config"]["idx"]] = record
        self._file = None

    def pending(self, trace: list[TraceEntry]) -> list[TraceEntry]:
        """Entries not recorded yet; refuses a journal written from another trace."""
        for entry in trace:
            done = self.records.get(entry.idx)
            if done is not None and done["config"] != request_config(entry):
                raise ValueError(
                    f"{self.path} records another request #{entry.idx}; "
                    "it belongs to a different trace, use another --out"
                )
        return [e for e in trace if e.idx not in self.records]

    def write(self, entry: TraceEntry, result: dict) -> None:
        if self._file is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a")
        record = {"config": request_config(entry), "result": result}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()  # an interrupted run keeps every finished request
        self.records[entry.idx] = record

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def run_open_loop(
    url: str,
    entries: list[TraceEntry],
    on_done: Callable[[TraceEntry, dict], None],
    temperature: float = 0.0,
    timeout_s: float = 600.0,
    max_concurrency: int = 512,
    api_key: str | None = None,
) -> float:
    """Send `entries` at their arrival offsets (the first at once), with `api_key` as a bearer
    key where given; returns the start time.

    `on_done(entry, result)` runs on the calling thread, in finishing order. Offsets are taken
    relative to the first entry, so a resumed run keeps the gaps of the remaining requests.
    """
    done: queue.Queue = queue.Queue()
    session = requests.Session()
    session.headers.update(bearer_header(api_key))
    session.mount("http://", requests.adapters.HTTPAdapter(pool_maxsize=max_concurrency))
    origin = entries[0].arrival_s if entries else 0.0
    start = time.time()
    stop = threading.Event()

    def task(entry: TraceEntry, scheduled: float) -> None:
        done.put((entry, send(session, url, entry, temperature, timeout_s, scheduled)))

    def dispatch(pool: ThreadPoolExecutor) -> None:
        for entry in entries:
            scheduled = start + entry.arrival_s - origin
            if stop.wait(max(0.0, scheduled - time.time())):
                return
            pool.submit(task, entry, scheduled)

    with ThreadPoolExecutor(max_concurrency, thread_name_prefix="loadgen") as pool:
        dispatcher = threading.Thread(target=dispatch, args=(pool,), daemon=True)
        dispatcher.start()
        try:
            for _ in entries:
                entry, result = done.get()
                on_done(entry, result)
        finally:
            stop.set()
            dispatcher.join()
            session.close()
    return start
