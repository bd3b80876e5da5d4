"""Waitress's handler threads, used last-in first-out: the fewest threads do the work.

Waitress wakes an idle handler thread for each request through a `threading.Condition`, whose
`notify` wakes the thread that has waited longest. The idle threads thus take requests in turn,
and over a few hundred requests every one of a server's threads (520 by default: one per request
that may be in flight) has served some, even at a concurrency of a handful. Each keeps what that
left behind for its whole life: its last task (waitress's loop variable: the connection, its
buffers, the request's body), the stack pages its deepest request touched, glibc's per-thread
cache of freed blocks. Summed over 520 threads that is memory a long-running server keeps for
nothing, and it varies with whatever each thread served last (issue 48's soak: 520 stale tasks,
about 3,600 live builtin methods of their locks, and thread stacks growing 1 MiB a minute).

`LifoTaskDispatcher` is waitress's `ThreadedTaskDispatcher` with two changes: the thread woken for
a task is the one that went idle last (a `LifoCondition`), so the threads that run are about as
many as the requests in flight at the busiest moment so far, and the rest stay untouched; and a
thread drops its task once it has served it. Queueing, stopping and shutdown are waitress's own.
"""

from __future__ import annotations

import threading

from waitress.task import ThreadedTaskDispatcher


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
