"""EventFuture: the result of device work, available once an event has fired.

The executor hands one out per step: it resolves when the step's produced tokens are on
the host. Blocking callers use `result(timeout)`; asyncio callers `await` it, which waits
for the event on a helper thread so the event loop keeps serving sockets meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Generic, TypeVar

from overlap.device import Event

T = TypeVar("T")


class EventFuture(Generic[T]):
    def __init__(self, event: Event, value: Callable[[], T]):
        self.event = event
        self._value = value  # builds the result from host data; valid after the event
        self._result: T | None = None
        self._resolved = False

    def done(self) -> bool:
        return self._resolved or self.event.query()

    def result(self, timeout: float | None = None) -> T:
        if not self._resolved:
            self.event.synchronize(timeout)  # raises DeviceError if the device work failed
            self._result = self._value()
            self._resolved = True
        return self._result

    def __await__(self):
        if self._resolved:
            return self._result
        loop = asyncio.get_running_loop()
        yield from loop.run_in_executor(None, self.event.synchronize).__await__()
        return self.result()
