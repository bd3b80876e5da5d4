"""Perf-model coefficients derived from the Toppings paper's Fig. 6 (A100, Llama-7B).

These stand in until a model fitted on our own engine exists; anything computed with them must be
labelled PAPER_SOURCE. Fig. 6: instance 1 runs 24 requests of rank 32, instance 2 runs 16 of
rank 64; their decode iterations take 34.8 / 35.8 ms with BGMV and 35.3 / 35.9 ms with MBGMV.
Two points per kernel fix Eq. 2's two coefficients:

    BGMV:  |S| * max rank = 24*32 = 768 -> 34.8 ms, 16*64 = 1024 -> 35.8 ms
           a_B = (35.8 - 34.8) / (1024 - 768) = 1/256 ms,  b_B = 34.8 - 768/256 = 31.8 ms
    MBGMV: sum rank       = 24*32 = 768 -> 35.3 ms, 16*64 = 1024 -> 35.9 ms
           a_M = (35.9 - 35.3) / 256 = 0.00234375 ms,     b_M = 35.3 - 768*a_M = 33.5 ms

The paper gives no prefill numbers for this setting, so prefill is an assumption, not a
derivation: one iteration's fixed cost equals the decode intercept, 0.07 ms per prompt token
(Llama-7B needs ~14 GFLOP per token; an A100 sustains ~200 TFLOP/s on prefill GEMMs), and the
LoRA work per token x rank costs an eighth of the decode slope (prefill runs the adapters as
GEMMs, not matrix-vector products), which makes LoRA ~14% of a 256-token rank-64 BGMV prefill.
All three prefill numbers are guesses to be replaced by a model fitted on our engine.
"""

from __future__ import annotations

from toppings.scheduler.perf_model import LinearPerfModel, PerfModels

PAPER_SOURCE = "paper Fig. 6 (not measured here)"
PREFILL_MS_PER_TOKEN = 0.07
PREFILL_LORA_FRACTION_OF_DECODE_SLOPE = 0.125

FIG6_BATCH_PRODUCT = (24 * 32, 16 * 64)  # |S| * max rank, and sum rank, of instance 1 and 2
FIG6_BGMV_MS = (34.8, 35.8)
FIG6_MBGMV_MS = (35.3, 35.9)


def _two_point_fit(xs: tuple[int, int], ys: tuple[float, float]) -> tuple[float, float]:
    slope = (ys[1] - ys[0]) / (xs[1] - xs[0])
    return slope, ys[0] - slope * xs[0]


def paper_fig6_models() -> PerfModels:
    """Decode models from Fig. 6's four latencies; prefill models from the stated assumptions."""
    a_b, b_b = _two_point_fit(FIG6_BATCH_PRODUCT, FIG6_BGMV_MS)
    a_m, b_m = _two_point_fit(FIG6_BATCH_PRODUCT, FIG6_MBGMV_MS)
    lora = PREFILL_LORA_FRACTION_OF_DECODE_SLOPE
    models = {
        "bgmv_decode": LinearPerfModel("bgmv", "decode", b_b, (a_b,)),
        "mbgmv_decode": LinearPerfModel("mbgmv", "decode", b_m, (a_m,)),
        "bgmv_prefill": LinearPerfModel("bgmv", "prefill", b_b, (PREFILL_MS_PER_TOKEN, lora * a_b)),
        "mbgmv_prefill": LinearPerfModel(
            "mbgmv", "prefill", b_m, (PREFILL_MS_PER_TOKEN, lora * a_m)
        ),
    }
    return PerfModels(models, source=PAPER_SOURCE)
