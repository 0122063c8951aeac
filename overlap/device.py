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
from collections.abc import Callable
from typing import Protocol

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
    def __init__(self) -> None:
        self._done = threading.Event()
        self.time: float | None = None  # perf_counter when the worker reached the event
        self.error: BaseException | None = None

    def _set(self, error: BaseException | None) -> None:
        self.time = time.perf_counter()
        self.error = error
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self, timeout: float | None = None) -> None:
        if not self._done.wait(timeout):
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
            event._done.wait()
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
        if timeout is None:
            self.event.synchronize()
            return
        # cudaEventSynchronize has no timeout: poll, so a hung device surfaces as an error.
        deadline = time.monotonic() + timeout
        while not self.event.query():
            if time.monotonic() > deadline:
                raise TimeoutError(f"device work not finished after {timeout} s")
            time.sleep(50e-6)

    def seconds_since(self, earlier: "CudaEvent") -> float:
        return earlier.event.elapsed_time(self.event) / 1000.0


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
    """The executor's view of its accelerator: a forward stream for model work and a copy
    stream for device→host copies of results (into pinned buffers on CUDA)."""

    def __init__(self, device: str | torch.device = "cpu"):
        self.torch_device = torch.device(device)
        self.is_cuda = self.torch_device.type == "cuda"
        if self.is_cuda:
            self.forward = CudaStream(self.torch_device)
            self.copy = CudaStream(self.torch_device)
        else:
            self.forward = CpuStream("forward")
            self.copy = CpuStream("copy")

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
        self.copy.wait(self.forward.record())
        if not self.is_cuda:
            self.copy.submit(lambda: copy.values.extend(tensors))
        else:
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
        self.copy.close()


class HostCopy:
    """Host tensors on their way from the device; valid once `event` fired."""

    def __init__(self, event: Event | None = None) -> None:
        self.values: list[torch.Tensor] = []
        self.event: Event | None = event
