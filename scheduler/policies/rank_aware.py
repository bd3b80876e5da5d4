"""Toppings' rank-aware routing (Algorithm 1)."""

from __future__ import annotations

import math

from toppings.scheduler.policies.base import KeyedPolicy
from toppings.scheduler.state import RouteRequest, ServerState


class RankAware(KeyedPolicy):
    """Toppings Algorithm 1.

    For each server: cost = dPrefill(queue + req) / avg_resp_len + dDecode(running + queue + req),
    where d is the predicted increase over the set without req (an empty set costs 0: no iteration
    runs); cost is +inf when Decode(running + queue + req) > SLO; total = cost * (running + queue).

    Among servers of equal total, the one where the request's adapter already is goes first: on
    the device, then loading there, then in host memory only, then one that must fetch it
    (`ServerState.residency`, from each server's `/stats`): a load costs the request a cold
    start and the device memory another adapter's eviction, which the cost model does not see.

    Empty server: the product is 0, and we keep it. The product charges the request's delay to
    every request already there; on an empty server nobody is delayed, so 0 is the right price
    and an idle server wins. Ties (several empty servers, or every server over the SLO) are broken
    by the adapter's residency, then by the unweighted cost, then by the predicted decode latency
    with the request (the least SLO violation when all are +inf), then by server order. inf * 0
    would be nan, so an over-SLO server gets total = +inf directly.
    """

    name = "rank-aware"

    def _key(self, request: RouteRequest, server: ServerState) -> tuple[float, int, float, float]:
        decode = self.perf.decode(server.kernel)
        batch_after = server.batch.add(request.rank, request.prompt_tokens)
        decode_after = decode.predict(batch_after)
        residency = server.residency(request.adapter)
        if decode_after > self.slo_ms:
            return math.inf, residency, math.inf, decode_after
        prefill = self.perf.prefill(server.kernel)
        queue_after = server.queue.add(request.rank, request.prompt_tokens)
        d_prefill = prefill.predict(queue_after) - prefill.predict(server.queue)
        d_decode = decode_after - decode.predict(server.batch)
        cost = d_prefill / self.avg_resp_len + d_decode
        return cost * server.num_requests, residency, cost, decode_after
