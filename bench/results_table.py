"""The table of current results in docs/benchmarks.md, made from bench/results/*.json.

    python -m bench.results_table          # rewrite the table between the page's markers
    python -m bench.results_table --check  # exit 1 when the page's table is stale

Every file under bench/results/ is either CURRENT (a row: what it measures and the metric keys
that are its headline, read from the file's `metrics`) or EARLIER (a run the notes of the page
cite: a rerun, a control, a before/after pair, a superseded configuration). A new result file
that is neither fails tests/test_docs.py, so the table cannot fall behind the results.

The command column names each driver where it lives now: a file written before a driver moved
(`scripts.bench_*` before bench/ held them, `bench.tcache`) keeps the command it ran as, and
MOVED rewrites it for the table.

A headline key is a path into `metrics`: "a.b" reads metrics["a"]["b"], "*" every key of one
level that has the rest of the path ("*.ratio_b_vs_a": that ratio per precision); a dict of
numbers prints as `key: value`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"
BEGIN = "<!-- results-table:begin (python -m bench.results_table) -->"
END = "<!-- results-table:end -->"

_TPUT = ("tokens_per_s", "ratio_vs_hf_peft", "decode_step_ratio_lora_vs_base", "roofline_fraction")
_CPU_ASSISTED = ("ttft_ratio_cpu_assisted_vs_cached", "ttft_ratio_cpu_assisted_vs_on_demand",
                 "tpt_ratio_cpu_assisted_vs_cached", "link")  # fmt: skip
_QUEUEING = ("sustained_load_ratio_vs_slora", "p99_ttft_ratio_vs_slora",
             "sustained_load_ratio_vs_fcfs", "p99_ttft_ratio_vs_fcfs_overload")  # fmt: skip
_LOADGEN = ("ttft_p50_ms", "tpt_p50_ms", "requests_per_s", "num_failed")
_ATTENTION = ("bfloat16_new128_past0.*.ms_median", "bfloat16_new256_past2300.*.ms_median")

# file -> (what it measures, headline metric paths)
CURRENT: dict[str, tuple[str, tuple[str, ...]]] = {
    "engine_throughput.json": ("SmolLM2 bf16, 16 adapters, 64 requests: the engine against "
                               "transformers + PEFT in the same run",
                               (*_TPUT, "threads_speedup", "ttft_ms_single", "tpot_ms_single")),
    "engine_throughput_1b.json": ("the same on a Llama-3.2-1B-shaped dummy model", _TPUT),
    "engine_throughput_1b_hf64.json": ("1B shapes, transformers + PEFT at batch 64",
                                       ("tokens_per_s", "tokens_per_s_hf_peft",
                                        "ratio_vs_hf_peft")),
    "engine_throughput_qwen1.5b.json": ("the same on a Qwen2.5-1.5B-shaped dummy model", _TPUT),
    "single_stream.json": ("one stream's time per token by precision, beside llama-server",
                           ("tpot_ms_batch1", "tpot_ratio_vs_llama_server_batch1",
                            "tpot_ratio_adapter_vs_base_batch1")),
    "long_prompt.json": ("a long prompt's first token by precision, beside llama-server",
                         ("*.toppings_ttft_ms.median", "*.llama_server_ttft_ms.median")),
    "prefill_attention.json": ("prefill attention kernels (tiles, rows, SDPA), 1 thread",
                               _ATTENTION),
    "prefill_attention_2threads.json": ("the same on 2 threads", _ATTENTION),
    "prefill_attention_amx.json": ("the same on an AMX Xeon, 2 threads: SDPA's flash kernel "
                                   "ahead in bfloat16", (*_ATTENTION,
                                   "bfloat16_new2500_past0.*.ms_median")),
    "long_prompt_amx.json": ("a 3,000-token bfloat16 prompt on an AMX Xeon, its long segments "
                             "through SDPA, beside llama-server",
                             ("*.toppings_ttft_ms.median", "*.llama_server_ttft_ms.median")),
    "cpu_linear.json": ("packed (oneDNN) against plain linear layers, decode rows",
                        ("decode_speedup_packed_vs_plain.*.4",)),
    "decode_rows.json": ("decode steps at 1-32 requests: the GEMV on AMX's tiles against "
                         "gemv_bf16 + oneDNN (AMX Xeon, 1 thread)",
                         ("base_b4.vectors_over_tiles", "base_b8.vectors_over_tiles",
                          "adapters_b8.tiles_ms", "adapters_b8.vectors_over_tiles")),
    "host_served_decode.json": ("decode steps with requests served on the host: in one native "
                                "call against layer by layer (AMX Xeon, 1 thread)",
                                ("b12.one_call_ms", "b12.layer_by_layer_over_one_call",
                                 "b16.one_call_ms", "b16.layer_by_layer_over_one_call")),
    "cpu_decode_paths.json": ("CPU LoRA decode paths: native runs, runs, dense; every request "
                              "served from the host",
                              ("*.native_runs_ms", "*.dense_vs_runs",
                               "*.host_native_vs_native_runs", "*.host_native_vs_host_matmuls")),
    "cpu_lora_ipc.json": ("host LoRA job overhead through shared memory",
                          ("overhead_p50_us", "overhead_p99_us",
                           "shm_vs_socket_ratio_at_max_workers")),
    "cpu_lora_parallel.json": ("CPU LoRA worker pool against threads in one process",
                               ("speedup_pool_vs_threads", "speedup_pool_vs_threads_bf16")),
    "cpu_assisted.json": ("CPU-assisted prefill against cached and on-demand adapters",
                          _CPU_ASSISTED),
    "cpu_assisted_split.json": ("the same with the engine and the workers on separate cores",
                                _CPU_ASSISTED),
    "cpu_assisted_nosplit.json": ("the same, engine and workers sharing both cores",
                                  _CPU_ASSISTED),
    "single_server.json": ("one server under a trace, by LoRA mode (TTFT / cached)",
                           ("ratios.*.ttft_ratio_vs_cached",)),
    "single_server_rps1.json": ("the same at 1 request/s", ("ratios.*.ttft_ratio_vs_cached",)),
    "single_server_evict.json": ("the same with an adapter cache of 5% (evictions)",
                                 ("ratios.*.ttft_ratio_vs_cached",)),
    "adapter_scale.json": ("distinct, zipf and identical adapters per request, found on "
                           "first use (read from disk): the default (auto: cpu-assisted on a "
                           "CPU), on-demand beside it",
                           ("p99_ttft_ratio_distinct_vs_identical",
                            "p99_ttft_ratio_distinct_vs_identical_per_round",
                            "p99_ttft_text_ratio_distinct_vs_identical",
                            "throughput_ratio_distinct_vs_identical",
                            "p99_ttft_ratio_zipf_vs_identical",
                            "modes.on-demand.p99_ttft_ratio_distinct_vs_identical",
                            "modes.on-demand.p99_ttft_ratio_zipf_vs_identical")),
    "adapter_scale_default_again.json": ("the default mode alone, run right after (the spread "
                                         "between runs)",
                                         ("p99_ttft_ratio_distinct_vs_identical",
                                          "p99_ttft_ratio_distinct_vs_identical_per_round",
                                          "p99_ttft_ratio_zipf_vs_identical",
                                          "p99_ttft_ratio_zipf_vs_identical_per_round",
                                          "throughput_ratio_distinct_vs_identical")),
    "adapter_scale_six_rounds.json": ("the default mode alone, six rounds (2,400 requests an "
                                      "assignment): the ratios pooled and their spread; TTFT "
                                      "to the first token, `text` to the first text",
                                      ("p99_ttft_ratio_distinct_vs_identical",
                                       "p99_ttft_ratio_distinct_vs_identical_per_round",
                                       "p99_ttft_text_ratio_distinct_vs_identical",
                                       "p99_ttft_ratio_zipf_vs_identical",
                                       "p99_ttft_ratio_zipf_vs_identical_per_round",
                                       "p99_ttft_text_ratio_zipf_vs_identical")),
    "adapter_scale_epyc_four_rounds.json": ("the default mode alone, four rounds on the 2-core "
                                            "EPYC (session 53)",
                                            ("p99_ttft_ratio_distinct_vs_identical",
                                             "p99_ttft_ratio_distinct_vs_identical_per_round",
                                             "p99_ttft_ratio_zipf_vs_identical",
                                             "p99_ttft_ratio_zipf_vs_identical_per_round",
                                             "throughput_ratio_distinct_vs_identical")),
    "adapter_scale_session56.json": ("the default mode alone, four rounds on the same EPYC "
                                     "on session 56's code",
                                     ("p99_ttft_ratio_distinct_vs_identical",
                                      "p99_ttft_ratio_distinct_vs_identical_per_round",
                                      "p99_ttft_ratio_zipf_vs_identical",
                                      "p99_ttft_ratio_zipf_vs_identical_per_round",
                                      "throughput_ratio_distinct_vs_identical")),
    "adapter_scale_all_cached_epyc.json": ("the default beside all-cached (nothing ever cold) "
                                           "on the EPYC, session 56",
                                           ("p99_ttft_ratio_distinct_vs_identical",
                                            "p99_ttft_ratio_zipf_vs_identical",
                                            "p99_ttft_ratio_distinct_vs_all_cached_distinct",
                                            "modes.all-cached.p99_ttft_ratio_distinct_vs_identical")),
    "adapter_scale_layouts.json": ("the default mode in both memory layouts, four rounds on "
                                   "the EPYC (session 57): the pool layout, the server's "
                                   "default, at top level; the static one beside it",
                                   ("p99_ttft_ratio_distinct_vs_identical",
                                    "p99_ttft_ratio_distinct_vs_identical_per_round",
                                    "p99_ttft_ratio_zipf_vs_identical",
                                    "p99_ttft_ratio_zipf_vs_identical_per_round",
                                    "throughput_ratio_distinct_vs_identical",
                                    "modes.cpu-assisted.layouts.static."
                                    "p99_ttft_ratio_distinct_vs_identical",
                                    "modes.cpu-assisted.layouts.static."
                                    "p99_ttft_ratio_zipf_vs_identical")),
    "adapter_scale_pool_again.json": ("the default mode in the default (pool) layout alone, "
                                      "four rounds on the EPYC, run right after (session 57)",
                                      ("p99_ttft_ratio_distinct_vs_identical",
                                       "p99_ttft_ratio_distinct_vs_identical_per_round",
                                       "p99_ttft_ratio_zipf_vs_identical",
                                       "p99_ttft_ratio_zipf_vs_identical_per_round",
                                       "throughput_ratio_distinct_vs_identical")),
    "adapter_scale_registered.json": ("the same with every adapter registered at start-up "
                                      "(in host memory, as Toppings keeps them)",
                                      ("p99_ttft_ratio_distinct_vs_identical",
                                       "p99_ttft_ratio_zipf_vs_identical",
                                       "modes.on-demand.p99_ttft_ratio_distinct_vs_identical",
                                       "modes.on-demand.p99_ttft_ratio_zipf_vs_identical")),
    "adapter_scale_registered_xeon.json": ("the same on the Intel Xeon of session 45",
                                           ("p99_ttft_ratio_distinct_vs_identical",
                                            "p99_ttft_ratio_zipf_vs_identical")),
    "adapter_scale_all_cached.json": ("the default beside all-cached, a control with every "
                                      "adapter of its trace registered and resident: what "
                                      "many adapters cost with none ever cold",
                                      ("p99_ttft_ratio_distinct_vs_identical",
                                       "p99_ttft_ratio_distinct_vs_all_cached_distinct",
                                       "modes.all-cached.p99_ttft_ratio_distinct_vs_identical",
                                       "modes.all-cached.p99_ttft_ratio_zipf_vs_identical")),
    "resolution_profile.json": ("where a cold adapter's resolution goes (read, digest, "
                                "registration, copy; the host tier)",
                                ("resolution_mean_ms", "all.open.mean_ms", "all.digest.mean_ms")),
    "memory.json": ("one memory pool with prefix reuse against static partitions",
                    ("ttft_p50_ratio_vs_static", "ttft_p99_ratio_vs_static",
                     "tpt_ratio_vs_static")),
    "chunked_prefill.json": ("chunked against unchunked prefill, and against llama-server",
                             ("itl_p99_ratio", "ttft_p99_ratio", "throughput_ratio",
                              "itl_p50_ratio", "ttft_p99_ratio_vs_llama_server")),
    "chunked_prefill_rerun.json": ("the same, rerun in session 55 on the final code (with "
                                    "the FLOOR_STALL bound), without llama-server",
                                    ("itl_p99_ratio", "ttft_p99_ratio", "throughput_ratio",
                                     "itl_p50_ratio", "itl_max_ratio")),
    "chunked_prefill_floors.json": ("the GEMM floor's trade (session 56): chunked engines "
                                    "with floors of 128, 256 and 1,024 tokens beside the "
                                    "default's (512 here) at 0.5 and 0.7 of capacity, each "
                                    "against unchunked, the worst over the two loads",
                                    ("target_sweep.*.ttft_p99_ratio",
                                     "target_sweep.*.itl_p99_ratio",
                                     "target_sweep.*.itl_p50_ratio")),
    "chunked_prefill_session54.json": ("the same over 4 rounds in session 54, before chunks of "
                                       "the GEMM floor's rows (a late chunk's past priced)",
                                       ("itl_p99_ratio", "ttft_p99_ratio", "throughput_ratio",
                                        "itl_p50_ratio")),
    "chunked_prefill_session53.json": ("the same over 2 rounds in session 53 (P99 TTFT and "
                                       "median ITL at their targets' edge)",
                                       ("itl_p99_ratio", "ttft_p99_ratio", "throughput_ratio",
                                        "itl_p50_ratio")),
    "chunked_prefill_session52.json": ("the same with session 52's thread governor (symmetric: "
                                       "its flips to one thread did not come in that run)",
                                       ("itl_p99_ratio", "ttft_p99_ratio", "throughput_ratio",
                                        "itl_p50_ratio")),
    "chunked_prefill_governor_flips.json": ("the same where the chunked engine's governor, "
                                            "before its lopsided rule, went to one thread on "
                                            "noise (0.70-0.82x) for much of 3 of its 6 runs",
                                            ("ttft_p99_ratio", "itl_p50_ratio",
                                             "throughput_ratio", "capacity_ratio")),
    "chunked_prefill_epyc_floor8.json": ("the same with the GEMM floor beside at most 8 decodes "
                                         "(session 51; the target alone beside more)",
                                         ("itl_p99_ratio", "ttft_p99_ratio",
                                          "throughput_ratio", "itl_p50_ratio")),
    "chunked_prefill_epyc_floor256.json": ("the same before the GEMM floor counted the decode "
                                           "step a chunk carries (256 tokens there; 512 now)",
                                           ("itl_p99_ratio", "ttft_p99_ratio",
                                            "throughput_ratio", "itl_p50_ratio")),
    "chunked_prefill_xeon.json": ("the same on the 2-core AMX Xeon of session 50 (floor 2,048)",
                                  ("itl_p99_ratio", "ttft_p99_ratio", "throughput_ratio",
                                   "itl_p50_ratio")),
    "chunked_prefill_floor256.json": ("the Xeon's with the GEMM floor held at 256 tokens (the "
                                      "measured floor's A/B on the AMX Xeon)",
                                      ("itl_p99_ratio", "ttft_p99_ratio", "throughput_ratio",
                                       "itl_p50_ratio")),
    "mixed_steps.json": ("step budget: the longest step against its inter-token target",
                         ("budget_tokens", "max_step_over_target")),
    "queueing.json": ("queue policies (Chameleon, S-LoRA, FCFS) on the engine", _QUEUEING),
    "queueing_pool.json": ("the same with the memory pool", _QUEUEING),
    "queueing_long.json": ("Chameleon's scheduling on or off, longer runs",
                           ("p99_ttft_ratio_vs_fcfs_overload",)),
    "queueing_sim.json": ("queue policies in the simulator, CPU step model",
                          ("sustained_load_ratio_vs_fcfs", "p99_ttft_ratio_vs_fcfs")),
    "queueing_sim_flat.json": ("the same, flat-decode step model",
                               ("sustained_load_ratio_vs_fcfs", "p99_ttft_ratio_vs_fcfs")),
    "queueing_sim_configs.json": ("the engine's configurations in the simulator", _QUEUEING),
    "queueing_sim_validate.json": ("the simulator against queueing.json (capacity)",
                                   ("capacity_rps.per_config.*.ratio",)),
    "structured_output.json": ("constrained against free decoding, grammar compile times",
                               ("tpot_ratio_constrained_vs_free", "compile.cold.p50_ms",
                                "compile.cold.p99_ms")),
    "alora_pipeline.json": ("activated LoRA checker turns against plain LoRA ones",
                            ("ttft_ratio_alora_vs_lora", "turn_e2e_ratio_alora_vs_lora.median")),
    "prefix_routing.json": ("prefix-aware routing on or off",
                            ("prefix_hit_rate", "prefix_hit_rate_off",
                             "ttft_ratio_prefix_routing_vs_off.median")),
    "async_scheduling.json": ("planning the next step while this one runs",
                              ("step_ratio_async_vs_bound", "step_ratio_async_vs_bound_nominal",
                               "speedup_async_vs_sync_min")),
    "host_overhead.json": ("the host's cost of a step, fixed and per request",
                           ("host_fixed_us", "host_us_per_request")),
    "host_overhead_xeon.json": ("the same on the AMX Xeon; the graph path's host side and mixed "
                                "steps (a 256-token chunk beside the decodes) beside",
                                ("host_fixed_us", "host_us_per_request",
                                 "graph.host_fixed_us", "graph.host_us_per_request",
                                 "mixed.host_fixed_us", "mixed.host_us_per_request")),
    "step_glue.json": ("the Python between native calls of a decode step",
                       ("glue_us_real", "glue_us_warm", "native_ms_real")),
    "cold_ops.json": ("small tensor ops with cold and warm caches",
                      ("scan_logits.cold_over_warm", "torch_index_write.cold_over_warm")),
    "pair_steps.json": ("paired decode steps, whole step B against A, by precision",
                        ("*.ratio_b_vs_a",)),
    "pair_steps_adapter.json": ("paired steps: an adapter against none", ("*.ratio_b_vs_a",)),
    "pair_steps_control.json": ("paired steps: no change (the method's noise)",
                                ("*.ratio_b_vs_a",)),
    "pair_steps_huge_pages.json": ("paired steps: huge pages on", ("*.ratio_b_vs_a",)),
    "pair_steps_huge_pages_1b.json": ("paired steps: huge pages on, 1B shapes",
                                      ("*.ratio_b_vs_a",)),
    "pair_steps_int8_vs_bf16.json": ("paired steps: int8 weights against bf16",
                                     ("*.ratio_b_vs_a",)),
    "pair_steps_int8_vs_bf16_scan.json": ("the same with the logits scan", ("*.ratio_b_vs_a",)),
    "pair_steps_scan_in_step.json": ("paired steps: the logits scan inside the step",
                                     ("*.ratio_b_vs_a",)),
    "tcache.json": ("the allocator's thread cache off against on", ("ratio_off_over_on",)),
    "neighbour.json": ("one stream beside a busy neighbour, thread governor on or off",
                       ("busy_over_quiet", "governor_on_over_off_busy",
                        "governor_on_over_off_quiet")),
    "neighbour_median_arrival.json": ("the same before two slow steps beside a crowding "
                                      "neighbour started a comparison (2026-12-06 21:00)",
                                      ("busy_over_quiet", "governor_on_over_off_busy",
                                       "governor_on_over_off_quiet")),
    "neighbour_running_tasks.json": ("the same where the governor read the free cores from "
                                     "a count of running tasks (2026-12-06 18:54)",
                                     ("busy_over_quiet", "governor_on_over_off_busy",
                                      "governor_on_over_off_quiet")),
    "neighbour_symmetric_rule.json": ("the same with the governor's symmetric rule "
                                      "(2026-11-27)",
                                      ("busy_over_quiet", "governor_on_over_off_busy",
                                       "governor_on_over_off_quiet")),
    "soak.json": ("30 minutes of churn, poison and overflow against one server",
                  ("engine_deaths", "failures_healthy_requests",
                   "rss_growth_after_warmup_mb_per_hour")),
    "hostile_body.json": ("deeply nested bodies: refusal time, /health meanwhile",
                          ("server/body.seconds_max", "server/body.health_max_ms")),
    "demo_cold.json": ("the demo from a cold and a warm cache", ("cold_total_s", "warm_total_s")),
    "first_request.json": ("a fresh server's first request against the same warm, and against "
                           "a prompt length it has not met (AMX Xeon)",
                           ("base.first_over_warm_ttft.median", "base.new_over_warm_ttft.median",
                            "adapter.first_over_warm_ttft.median")),
    "scored_prompt.json": ("8 streams beside a 6,000-token prompt scored (prompt logprobs) and "
                           "plain: the streams' largest gap (AMX Xeon)",
                           ("scored.max_gap_ms", "plain.max_gap_ms",
                            "max_gap_ratio_scored_vs_plain.median", "scored.request_s")),
    "mixed_plan.json": ("mixed steps (B decodes beside a 256-token chunk) with the attention plan "
                        "from spans of the request table against per-segment slices, tiny Llama "
                        "(host-bound; AMX Xeon)",
                        ("batch_64.step_ratio_spans_vs_slices.median",
                         "batch_256.step_ratio_spans_vs_slices.median",
                         "batch_256.plan_us")),
    "mixed_plan_smollm2.json": ("the same on SmolLM2 bf16, whose compute dilutes it",
                                ("batch_64.step_ratio_spans_vs_slices.median",
                                 "batch_256.step_ratio_spans_vs_slices.median")),
    "fair_share.json": ("one adapter's flood of 48 requests and another adapter's single request, "
                        "SmolLM2 bf16, batch 8: fair shares on against off (AMX Xeon)",
                        ("lone_ttft_s_on_vs_off.median", "all_makespan_s_on_vs_off.median",
                         "flood_median_ttft_s_on_vs_off.median")),
    "kv_admission.json": ("64 one-sentence chat questions at once with max_tokens 4,096, SmolLM2 "
                          "bf16, 32,768 KV tokens: KV reserved for the output expected against "
                          "all of max_tokens (AMX Xeon)",
                          ("output_tokens_per_s_expected_vs_worst.median",
                           "median_ttft_s_expected_vs_worst.median",
                           "expected.most_running.median", "worst-case.most_running.median")),
    "kv_admission_stories.json": ("the same, 32 requests of max_tokens 1,024 in 1,536 KV tokens, "
                                  "every 16th a long story that outgrows its reservation",
                                  ("output_tokens_per_s_expected_vs_worst.median",
                                   "median_ttft_s_expected_vs_worst.median",
                                   "expected.preemptions.median")),
    "queueing_sim_fair.json": ("the simulator: Chameleon with fair shares (the default since "
                               "session 62) beside arrival order, S-LoRA and cached FCFS",
                               ("sustained_rps.chameleon-fair", "sustained_rps.chameleon",
                                "capacity_rps.chameleon-fair", "capacity_rps.chameleon")),
    "stats_poll.json": ("the scheduler's /stats poll of a server with 5,000 adapters: the list "
                        "only when it changed against every time (AMX Xeon)",
                        ("every_time.poll_ms.median", "changed_only.poll_ms.median",
                         "every_time.body_bytes", "changed_only.body_bytes")),
    "logprobs.json": ("64 streams decoding with 5 logprobs and a 2,000-token prompt scored: the "
                      "native pass against torch's ops and against no logprobs (AMX Xeon)",
                      ("decode_ratio_native_vs_torch.median", "decode_ratio_native_vs_none.median",
                       "scored_prompt_ratio_native_vs_torch.median")),
    "demo_loadgen.json": ("the demo cluster under toppings-loadgen, 1 request/s", _LOADGEN),
    "demo_loadgen_replay.json": ("the same trace replayed", _LOADGEN),
    "gguf_convert.json": ("GGUF conversion, parsed once against plain",
                          ("ratio_parsed_once_vs_plain",)),
    "perf_model.json": ("the fits of the kernel latency models (the scheduler's --perf-model "
                        "file is perf_model_smollm2_cpu.json)", ("r2", "predict_us")),
    "cluster_sim.json": ("placement policies in the cluster simulator (paper's models)",
                         ("slo_attainment", "tpt_reduction_rank_aware_vs")),
    "cluster_sim_smollm2_cpu.json": ("the same with SmolLM2-on-CPU latency models",
                                     ("slo_attainment",)),
    "cluster_placement.json": ("LoRAServe placement against rank-aware, 40,000 adapters",
                               ("sustained_rps_ratio_vs_rank_aware",
                                "adapter_moves_per_step.loraserve.fraction_of_adapters_after_first")),
    "cluster_placement_seed1.json": ("the same, another seed",
                                     ("sustained_rps_ratio_vs_rank_aware",)),
    "cluster_real.json": ("three real servers behind the scheduler, LoRAServe against rank-aware",
                          ("ttft_p50_ratio_loraserve_vs_rank_aware",)),
    "kernels.json": ("Triton BGMV / MBGMV kernels, decode at batch 64 rank 64 (GPU)",
                     ("*.B64_r64.time_us", "*.B64_r64.fraction_of_peak")),
}  # fmt: skip

# Runs the notes cite (reruns, controls, before/after pairs, superseded configurations), and the
# fitted perf models `toppings-scheduler --perf-model` reads (not result envelopes).
EARLIER = frozenset({
    "first_request_before.json", "scored_prompt_before.json",
    "adapter_scale_shared_machine.json", "adapter_scale_rerun.json",
    "adapter_scale_before_reads_off_thread.json", "adapter_scale_on_demand_default.json",
    "adapter_scale_session38.json", "adapter_scale_cpu_assisted.json", "adapter_scale_run3.json",
    "adapter_scale_session39.json", "adapter_scale_session40.json",
    "adapter_scale_session42.json", "adapter_scale_session43.json",
    "adapter_scale_session44.json", "adapter_scale_read_before_1.json",
    "adapter_scale_read_before_2.json", "adapter_scale_read_before_3.json",
    "adapter_scale_read_after_1.json", "adapter_scale_read_after_2.json",
    "adapter_scale_read_after_3.json", "adapter_scale_tiles_1.json", "adapter_scale_tiles_2.json",
    "adapter_scale_tiles_3.json", "adapter_scale_vectors_1.json", "adapter_scale_vectors_2.json",
    "adapter_scale_session46.json",
    "adapter_scale_session47.json", "adapter_scale_session48.json",
    "adapter_scale_session49.json", "adapter_scale_session50.json",
    "adapter_scale_session51.json", "adapter_scale_epyc_again.json",
    "adapter_scale_session48_again.json",
    "adapter_scale_vectors_3.json",
    "adapter_scale_four_readers.json", "adapter_scale_one_reader_rerun.json",
    "resolution_profile_float32_host.json",
    "resolution_profile_session38.json", "async_scheduling_session38.json",
    "async_scheduling_session39.json",
    "host_overhead_session38.json", "host_overhead_session39.json",
    "host_overhead_output_thread_before.json",
    "host_overhead_output_thread_off.json", "host_overhead_output_thread_on.json",
    "async_scheduling_output_thread_off.json", "async_scheduling_output_thread_on.json",
    "async_scheduling_persistent_batch.json",
    "async_scheduling_persistent_batch_before.json", "chunked_prefill_band.json",
    "chunked_prefill_issue64_run1.json", "chunked_prefill_session44.json",
    "chunked_prefill_session49.json",
    "chunked_prefill_pre_s26.json",
    "chunked_prefill_targets.json", "cpu_assisted_nosplit_passive.json",
    "cpu_assisted_nosplit_spin30k.json", "cpu_assisted_workers1.json",
    "cpu_lora_ipc_rerun1.json", "cpu_lora_ipc_rerun2.json", "cpu_lora_ipc_v2_run1.json",
    "cpu_lora_ipc_v2_run2.json", "cpu_lora_ipc_v2_run3.json", "engine_step_before_after.json",
    "engine_throughput_float32.json", "host_overhead_after.json", "host_overhead_b374232.json",
    "host_overhead_persistent_batch.json", "host_overhead_persistent_batch_before.json",
    "house_before_after.json", "house4_before_after.json", "long_prompt_quant_before.json",
    "perf_model_smollm2_cpu.json", "perf_model_smollm2_cpu_eq2.json",
    "prefix_routing_before_routed_as.json", "queueing_dense.json",
    "single_stream_aa_control.json", "single_stream_glue_before_after.json",
    "single_stream_loaded.json", "single_stream_quant_prefill_before_after.json",
    "soak_onednn128.json", "soak_run1_cached.json", "soak_run2.json", "soak_short.json",
    "soak_tcache_on.json", "step_glue_int8.json", "step_glue_omp_passive.json",
    "step_glue_omp_spin30k.json", "tcache_single_stream.json", "throughput_before_after.json",
})  # fmt: skip


def unclassified(results: Path = RESULTS) -> list[str]:
    """Result files in neither CURRENT nor EARLIER, and names in them with no file."""
    on_disk = {p.name for p in results.glob("*.json")}
    listed = set(CURRENT) | EARLIER
    return sorted(on_disk ^ listed)


def read(metrics: object, path: str) -> object:
    """The value at `path` ("a.b", "*" for every key of a level) in `metrics`."""
    head, _, rest = path.partition(".")
    if head == "*":  # the keys whose values have the rest of the path
        found = {k: _read_or_none(v, rest) for k, v in metrics.items()}
        found = {k: v for k, v in found.items() if v is not None}
        if not found:
            raise KeyError(path)
        return found
    value = metrics[head]
    return read(value, rest) if rest else value


def _read_or_none(metrics: object, path: str) -> object:
    if not path:
        return metrics
    try:
        return read(metrics, path)
    except (KeyError, TypeError):
        return None


def show(value: object) -> str:
    """A value for a table cell: numbers to 3 significant digits (whole ones from
    1,000 on), a dict as `key: value`."""
    if isinstance(value, bool) or value is None:
        return str(value).lower()
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.3g}"
    if isinstance(value, dict):
        return ", ".join(f"{k}: {show(v)}" for k, v in value.items())
    if isinstance(value, list):
        return "[" + ", ".join(show(v) for v in value) + "]"
    return str(value)


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# A driver's old module -> where it is now (the file's command keeps what ran).
MOVED = {"-m scripts.": "-m bench.", "-m bench.tcache ": "-m bench.bench_tcache "}


def rerunnable(command: str) -> str:
    """`command` with each moved driver's module as it is named now."""
    for old, new in MOVED.items():
        command = command.replace(old, new)
    return command


def row(name: str, what: str, keys: tuple[str, ...], results: Path = RESULTS) -> str:
    envelope = json.loads((results / name).read_text())
    headline = "<br>".join(f"`{k}` {show(read(envelope['metrics'], k))}" for k in keys)
    parts = (f"`{name}`", what, headline, envelope["device"], envelope["date"][:10],
             f"`{rerunnable(envelope['command'].strip())}`")  # fmt: skip
    return "| " + " | ".join(cell(p) for p in parts) + " |"


def table(results: Path = RESULTS) -> str:
    """The generated block: the table of current results, then the earlier runs by name."""
    lines = ["| file | measures | headline | device | date | command |",
             "| --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    lines += [row(name, what, keys, results) for name, (what, keys) in CURRENT.items()]
    lines += ["", "Earlier runs, controls and before/after pairs the notes below cite: "
              + ", ".join(f"`{n}`" for n in sorted(EARLIER)) + "."]  # fmt: skip
    return "\n".join(lines)


def with_table(page: str, block: str) -> str:
    """`page` with the text between the markers replaced by `block`."""
    start, end = page.index(BEGIN) + len(BEGIN), page.index(END)
    return page[:start] + "\n" + block + "\n" + page[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the page is stale")
    args = parser.parse_args(argv)
    if missing := unclassified(RESULTS):
        print("neither CURRENT nor EARLIER (or no such file): " + ", ".join(missing))
        return 1
    page = PAGE.read_text()
    new = with_table(page, table(RESULTS))
    if args.check:
        if new != page:
            print(f"{PAGE} is stale: run python -m bench.results_table")
            return 1
        return 0
    PAGE.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main())
