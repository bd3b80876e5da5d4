"""Load generator: workload generators, stats, the resumable journal, and exact trace replay
against a tiny-model server on loopback."""

from __future__ import annotations

import collections
import json
import random
import statistics

import numpy as np
import pytest

from toppings.scripts.loadgen import cli as loadgen
from toppings.scripts.loadgen.bursts import AZURE_SHAPES
from toppings.scripts.loadgen.client import Journal, request_config
from toppings.scripts.loadgen.stats import percentile, summarise
from toppings.scripts.loadgen.workload import (
    LengthSpec,
    WorkloadSpec,
    arrival_times,
    build_trace,
    load_trace,
    parse_assignment,
    parse_rank_mix,
    popularity_weights,
    save_trace,
)

ADAPTERS = {"a": 8, "b": 8, "c": 16, "d": 32}


def test_poisson_and_gamma_arrivals_have_the_asked_rate_and_cv():
    rng = random.Random(1)
    poisson = arrival_times(WorkloadSpec(rps=4.0, num_requests=20_000), rng)
    gaps = np.diff([0.0] + poisson)
    assert len(poisson) == 20_000 and np.all(gaps > 0)
    assert gaps.mean() == pytest.approx(0.25, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)
    gamma = arrival_times(WorkloadSpec(rps=4.0, arrivals="gamma", cv=3.0, num_requests=20_000), rng)
    gaps = np.diff([0.0] + gamma)
    assert gaps.mean() == pytest.approx(0.25, rel=0.1)
    assert gaps.std() / gaps.mean() == pytest.approx(3.0, rel=0.1)


def window_counts(times: list[float], window_s: float) -> np.ndarray:
    return np.bincount((np.asarray(times) // window_s).astype(int))


@pytest.mark.parametrize("kind", sorted(AZURE_SHAPES))
def test_azure_shaped_arrivals_keep_the_rate_and_are_bursty(kind):
    shape = AZURE_SHAPES[kind]
    rps = 3.0
    spec_ = WorkloadSpec(rps=rps, arrivals=kind, num_requests=200_000)
    times = arrival_times(spec_, random.Random(2))
    assert len(times) == 200_000 and times == sorted(times) and times[0] >= 0
    # the long-run rate asked for (over seeds, the rate of 30,000 has a spread of 9%)
    assert len(times) / times[-1] == pytest.approx(rps, rel=0.12)
    window_s = shape.window_requests / rps  # the shape's window at this rate
    counts = window_counts(times, window_s)
    # Poisson's counts have variance = mean; these are far burstier at the window's scale ...
    assert counts.var() / counts.mean() > 3
    # ... and a window is empty about as often as the chain is off
    assert np.mean(counts == 0) == pytest.approx(1 - shape.share_on, abs=0.08)
    poisson = arrival_times(WorkloadSpec(rps=rps, num_requests=200_000), random.Random(2))
    counts = window_counts(poisson, window_s)
    assert counts.var() / counts.mean() < 1.5 and not np.any(counts == 0)
    # a duration bounds them as it bounds the others
    timed = arrival_times(WorkloadSpec(rps=rps, arrivals=kind, duration_s=60.0), random.Random(2))
    assert timed and max(timed) < 60.0


def test_azure_code_shape_has_silent_windows_and_conv_none():
    assert AZURE_SHAPES["azure-code"].share_on == pytest.approx(0.437, abs=0.01)
    assert AZURE_SHAPES["azure-conv"].share_on == 1.0


def test_constant_arrivals():
    times = arrival_times(
        WorkloadSpec(rps=4.0, arrivals="constant", duration_s=1.1), random.Random(0)
    )
    assert times == pytest.approx([0.25, 0.5, 0.75, 1.0])


def test_arrivals_stop_at_the_duration_or_the_count():
    timed = arrival_times(WorkloadSpec(rps=50.0, duration_s=2.0), random.Random(0))
    assert 60 < len(timed) < 140 and max(timed) < 2.0 and timed == sorted(timed)
    both = arrival_times(WorkloadSpec(rps=50.0, duration_s=2.0, num_requests=7), random.Random(0))
    assert both == timed[:7]
    with pytest.raises(ValueError):
        WorkloadSpec(rps=1.0)  # unbounded


def test_popularity_weights():
    rng = random.Random(0)
    assert popularity_weights("uniform", 4, 1.0, rng) == [0.25] * 4
    zipf = popularity_weights("zipf", 10, 1.5, rng)
    assert zipf[0] / zipf[1] == pytest.approx(2**1.5) and sum(zipf) == pytest.approx(1.0)
    # S-LoRA draws adapter floor(n * x), x ~ numpy power(alpha): compare with that sampler.
    n, alpha = 20, 0.3
    power = popularity_weights("power", n, alpha, rng)
    draws = (np.random.default_rng(0).power(alpha, 200_000) * n).astype(int)
    assert np.allclose(np.bincount(draws, minlength=n) / draws.size, power, atol=0.004)
    assert popularity_weights("power", 5, 1.0, rng) == pytest.approx([0.2] * 5)
    azure = popularity_weights("azure", 5000, 1.0, rng)
    assert azure == sorted(azure, reverse=True)
    assert 0.97 < sum(azure[: int(0.186 * 5000)]) < 1.0  # Azure Functions: 18.6% take 99.6%


def test_length_specs():
    rng = random.Random(0)
    assert LengthSpec.parse("17", 100).sample(rng) == 17
    assert LengthSpec.parse("fixed:500", 100).sample(rng) == 100  # clipped to the max
    uniform = {LengthSpec.parse("uniform:3:5", 100).sample(rng) for _ in range(200)}
    assert uniform == {3, 4, 5}
    lmsys = LengthSpec.parse("lmsys", 100_000, "prompt")
    assert lmsys.a == 69.5
    assert statistics.mean(lmsys.sample(rng) for _ in range(40_000)) == pytest.approx(
        69.5, rel=0.05
    )
    assert LengthSpec.parse("lmsys", 10, "output").a == 214.5
    for bad in ("uniform:5:3", "lognormal:0:1", "zero", "fixed:0", "lmsys:3"):
        with pytest.raises(ValueError):
            LengthSpec.parse(bad, 100)


def spec(**kw) -> WorkloadSpec:
    base = dict(
        rps=20.0,
        num_requests=400,
        prompt_len=LengthSpec("uniform", 2, 9),
        output_len=LengthSpec("fixed", 4),
        token_range=(10, 20),
        seed=3,
    )
    return WorkloadSpec(**(base | kw))


def test_trace_is_deterministic_and_follows_the_rank_mix():
    trace = build_trace(spec(rank_mix=parse_rank_mix("8:3,32:1")), ADAPTERS)
    assert trace == build_trace(spec(rank_mix=((8, 3.0), (32, 1.0))), ADAPTERS)
    assert {e.model for e in trace} == {"a", "b", "d"}
    share_8 = sum(e.rank == 8 for e in trace) / len(trace)
    assert 0.68 < share_8 < 0.82
    assert all(e.rank == ADAPTERS[e.model] for e in trace)
    assert all(2 <= len(e.prompt) <= 9 and set(e.prompt) <= set(range(10, 20)) for e in trace)
    # Each aspect has its own random stream: new lengths keep the arrivals and adapters.
    longer = build_trace(
        spec(rank_mix=((8, 3.0), (32, 1.0)), output_len=LengthSpec("fixed", 9)), ADAPTERS
    )
    assert [(e.arrival_s, e.model) for e in longer] == [(e.arrival_s, e.model) for e in trace]
    assert build_trace(spec(seed=4), ADAPTERS) != build_trace(spec(), ADAPTERS)
    with pytest.raises(ValueError, match="rank"):
        build_trace(spec(rank_mix=((64, 1.0),)), ADAPTERS)
    assert {e.model for e in build_trace(spec(), {}, "base")} == {"base"}


def test_identical_and_distinct_assignments():
    identical = build_trace(spec(popularity="identical"), ADAPTERS)
    assert len({e.model for e in identical}) == 1
    distinct = build_trace(spec(popularity="distinct"), ADAPTERS)
    models = [e.model for e in distinct]
    assert all(a != b for a, b in zip(models, models[1:]))  # never twice in a row
    counts = collections.Counter(models)
    assert set(counts) == set(ADAPTERS) and max(counts.values()) - min(counts.values()) <= 1
    # within a rank mix, each rank's adapters in turn
    mixed = build_trace(spec(popularity="distinct", rank_mix=((8, 1.0),)), ADAPTERS)
    eights = sorted(n for n, r in ADAPTERS.items() if r == 8)
    assert collections.Counter(e.model for e in mixed) == {n: 400 // len(eights) for n in eights}


def test_assignment_spellings():
    assert parse_assignment("identical") == ("identical", 1.0)
    assert parse_assignment("distinct") == ("distinct", 1.0)
    assert parse_assignment("uniform") == ("uniform", 1.0)
    assert parse_assignment("zipf") == ("zipf", 1.0)
    assert parse_assignment("zipf", alpha=1.3) == ("zipf", 1.3)  # the old --alpha still counts
    assert parse_assignment("zipf:1.5", alpha=1.3) == ("zipf", 1.5)  # the spec's own wins
    assert parse_assignment("power:0.3") == ("power", 0.3)
    for bad in ("zipf:", "zipf:0", "zipf:-1", "zipf:x", "uniform:2", "skewed", "distinct:1"):
        with pytest.raises(ValueError):
            parse_assignment(bad)
    popularity, alpha = parse_assignment("zipf:2.0")
    trace = build_trace(spec(popularity=popularity, alpha=alpha, num_requests=4000), ADAPTERS)
    counts = sorted(collections.Counter(e.model for e in trace).values(), reverse=True)
    assert counts[0] / counts[1] == pytest.approx(4.0, rel=0.2)  # 1/1^2 : 1/2^2


def test_trace_jsonl_round_trip(tmp_path):
    trace = build_trace(spec(num_requests=20), ADAPTERS)
    save_trace(trace, tmp_path / "t.jsonl")
    assert load_trace(tmp_path / "t.jsonl") == trace
    (tmp_path / "bad.jsonl").write_text('{"arrival_s": 1}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        load_trace(tmp_path / "bad.jsonl")


def ok(tpt_s: float, start: float = 0.0, tokens: int = 10) -> dict:
    return {
        "config": {},
        "result": {
            "ok": True,
            "ttft_s": tpt_s,
            "e2e_s": tpt_s * tokens,
            "tpt_s": tpt_s,
            "output_tokens": tokens,
            "start_unix": start,
            "end_unix": start + tpt_s * tokens,
            "lag_s": 0.0,
        },
    }


def test_percentiles_and_summary():
    values = [random.Random(i).random() for i in range(101)]
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))
    records = [ok(0.01 * (i + 1), start=float(i)) for i in range(10)]
    records.append({"config": {}, "result": {"ok": False, "error": "boom"}})
    s = summarise(records, slo_tpt_ms=50.0)
    assert (s["num_ok"], s["num_failed"]) == (10, 1)
    assert s["tpt_p50_ms"] == pytest.approx(55.0) and s["tpt_p90_ms"] == pytest.approx(91.0)
    assert s["slo_attainment"] == pytest.approx(5 / 11)  # the failed request missed it
    assert s["span_s"] == pytest.approx(10.0) and s["output_tokens_per_s"] == pytest.approx(10.0)


def test_journal_resumes_and_refuses_another_trace(tmp_path):
    trace = build_trace(spec(num_requests=5), ADAPTERS)
    journal = Journal(tmp_path / "run.jsonl")
    for entry in trace[:3]:
        journal.write(entry, {"ok": True})
    journal.close()
    again = Journal(tmp_path / "run.jsonl")
    assert again.pending(trace) == trace[3:]
    assert again.records[0]["config"] == request_config(trace[0])
    other = build_trace(spec(num_requests=5, seed=9), ADAPTERS)
    with pytest.raises(ValueError, match="different trace"):
        again.pending(other)


# ---- against a tiny-model server on loopback ------------------------------------------------


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model_dir, tiny_engine, serve_app):
    """(url, received): a tiny server whose engine records every request it is given."""
    from toppings.scripts.make_adapters import make_random_adapter
    from toppings.server.api.app import create_app

    root = tmp_path_factory.mktemp("loadgen_adapters")
    loras = {
        n: str(make_random_adapter(root / n, tiny_model_dir, rank=r, seed=i))
        for i, (n, r) in enumerate(ADAPTERS.items())
    }
    received: list[tuple] = []
    with tiny_engine(loras) as engine:
        submit_all = engine.submit_all

        def recording_submit(reqs):
            for req in reqs:
                name = req.adapter.name if req.adapter is not None else None
                received.append((name, tuple(req.prompt_ids), req.params.max_new_tokens))
            return submit_all(reqs)

        engine.submit_all = recording_submit
        with serve_app(create_app(engine), threads=8) as url:
            yield url, received


def read_journal(path) -> list[dict]:
    return sorted((json.loads(line) for line in open(path)), key=lambda r: r["config"]["idx"])


def test_replayed_trace_sends_the_same_requests(served, tmp_path):
    url, received = served
    trace_path = tmp_path / "trace.jsonl"
    args = ["--url", url, "--rps", "20", "--num-requests", "8", "--ranks", "8,16", "--seed", "5"]
    args += ["--prompt-len", "uniform:3:12", "--output-len", "uniform:2:6"]
    assert loadgen.main(args + ["--save-trace", str(trace_path), "--dry-run"]) == 0
    trace = load_trace(trace_path)
    assert len(trace) == 8 and {e.rank for e in trace} <= {8, 16} and not received

    runs = []
    for name in ("one", "two"):
        received.clear()
        out = tmp_path / f"{name}.jsonl"
        extra = ["--plot", str(tmp_path / "cdf.png")] if name == "one" else []
        argv = ["--url", url, "--trace", str(trace_path), "--out", str(out), "--no-progress"]
        assert loadgen.main(argv + ["--slo-tpt-ms", "1000"] + extra) == 0
        runs.append((sorted(received), read_journal(out)))
    (sent_one, journal_one), (sent_two, journal_two) = runs
    by_prompt = sorted((e.model, tuple(e.prompt), e.max_tokens) for e in trace)
    assert sent_one == sent_two == by_prompt  # what the server was given, both times
    assert [r["config"] for r in journal_one] == [r["config"] for r in journal_two]
    assert [r["config"] for r in journal_one] == [request_config(e) for e in trace]
    for record, entry in zip(journal_one + journal_two, trace + trace):
        result = record["result"]
        assert result["ok"], result
        assert result["output_tokens"] == entry.max_tokens  # ignore_eos reached the server
        assert result["prompt_tokens"] == len(entry.prompt)
        assert 0 < result["ttft_s"] <= result["e2e_s"]
        first_text = result["ttft_text_s"]  # None: every token's text was empty
        assert first_text is None or result["ttft_s"] <= first_text <= result["e2e_s"]
    assert (tmp_path / "cdf.png").stat().st_size > 0

    # Rerunning into a finished journal sends nothing and keeps its lines.
    received.clear()
    argv = ["--url", url, "--trace", str(trace_path), "--out", str(tmp_path / "one.jsonl")]
    assert loadgen.main(argv + ["--no-progress"]) == 0
    assert not received and len(read_journal(tmp_path / "one.jsonl")) == 8


def test_lora_assignment_and_its_old_spelling_make_the_same_trace(served, tmp_path):
    url, received = served
    args = ["--url", url, "--rps", "5", "--num-requests", "12", "--dry-run"]
    traces = {}
    for name, extra in {
        "new": ["--lora-assignment", "zipf:1.5", "--arrivals", "azure-conv"],
        "old": ["--popularity", "zipf", "--alpha", "1.5", "--arrivals", "azure-conv"],
        "distinct": ["--lora-assignment", "distinct"],
    }.items():
        path = tmp_path / f"{name}.jsonl"
        assert loadgen.main(args + extra + ["--save-trace", str(path)]) == 0
        traces[name] = load_trace(path)
    assert traces["new"] == traces["old"] and len(traces["new"]) == 12
    models = [e.model for e in traces["distinct"]]
    assert all(a != b for a, b in zip(models, models[1:])) and set(models) == set(ADAPTERS)
    assert not received  # a dry run sends nothing
    with pytest.raises(SystemExit, match="adapter assignment"):
        loadgen.main(args + ["--lora-assignment", "skewed"])


def test_a_keyed_server_takes_the_key_from_the_flag_or_the_environment(
    tiny_engine, serve_app, tmp_path, monkeypatch
):
    """--api-key (or $TOPPINGS_SCHEDULER_API_KEY, then $TOPPINGS_API_KEY) on every request,
    /v1/models included; the summary file keeps no trace of it."""
    from toppings.server.api.app import ApiOptions, create_app

    for name in ("TOPPINGS_SCHEDULER_API_KEY", "TOPPINGS_API_KEY"):
        monkeypatch.delenv(name, raising=False)
    with tiny_engine({}) as engine, serve_app(create_app(engine, ApiOptions(api_key="k1"))) as url:
        args = ["--url", url, "--rps", "20", "--num-requests", "3", "--output-len", "2",
                "--no-progress"]  # fmt: skip
        with pytest.raises(SystemExit, match=r"401 .* \(the key: --api-key"):
            loadgen.main(args)
        summary = tmp_path / "run.json"
        assert loadgen.main(args + ["--api-key", "k1", "--summary", str(summary)]) == 0
        assert "k1" not in summary.read_text()
        assert json.loads(summary.read_text())["metrics"]["num_ok"] == 3
        monkeypatch.setenv("TOPPINGS_API_KEY", "k1")
        out = tmp_path / "env.jsonl"
        assert loadgen.main(args + ["--out", str(out)]) == 0
        assert all(r["result"]["ok"] for r in read_journal(out))


def test_bursty_arrivals_that_leave_a_short_run_empty_say_so(monkeypatch, capsys):
    """azure-code at 5 requests/s is off for tens of seconds at a time: a 10-second run may
    hold nothing. Said, not a table of NaN and exit 0."""
    monkeypatch.setattr(loadgen, "list_models", lambda url, **kw: ("base", {"a8": 8}))
    args = ["--url", "http://127.0.0.1:9", "--arrivals", "azure-code", "--rps", "5",
            "--duration", "10", "--no-progress"]  # fmt: skip
    sizes = {}
    for seed in range(12):
        assert loadgen.main(args + ["--seed", str(seed), "--dry-run"]) == 0
        out = capsys.readouterr().out
        sizes[seed] = json.loads(out.split("trace: ", 1)[1].splitlines()[0])["num_requests"]
        assert ("note: azure-code arrivals are bursty" in out) == (sizes[seed] < 25), out
    empty = [seed for seed, n in sizes.items() if n == 0]
    assert empty, sizes
    with pytest.raises(SystemExit, match="the trace holds no request"):
        loadgen.main(args + ["--seed", str(empty[0])])
