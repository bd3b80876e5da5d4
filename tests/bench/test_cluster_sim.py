"""bench/cluster_sim end to end on a tiny cluster: the JSON and the PNGs land where --out says."""

from __future__ import annotations

import json

from bench.cluster_sim import main


def test_outputs_follow_out(tmp_path):
    out = tmp_path / "results" / "tiny_sim.json"
    args = ["--servers", "3", "--rps", "4", "--duration", "4", "--loads", "4"]
    assert main([*args, "--kernels", "bgmv", "--workers", "1", "--out", str(out)]) in (0, None)
    result = json.loads(out.read_text())
    assert set(result["metrics"]["slo_attainment"]) == {
        "rank-aware", "prefix-aware", "random", "first-fit", "least-loaded"
    }  # fmt: skip
    assert all(0.0 <= v <= 1.0 for v in result["metrics"]["slo_attainment"].values())
    assert (tmp_path / "tiny_sim_slo.png").stat().st_size > 0
    assert (tmp_path / "tiny_sim_tpt_cdf.png").stat().st_size > 0
