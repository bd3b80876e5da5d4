"""A soak of one `toppings-serve`: mixed tenants, adapter churn, disconnects, poisoned adapters.

    python -m bench.soak --duration 600 [--clients 6] [--serve-args "--lora-mode cpu-assisted"]

For `--duration` seconds, `--clients` threads send completions and chat requests (streamed or
not, some cancelled after their first chunk) to the base model and to 8 random rank-8 adapters
of SmolLM2, while a churn thread unloads one of the 8 and loads it back every second, and one
client asks for two poisoned adapters every few seconds and tries to load them: one whose
`lora_alpha` is 1e308 (refused at load), and one that passes the load-time bound but overflows
on real activations (its requests fail at run time, alone). `/health` is polled each second and
the server's RSS (its CPU workers included) sampled every 10 s, with each process's anonymous and
file-backed memory and thread count.

What counts as a failure: any answer to a healthy request other than 200, or 404 / 409 for an
adapter the churn thread has just taken away; a transport error that was not our own cancel; a
`/health` that is not 200 (an engine death). At the end, with no request in flight, `/stats` must
be balanced (nothing running or queued, no KV block or adapter reference held by a request) and
after the server stops, /dev/shm must hold what it held before. Writes bench/results/soak.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import random
import shlex
import statistics
import tempfile
import threading
import time
from pathlib import Path

import requests

from bench.envelope import describe_device, write_result
from toppings.scripts.children import start, stop, wait_healthy
from toppings.scripts.make_adapters import load_base, make_random_adapter
from toppings.server.model.loader import resolve_model_dir

log = logging.getLogger("soak")

NUM_ADAPTERS = 8
POISON = "poison"  # refused at load: its lora_alpha makes every product overflow
OVERFLOW = "overflow"  # passes the load check, overflows on real activations at run time
OVERFLOW_BOUND = 1e37  # its scaling x r x max|A| x max|B|: under float32's and bfloat16's max
PROMPTS = ("Tell me about the sea.", "List three colours.", "What is 2+2?", "Write a haiku.")
# Answers a healthy request may get while the churn thread has its adapter unloaded.
CHURN_STATUSES = (404, 409)


def make_adapters(root: Path) -> list[str]:
    """8 rank-8 adapters on q/v/o and the two poisoned ones under `root`; returns the 8 names."""
    names = [f"tenant-{i}" for i in range(NUM_ADAPTERS)]
    base = None
    for i, name in enumerate(names + [POISON, OVERFLOW]):
        if (root / name / "adapter_model.safetensors").is_file():
            continue
        base = base or load_base(resolve_model_dir("smollm2"))
        targets = ("q_proj", "v_proj", "o_proj")
        make_random_adapter(root / name, base, rank=8, target_modules=targets, seed=100 + i)
    config_path = root / POISON / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config["lora_alpha"] = 1e308
    config_path.write_text(json.dumps(config))
    scale_to_bound(root / OVERFLOW)
    return names


def scale_to_bound(adapter_dir: Path) -> None:
    """Scale the adapter's B matrices so that scaling x r x max|A| x max|B| is OVERFLOW_BOUND
    per module: the load-time check (which bounds the product for an input of unit l1 norm)
    passes, and a hidden state of l1 norm in the hundreds overflows at run time."""
    from safetensors.torch import load_file, save_file

    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    rank, scaling = config["r"], config["lora_alpha"] / config["r"]
    path = adapter_dir / "adapter_model.safetensors"
    tensors = load_file(path)
    for key in [k for k in tensors if "lora_B" in k]:
        a, b = tensors[key.replace("lora_B", "lora_A")], tensors[key]
        product = scaling * rank * a.abs().max().item() * b.abs().max().item()
        tensors[key] = b * (OVERFLOW_BOUND / product)
    save_file(tensors, path)


class Tally:
    """Outcomes by kind, shared by the client threads."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts: collections.Counter[str] = collections.Counter()
        self.failures: list[str] = []

    def add(self, kind: str, failure: str | None = None) -> None:
        with self.lock:
            self.counts[kind] += 1
            if failure is not None and len(self.failures) < 50:
                self.failures.append(failure)


def family(pid: int) -> list[int]:
    """`pid` and its children (the CPU workers)."""
    pids = [pid]
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            children = Path(f"/proc/{pid}/task/{tid}/children").read_text().split()
            pids += [int(c) for c in children]
    except OSError:
        pass
    return pids


def process_memory(pid: int) -> dict[str, int]:
    """One process as the kernel sees it: resident KiB, anonymous and file-backed KiB
    (smaps_rollup), and its thread count; {} once it is gone."""
    out: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(("VmRSS:", "Threads:")):
                key, value = line.split(":")
                out["rss_kib" if key == "VmRSS" else "threads"] = int(value.split()[0])
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
            key, _, rest = line.partition(":")
            if key == "Anonymous":
                out["anon_kib"] = int(rest.split()[0])
            elif key in ("Shared_Clean", "Private_Clean"):
                out["file_kib"] = out.get("file_kib", 0) + int(rest.split()[0])
    except OSError:
        return {}
    return out


def rss_kib(pid: int) -> int:
    """Resident set of `pid` and its children (the CPU workers), KiB."""
    return sum(process_memory(p).get("rss_kib", 0) for p in family(pid))


class Soak:
    def __init__(self, url: str, base: str, root: Path, names: list[str], key: str, seed: int):
        self.url, self.base, self.root, self.names = url, base, root, names
        self.headers = {"Authorization": f"Bearer {key}"}
        self.tally = Tally()
        self.stop = threading.Event()
        self.loaded = set(names)
        self.loaded_lock = threading.Lock()
        self.rng = random.Random(seed)

    def post(self, path: str, body: dict, **kw) -> requests.Response:
        return requests.post(self.url + path, json=body, headers=self.headers, **kw)

    def load(self, name: str) -> int:
        body = {"lora_name": name, "lora_path": str(self.root / name)}
        return self.post("/v1/load_lora_adapter", body, timeout=60).status_code

    def unload(self, name: str) -> int:
        return self.post("/v1/unload_lora_adapter", {"lora_name": name}, timeout=60).status_code

    def client(self, idx: int) -> None:
        rng = random.Random(idx)
        while not self.stop.is_set():
            model = rng.choice([*self.names, self.base, self.base])
            self.one_request(rng, model, idx)

    def one_request(self, rng: random.Random, model: str, idx: int) -> None:
        chat = rng.random() < 0.5
        stream = rng.random() < 0.5
        cancel = stream and rng.random() < 0.2
        body: dict = {"model": model, "max_tokens": rng.randint(4, 24), "stream": stream}
        body["temperature"] = rng.choice([0.0, 0.8])
        prompt = rng.choice(PROMPTS) * rng.randint(1, 8)
        if chat:
            body["messages"] = [{"role": "user", "content": prompt}]
        else:
            body["prompt"] = prompt
        path = "/v1/chat/completions" if chat else "/v1/completions"
        kind = "base" if model == self.base else "adapter"
        try:
            with self.post(path, body, timeout=120, stream=stream) as r:
                if r.status_code in CHURN_STATUSES and kind == "adapter":
                    self.tally.add(f"{kind}_{r.status_code}_churn")
                    return
                if r.status_code != 200:
                    failure = f"{model} {path}: {r.status_code} {r.text[:200]}"
                    self.tally.add(f"{kind}_fail", failure)
                    return
                if stream:
                    for i, line in enumerate(r.iter_lines()):
                        if is_error_event(line):
                            self.tally.add(f"{kind}_fail", f"{model}: stream error {line[:200]}")
                            return
                        if cancel and i >= 1:
                            self.tally.add(f"{kind}_cancelled")
                            return  # closing the connection mid-stream: a client disconnect
                else:
                    r.json()["choices"][0]
                self.tally.add(f"{kind}_ok")
        except (requests.RequestException, ValueError, KeyError) as e:
            self.tally.add(f"{kind}_fail", f"{model}: {type(e).__name__} {e}")

    def poison_client(self) -> None:
        """Every 3 s: try to load both poisoned adapters, and send one request to each (their
        own failures are expected and counted apart)."""
        while not self.stop.wait(3.0):
            for name in (POISON, OVERFLOW):
                status = self.load(name)
                self.tally.add(f"{name}_load_{status}")
                prompt = self.rng.choice(PROMPTS) * self.rng.randint(1, 8)
                body = {"model": name, "prompt": prompt, "max_tokens": 8}
                try:
                    r = self.post("/v1/completions", body, timeout=60)
                    self.tally.add(f"{name}_request_{r.status_code}")
                except requests.RequestException as e:
                    self.tally.add(f"{name}_request_error", f"{name}: {e}")

    def churn(self) -> None:
        while not self.stop.wait(1.0):
            name = self.rng.choice(self.names)
            status = self.unload(name)
            self.tally.add(f"churn_unload_{status}")
            if status == 200:
                status = self.load(name)
                self.tally.add(f"churn_load_{status}")
                if status != 200:
                    self.tally.add("churn_fail", f"reload {name}: {status}")

    def watch(self, pid: int, rss: list[tuple[float, int]], detail: list[dict], t0: float) -> None:
        """Poll /health each second; every 10 s sample RSS (server and CPU workers summed, into
        `rss`) and each process's anonymous / file-backed KiB and threads (into `detail`)."""
        last_rss = 0.0
        while not self.stop.wait(1.0):
            try:
                status = requests.get(self.url + "/health", timeout=5).status_code
            except requests.RequestException as e:
                status = type(e).__name__
            if status != 200:
                self.tally.add("health_not_ok", f"/health: {status}")
            if time.monotonic() - last_rss >= 10.0:
                last_rss = time.monotonic()
                processes = {str(p): process_memory(p) for p in family(pid)}
                t = round(last_rss - t0, 1)
                rss.append((t, sum(m.get("rss_kib", 0) for m in processes.values())))
                detail.append({"t": t, "processes": processes})


def is_error_event(line: bytes) -> bool:
    """Whether a server-sent line is an error event (`data: {"error": ...}`): a chunk whose
    text is "error" is not (a model may write that word; the soak counted one as a failure)."""
    if not line.startswith(b"data: ") or line == b"data: [DONE]":
        return False
    event = json.loads(line[len(b"data: ") :])
    return isinstance(event, dict) and "error" in event


def glibc_tcache(pid: int) -> str:
    """Whether glibc's per-thread caches are on in process `pid`, from its GLIBC_TUNABLES."""
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return "unknown"
    tunables = next((e[len(b"GLIBC_TUNABLES=") :].decode() for e in environ
                     if e.startswith(b"GLIBC_TUNABLES=")), "")  # fmt: skip
    if "tcache_count=0" in tunables:
        return f"off ({tunables})"
    return f"on ({tunables})" if tunables else "on (glibc's default)"


def shm_entries() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--duration", type=float, default=600.0)
    p.add_argument("--clients", type=int, default=6)
    p.add_argument("--warmup", type=float, default=60.0, help="seconds before RSS counts")
    p.add_argument("--port", type=int, default=8471)
    p.add_argument("--serve-args", default="", help="extra toppings-serve flags")
    p.add_argument("--work", default=None, help="directory for adapters and logs")
    p.add_argument("--out", default="bench/results/soak.json")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")

    work = Path(args.work or tempfile.mkdtemp(prefix="soak-"))
    root = work / "adapters"
    root.mkdir(parents=True, exist_ok=True)
    names = make_adapters(root)
    key = "soak-key"
    shm_before = shm_entries()
    serve = ["--model", "smollm2", "--port", str(args.port), "--allowed-lora-root", str(root)]
    serve += ["--api-key", key, *shlex.split(args.serve_args)]
    logfile = work / "server.log"
    proc = start("toppings.server.cli", serve, logfile)
    tcache = glibc_tcache(proc.pid)
    url = f"http://127.0.0.1:{args.port}"
    try:
        wait_healthy(url, proc, logfile, 900.0)
        models = requests.get(url + "/v1/models", headers={"Authorization": f"Bearer {key}"})
        base = models.json()["data"][0]["id"]
        soak = Soak(url, base, root, names, key, seed=0)
        for name in names:
            if soak.load(name) != 200:
                raise SystemExit(f"could not load {name}; see {logfile}")
        rss: list[tuple[float, int]] = []
        detail: list[dict] = []
        t0 = time.monotonic()
        threads = [threading.Thread(target=soak.client, args=(i,)) for i in range(args.clients)]
        threads += [threading.Thread(target=f) for f in (soak.churn, soak.poison_client)]
        threads.append(threading.Thread(target=soak.watch, args=(proc.pid, rss, detail, t0)))
        for t in threads:
            t.start()
        while time.monotonic() - t0 < args.duration and proc.poll() is None:
            time.sleep(5.0)
            log.info("%.0f s: %s", time.monotonic() - t0, dict(soak.tally.counts))
        soak.stop.set()
        for t in threads:
            t.join()
        alive = proc.poll() is None
        stats = requests.get(url + "/stats", headers=soak.headers, timeout=30).json()
    finally:
        stop([proc])
    time.sleep(1.0)
    # Only the server's own segments and semaphores (named after its pid): other processes on
    # the machine may create and remove theirs meanwhile.
    leaked_shm = sorted(e for e in shm_entries() - shm_before if f"toppings-{proc.pid}-" in e)
    memory = stats.get("memory", {})
    blocks = memory.get("blocks", {})
    balanced = (
        not stats["running"]
        and not stats["queue"]
        and stats.get("num_in_flight", 0) == 0
        and blocks.get("kv_in_use", 0) == 0
        and blocks.get("adapters_in_use", 0) == 0
    )
    after = [kib for t, kib in rss if t >= args.warmup]
    half = [(t, kib) for t, kib in rss if t >= args.duration / 2]
    slope = (half[-1][1] - half[0][1]) / max(half[-1][0] - half[0][0], 1.0) * 60 if half else None
    warm = [(t, kib) for t, kib in rss if t >= args.warmup]
    per_hour = None
    if len(warm) >= 2:  # least-squares slope of RSS after warm-up, MB an hour
        per_hour = statistics.linear_regression([t for t, _ in warm], [k for _, k in warm])
        per_hour = round(per_hour.slope * 3600 / 1024, 1)
    server = str(proc.pid)
    threads = [d["processes"][server]["threads"] for d in detail if d["t"] >= args.warmup
               and "threads" in d["processes"].get(server, {})]  # fmt: skip
    counts = dict(soak.tally.counts)
    failures = sum(v for k, v in counts.items() if k.endswith("_fail") or k == "health_not_ok")
    metrics = {
        "duration_s": args.duration,
        "server_alive_at_end": alive,
        "engine_deaths": counts.get("health_not_ok", 0),
        "failures_healthy_requests": failures,
        "first_failures": soak.tally.failures[:20],
        "outcomes": counts,
        "stats_balanced": balanced,
        "stats_at_end": {
            k: stats.get(k) for k in ("running", "queue", "num_in_flight", "free_kv_tokens")
        }
        | {"blocks": blocks, "adapter_host_memory": stats.get("adapter_host_memory")},
        "leaked_shm": leaked_shm,
        "rss_kib_samples": rss,
        "rss_after_warmup_kib": {
            "first": after[0] if after else None,
            "last": after[-1] if after else None,
            "min": min(after, default=None),
            "max": max(after, default=None),
            "median": statistics.median(after) if after else None,
        },
        "server_threads_after_warmup": {
            "min": min(threads, default=None),
            "max": max(threads, default=None),
        },
        "process_samples": detail,
        "rss_growth_second_half_kib_per_min": slope,
        "rss_growth_after_warmup_mb_per_hour": per_hour,
    }
    config = {
        "model": "smollm2",
        "adapters": NUM_ADAPTERS,
        "clients": args.clients,
        "serve_args": serve[4:],
        "glibc_tcache": tcache,
        "churn": "unload + reload one adapter every second",
        "poison": "lora_alpha 1e308 (refused at load), load tried every 3 s",
        "overflow": f"B scaled so scaling x r x max|A| x max|B| = {OVERFLOW_BOUND:g} (loads, "
        "overflows at run time), load tried and one request sent every 3 s",
    }
    write_result(args.out, "soak", "soak", device=describe_device(), config=config, metrics=metrics)
    print(
        json.dumps(
            metrics | {"rss_kib_samples": len(rss), "process_samples": len(detail)}, indent=1
        )
    )


if __name__ == "__main__":
    main()
