"""Several engine requests answered as one HTTP response (n choices, a list of prompts).

The requests are submitted together; one handler thread reads every choice's outputs as the
engine produces them: each handle wakes the group when it gets an output (`RequestHandle.on_put`)
and the group sweeps the handles that have something, so no thread per choice and no busy
polling. Leaving early, a client disconnect, or a failure aborts every request of the group that
has not ended.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

from toppings.server.requests.errors import SERVER_ERROR
from toppings.server.requests.request import (
    GenerationRequest,
    RequestError,
    RequestHandle,
    RequestOutput,
    merge_outputs,
)

POLL_S = 0.5  # how often a waiting handler checks engine health and client disconnect


class RequestGroup:
    """The requests of one response; choice i is `requests[i]`."""

    def __init__(self, engine, requests: list[GenerationRequest]):
        """Submit every request at once; if one is refused, none is queued."""
        self._engine = engine
        self._wake = threading.Event()
        # Submitted together (one prefill step) or not at all (a RequestError for the first
        # that can never be served).
        self._handles = engine.submit_all(requests)
        for handle in self._handles:
            # An output put before this line waits in the handle's queue: the first sweep finds
            # it.
            handle.on_put = self._wake.set
        self._open = set(range(len(self._handles)))

    def abort(self) -> None:
        """Ask the engine to stop every request of the group that has not ended; idempotent."""
        for handle in self._handles:
            handle.abort()

    def outputs(
        self, is_gone: Callable[[], bool], on_final: Callable[[RequestOutput], None]
    ) -> Iterator[tuple[int, RequestOutput]]:
        """(choice index, output) as the engine produces them, until every request has ended.

        Aborts the group when the client is gone; raises RequestError(503) if the engine dies.
        Closing the iterator early aborts what is still running.
        """
        try:
            while self._open:
                self._wake.clear()  # before the sweep: a put during it sets it again
                found = False
                for idx in sorted(self._open):
                    for out in self._handles[idx].poll():
                        found = True
                        if out.finish_reason is not None:
                            self._open.discard(idx)
                            on_final(out)
                        yield idx, out
                if found:
                    if self._open and is_gone():
                        self.abort()  # the engine answers each with a final "abort" output
                    continue
                if not self._wake.wait(POLL_S):
                    if is_gone():
                        self.abort()
                    elif not self._engine.is_healthy():
                        raise RequestError("the engine stopped", 503, SERVER_ERROR)
        finally:
            self.abort()
            for idx in self._open:  # closed early: counted when the engine's abort lands
                _on_final_later(self._handles[idx], on_final)

    def results(
        self, is_gone: Callable[[], bool], on_final: Callable[[RequestOutput], None]
    ) -> list[RequestOutput]:
        """Every choice's merged output, in choice order."""
        per_choice: list[list[RequestOutput]] = [[] for _ in self._handles]
        for idx, out in self.outputs(is_gone, on_final):
            per_choice[idx].append(out)
        return [merge_outputs(outs) for outs in per_choice]


def _on_final_later(handle: RequestHandle, on_final: Callable[[RequestOutput], None]) -> None:
    """Call `on_final` with `handle`'s final output once it comes (from the thread that puts it,
    or at once if it is there): a stream the client closed still counts its tokens."""

    def drain() -> None:
        for out in handle.poll():
            if out.finish_reason is not None:
                handle.on_put = None
                on_final(out)

    handle.on_put = drain
    drain()  # an output put before on_put was set
