"""Chameleon's sizing formulas: WRS, the output predictor, K-means cutoffs, the M/M/1 quota."""

from __future__ import annotations

import random

import pytest

from toppings.server.sched.sizing import (
    OutputPredictor,
    kmeans_1d,
    min_quota_tokens,
    queue_cutoffs,
    split_quotas,
    weighted_request_size,
)


def test_wrs_is_the_papers_formula():
    # (0.4 * 50/100 + 0.6 * 20/40) * 8/16 = (0.2 + 0.3) * 0.5
    assert weighted_request_size(50, 20, 8, 100, 40, 16) == pytest.approx(0.25)
    assert weighted_request_size(100, 40, 16, 100, 40, 16) == pytest.approx(1.0)


def test_wrs_clips_ratios_above_a_stale_maximum():
    assert weighted_request_size(500, 400, 32, 100, 40, 16) == pytest.approx(1.0)


def test_wrs_orders_by_adapter_size_at_equal_lengths():
    small = weighted_request_size(64, 64, 8, 512, 128, 128)
    large = weighted_request_size(64, 64, 128, 512, 128, 128)
    assert large == pytest.approx(16 * small)


def test_output_predictor_learns_per_adapter_and_caps_by_max_tokens():
    p = OutputPredictor()
    assert p.predict("a", 100) == 100  # nothing known: the request's own bound
    for n in (10, 20, 30):
        p.observe("a", n, 100)  # adapter a's requests stop at a fifth of their bound
    p.observe("b", 200, 200)
    assert p.predict("a", 100) == pytest.approx(20)
    assert p.predict("a", 500) == pytest.approx(100)
    assert p.predict("b", 64) == 64  # never above max_new_tokens
    assert p.predict("new", 100) == pytest.approx(100 * (0.1 + 0.2 + 0.3 + 1.0) / 4)


def test_kmeans_finds_separated_clusters():
    values = [0.1, 0.11, 0.09, 0.5, 0.52, 0.48, 0.9, 0.91, 0.89]
    centroids, wcss = kmeans_1d(values, 3)
    assert centroids == pytest.approx([0.1, 0.5, 0.9], abs=1e-9)
    assert wcss == pytest.approx(4 * 0.01**2 + 2 * 0.02**2)


def test_cutoffs_are_midpoints_between_centroids():
    rng = random.Random(0)
    values = [rng.gauss(c, 0.01) for c in (0.1, 0.5, 0.9) for _ in range(100)]
    cuts = queue_cutoffs(values)
    assert len(cuts) == 2  # K = 3: a fourth queue would not halve the WCSS again
    assert cuts == pytest.approx([0.3, 0.7], abs=0.01)


def test_at_most_four_queues():
    values = [i / 1000 for i in range(1000)]  # a uniform spread: only K = 4 explains 90%
    cuts = queue_cutoffs(values)
    assert cuts == pytest.approx([0.25, 0.5, 0.75], abs=0.01)  # K = 4 = K_max


def test_one_queue_when_sizes_are_alike_or_a_cluster_is_tiny():
    assert queue_cutoffs([0.2] * 50) == []
    outlier = [0.1] * 98 + [0.9] * 2  # 2% of the requests: not worth a queue and its quota
    assert queue_cutoffs(outlier) == []


def test_min_quota_meets_the_slo_of_an_mm1_queue():
    s, d, slo, lam = 100, 2.0, 0.5, 3.0
    tok = min_quota_tokens(s, d, slo, lam)
    assert tok == pytest.approx(100 * 2 * (1 / 0.5 + 3))
    mu = tok / (s * d)  # requests per second served with `tok` tokens
    assert 1 / (mu - lam) == pytest.approx(slo)  # time in system = the SLO exactly


def test_quotas_get_their_minimum_and_share_the_rest_by_demand():
    assert split_quotas([100, 200], [1, 3], 700) == [200, 500]
    assert split_quotas([100, 200], [0, 0], 500) == [200, 300]


def test_quotas_scale_down_when_the_minimums_do_not_fit():
    assert split_quotas([300, 900], [1, 1], 600) == [150, 450]


def test_overloaded_quotas_keep_room_for_each_queues_largest_request():
    # Minimums 300 + 900 > 600. Scaled alone, the small queue would get 150, less than its
    # largest request (200): it could then run one request at a time. Floors first: 200 and
    # 300, then the 100 left in proportion to what each still needs (100 and 600).
    assert split_quotas([300, 900], [1, 1], 600, floors=[200, 300]) == [214, 385]
    # Floors that do not fit either are scaled down together.
    assert split_quotas([300, 900], [1, 1], 400, floors=[200, 600]) == [100, 300]


def test_output_predictor_forgets_an_adapter():
    p = OutputPredictor()
    p.observe("a", 10, 100)
    p.observe("b", 50, 100)
    p.forget("a")
    p.forget("never seen")
    assert p.num_adapters == 1
    assert p.predict("a", 100) == pytest.approx(100 * (0.1 + 0.5) / 2)  # all adapters' share
