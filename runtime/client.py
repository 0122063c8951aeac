"""The ZeroMQ client library: talk to an `overlap serve` daemon.

    from runtime.client import Client
    with Client("tcp://127.0.0.1:5557") as c:
        print(c.generate("def fib(n):", max_tokens=32).text)
        for delta in c.stream(messages=[{"role": "user", "content": "Hi"}], max_tokens=16):
            print(delta.text, end="", flush=True)

    async with AsyncClient(address) as c:           # the same methods, awaitable
        result = await c.generate("The capital of France is", max_tokens=8)
        async for delta in c.stream("Once upon a time", temperature=0.8, seed=1):
            ...

One DEALER socket carries any number of concurrent requests; replies are routed to their
request by id. `Client` may be shared by threads (one thread at a time reads the socket and
hands other requests' messages over). Every wait has a timeout: no message for a request
within `timeout` seconds raises `ClientTimeout` and aborts it on the server. Server
refusals raise `RequestRejected` (with the offending `field`), `ServerOverloaded` or
`ServerUnavailable`. Leaving a `stream()` early aborts its request, so its KV pages return.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import defaultdict, deque
from collections.abc import AsyncIterator, Iterator

import msgspec
import zmq
import zmq.asyncio

from runtime import ipc
from runtime.messages import (Abort, ChatMessage, Delta, Error, Generate, Health, HealthReply, SamplingParams,
                              Stats, StatsReply, pack_ids)
from runtime.results import Result

DEFAULT_TIMEOUT_S = 300.0


class ServerError(RuntimeError):
    def __init__(self, error: Error):
        super().__init__(error.message)
        self.message = error.message
        self.code = error.code
        self.field = error.field
        self.request_id = error.request_id


class RequestRejected(ServerError):
    """The server refused the request as invalid; `field` names what to fix."""


class ServerOverloaded(ServerError):
    """The admission queue is full: retry later."""


class ServerUnavailable(ServerError):
    """The server lost a process; the request cannot complete."""


class ClientTimeout(TimeoutError):
    pass


def _raise(error: Error):
    kind = {"bad_request": RequestRejected, "overloaded": ServerOverloaded,
            "unavailable": ServerUnavailable}.get(error.code, ServerError)
    raise kind(error)


def build_generate(request_id: str | None, prompt: str | list[int] | None, messages: list[dict] | None,
                   params: SamplingParams | None, kwargs: dict) -> Generate:
    """One `Generate` from the friendly call signature (prompt text or ids, or chat messages)."""
    if params is None:
        try:
            params = msgspec.convert(kwargs, SamplingParams)
        except msgspec.ValidationError as e:
            raise TypeError(f"bad sampling parameter: {e}") from None
    elif kwargs:
        raise TypeError("give either params= or keyword sampling parameters, not both")
    ids = None
    if isinstance(prompt, list):
        ids, prompt = pack_ids(prompt), None
    chat = None if messages is None else [ChatMessage(m["role"], m["content"]) for m in messages]
    return Generate(request_id or uuid.uuid4().hex, prompt, chat, ids, params)


class _Accumulator:
    def __init__(self, request_id: str):
        self.request_id = request_id
        self.text: list[str] = []
        self.ids: list[int] = []

    def add(self, d: Delta) -> Result | None:
        self.text.append(d.text)
        self.ids += d.token_ids
        if d.finish_reason is None:
            return None
        return Result(self.request_id, "".join(self.text), self.ids, d.finish_reason, d.stats or {})


def _key(msg) -> str:
    return msg.query_id if isinstance(msg, HealthReply | StatsReply) else msg.request_id


# -- sync ------------------------------------------------------------------------------------

class Client:
    def __init__(self, address: str, timeout: float = DEFAULT_TIMEOUT_S):
        self.address = address
        self.timeout = timeout
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)
        self._sock_lock = threading.Lock()  # zmq sockets are not thread-safe
        self._inbox: dict[str, deque] = defaultdict(deque)
        self._arrived = threading.Condition()
        self._open: set[str] = set()  # requests in flight (their replies are kept)
        self._closed = False

    # -- plumbing --------------------------------------------------------------------------

    def _send(self, msg) -> None:
        with self._sock_lock:
            self._sock.send(ipc.encode(msg))

    def _pump(self, wait_s: float) -> None:
        """Read whatever arrives within wait_s (if no other thread is reading) and file it."""
        if not self._sock_lock.acquire(blocking=False):
            with self._arrived:
                self._arrived.wait(wait_s)  # another thread reads; it wakes us on arrivals
            return
        try:
            got = []
            if self._sock.poll(int(wait_s * 1000)):
                while True:
                    try:
                        got.append(ipc.decode_client_reply(self._sock.recv(zmq.NOBLOCK)))
                    except zmq.Again:
                        break
                    except ipc.BadMessage:
                        continue  # not from an overlap server: nothing to route it to
        finally:
            self._sock_lock.release()
        with self._arrived:
            for msg in got:
                key = _key(msg)
                if key in self._open:
                    self._inbox[key].append(msg)
            self._arrived.notify_all()

    def _next(self, key: str, timeout: float | None):
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            with self._arrived:
                if self._inbox[key]:
                    return self._inbox[key].popleft()
            left = deadline - time.monotonic()
            if left <= 0:
                raise ClientTimeout(f"no reply from {self.address} for {key!r} within the timeout")
            self._pump(min(left, 0.05))

    def _close_key(self, key: str) -> None:
        with self._arrived:
            self._open.discard(key)
            self._inbox.pop(key, None)

    def _ask(self, msg, key: str, timeout: float | None):
        with self._arrived:
            self._open.add(key)
        try:
            self._send(msg)
            reply = self._next(key, timeout)
        finally:
            self._close_key(key)
        if isinstance(reply, Error):
            _raise(reply)
        return reply

    # -- requests --------------------------------------------------------------------------

    def submit(self, prompt: str | list[int] | None = None, *, messages: list[dict] | None = None,
               request_id: str | None = None, params: SamplingParams | None = None, **sampling) -> str:
        """Send a request and return its id at once; read it with `deltas(id)` or `next_deltas()`."""
        msg = build_generate(request_id, prompt, messages, params, sampling)
        with self._arrived:
            if msg.request_id in self._open:
                raise ValueError(f"request id {msg.request_id!r} is already in flight on this client")
            self._open.add(msg.request_id)
        self._send(msg)
        return msg.request_id

    def deltas(self, request_id: str, timeout: float | None = None) -> Iterator[Delta]:
        """The deltas of one submitted request, up to and including the final one."""
        finished = False
        try:
            while True:
                msg = self._next(request_id, timeout)
                if isinstance(msg, Error):
                    finished = True
                    _raise(msg)
                yield msg
                if msg.finish_reason:
                    finished = True
                    return
        finally:
            if not finished and not self._closed:  # abandoned early (break, exception, timeout)
                self.abort(request_id)  # frees its pages on the server
            self._close_key(request_id)

    def next_deltas(self, timeout: float | None = None) -> list[Delta | Error]:
        """Every message that has arrived for any open request (waits up to `timeout` for
        one); finished requests are closed. For clients that multiplex many requests."""
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            with self._arrived:
                got = [m for q in self._inbox.values() for m in q]
                for q in self._inbox.values():
                    q.clear()
                for m in got:
                    if isinstance(m, Error) or m.finish_reason:
                        self._open.discard(m.request_id)
                        self._inbox.pop(m.request_id, None)
            if got:
                return got
            left = deadline - time.monotonic()
            if left <= 0:
                raise ClientTimeout(f"no reply from {self.address} within the timeout")
            self._pump(min(left, 0.05))

    def stream(self, prompt: str | list[int] | None = None, *, messages: list[dict] | None = None,
               request_id: str | None = None, timeout: float | None = None,
               params: SamplingParams | None = None, **sampling) -> Iterator[Delta]:
        request_id = self.submit(prompt, messages=messages, request_id=request_id, params=params, **sampling)
        yield from self.deltas(request_id, timeout)

    def generate(self, prompt: str | list[int] | None = None, *, messages: list[dict] | None = None,
                 request_id: str | None = None, timeout: float | None = None,
                 params: SamplingParams | None = None, **sampling) -> Result:
        request_id = self.submit(prompt, messages=messages, request_id=request_id, params=params, **sampling)
        acc = _Accumulator(request_id)
        for d in self.deltas(request_id, timeout):
            result = acc.add(d)
            if result is not None:
                return result
        raise ServerError(Error(request_id, "stream ended without a final delta", code="internal"))

    def abort(self, request_id: str) -> None:
        self._send(Abort(request_id))

    def health(self, timeout: float = 10.0) -> dict:
        qid = uuid.uuid4().hex
        return msgspec.structs.asdict(self._ask(Health(qid), qid, timeout))

    def stats(self, timeout: float = 30.0) -> dict:
        qid = uuid.uuid4().hex
        return self._ask(Stats(qid), qid, timeout).stats

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._sock.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# -- asyncio ---------------------------------------------------------------------------------

class AsyncClient:
    def __init__(self, address: str, timeout: float = DEFAULT_TIMEOUT_S):
        self.address = address
        self.timeout = timeout
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.connect(address)
        self._queues: dict[str, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None
        self._closed = False

    async def _read(self) -> None:
        while True:
            data = await self._sock.recv()
            try:
                msg = ipc.decode_client_reply(data)
            except ipc.BadMessage:
                continue
            queue = self._queues.get(_key(msg))
            if queue is not None:
                queue.put_nowait(msg)

    def _open(self, key: str) -> asyncio.Queue:
        if self._reader is None:
            self._reader = asyncio.get_running_loop().create_task(self._read())
        if key in self._queues:
            raise ValueError(f"request id {key!r} is already in flight on this client")
        self._queues[key] = asyncio.Queue()
        return self._queues[key]

    async def _next(self, key: str, queue: asyncio.Queue, timeout: float | None):
        # asyncio.timeout, not wait_for: before Python 3.12, wait_for returns a reply that arrived
        # in the same loop turn as a cancel and drops the cancel, so a reader the HTTP server
        # cancelled for a departed client read its request to the end.
        try:
            async with asyncio.timeout(self.timeout if timeout is None else timeout):
                return await queue.get()
        except TimeoutError:
            raise ClientTimeout(f"no reply from {self.address} for {key!r} within the timeout") from None

    async def _ask(self, msg, key: str, timeout: float | None):
        queue = self._open(key)
        try:
            await self._sock.send(ipc.encode(msg))
            reply = await self._next(key, queue, timeout)
        finally:
            self._queues.pop(key, None)
        if isinstance(reply, Error):
            _raise(reply)
        return reply

    async def submit(self, prompt: str | list[int] | None = None, *, messages: list[dict] | None = None,
                     request_id: str | None = None, params: SamplingParams | None = None, **sampling) -> str:
        """Send a request and return its id once it is on the wire; read it with `deltas(id)`.
        An `abort(id)` sent after this returns reaches the server after the request itself."""
        msg = build_generate(request_id, prompt, messages, params, sampling)
        self._open(msg.request_id)
        try:
            await self._sock.send(ipc.encode(msg))
        except BaseException:
            self._queues.pop(msg.request_id, None)
            raise
        return msg.request_id

    async def deltas(self, request_id: str, timeout: float | None = None) -> AsyncIterator[Delta]:
        """The deltas of one submitted request, up to and including the final one (an
        `abort(id)` ends it with a final delta whose finish_reason is "abort")."""
        queue = self._queues[request_id]
        finished = False
        try:
            while True:
                reply = await self._next(request_id, queue, timeout)
                if isinstance(reply, Error):
                    finished = True
                    _raise(reply)
                yield reply
                if reply.finish_reason:
                    finished = True
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished and not self._closed:  # abandoned early: free its pages
                await self.abort(request_id)

    async def stream(self, prompt: str | list[int] | None = None, *, messages: list[dict] | None = None,
                     request_id: str | None = None, timeout: float | None = None,
                     params: SamplingParams | None = None, **sampling) -> AsyncIterator[Delta]:
        request_id = await self.submit(prompt, messages=messages, request_id=request_id, params=params, **sampling)
        deltas = self.deltas(request_id, timeout)
        try:
            async for delta in deltas:
                yield delta
        finally:
            await deltas.aclose()  # now, not at garbage collection: an early exit aborts at once

    async def generate(self, prompt: str | list[int] | None = None, *, messages: list[dict] | None = None,
                       request_id: str | None = None, timeout: float | None = None,
                       params: SamplingParams | None = None, **sampling) -> Result:
        acc = None
        async for d in self.stream(prompt, messages=messages, request_id=request_id, timeout=timeout,
                                   params=params, **sampling):
            acc = acc or _Accumulator(d.request_id)
            result = acc.add(d)
            if result is not None:
                return result
        raise ServerError(Error(request_id or "", "stream ended without a final delta", code="internal"))

    async def abort(self, request_id: str) -> None:
        await self._sock.send(ipc.encode(Abort(request_id)))

    async def health(self, timeout: float = 10.0) -> dict:
        qid = uuid.uuid4().hex
        return msgspec.structs.asdict(await self._ask(Health(qid), qid, timeout))

    async def stats(self, timeout: float = 30.0) -> dict:
        qid = uuid.uuid4().hex
        return (await self._ask(Stats(qid), qid, timeout)).stats

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._reader is not None:
            self._reader.cancel()
        self._sock.close(linger=0)
        self._ctx.term()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()
