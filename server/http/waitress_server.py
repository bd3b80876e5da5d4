"""The waitress server of `toppings-serve`: a header-read deadline, so that slow-header clients
cannot take every connection, and an orderly stop.

Waitress stops accepting at `connection_limit` open connections and, by itself, closes a
connection only after `channel_timeout` seconds without a byte (measured with waitress 3.0: a
client that sends half a header and stalls is closed then; one that trickles a header line every
few seconds is never closed). Without more, a thousand sockets that each send half a header lock
every other client out, /health included, until they time out.

`GuardedServer` adds three checks to waitress's own loop (all on its thread, no lock needed):
- a request whose headers are not complete `header_timeout_s` after its first byte arrived is
  closed, however its bytes trickle in (checked every `cleanup_interval` seconds);
- a request whose body is not complete `header_timeout_s` after its headers, plus a second for
  every MIN_BODY_BYTES_PER_S bytes of it received (Apache's mod_reqtimeout rule: a slow link
  with a large body is fine, a trickle is not), gets a 408 with the JSON error and is closed.
  Waitress reads a body whole before a handler runs: a body that trickled held a connection,
  counted against the limit, for as long as a byte came every `channel_timeout` seconds, and a
  Content-Length larger than what was sent was closed with no answer;
- at the connection limit, the connection that has waited longest for the rest of its headers
  (past MIN_EVICT_AGE_S) is closed to make room, so that a new client (a /health probe) is
  accepted now rather than once the stalled ones time out.
A connection whose request is running or streaming is never closed by these checks; an idle
keep-alive one is closed by waitress's `channel_timeout` (server.http.frontend.waitress_settings
sets it to the same timeout).
This is a floor, not a shield: in production a reverse proxy with client timeouts and
per-client connection limits goes in front (README, "In front of the server").

Stopping (`stop` from another thread, then `release` once `run` has returned): the handlers
still running get a grace period to end, then the loop's thread closes the listener and every
connection, and the trigger (the pipe through which handler threads wake the loop) is closed
only after the handler threads have stopped. Closing it with the rest, as
`wasyncore.close_all` does, let a handler that ended at that moment write to the closed pipe (a
"Bad file descriptor" traceback at SIGTERM, or a byte into whatever file reused the number),
and cut the last bytes of the responses that were ending.

Its connections log a client that went away mid-response at DEBUG (`DisconnectsAtDebug`). Its
handler threads are woken last-in first-out (`LifoTaskDispatcher`, below).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

from waitress import wasyncore
from waitress.adjustments import Adjustments
from waitress.channel import HTTPChannel
from waitress.server import TcpWSGIServer
from waitress.task import ThreadedTaskDispatcher

from toppings.server.requests.errors import REQUEST_TIMEOUT, error_body

logger = logging.getLogger(__name__)

MIN_EVICT_AGE_S = 1.0  # a client this recent is still sending its headers, not stalling
STOP_POLL_S = 0.05  # how often `stop` looks whether the handlers have ended
DISCONNECT_LINE = "Client disconnected while serving"  # waitress.channel's wording
MIN_BODY_BYTES_PER_S = 500  # a body's deadline moves a second later for each this many bytes


# Waitress's handler threads, used last-in first-out: the fewest threads do the work.
#
# Waitress wakes an idle handler thread for each request through a `threading.Condition`, whose
# `notify` wakes the thread that has waited longest. The idle threads thus take requests in turn,
# and over a few hundred requests every one of a server's threads (520 by default: one per request
# that may be in flight) has served some, even at a concurrency of a handful. Each keeps what that
# left behind for its whole life: its last task (waitress's loop variable: the connection, its
# buffers, the request's body), the stack pages its deepest request touched, glibc's per-thread
# cache of freed blocks. Summed over 520 threads that is memory a long-running server keeps for
# nothing, and it varies with whatever each thread served last (issue 48's soak: 520 stale tasks,
# about 3,600 live builtin methods of their locks, and thread stacks growing 1 MiB a minute).
#
# `LifoTaskDispatcher` is waitress's `ThreadedTaskDispatcher` with two changes: the thread woken for
# a task is the one that went idle last (a `LifoCondition`), so the threads that run are about as
# many as the requests in flight at the busiest moment so far, and the rest stay untouched; and a
# thread drops its task once it has served it. Queueing, stopping and shutdown are waitress's own.


class LifoCondition(threading.Condition):
    """A condition variable whose `notify` wakes the threads that began waiting last (the
    standard one wakes those that began first). Everything else is threading.Condition's."""

    def notify(self, n: int = 1) -> None:
        if not self._is_owned():
            raise RuntimeError("cannot notify on un-acquired lock")
        waiters = self._waiters
        while waiters and n > 0:
            waiter = waiters.pop()  # the newest waiter: the standard notify takes waiters[0]
            try:
                waiter.release()
            except RuntimeError:  # released by a notify interrupted before it removed it
                continue
            n -= 1


class LifoTaskDispatcher(ThreadedTaskDispatcher):
    """Waitress's task dispatcher, waking the handler thread that went idle last and keeping
    no reference to a task once served."""

    def __init__(self) -> None:
        super().__init__()
        self.queue_cv = LifoCondition(self.lock)

    def handler_thread(self, thread_no: int) -> None:
        # waitress.task.ThreadedTaskDispatcher.handler_thread, but for the `del task`.
        while True:
            with self.lock:
                while not self.queue and self.stop_count == 0:
                    self.active_count -= 1  # idle while it waits
                    self.queue_cv.wait()
                    self.active_count += 1
                if self.stop_count > 0:
                    self.active_count -= 1
                    self.stop_count -= 1
                    self.threads.discard(thread_no)
                    self.thread_exit_cv.notify()
                    break
                task = self.queue.popleft()
            try:
                task.service()
            except BaseException:
                self.logger.exception("Exception when servicing %r", task)
            del task  # else it holds the connection and its buffers until the next task


class DisconnectsAtDebug(logging.LoggerAdapter):
    """Waitress's logger for its connections, with the line it writes when a client goes away
    mid-response ("Client disconnected while serving PATH") at DEBUG instead of INFO: a client
    that leaves early (a benchmark's cancelled streams) is routine, its requests are aborted
    and counted in /metrics anyway, and one line each buried the log."""

    def info(self, msg: object, *args: Any, **kwargs: Any) -> None:
        if isinstance(msg, str) and msg.startswith(DISCONNECT_LINE):
            self.debug(msg, *args, **kwargs)
        else:
            super().info(msg, *args, **kwargs)


class HeaderTimedChannel(HTTPChannel):
    """A waitress connection that knows since when it has been waiting for a request's headers."""

    logger = DisconnectsAtDebug(logging.getLogger("waitress"))
    request_started: float | None = None  # time.time() of the first byte of the latest request
    body_started: float | None = None  # time.time() its headers were complete
    body_bytes = 0  # bytes received since then

    def received(self, data: bytes) -> bool:
        if self.request is None and data:
            self.request_started, self.body_started = time.time(), None
        result = super().received(data)
        request = self.request
        if request is not None and request.headers_finished:
            if self.body_started is None:  # (the read's header bytes counted too: a few hundred)
                self.body_started, self.body_bytes = time.time(), len(data)
            else:
                self.body_bytes += len(data)
        return result

    def body_deadline(self, base_s: float, now: float) -> float | None:
        """When the body of the request being read must be complete (None: none is being
        read). A request read ahead while another runs waits for that one, not for the client:
        its clock starts when that one ends."""
        request = self.request
        if request is None or self.body_started is None:
            return None
        if not request.headers_finished or request.completed:
            return None
        if self.requests:
            self.body_started = now
            return None
        by_rate = self.body_started + base_s + self.body_bytes / MIN_BODY_BYTES_PER_S
        # never after waitress's idle timeout, which would close it with no answer
        return min(by_rate, self.last_activity + self.adj.channel_timeout)

    def refuse_slow_body(self, now: float) -> None:
        """(The loop's thread, no request running.) Answer 408 and close once it is sent."""
        waited = now - (self.body_started or now)
        message = (f"the request's body did not arrive in time: {self.body_bytes} bytes of it in "
                   f"{waited:.0f} s (after the first seconds, at least {MIN_BODY_BYTES_PER_S} "
                   "bytes a second)")  # fmt: skip
        body = json.dumps(error_body(message, 408, REQUEST_TIMEOUT)).encode()
        head = (b"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body))  # fmt: skip
        with self.outbuf_lock:
            self.outbufs[-1].append(head + body)
            self.current_outbuf_count += len(head + body)
            self.total_outbufs_len += len(head + body)
        self.close_when_flushed = True

    def header_wait_started(self) -> float | None:
        """When this connection began waiting for a request's headers: the request's first byte,
        or the connection's opening while no byte came; None when it waits for none (a request
        running or sending its body, or idle between keep-alive requests). A request read ahead
        while another runs (`channel_request_lookahead`) waits for that one, not for the client:
        closing it would cut the running response."""
        if self.requests:
            return None
        if self.request is not None:
            return None if self.request.headers_finished else self.request_started
        if self.request_started is None:
            return self.creation_time
        return None


class GuardedServer(TcpWSGIServer):
    """Waitress's TCP server plus the header deadline and the eviction at the limit."""

    channel_class = HeaderTimedChannel

    def __init__(self, application: Any, header_timeout_s: float, **settings: Any):
        self.header_timeout_s = header_timeout_s
        adj = Adjustments(**settings)
        dispatcher = LifoTaskDispatcher()  # the fewest handler threads do the work
        dispatcher.set_thread_count(adj.threads)
        super().__init__(application, adj=adj, dispatcher=dispatcher)

    def maintenance(self, now: float) -> None:
        """The body deadline (first: a body that stopped coming is answered 408, not closed
        silently by the idle timeout), waitress's idle timeout, then the header deadline."""
        for channel in list(self.active_channels.values()):
            deadline = channel.body_deadline(self.header_timeout_s, now)
            if deadline is not None and deadline < now and not channel.close_when_flushed:
                logger.debug("answering 408 to %s: its body is late", channel.addr)
                channel.refuse_slow_body(now)
        super().maintenance(now)
        cutoff = now - self.header_timeout_s
        for channel, started in self._waiting_for_headers():
            if started < cutoff:
                logger.debug("closing %s: no complete header after %.0f s", channel.addr,
                             self.header_timeout_s)  # fmt: skip
                channel.will_close = True

    def readable(self) -> bool:
        """Waitress's accept decision (no more connections at the limit), after making room at
        the limit when a stalled header can give it."""
        if self.accepting and len(self._map) >= self.adj.connection_limit:
            self._evict_oldest_header(time.time())
        return super().readable()

    def _waiting_for_headers(self) -> list[tuple[HeaderTimedChannel, float]]:
        waiting = [(ch, ch.header_wait_started()) for ch in self.active_channels.values()]
        return [(ch, started) for ch, started in waiting if started is not None]

    def _evict_oldest_header(self, now: float) -> None:
        waiting = self._waiting_for_headers()
        if not waiting or any(ch.will_close for ch, _ in waiting):
            # One is closing already: with nothing to send, it closes on this turn of the loop.
            return
        oldest, started = min(waiting, key=lambda item: item[1])
        if started < now - MIN_EVICT_AGE_S:
            logger.debug("closing %s at the connection limit: its header is incomplete after "
                         "%.1f s", oldest.addr, now - started)  # fmt: skip
            oldest.will_close = True

    def stop(self, grace_s: float) -> None:
        """Stop serving, from any thread but the loop's: wait up to `grace_s` for the running
        handlers to end, then close the listener and every connection on the loop's thread,
        after which `run` returns."""
        deadline = time.monotonic() + grace_s
        dispatcher = self.task_dispatcher
        while (dispatcher.active_count or dispatcher.queue) and time.monotonic() < deadline:
            time.sleep(STOP_POLL_S)
        if dispatcher.active_count or dispatcher.queue:
            logger.warning("handlers still running after %.0f s; closing their connections",
                           grace_s)  # fmt: skip
        self.trigger.pull_trigger(self._close_connections)

    def _close_connections(self) -> None:
        """(The loop's thread.) Send what each socket takes of its pending output, close every
        connection and the listener, and take the trigger out of the loop's map (not closing
        it): with nothing left to watch, the loop returns."""
        for channel in list(self.active_channels.values()):
            if channel.total_outbufs_len:
                channel.handle_write()
            channel.handle_close()
        wasyncore.dispatcher.close(self)  # the listener only; self.close() would take the trigger
        self.trigger.del_channel()

    def release(self) -> None:
        """After `run` has returned: stop the handler threads, then close the trigger they pull
        when a response ends."""
        self.task_dispatcher.shutdown()
        self.trigger.close()
