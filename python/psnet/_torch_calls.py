"""How psnet's torch process group runs its calls: collective calls in order on a thread of
their own, point-to-point messages each on its own thread, and the ``Work`` they return."""

import atexit
import queue
import threading
import time

import torch
import torch.distributed as dist


class _Work(dist.Work):
    """A call's ``Work``: done when its future is; ``wait()`` raises the call's error (torch's
    future-wrapping work returns from ``wait()`` on a failed future as if it succeeded)."""

    def __init__(self, fut):
        super().__init__()
        self._fut = fut

    def wait(self, timeout=None):
        """Blocks until the call is done and raises its error. With ``timeout`` (a
        ``timedelta`` or seconds), raises ``RuntimeError`` if it is not done by then, as
        torch's works do; the call itself goes on (``PSNET_COLL_TIMEOUT`` bounds it)."""
        if timeout is not None:
            seconds = timeout.total_seconds() if hasattr(timeout, "total_seconds") else float(timeout)
            if seconds > 0 and not _done_within(self._fut, seconds):
                raise RuntimeError(f"psnet: the call did not complete within {seconds:g} s "
                                   "(Work.wait timeout)")
        self._fut.wait()
        return True

    def is_completed(self):
        return self._fut.done()

    def is_success(self):
        if not self._fut.done():
            return False
        try:
            self._fut.value()
        except Exception:  # noqa: BLE001 (any error is a failure)
            return False
        return True

    def exception(self):
        try:
            self._fut.value()
        except Exception as e:  # noqa: BLE001
            return e
        return None

    def get_future(self):
        return self._fut

    def _source_rank(self):
        """The sender of a receive from any rank (torch's ``recv(src=None)`` asks), once
        done."""
        self.wait()
        source = getattr(self, "_psnet_source", None)
        if not source:
            raise RuntimeError("psnet: only a receive from any rank has a source rank to tell")
        return source[0]

    def result(self):
        return self._fut.value()


# How long ending a group's call thread waits for the calls queued before.
_STOP_WAIT = 30.0


class _Calls:
    """A process group's collective calls, run one after another on a thread of their own in
    the order they were made (so that they pair up across ranks): the call returns at once
    with a ``Work`` whose future completes when psnet's operation does, and DDP's bucket
    allreduces run while backward goes on. A call with a CUDA tensor runs on the caller's
    thread (its device and streams are the caller's) once the calls before it are done."""

    def __init__(self):
        self._queue = queue.SimpleQueue()
        self._thread = None
        self._lock = threading.Lock()

    def _start(self):
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, daemon=True,
                                                name="psnet-calls")
                self._thread.start()
                # Ended and joined before the interpreter finalizes: a thread still alive
                # then, having called into torch, made about one process in three abort at
                # exit ("terminate called without an active exception", SIGABRT).
                atexit.register(self.stop)

    def _loop(self):
        while True:
            item = self._queue.get()
            if item is None:
                return
            run, result, fut = item
            try:
                run()
            except BaseException as e:  # reaches wait() and the future
                fut.set_exception(e)
            else:
                fut.set_result(result)

    def submit(self, run, result, now=False):
        """Queues ``run``; its Work's future gets ``result`` (or ``run``'s exception). With
        ``now``, waits for the calls before it, runs it here, and returns it done."""
        fut = torch.futures.Future()
        if now:
            self.drain()
            try:
                run()
            except BaseException as e:
                fut.set_exception(e)
                raise
            fut.set_result(result)
        else:
            self._start()
            self._queue.put((run, result, fut))
        return _Work(fut)

    def drain(self):
        """Waits until every call made so far is done (their errors stay with their Works)."""
        if self._thread is None:
            return
        done = torch.futures.Future()
        self._queue.put((lambda: None, None, done))
        done.wait()

    def stop(self, wait=_STOP_WAIT):
        """Ends the thread once the calls queued before are done (waiting at most ``wait``
        seconds for them)."""
        with self._lock:
            thread, self._thread = self._thread, None
        if thread is not None:
            self._queue.put(None)
            if thread is not threading.current_thread():
                thread.join(wait)


def _any_cuda(*tensors):
    for t in tensors:
        if isinstance(t, (list, tuple)):
            if _any_cuda(*t):
                return True
        elif getattr(getattr(t, "device", None), "type", "cpu") != "cpu":
            return True
    return False


def _p2p_work(run, result):
    """A point-to-point message's Work: it runs on a thread of its own (its place among the
    messages was taken when the call was made), so sends and receives in flight do not wait
    for each other."""
    fut = torch.futures.Future()

    def body():
        try:
            run()
        except BaseException as e:
            fut.set_exception(e)
        else:
            fut.set_result(result)

    threading.Thread(target=body, daemon=True, name="psnet-p2p").start()
    return _Work(fut)


# A tag of its own for monitored_barrier's messages, out of the way of users' tags.
_MONITORED_BARRIER_TAG = (1 << 63) - 1


def _done_within(fut, seconds):
    """Whether ``fut`` is done within ``seconds``."""
    deadline = time.monotonic() + seconds
    while not fut.done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.005)
    return True


def _wait_for(work, seconds):
    """Whether ``work`` completed within ``seconds`` (its error, if it failed, is raised)."""
    fut = work.get_future()
    if not _done_within(fut, seconds):
        return False
    fut.wait()
    return True


def _done(result):
    fut = torch.futures.Future()
    fut.set_result(result)
    return _Work(fut)
