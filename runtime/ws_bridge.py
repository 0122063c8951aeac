"""The websocket bridge: JSON over a websocket <-> the daemon through the ZeroMQ client library.

    overlap bridge --server tcp://127.0.0.1:5557 --listen 127.0.0.1:8765 [--token SECRET]
    overlap serve --ws 8765 ...            (the daemon starts it as a fourth process)

A browser page that streams a completion is served at http://HOST:PORT/ .

Protocol (one JSON object per websocket text message):
  client → bridge
    {"type": "generate", "id": "a1", "prompt": "def fib(n):" | [ids...] | "messages": [{"role", "content"}],
     "params": {"max_tokens": 64, "temperature": 0.7, "top_p": .., "top_k": .., "seed": .., "stop": [..]},
     "spec": {"mode": "draft" | "none", "num_spec_tokens": 3}}            ("type" defaults to generate)
    {"type": "cancel", "id": "a1"}
  bridge → client
    {"type": "delta", "id": "a1", "text": "...", "token_ids": [...]}       (as tokens are produced)
    {"type": "done", "id": "a1", "text": "", "token_ids": [], "finish_reason": "stop" | "length" |
     "abort", "usage": {...}, "spec": {...} | null}
    {"type": "error", "id": "a1" | null, "field": "params.max_tokens" | null, "code": "...", "message": "..."}
Many requests may run at once on one connection, each under its own id. A connection that
closes cancels its requests, which frees their pages on the server. With a token set
(--token or OVERLAP_BRIDGE_TOKEN), a connection must present it as `Authorization: Bearer
TOKEN` or, for browsers (which cannot set headers on a websocket), as `?token=TOKEN`.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import re
from http import HTTPStatus
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import msgspec
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from runtime.client import AsyncClient, ClientTimeout, ServerError
from runtime.messages import ChatMessage, SamplingParams

TOKEN_ENV = "OVERLAP_BRIDGE_TOKEN"
MAX_MESSAGE_BYTES = 1 << 20  # a larger message closes the connection (code 1009)
PAGE = Path(__file__).with_name("static") / "index.html"
log = logging.getLogger("overlap.bridge")


class SpecOptions(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    mode: str | None = None  # "none" switches speculation off; else it must be the server's
    num_spec_tokens: int | None = None


class WsGenerate(msgspec.Struct, tag="generate", frozen=True, forbid_unknown_fields=True):
    id: str
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
    params: SamplingParams = SamplingParams()
    spec: SpecOptions = SpecOptions()


class WsCancel(msgspec.Struct, tag="cancel", frozen=True, forbid_unknown_fields=True):
    id: str


_decoder = msgspec.json.Decoder(WsGenerate | WsCancel)


class BadRequest(ValueError):
    def __init__(self, message: str, field: str | None, request_id: str | None):
        super().__init__(message)
        self.field = field
        self.request_id = request_id


def decode_request(raw: str | bytes) -> WsGenerate | WsCancel:
    """JSON text → request; anything else raises BadRequest naming the field at fault."""
    if isinstance(raw, str):
        raw = raw.encode()
    try:
        obj = json.loads(raw)
    except ValueError as e:
        raise BadRequest(f"not valid JSON: {e}", None, None) from None
    if not isinstance(obj, dict):
        raise BadRequest("a request is a JSON object", None, None)
    request_id = obj.get("id") if isinstance(obj.get("id"), str) else None
    obj.setdefault("type", "generate")
    try:
        return msgspec.convert(obj, WsGenerate | WsCancel)
    except msgspec.ValidationError as e:
        # msgspec says where: "... - at `$.params.max_tokens`"; report that as the field.
        where = re.search(r"at `\$\.?([^`]*)`", str(e))
        field = (where.group(1) if where else "") or None
        unknown = re.search(r"unknown field `([^`]*)`", str(e))
        if unknown:
            field = ".".join(filter(None, [field, unknown.group(1)]))
        raise BadRequest(str(e), field, request_id) from None


def _sampling(req: WsGenerate, served_mode: str) -> SamplingParams:
    mode = req.spec.mode
    if mode is not None and mode not in ("none", served_mode):
        raise BadRequest(f"spec mode {mode!r} is not available: this server runs {served_mode!r} (or use 'none')",
                         "spec.mode", req.id)
    changes = {}
    if mode == "none":
        changes["spec"] = False
    if req.spec.num_spec_tokens is not None:
        changes["num_spec_tokens"] = req.spec.num_spec_tokens
    return msgspec.structs.replace(req.params, **changes) if changes else req.params


def _done(request_id: str, text: str, token_ids: list[int], finish_reason: str, stats: dict | None) -> dict:
    stats = stats or {}
    spec = None
    if "drafts" in stats:
        spec = {k: stats[k] for k in ("drafts", "draft_tokens", "accepted_tokens", "acceptance_length",
                                      "drafted_per_position", "accepted_per_position")}
    return {"type": "done", "id": request_id, "text": text, "token_ids": token_ids, "finish_reason": finish_reason,
            "usage": {"prompt_tokens": stats.get("prompt_tokens"), "completion_tokens": stats.get("output_tokens"),
                      "ttft_s": stats.get("ttft_s"), "latency_s": stats.get("latency_s")},
            "spec": spec}


def _error(request_id: str | None, message: str, field: str | None = None, code: str = "bad_request") -> dict:
    return {"type": "error", "id": request_id, "field": field, "code": code, "message": message}


class Bridge:
    def __init__(self, server: str, token: str | None = None, timeout: float = 300.0):
        self.server = server
        self.token = token or None
        self.timeout = timeout
        self.served_mode: str | None = None
        self.connections = 0

    # -- HTTP side: the page, and the token check before the websocket handshake ------------

    def process_request(self, connection: ServerConnection, request):
        if request.headers.get("Upgrade", "").lower() != "websocket":
            if urlsplit(request.path).path in ("/", "/index.html"):
                response = connection.respond(HTTPStatus.OK, PAGE.read_text())
                del response.headers["Content-Type"]
                response.headers["Content-Type"] = "text/html; charset=utf-8"
                return response
            return connection.respond(HTTPStatus.NOT_FOUND, "not found\n")
        if self.token is None:
            return None
        given = request.headers.get("Authorization", "")
        given = given[len("Bearer "):] if given.startswith("Bearer ") else None
        if given is None:
            given = (parse_qs(urlsplit(request.path).query).get("token") or [None])[0]
        if given is None or not hmac.compare_digest(given.encode(), self.token.encode()):
            return connection.respond(HTTPStatus.UNAUTHORIZED, "missing or wrong bearer token\n")
        return None

    # -- websocket side ------------------------------------------------------------------------

    async def handle(self, ws: ServerConnection) -> None:
        self.connections += 1
        client = AsyncClient(self.server, timeout=self.timeout)
        running: dict[str, asyncio.Task] = {}
        try:
            if self.served_mode is None:
                self.served_mode = (await client.health())["spec"]
            async for raw in ws:
                try:
                    req = decode_request(raw)
                    if isinstance(req, WsCancel):
                        task = running.get(req.id)
                        if task is not None:
                            task.cancel()
                        continue
                    if req.id in running:
                        raise BadRequest(f"request id {req.id!r} is already running on this connection", "id", req.id)
                    params = _sampling(req, self.served_mode)
                except BadRequest as e:
                    await ws.send(json.dumps(_error(e.request_id, str(e), e.field)))
                    continue
                task = asyncio.create_task(self._run(ws, client, req, params))
                running[req.id] = task
                task.add_done_callback(lambda _, rid=req.id: running.pop(rid, None))
        except ConnectionClosed:
            pass
        except (ClientTimeout, ServerError) as e:
            await ws.close(1011, f"server unavailable: {e}"[:120])
        finally:
            # A closed websocket cancels its requests: each stream aborts on the server.
            for task in list(running.values()):
                task.cancel()
            await asyncio.gather(*running.values(), return_exceptions=True)
            client.close()

    async def _run(self, ws: ServerConnection, client: AsyncClient, req: WsGenerate,
                   params: SamplingParams) -> None:
        prompt = req.prompt
        messages = [{"role": m.role, "content": m.content} for m in req.messages] if req.messages else None
        text: list[str] = []
        try:
            async for d in client.stream(prompt, messages=messages, request_id=req.id, params=params):
                if d.finish_reason:
                    await ws.send(json.dumps(_done(req.id, d.text, d.token_ids, d.finish_reason, d.stats)))
                    return
                text.append(d.text)
                await ws.send(json.dumps({"type": "delta", "id": req.id, "text": d.text, "token_ids": d.token_ids}))
        except asyncio.CancelledError:
            # A cancel message (or the connection closing): the stream's exit aborted it.
            try:
                await ws.send(json.dumps(_done(req.id, "", [], "abort", None)))
            except ConnectionClosed:
                pass
        except ServerError as e:
            await ws.send(json.dumps(_error(req.id, e.message, e.field, e.code)))
        except ClientTimeout as e:
            await ws.send(json.dumps(_error(req.id, str(e), None, "unavailable")))
        except ConnectionClosed:
            pass


async def run_bridge(server: str, host: str, port: int, token: str | None = None,
                     ready: asyncio.Future | None = None) -> None:
    bridge = Bridge(server, token if token is not None else os.environ.get(TOKEN_ENV))
    async with serve(bridge.handle, host, port, process_request=bridge.process_request,
                     max_size=MAX_MESSAGE_BYTES) as srv:
        bound = srv.sockets[0].getsockname()
        log.info("websocket bridge on ws://%s:%d/ (page: http://%s:%d/) -> %s%s", bound[0], bound[1],
                 bound[0], bound[1], server, " (token required)" if bridge.token else "")
        if ready is not None:
            ready.set_result(bound[1])
        await asyncio.Future()  # until cancelled


def parse_listen(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--listen wants HOST:PORT, got {listen!r}")
    return host, int(port)


def run_bridge_process(server: str, listen: str, token: str | None, daemon_address: str | None) -> None:
    """The bridge as a child of the daemon (`overlap serve --ws PORT`)."""
    import uvloop
    import zmq

    from runtime.procs import become_child, report_fatal, report_ready

    log_ = become_child("bridge")
    ctx = zmq.Context()

    async def main() -> None:
        host, port = parse_listen(listen)
        ready = asyncio.get_running_loop().create_future()
        serving = asyncio.create_task(run_bridge(server, host, port, token, ready))
        done, _ = await asyncio.wait([serving, ready], return_when=asyncio.FIRST_COMPLETED)
        if serving in done:
            serving.result()  # failed to start: raise why
        if daemon_address:
            report_ready(ctx, daemon_address, "bridge", f"ws://{host}:{ready.result()}/")
        await serving

    try:
        uvloop.run(main())
    except SystemExit:
        pass
    except BaseException as e:  # noqa: BLE001
        if daemon_address:
            report_fatal(ctx, [daemon_address], "bridge", e, log_)
        raise SystemExit(1) from None
    finally:
        ctx.destroy(linger=0)
