"""The tokenizer process: the server's front door (asyncio on uvloop).

Clients talk to a ROUTER socket (one DEALER per client connection, many requests each).
For every `Generate` it validates, tokenizes (chat template for `messages`) and forwards an
`AddRequest` to the scheduler; for every `TokenBatch` back it detokenizes incrementally and
streams a `Delta` to the request's client. Request ids are the client's, scoped by the
connection, so two clients may use the same id. We learn that a connection dropped when the
next delta sent to it fails (the next delta sent to it fails with EHOSTUNREACH under ROUTER_MANDATORY); its
requests are aborted so their pages go back at once.

Nothing a client sends can stop this process: undecodable bytes get an `Error` reply
(request_id ""), invalid requests an `Error` naming the field by its path in `Generate`:
"prompt", "messages" or "prompt_token_ids" (whichever carried the prompt), "request_id",
"params.max_tokens", "params.temperature", ...

Every finished request is logged on one line (logger "overlap.access", INFO): its id,
tokens, TTFT, decode speed, acceptance length and finish reason.
"""

from __future__ import annotations

import asyncio
import logging
import random
import signal
import time
import uuid
from dataclasses import dataclass

import zmq
import zmq.asyncio

from overlap.models.loading import load_tokenizer
from runtime import ipc
from runtime.frontend import RequestState, encode_prompt, validate_request
from runtime.messages import (Abort, AbortRequest, AddRequest, Delta, Error, FatalError, Generate,
                              Health, HealthReply, RequestError, RequestFailed, SamplingParams, SchedulerStats,
                              Stats, StatsQuery, StatsReply, TokenBatch, pack_ids, unpack_ids)
from runtime.procs import ServeSpec, become_child, report_fatal, report_ready

STATS_TIMEOUT_S = 10.0
SAMPLING_FIELDS = frozenset(SamplingParams.__struct_fields__)
access_log = logging.getLogger("overlap.access")


def wire_field(field: str, msg: Generate) -> str:
    """A validation error's field → its path in the `Generate` the client sent."""
    if field in SAMPLING_FIELDS:
        return f"params.{field}"
    if field == "prompt":  # the shared checks say "prompt" for whichever form carried it
        return "messages" if msg.messages is not None else \
            "prompt_token_ids" if msg.prompt_token_ids is not None else "prompt"
    return field


def access_line(request_id: str, stats: dict, finish_reason: str) -> str:
    """One finished request, as serving engines log it (decode speed: tokens after the first
    over the time after the first)."""
    out, ttft, latency = stats.get("output_tokens", 0), stats.get("ttft_s"), stats.get("latency_s")
    decode_s = latency - ttft if latency is not None and ttft is not None else None
    return ", ".join([
        f"request {request_id}: {stats.get('prompt_tokens', 0)} prompt + {out} output tokens",
        f"TTFT {ttft * 1e3:.0f} ms" if ttft is not None else "TTFT -",
        f"{(out - 1) / decode_s:.1f} tok/s" if decode_s and out > 1 else "- tok/s",
        f"acceptance length {stats['acceptance_length']:.2f}" if "acceptance_length" in stats
        else "acceptance length -",
        f"finish {finish_reason}",
        f"latency {latency:.2f} s" if latency is not None else "latency -",
    ])


@dataclass
class _Live:
    """A request between admission and its final delta."""

    identity: bytes  # the client connection (ROUTER routing id)
    client_request_id: str
    state: RequestState


class TokenizerService:
    def __init__(self, spec: ServeSpec, tokenizer, clients: zmq.asyncio.Socket,
                 send_to_scheduler: zmq.asyncio.Socket):
        self.spec = spec
        self.tokenizer = tokenizer
        self.limits = spec.limits
        self.clients = clients
        self.send_to_scheduler = send_to_scheduler
        self.live: dict[str, _Live] = {}  # internal request id → request
        self.by_client: dict[tuple[bytes, str], str] = {}  # (identity, client id) → internal id
        self.stats_queries: dict[str, asyncio.Future] = {}
        self.failed: str | None = None  # set when the pipeline behind us died
        self.seeds = random.Random()
        self.started = time.monotonic()
        self.counts = {"received": 0, "rejected": 0, "finished": 0, "aborted": 0, "disconnects": 0}

    # -- client side -----------------------------------------------------------------------

    async def on_client(self, identity: bytes, payload: bytes) -> None:
        try:
            msg = ipc.decode_client_request(payload)
        except ipc.BadMessage as e:
            await self._reply(identity, Error("", f"malformed request: {e}"))
            return
        if isinstance(msg, Generate):
            await self._generate(identity, msg)
        elif isinstance(msg, Abort):
            await self._abort(identity, msg.request_id)
        elif isinstance(msg, Health):
            await self._reply(identity, HealthReply(msg.query_id, self.failed is None, self.spec.model_name,
                                                    self.spec.config.spec.method, time.monotonic() - self.started,
                                                    self.limits.default_num_spec_tokens))
        elif isinstance(msg, Stats):
            await self._reply(identity, StatsReply(msg.query_id, await self.stats()))

    async def _generate(self, identity: bytes, msg: Generate) -> None:
        self.counts["received"] += 1
        key = (identity, msg.request_id)
        try:
            if self.failed:
                raise _Refused(Error(msg.request_id, self.failed, code="unavailable"))
            if key in self.by_client:
                raise RequestError("request_id", f"{msg.request_id!r} is already in flight on this connection")
            ids = self._prompt_ids(msg)
            validate_request(ids, msg.params, self.limits)
        except RequestError as e:
            self.counts["rejected"] += 1
            field = wire_field(e.field, msg)
            await self._reply(identity, Error(msg.request_id, f"{field}: {e.message}", field=field))
            return
        except _Refused as r:
            self.counts["rejected"] += 1
            await self._reply(identity, r.error)
            return
        internal = uuid.uuid4().hex
        params = msg.params
        seed = params.seed if params.seed is not None else self.seeds.getrandbits(63)
        self.live[internal] = _Live(identity, msg.request_id,
                                    RequestState(msg.request_id, self.tokenizer, ids, params))
        self.by_client[key] = internal
        await self.send_to_scheduler.send(ipc.encode(AddRequest(
            internal, pack_ids(ids), params, seed, self.limits.num_spec_tokens(params))))

    def _prompt_ids(self, msg: Generate) -> list[int]:
        given = [x is not None for x in (msg.prompt, msg.messages, msg.prompt_token_ids)]
        if sum(given) != 1:
            raise RequestError("prompt", "give exactly one of prompt, messages or prompt_token_ids")
        if msg.prompt_token_ids is not None:
            return unpack_ids(msg.prompt_token_ids)
        if msg.messages is not None:
            return encode_prompt(self.tokenizer, messages=[{"role": m.role, "content": m.content}
                                                           for m in msg.messages])
        if not msg.prompt:
            raise RequestError("prompt", "is empty")
        return encode_prompt(self.tokenizer, msg.prompt)

    async def _abort(self, identity: bytes, client_request_id: str) -> None:
        internal = self.by_client.get((identity, client_request_id))
        if internal is None:
            return  # already finished: nothing to abort
        await self.send_to_scheduler.send(ipc.encode(AbortRequest(internal)))
        live = self._drop(internal)
        live.state.finish("abort")
        self.counts["aborted"] += 1
        stats = live.state.stats.as_dict()
        self._log_finished(live, stats, "abort")
        await self._reply(identity, Delta(client_request_id, "", [], "abort", stats))

    async def _disconnected(self, identity: bytes) -> None:
        self.counts["disconnects"] += 1
        for internal in [i for i, live in self.live.items() if live.identity == identity]:
            await self.send_to_scheduler.send(ipc.encode(AbortRequest(internal)))
            self._drop(internal)
            self.counts["aborted"] += 1

    def _drop(self, internal: str) -> _Live:
        live = self.live.pop(internal)
        self.by_client.pop((live.identity, live.client_request_id), None)
        return live

    async def _reply(self, identity: bytes, msg) -> None:
        try:
            await self.clients.send_multipart([identity, ipc.encode(msg)])
        except zmq.ZMQError as e:
            if e.errno != zmq.EHOSTUNREACH:
                raise
            await self._disconnected(identity)

    # -- scheduler side --------------------------------------------------------------------

    async def on_scheduler(self, msg) -> None:
        if isinstance(msg, TokenBatch):
            for up in msg.updates:
                await self._tokens(up)
        elif isinstance(msg, RequestFailed):
            live = self.live.get(msg.request_id)
            if live is not None:
                self._drop(msg.request_id)
                await self._reply(live.identity, Error(live.client_request_id, msg.message, code=msg.code))
        elif isinstance(msg, SchedulerStats):
            fut = self.stats_queries.pop(msg.query_id, None)
            if fut is not None and not fut.done():
                fut.set_result(msg.stats)
        elif isinstance(msg, FatalError):
            await self.fail_all(msg.message)

    async def _tokens(self, up) -> None:
        live = self.live.get(up.request_id)
        if live is None:
            return  # aborted while its step ran
        got = live.state.on_tokens(up.token_ids, up.finish_reason, up.num_drafts, up.num_accepted, up.spec_k)
        if got.by_stop_string:
            await self.send_to_scheduler.send(ipc.encode(AbortRequest(up.request_id)))
        stats = None
        if got.finish_reason:
            self._drop(up.request_id)
            self.counts["finished"] += 1
            stats = live.state.stats.as_dict()
            self._log_finished(live, stats, got.finish_reason)
        await self._reply(live.identity, Delta(live.client_request_id, got.text, up.token_ids, got.finish_reason,
                                               stats, got.token_depths, got.spans))

    @staticmethod
    def _log_finished(live: _Live, stats: dict, finish_reason: str) -> None:
        if access_log.isEnabledFor(logging.INFO):
            access_log.info("%s", access_line(live.client_request_id, stats, finish_reason))

    async def fail_all(self, message: str) -> None:
        """The pipeline behind us is gone: every in-flight request gets an error now."""
        self.failed = message
        for internal in list(self.live):
            live = self._drop(internal)
            await self._reply(live.identity, Error(live.client_request_id, message, code="unavailable"))

    async def stats(self) -> dict:
        query_id = uuid.uuid4().hex
        fut = asyncio.get_running_loop().create_future()
        self.stats_queries[query_id] = fut
        await self.send_to_scheduler.send(ipc.encode(StatsQuery(query_id)))
        try:
            async with asyncio.timeout(STATS_TIMEOUT_S):  # not wait_for: it can drop a cancel (client.py)
                scheduler = await fut
        except TimeoutError:
            scheduler = {"error": "the scheduler did not answer"}
        finally:
            self.stats_queries.pop(query_id, None)
        return {**scheduler, "live_requests": len(self.live), **self.counts,
                "uptime_s": time.monotonic() - self.started}


class _Refused(Exception):
    def __init__(self, error: Error):
        self.error = error


def run_tokenizer_process(spec: ServeSpec) -> None:
    log = become_child("tokenizer", spec.log_level)
    import uvloop

    try:
        uvloop.run(_main(spec, log))
    except SystemExit:
        pass


async def _main(spec: ServeSpec, log) -> None:
    ctx = zmq.asyncio.Context()
    addresses = spec.addresses
    try:
        clients = ctx.socket(zmq.ROUTER)
        # A send to a connection that has gone away raises EHOSTUNREACH instead of vanishing:
        # that is how a client that died mid-stream is noticed (its requests are aborted).
        clients.setsockopt(zmq.ROUTER_MANDATORY, 1)
        clients.setsockopt(zmq.SNDHWM, 0)  # never drop a delta for a slow reader
        clients.bind(addresses.clients)
        recv_from_scheduler = ctx.socket(zmq.PULL)
        recv_from_scheduler.bind(addresses.tokenizer)
        send_to_scheduler = ctx.socket(zmq.PUSH)
        send_to_scheduler.setsockopt(zmq.LINGER, 1000)
        send_to_scheduler.connect(addresses.scheduler)
        service = TokenizerService(spec, load_tokenizer(spec.model_dir), clients, send_to_scheduler)
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        endpoint = clients.getsockopt_string(zmq.LAST_ENDPOINT)
        report_ready(zmq.Context.instance(), addresses.daemon, "tokenizer", endpoint)
        loops = [asyncio.create_task(_client_loop(service, clients, log)),
                 asyncio.create_task(_scheduler_loop(service, recv_from_scheduler, log))]
        # Serve until SIGTERM from the daemon, or until a loop fails.
        stopped = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait([*loops, stopped], return_when=asyncio.FIRST_COMPLETED)
        for task in [*loops, stopped]:
            task.cancel()
        for task in done:
            if task is not stopped and task.exception():
                raise task.exception()
    except (SystemExit, asyncio.CancelledError):
        pass
    except BaseException as e:  # noqa: BLE001
        report_fatal(zmq.Context.instance(), [addresses.daemon], "tokenizer", e, log)
        raise SystemExit(1) from None
    finally:
        ctx.destroy(linger=0)


async def _client_loop(service: TokenizerService, clients: zmq.asyncio.Socket, log) -> None:
    while True:
        frames = await clients.recv_multipart()
        if len(frames) != 2:
            log.warning("dropped a message of %d frames (expected routing id + payload)", len(frames))
            if len(frames) > 1:
                await service._reply(frames[0], Error("", "malformed request: expected one frame"))
            continue
        try:
            await service.on_client(frames[0], frames[1])
        except Exception as e:  # noqa: BLE001 - one bad request must not end the front door
            log.exception("request failed")
            await service._reply(frames[0], Error("", f"internal error: {e!r}", code="internal"))


async def _scheduler_loop(service: TokenizerService, recv: zmq.asyncio.Socket, log) -> None:
    while True:
        data = await recv.recv()
        try:
            msg = ipc.decode_to_tokenizer(data)
        except ipc.BadMessage as e:
            log.warning("dropped a malformed message from the scheduler: %s", e)
            continue
        await service.on_scheduler(msg)
