"""Streams and events: CUDA's, or a CPU emulation with the same semantics.

The executor issues device work through a `Stream` and learns of its completion through
`Event`s, never by blocking on a tensor. On CUDA a stream is a `torch.cuda.Stream`: work
submitted to it runs on the host at once and only *enqueues* kernels. On the CPU there is
no asynchronous device, so a stream is a worker thread that runs the submitted closures in
order; an event is set when the closures submitted before it have run. Either way the host
gets control back as soon as the work is queued, so the same pipelined code (plan step N+1
while step N runs) executes, is tested and is measured on both.

Events also carry time: `b.seconds_since(a)` is how long the stream took from `a` to `b`
(CUDA: `elapsed_time` of timing events; CPU: when the worker reached each event), which is
how the executor measures device busy and idle time without a host sync.
"""

from __future__ import annotations

import atexit
import contextlib
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import torch


class Event(Protocol):
    def query(self) -> bool: ...

    def synchronize(self, timeout: float | None = None) -> None: ...

    def seconds_since(self, earlier: "Event") -> float: ...


class Stream(Protocol):
    def submit(self, fn: Callable[[], object]) -> None: ...

    def record(self) -> Event: ...

    def wait(self, event: Event) -> None: ...

    def synchronize(self) -> None: ...


class DeviceError(RuntimeError):
    """Work on a stream raised; every later event of that stream re-raises it."""


# -- CPU emulation ---------------------------------------------------------------------------

class CpuEvent:
    """Set once, by the stream's worker, when it reaches the event; waited on by any thread.

    A lock held from creation and released when set, not a threading.Event: a step records
    five or six events, and threading.Event's Condition is Python code (4 us to make, set and
    query one here against 0.3 us for a lock, each run on both threads of a batch-1 step)."""

    __slots__ = ("_latch", "_fired", "time", "error")

    def __init__(self) -> None:
        self._latch = threading.Lock()
        self._latch.acquire()
        self._fired = False  # only the setting thread reads it: a second _set releases nothing
        self.time: float | None = None  # perf_counter when the worker reached the event
        self.error: BaseException | None = None

    def _set(self, error: BaseException | None) -> None:
        # The error and the time before the release: a waiter reads them once it gets through.
        self.error = error
        self.time = time.perf_counter()
        if not self._fired:
            self._fired = True
            self._latch.release()

    def query(self) -> bool:
        return self.time is not None

    def _wait(self, timeout: float | None = None) -> bool:
        """Block until set (each waiter takes the latch and hands it on); False on timeout."""
        if self.time is not None:
            return True
        if not self._latch.acquire(timeout=-1 if timeout is None else timeout):
            return False
        self._latch.release()
        return True

    def synchronize(self, timeout: float | None = None) -> None:
        if not self._wait(timeout):
            raise TimeoutError(f"device work not finished after {timeout} s")
        if self.error is not None:
            raise DeviceError(f"device work failed: {self.error!r}") from self.error

    def seconds_since(self, earlier: "CpuEvent") -> float:
        return self.time - earlier.time


class CpuStream:
    """An in-order work queue served by one thread: the CPU stand-in for a CUDA stream."""

    def __init__(self, name: str = "stream"):
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._serve, name=f"overlap-{name}", daemon=True)
        self._thread.start()
        _live_streams.add(self)

    def _serve(self) -> None:
        while True:
            fn = self._queue.get()
            if fn is None:
                return
            if isinstance(fn, CpuEvent):
                fn._set(self._error)
                continue
            if self._error is not None:
                continue  # a failed stream runs nothing more; its events report the error
            try:
                with torch.no_grad():
                    fn()
            except BaseException as e:  # surfaced at the next event, like a CUDA error
                self._error = e

    def submit(self, fn: Callable[[], object]) -> None:
        self._queue.put(fn)

    def record(self, event: CpuEvent | None = None) -> CpuEvent:
        event = event or CpuEvent()
        if threading.current_thread() is self._thread:
            # Recorded by work running on this stream: everything before this point has run.
            event._set(self._error)
        else:
            self._queue.put(event)
        return event

    def wait(self, event: CpuEvent) -> None:
        # The worker blocks until the other stream reaches the event (cudaStreamWaitEvent);
        # an error there fails this stream too, so a waiter sees the original cause.
        def wait_for_other_stream() -> None:
            event._wait()
            if event.error is not None:
                raise event.error

        self._queue.put(wait_for_other_stream)

    def synchronize(self) -> None:
        self.record().synchronize()

    def close(self, timeout: float = 5.0) -> None:
        """Finish the queued work and stop the thread (before the interpreter exits, so no
        torch op is cut off mid-flight by the runtime's teardown)."""
        self._queue.put(None)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)


# Streams not closed by their owner are stopped at exit: a worker thread still inside a torch
# op when the interpreter tears down aborts the process ("terminate called ...").
_live_streams: "weakref.WeakSet[CpuStream]" = weakref.WeakSet()


@atexit.register
def _close_streams() -> None:
    for stream in list(_live_streams):
        stream.close(timeout=2.0)


# -- CUDA ------------------------------------------------------------------------------------

class CudaEvent:
    def __init__(self, stream: "torch.cuda.Stream | None" = None):
        self.event = torch.cuda.Event(enable_timing=True)
        if stream is not None:
            self.event.record(stream)

    def query(self) -> bool:
        return self.event.query()

    def synchronize(self, timeout: float | None = None) -> None:
        # cudaEventSynchronize: the host thread blocks on the event itself (no polling loop
        # that burns a core and adds up to a sleep's latency to every wait). A timeout is
        # enforced from a watchdog thread: CUDA has no timed event wait, and a hung device
        # must surface as an error rather than block forever.
        if timeout is None:
            self.event.synchronize()
            return
        if self.event.query():
            return
        if not _event_waiter.wait(self.event, timeout):
            raise TimeoutError(f"device work not finished after {timeout} s")

    def seconds_since(self, earlier: "CudaEvent") -> float:
        return earlier.event.elapsed_time(self.event) / 1000.0


class _EventWaiter:
    """One long-lived thread that blocks in cudaEventSynchronize for callers that want a
    timeout: the caller waits on a threading.Event with its timeout, woken by the driver's
    own completion wait instead of polling query() in a sleep loop."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue | None = None
        self._lock = threading.Lock()

    def _serve(self) -> None:
        while True:
            event, done = self._queue.get()
            try:
                event.synchronize()
            except BaseException:  # the caller's own query/synchronize re-raises it
                pass
            done.set()

    def wait(self, event: "torch.cuda.Event", timeout: float) -> bool:
        with self._lock:
            if self._queue is None:
                self._queue = queue.SimpleQueue()
                threading.Thread(target=self._serve, name="overlap-event-wait", daemon=True).start()
        done = threading.Event()
        self._queue.put((event, done))
        if not done.wait(timeout):
            return False
        event.synchronize()  # completed: returns at once, or raises the device's error
        return True


_event_waiter = _EventWaiter()


class CudaStream:
    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device)

    def submit(self, fn: Callable[[], object]) -> None:
        # Runs now on the host; the kernels it launches are queued on this stream.
        with torch.cuda.stream(self.stream), torch.no_grad():
            fn()

    def record(self, event: CudaEvent | None = None) -> CudaEvent:
        if event is None:
            return CudaEvent(self.stream)
        event.event.record(self.stream)
        return event

    def wait(self, event: CudaEvent) -> None:
        self.stream.wait_event(event.event)

    def synchronize(self) -> None:
        self.stream.synchronize()

    def close(self, timeout: float = 5.0) -> None:
        pass


# -- the device ------------------------------------------------------------------------------

class Device:
    """The executor's view of its accelerator: a forward stream for model work and, on CUDA, a
    copy stream for device→host copies of results (into pinned buffers). On the CPU results
    are host tensors already, handed over by the forward stream itself (start_copy)."""

    def __init__(self, device: str | torch.device = "cpu"):
        self.torch_device = torch.device(device)
        self.is_cuda = self.torch_device.type == "cuda"
        if self.is_cuda:
            self.forward = CudaStream(self.torch_device)
            self.copy = CudaStream(self.torch_device)
        else:
            self.forward = CpuStream("forward")
            self.copy = None

    def issuing(self):
        """Context for host code that creates device tensors the forward stream will read
        (step inputs, attention plans): on CUDA their copies are queued on the forward
        stream, so the launch that follows is ordered after them; a copy on the default
        stream would race with the forward stream's kernels."""
        if self.is_cuda:
            return torch.cuda.stream(self.forward.stream)
        return contextlib.nullcontext()

    def new_event(self) -> Event:
        """An event to record later (e.g. from inside work on a stream)."""
        return CudaEvent() if self.is_cuda else CpuEvent()

    def start_copy(self, copy: "HostCopy", tensors: tuple[torch.Tensor, ...]) -> None:
        """From inside work on the forward stream: copy `tensors`, results computed up to this
        point, to the host on the copy stream, while the forward stream goes on with later
        work. `copy.event` fires when they are there."""
        if not self.is_cuda:
            # Host tensors already: handed over at once by the forward stream's own thread. A
            # copy thread here cost a wake-up and, on 2 busy cores, a wait for a time slice
            # before the host saw the ids: paired in one engine (AMD EPYC Zen 5, batch 1),
            # plain decoding +2.8% and EAGLE +1.9% without it (docs/fast_steps.md, "Session 33").
            copy.values.extend(tensors)
            copy.event._set(None)
            return
        self.copy.wait(self.forward.record())
        with torch.cuda.stream(self.copy.stream):
            for src in tensors:
                host = torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
                # record_stream: the forward stream may not reuse src's memory before the
                # copy stream has read it (the caching allocator tracks streams, not copies).
                src.record_stream(self.copy.stream)
                host.copy_(src, non_blocking=True)
                copy.values.append(host)
        self.copy.record(copy.event)

    def fail(self, copy: "HostCopy", error: BaseException) -> None:
        """The work that was to start `copy` raised: its waiter gets the error, not a hang."""
        if isinstance(copy.event, CpuEvent):
            copy.event._set(error)

    def close(self) -> None:
        self.forward.close()
        if self.copy is not None:
            self.copy.close()


class HostCopy:
    """Host tensors on their way from the device; valid once `event` fired."""

    def __init__(self, event: Event | None = None) -> None:
        self.values: list[torch.Tensor] = []
        self.event: Event | None = event


# -- step inputs: host data → device tensors -------------------------------------------------

_NP_DTYPES = {torch.int64: np.int64, torch.int32: np.int32, torch.float32: np.float32,
              torch.bool: np.bool_, torch.uint8: np.uint8}
# Pinned staging buffers used round-robin, each guarded by the event of its last copy: a
# buffer is rewritten only once the device has read it (normally long before).
STAGING_RING = 8
_ALIGN = 8  # every array starts on an 8-byte boundary, so each slice views as its dtype

_host_io = threading.local()


@contextlib.contextmanager
def host_io():
    """Marks the documented places where Python data becomes a tensor or a tensor is read
    back by the host: the staging copy here and the executor's collect point. Tests run the
    step under a guard that fails on any such conversion outside these
    (tests/test_sync_guard.py)."""
    _host_io.depth = getattr(_host_io, "depth", 0) + 1
    try:
        yield
    finally:
        _host_io.depth -= 1


def in_host_io() -> bool:
    return getattr(_host_io, "depth", 0) > 0


class HostStaging:
    """Builds a step's inputs from Python data in ONE pinned host buffer and copies it to the
    device with one non_blocking copy, queued on the current stream.

    `torch.tensor(list, device="cuda")` copies from pageable memory: a blocking copy that
    synchronises the stream, so a host preparing step N+1 would wait for step N. Here the
    host packs every array of a call into a page-locked buffer (8-byte aligned segments),
    issues one asynchronous copy and returns device views of it. A buffer is reused only
    after the event recorded behind its last copy has fired. On the CPU there is nothing to
    copy: each array is a plain CPU tensor, as before."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.is_cuda = self.device.type == "cuda"
        self._buffers: list[torch.Tensor | None] = [None] * STAGING_RING
        self._events: list[object | None] = [None] * STAGING_RING
        self._next = 0
        self._lock = threading.Lock()
        self.copies = 0  # packed copies issued (tests and the sync census read it)

    def upload(self, *arrays: tuple[object, torch.dtype]) -> list[torch.Tensor]:
        """arrays: (values, dtype) pairs; values a (nested) list or numpy array → one device
        tensor per pair, same shape."""
        with host_io():
            if not self.is_cuda:
                return [self._host_tensor(values, dtype) for values, dtype in arrays]
            host = [np.asarray(values, dtype=_NP_DTYPES[dtype]) for values, dtype in arrays]
            offsets, total = [], 0
            for a in host:
                offsets.append(total)
                total += -(-a.nbytes // _ALIGN) * _ALIGN
            total = max(total, _ALIGN)
            with self._lock:
                slot = self._next
                self._next = (slot + 1) % STAGING_RING
                event = self._events[slot]
                if event is not None:
                    event.synchronize()  # the guard: the device has read this buffer's last copy
                buf = self._buffers[slot]
                if buf is None or buf.numel() < total:
                    buf = self._buffers[slot] = torch.empty(max(total, 4096), dtype=torch.uint8, pin_memory=True)
                view = buf.numpy()
                for a, off in zip(host, offsets):
                    view[off: off + a.nbytes] = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
                dev = buf[:total].to(self.device, non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                self._events[slot] = event
                self.copies += 1
            return [dev[off: off + a.nbytes].view(dtype).view(a.shape)
                    for a, off, (_, dtype) in zip(host, offsets, arrays)]

    def _host_tensor(self, values: object, dtype: torch.dtype) -> torch.Tensor:
        if self.device.type == "cpu" and dtype in _NP_DTYPES:
            # Through numpy: torch.tensor(list) hands the GIL to the stream's worker thread and
            # waits to get it back (its copy to the target device runs without it), once per
            # array, while the worker runs the drafter's catch-up; np.array does not.
            return torch.from_numpy(np.array(values, dtype=_NP_DTYPES[dtype]))
        return torch.tensor(values, dtype=dtype, device=self.device)  # other dtypes; "meta" in tests


_stagings: dict[torch.device, HostStaging] = {}
_stagings_lock = threading.Lock()


def staging(device: torch.device | str) -> HostStaging:
    """The process's staging for `device` (one per device)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _stagings_lock:
        stage = _stagings.get(device)
        if stage is None:
            stage = _stagings[device] = HostStaging(device)
        return stage


def upload(device: torch.device | str, *arrays: tuple[object, torch.dtype]) -> list[torch.Tensor]:
    """Python data → device tensors through the device's staging (see HostStaging)."""
    return staging(device).upload(*arrays)
