"""Several engine requests answered as one HTTP response (n choices, a list of prompts).

The requests are submitted together and share one output queue, so a handler thread reads every
choice's outputs in the order the engine produces them. Leaving early, a client disconnect, or a
failure aborts every request of the group that has not ended.
"""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator

from toppings.server.errors import SERVER_ERROR
from toppings.server.request import GenerationRequest, RequestError, RequestOutput, merge_outputs

POLL_S = 0.5  # how often a waiting handler checks engine health and client disconnect


class RequestGroup:
    """The requests of one response; choice i is `requests[i]`."""

    def __init__(self, engine, requests: list[GenerationRequest]):
        """Submit every request; if one is refused, abort those already submitted."""
        self._engine = engine
        self._outputs: queue.Queue[RequestOutput] = queue.Queue()
        self._handles = []
        self._open: set[str] = set()
        try:
            for req in requests:
                self._handles.append(engine.submit(req, self._outputs))
                self._open.add(req.request_id)
        except BaseException:
            self.abort()
            raise
        self._index = {h.request_id: i for i, h in enumerate(self._handles)}

    def abort(self) -> None:
        """Ask the engine to stop every request of the group that has not ended; idempotent."""
        for handle in self._handles:
            if handle.request_id in self._open:
                self._engine.abort(handle.request_id)

    def outputs(
        self, is_gone: Callable[[], bool], on_final: Callable[[RequestOutput], None]
    ) -> Iterator[tuple[int, RequestOutput]]:
        """(choice index, output) as the engine produces them, until every request has ended.

        Aborts the group when the client is gone; raises RequestError(503) if the engine dies.
        Closing the iterator early aborts what is still running.
        """
        try:
            while self._open:
                try:
                    out = self._outputs.get(timeout=POLL_S)
                except queue.Empty:
                    if is_gone():
                        self.abort()
                    elif not self._engine.is_healthy():
                        raise RequestError("the engine stopped", 503, SERVER_ERROR) from None
                    continue
                if out.finish_reason is not None:
                    self._open.discard(out.request_id)
                    on_final(out)
                yield self._index[out.request_id], out
                if out.finish_reason is None and is_gone():
                    self.abort()  # the engine answers each with a final "abort" output
        finally:
            self.abort()

    def results(
        self, is_gone: Callable[[], bool], on_final: Callable[[RequestOutput], None]
    ) -> list[RequestOutput]:
        """Every choice's merged output, in choice order."""
        per_choice: list[list[RequestOutput]] = [[] for _ in self._handles]
        for idx, out in self.outputs(is_gone, on_final):
            per_choice[idx].append(out)
        return [merge_outputs(outs) for outs in per_choice]
