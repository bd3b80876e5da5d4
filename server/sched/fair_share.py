"""Fair shares between tenants (`--fair-share`): the order in which waiting requests are
admitted, so that one tenant's flood of requests waits behind the others' requests, not before
them. A tenant is an adapter (its reference: an adapter loaded again is a new tenant; the base
model is one tenant), as in the artifact of VTC (Sheng et al., "Fairness in Serving Large
Language Models", OSDI'24), whose clients are the adapters of one S-LoRA server.

Start-time fair queueing (Goyal et al., SIGCOMM'96) over tokens: each request gets a claim when it
first waits, a start tag S and a cost C, its tenant's next request starting where it ends:

    S = max(V, F[tenant]);  F[tenant] = S + C;  C = prompt tokens + 2 x predicted output tokens

where V, the virtual time, is the largest start tag admitted so far, and the output tokens are
predicted from what the adapter's earlier requests produced (sizing.OutputPredictor; an output
token weighs two prompt tokens, VTC's prices), but at least what the request guarantees itself
(`min_tokens`; all of max_tokens with ignore_eos and nothing else to stop it). Every queue policy
keeps its waiting requests in order of S (`order`) where it kept them in arrival order: with one
tenant that is arrival order; a tenant that sends 500 requests at once gets start tags 500 costs
deep, and another tenant's request, arriving after them, starts at V, ahead of all but the first
few of them. A request keeps its claim when it is preempted or squashed and waits again (it goes
back to its place), and its recomputation is not charged again.

Costs are predicted, not counted as VTC counts them step by step, so that the order is a sort
key fixed at arrival (the policies' queues stay sorted lists): when a request leaves the batch
its claim is settled at the tokens computed for it (`finished`: its tenant's end moves back, or
on where it ran longer than predicted), and one that leaves the queue unserved gives its whole
claim back (`removed`), so a tenant is charged what was computed for it. When a request
arrives to find none waiting, every tenant's past claims are forgotten (V moves to the last of
them): service that made nobody wait is not held against a tenant later, and what is kept is
bounded by the tenants with requests waiting since the queue was last empty.
"""

from __future__ import annotations

from dataclasses import dataclass
from weakref import WeakKeyDictionary

from toppings.server.requests.adapter_ref import AdapterRef
from toppings.server.requests.sequence import Sequence
from toppings.server.sched.sizing import OutputPredictor, guaranteed_output

OUTPUT_WEIGHT = 2.0  # an output token's cost in prompt tokens (VTC's output / input price)


@dataclass
class Claim:
    """One request's place: its start tag and the cost its tenant was charged for it."""

    tenant: AdapterRef | None
    start: float
    cost: float


class FairShares:
    """Start tags of waiting requests (see the module docstring); `enabled` False: every
    request's tag is its arrival time (arrival order)."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.virtual_time = 0.0
        # F of each tenant with a claim since the queue was last empty
        self._ends: dict[AdapterRef | None, float] = {}
        self._claims: WeakKeyDictionary[Sequence, Claim] = WeakKeyDictionary()
        self.predictor = OutputPredictor()

    def order(self, seq: Sequence) -> float:
        """The sort key of a waiting request: its start tag (its arrival time when disabled)."""
        claim = self._claims.get(seq) if self.enabled else None
        return seq.arrival if claim is None else claim.start

    def claim(self, seq: Sequence, queue_empty: bool) -> None:
        """`seq` waits: its first time, it gets a claim (a request preempted or squashed keeps
        the one it had). `queue_empty`: no other request waits now."""
        if not self.enabled or seq in self._claims:
            return
        if queue_empty:
            self.virtual_time = max(self.virtual_time, *self._ends.values(), 0.0)
            self._ends.clear()
        tenant = seq.request.adapter
        cost = seq.prompt_len + OUTPUT_WEIGHT * self._output(seq)
        start = max(self.virtual_time, self._ends.get(tenant, 0.0))
        self._ends[tenant] = start + cost
        self._claims[seq] = Claim(tenant, start, cost)

    def _output(self, seq: Sequence) -> float:
        """The output tokens `seq` is charged before it runs: what its adapter's history
        predicts, but at least what the request itself guarantees: `min_tokens`, and all of
        `max_new_tokens` where nothing but its length stops it (ignore_eos without stops, no
        constraint): a tenant's short answers do not make its long ones cheap."""
        params = seq.request.params
        predicted = self.predictor.predict(seq.request.adapter, params.max_new_tokens)
        return max(predicted, guaranteed_output(params))

    def admitted(self, seq: Sequence) -> None:
        """`seq` was admitted: the virtual time reaches its start tag."""
        claim = self._claims.get(seq)
        if claim is not None:
            self.virtual_time = max(self.virtual_time, claim.start)

    def finished(self, seq: Sequence, completed: bool) -> None:
        """An admitted request left the batch (it ended, or was preempted to wait again): its
        tenant is charged the tokens computed for it so far instead of its claim's prediction
        (given back what the prediction claimed beyond them, charged what it took beyond the
        prediction); once it completed, its adapter's output history learns its length."""
        if completed:
            params = seq.request.params
            self.predictor.observe(seq.request.adapter, len(seq.output_ids), params.max_new_tokens)
        claim = self._claims.get(seq)
        if claim is not None:
            self._settle(claim, seq.prompt_len + OUTPUT_WEIGHT * len(seq.output_ids))

    def removed(self, seq: Sequence) -> None:
        """A waiting request left unserved (aborted, failed): its tenant gets its claim back."""
        claim = self._claims.pop(seq, None)
        if claim is not None:
            self._settle(claim, 0.0)

    def _settle(self, claim: Claim, used: float) -> None:
        """Charge `claim`'s tenant `used` tokens for it where it was charged `claim.cost`: the
        tenant's end moves by the difference (never below the virtual time); its later
        requests' tags, given already, stay."""
        end = self._ends.get(claim.tenant)
        if end is not None:
            self._ends[claim.tenant] = max(end + used - claim.cost, self.virtual_time)
        claim.cost = used

    def forget_adapter(self, adapter: AdapterRef) -> None:
        """`adapter` was unloaded: its output history and claims go (a reload has a new
        reference)."""
        self.predictor.forget(adapter)
        self._ends.pop(adapter, None)

    def view(self) -> dict:
        """For /stats: whether shares are kept, and the tenants holding claims."""
        return {"fair_share": self.enabled, "tenants_with_claims": len(self._ends)}
