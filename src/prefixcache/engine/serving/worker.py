"""One worker thread serving a bounded FIFO of jobs; callers consume a job's output as a stream.

The worker never blocks on a consumer: it posts deltas to the job's own queue. A consumer that
stops early (closes its generator) cancels the job and, if the job already started, waits until
the worker has finished it, so the job's cache references are released when ``close()`` returns.
"""

from __future__ import annotations

import atexit
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from prefixcache.engine.config import DEFAULT_MAX_QUEUE, WorkerStats
from prefixcache.engine.types import EngineClosedError, QueueFullError, Request

log = logging.getLogger(__name__)

_DONE = object()


#: Workers whose thread was started; closed at interpreter exit (see Worker.close).
_RUNNING: weakref.WeakSet[Worker] = weakref.WeakSet()
#: How long exit waits for a worker still busy with queued requests.
EXIT_TIMEOUT_S = 10.0


@atexit.register
def _close_at_exit() -> None:
    """End every worker thread before the interpreter finalizes, so that a script which never
    called ``Engine.close()`` exits 0 instead of aborting in torch's C++ code (``close``'s doc).
    Requests still queued then get that long to finish; a thread still running after it is
    logged and left to the old behaviour."""
    for worker in list(_RUNNING):
        worker.close(EXIT_TIMEOUT_S)


class Job:
    """One request: its prepared arguments, its output queue and its cancellation state."""

    def __init__(self, request: Request, cancel: threading.Event | Callable[[], bool] | None = None) -> None:
        self.request = request
        self.submitted = time.perf_counter()
        self._external = cancel
        self._cancel = threading.Event()
        self._lock = threading.Lock()
        self.started = False
        self.done = threading.Event()
        self.out: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # The last item (result, error or cancellation) is posted by the worker only after the
        # job let go of everything, so a caller that sees it also sees refs released.
        self.terminal: Any = None

    def cancelled(self) -> bool:
        ext = self._external
        if ext is not None and (ext.is_set() if isinstance(ext, threading.Event) else ext()):
            return True
        return self._cancel.is_set()

    def post(self, item: Any) -> None:
        self.out.put(item)

    def finish(self, result: Any) -> None:
        self.terminal = result

    def finish_cancelled(self) -> None:
        """A cancelled job ends without a result; a still-listening ``generate`` raises."""
        self.terminal = _Cancelled()

    def cancel_and_wait(self, timeout: float = 120.0) -> None:
        """Cancel; if the worker already started the job, wait until it has let go of it."""
        with self._lock:
            self._cancel.set()
            started = self.started
        if started and not self.done.wait(timeout):
            log.warning("a cancelled request did not stop within %.0f s", timeout)

    def start(self) -> bool:
        """Called by the worker: False if the job was cancelled before it started."""
        with self._lock:
            if self.cancelled():
                return False
            self.started = True
            return True


class _Cancelled:
    pass


class Call:
    """A function to run on the worker thread between steps (:meth:`Worker.between_steps`)."""

    __slots__ = ("fn", "future")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.future: Future[Any] = Future()

    def run(self) -> None:
        try:
            self.future.set_result(self.fn())
        except BaseException as exc:  # handed to the caller
            self.future.set_exception(exc)


class RequestCancelledError(RuntimeError):
    """The request was cancelled through its ``cancel`` signal before it finished."""


class Worker:
    """A daemon thread running ``run(job)`` for each job, in submission order (one at a time).

    Subclasses replace :meth:`_loop` (the batch scheduler runs many jobs per step); admission,
    the bounded queue and the consumer side (:meth:`submit`) are shared."""

    def __init__(self, run: Callable[[Job], None] | None = None, max_queue: int = DEFAULT_MAX_QUEUE) -> None:
        if max_queue < 1:
            raise ValueError(f"max_queue must be >= 1; got {max_queue}")
        self.run = run
        self.max_queue = max_queue
        self.closed = False
        self._jobs: queue.SimpleQueue[Job | Call | None] = queue.SimpleQueue()
        self._calls: list[Call] = []  # taken in by the loop, run before its next step
        self._lock = threading.Lock()
        self._depth = 0
        self._thread: threading.Thread | None = None

    @property
    def depth(self) -> int:
        return self._depth

    def stats(self) -> WorkerStats:
        return WorkerStats()

    def check_integrity(self) -> None:
        """Raise when the worker's holdings disagree with its pool (none here)."""

    def between_steps(self, fn: Callable[[], Any], timeout: float = 120.0) -> Any:
        """Run ``fn`` on the worker thread between two steps (at once when no thread runs) and
        return its result: a consistent view of what the running requests hold."""
        with self._lock:
            thread = self._thread
            if thread is not None and thread.is_alive():
                call = Call(fn)
                self._jobs.put(call)
            else:
                call = None
        if call is None:
            return fn()
        deadline = time.monotonic() + timeout
        while True:
            try:
                return call.future.result(0.05)
            except FutureTimeout:
                if thread is not None and not thread.is_alive() and not call.future.done():
                    return fn()  # the thread ended (closed) before taking the call: nothing runs
                if time.monotonic() > deadline:
                    raise

    def _run_calls(self) -> None:
        calls, self._calls = self._calls, []
        for call in calls:
            call.run()

    def validate(self, request: Request) -> None:
        """Raise a ValueError for a request this worker could never run (none here)."""

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="prefixcache-engine", daemon=True)
            self._thread.start()
            _RUNNING.add(self)

    def submit(self, job: Job) -> Iterator[Any]:
        """Admit ``job`` (or raise QueueFullError at once) and yield its items until the end."""
        with self._lock:
            if self.closed:
                raise EngineClosedError("this engine is closed; create a new Engine")
            if self._depth >= self.max_queue:
                raise QueueFullError(
                    f"the engine's queue is full ({self._depth} requests in flight, "
                    f"max_queue={self.max_queue}); retry later"
                )
            self._depth += 1
            self._ensure_thread()
            self._jobs.put(job)
        finished = False
        try:
            while True:
                item = job.out.get()
                if item is _DONE:
                    finished = True
                    return
                if isinstance(item, _Cancelled):
                    finished = True
                    raise RequestCancelledError("the request was cancelled before it finished")
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                yield item
        finally:
            if not finished:  # the consumer stopped early: stop the job and free its blocks
                job.cancel_and_wait()

    def _loop(self) -> None:
        assert self.run is not None
        while True:
            job = self._jobs.get()
            if isinstance(job, Call):
                job.run()
                continue
            if job is None:
                return
            try:
                if job.start():
                    self.run(job)
                else:
                    job.finish_cancelled()
            except BaseException as exc:  # handed to the caller; the worker keeps serving
                self._failed(job, exc)
            finally:
                self._retire(job)

    @staticmethod
    def _failed(job: Job, exc: BaseException) -> None:
        if not isinstance(exc, ValueError):
            log.exception("request failed")
        job.terminal = exc

    def _retire(self, job: Job) -> None:
        """The job is over (result, error or cancellation set): hand out its last items."""
        with self._lock:
            self._depth -= 1
        job.done.set()
        if job.terminal is not None:
            job.post(job.terminal)
        job.post(_DONE)

    def close(self, timeout: float | None = None) -> None:
        """Stop after the jobs already queued and wait (at most ``timeout`` seconds; None: as
        long as they take) until the worker thread has ended. Idempotent.

        The thread is a daemon (an engine never closed does not keep the process alive), so it
        must be over before the interpreter finalizes: a daemon thread still running then (here,
        letting go of the runner's tensors as its loop returns) is stopped by ``pthread_exit``
        in the middle of torch's C++ code, which aborts the process ("terminate called without
        an active exception", exit 134) after the script's own work is done. So an exit hook
        closes every started worker that is still open (``_close_at_exit``)."""
        with self._lock:
            if not self.closed and self._thread is not None:
                self._jobs.put(None)
            self.closed = True
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                log.warning("the engine's worker did not stop within %.0f s of close()", timeout)
