"""The websocket bridge: JSON over a websocket <-> the daemon through the ZeroMQ client library.

    overlap bridge --server tcp://127.0.0.1:5557 --listen 127.0.0.1:8765 [--token SECRET]
    overlap serve --ws 8765 ...            (the daemon starts it as a fourth process)

A browser page that streams a completion is served at http://HOST:PORT/ .

Protocol (one JSON object per websocket text message):
  client → bridge
    {"type": "generate", "id": "a1", "prompt": "def fib(n):" | [ids...] | "messages": [{"role", "content"}],
     "params": {"max_tokens": 64, "temperature": 0.7, "top_p": .., "top_k": .., "seed": .., "stop": [..]},
     "spec": {"mode": "draft" | "none", "num_spec_tokens": 3}}            ("type" defaults to generate)
    {"type": "cancel", "id": "a1"}                                         (the request ends with done/abort)
    {"type": "info"}                                                       (what the server runs)
  bridge → client
    {"type": "delta", "id": "a1", "text": "...", "token_ids": [...],       (as tokens are produced)
     "depths": [...], "pieces": [["...", depth], ...]}
    {"type": "done", "id": "a1", "text": "", "token_ids": [], "depths": [], "pieces": [],
     "finish_reason": "stop" | "length" | "abort", "usage": {...}, "spec": {...} | null}
    {"type": "info", "model": "...", "spec": "ngram" | "draft" | ... | "none", "num_spec_tokens": 3}
    {"type": "error", "id": "a1" | null, "field": "params.max_tokens" | null, "code": "...", "message": "..."}
`depths` says how each token came (aligned with token_ids): 0 = the target's own token, d = a
draft the target accepted at depth d of its step; `pieces` is `text` cut per token with that
token's depth, for the page to colour (runtime/origins.py).
Every request ends with exactly one `done` (finish_reason "abort" after a cancel, with the
usage so far) or one `error`. An error's `field` is the path of the offending value in the
request as sent: "prompt", "messages", "id", "params.max_tokens", "spec.mode", ...
Many requests may run at once on one connection, each under its own id. A connection that
closes cancels its requests, which frees their pages on the server. With a token set
(--token or OVERLAP_BRIDGE_TOKEN; an empty one is an error, not "no auth"), a connection
must present it as `Authorization: Bearer TOKEN` or, for browsers (which cannot set headers
on a websocket), as `?token=TOKEN`: open the page as http://HOST:PORT/?token=TOKEN.
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
from runtime.messages import ChatMessage, Delta, SamplingParams
from runtime.origins import split_text

TOKEN_ENV = "OVERLAP_BRIDGE_TOKEN"
MAX_MESSAGE_BYTES = 1 << 20  # a larger message closes the connection (code 1009)
PAGE = Path(__file__).with_name("static") / "index.html"
AUTH_MARKER = '<meta name="overlap-auth" content="none">'  # the page learns whether to ask for a token
log = logging.getLogger("overlap.bridge")


def resolve_token(token: str | None) -> str | None:
    """The bridge's bearer token: `token` if given, else $OVERLAP_BRIDGE_TOKEN, else None (no
    auth). An empty one is refused: `--token "$SECRET"` with SECRET unset must not quietly
    turn authentication off."""
    if token is not None:
        if not token.strip():
            raise ValueError("--token is empty (an unset shell variable?): give a non-empty token, "
                             "or leave --token out to run without authentication")
        return token
    env = os.environ.get(TOKEN_ENV)
    if env is not None and not env.strip():
        raise ValueError(f"${TOKEN_ENV} is set but empty: give it a value, or unset it to run without "
                         "authentication")
    return env


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


class WsInfo(msgspec.Struct, tag="info", frozen=True, forbid_unknown_fields=True):
    pass


WsRequest = WsGenerate | WsCancel | WsInfo


class BadRequest(ValueError):
    def __init__(self, message: str, field: str | None, request_id: str | None):
        super().__init__(message)
        self.field = field
        self.request_id = request_id


def decode_request(raw: str | bytes) -> WsRequest:
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
        return msgspec.convert(obj, WsRequest)
    except msgspec.ValidationError as e:
        # msgspec says where: "... - at `$.params.max_tokens`"; report that as the field.
        where = re.search(r"at `\$\.?([^`]*)`", str(e))
        field = (where.group(1) if where else "") or None
        unknown = re.search(r"unknown field `([^`]*)`", str(e))
        if unknown:
            field = ".".join(filter(None, [field, unknown.group(1)]))
        raise BadRequest(str(e), field, request_id) from None


def _sampling(req: WsGenerate, served_mode: str) -> SamplingParams:
    if (req.prompt is None) == (req.messages is None):
        raise BadRequest("give exactly one of prompt (text or token ids) or messages", "prompt", req.id)
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


def _delta(request_id: str, d: Delta) -> dict:
    """A client `Delta` as the page wants it: its text cut per token, each piece with its depth."""
    return {"type": "delta", "id": request_id, "text": d.text, "token_ids": d.token_ids,
            "depths": d.token_depths, "pieces": split_text(d.text, d.spans)}


def _done(request_id: str, d: Delta) -> dict:
    stats = d.stats or {}
    spec = None
    if "drafts" in stats:
        spec = {k: stats[k] for k in ("drafts", "draft_tokens", "accepted_tokens", "acceptance_length",
                                      "drafted_per_position", "accepted_per_position")}
    return {**_delta(request_id, d), "type": "done", "finish_reason": d.finish_reason,
            "usage": {"prompt_tokens": stats.get("prompt_tokens"), "completion_tokens": stats.get("output_tokens"),
                      "ttft_s": stats.get("ttft_s"), "latency_s": stats.get("latency_s")},
            "spec": spec}


def _error(request_id: str | None, message: str, field: str | None = None, code: str = "bad_request") -> dict:
    return {"type": "error", "id": request_id, "field": field, "code": code, "message": message}


def _ws_field(field: str | None, req: WsGenerate) -> str | None:
    """A server error's field (a path in the ZeroMQ `Generate`) → its path in the websocket
    request: token ids are the websocket's `prompt`, the request id is `id`, and k is
    `spec.num_spec_tokens` when it was given there."""
    if field == "prompt_token_ids":
        return "prompt"
    if field == "request_id":
        return "id"
    if field == "params.num_spec_tokens" and req.spec.num_spec_tokens is not None:
        return "spec.num_spec_tokens"
    return field


class Bridge:
    def __init__(self, server: str, token: str | None = None, timeout: float = 300.0):
        self.server = server
        self.token = token
        self.timeout = timeout
        self.page = PAGE.read_text().replace(AUTH_MARKER, AUTH_MARKER.replace("none", "token")
                                             if token else AUTH_MARKER)
        self.served_mode: str | None = None
        self.info: dict | None = None  # what `{"type": "info"}` answers: the server's model and speculation
        self.connections = 0

    # -- HTTP side: the page, and the token check before the websocket handshake ------------

    def process_request(self, connection: ServerConnection, request):
        if request.headers.get("Upgrade", "").lower() != "websocket":
            if urlsplit(request.path).path in ("/", "/index.html"):
                response = connection.respond(HTTPStatus.OK, self.page)
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
                health = await client.health()
                self.served_mode = health["spec"]
                self.info = {"type": "info", "model": health["model"], "spec": health["spec"],
                             "num_spec_tokens": health.get("num_spec_tokens", 0)}
            async for raw in ws:
                try:
                    req = decode_request(raw)
                    if isinstance(req, WsInfo):
                        await ws.send(json.dumps(self.info))
                        continue
                    if isinstance(req, WsCancel):
                        # The server ends the request with a final "abort" delta (and its usage),
                        # which its task forwards as the one `done`. The request was sent before
                        # this message was read, so the abort cannot overtake it.
                        if req.id in running:
                            await client.abort(req.id)
                        continue
                    if req.id in running:
                        raise BadRequest(f"request id {req.id!r} is already running on this connection", "id", req.id)
                    params = _sampling(req, self.served_mode)
                except BadRequest as e:
                    await ws.send(json.dumps(_error(e.request_id, str(e), e.field)))
                    continue
                messages = None if req.messages is None else \
                    [{"role": m.role, "content": m.content} for m in req.messages]
                await client.submit(req.prompt, messages=messages, request_id=req.id, params=params)
                task = asyncio.create_task(self._run(ws, client, req))
                running[req.id] = task
                task.add_done_callback(lambda _, rid=req.id: running.pop(rid, None))
        except ConnectionClosed:
            pass
        except (ClientTimeout, ServerError) as e:
            await ws.close(1011, f"server unavailable: {e}"[:120])
        finally:
            # A closed websocket cancels its requests: each aborts on the server (here too for
            # a task cancelled before it ever ran; an abort of a finished request is ignored).
            left = list(running.items())
            for _, task in left:
                task.cancel()
            await asyncio.gather(*(task for _, task in left), return_exceptions=True)
            for request_id, _ in left:
                await client.abort(request_id)
            client.close()

    async def _run(self, ws: ServerConnection, client: AsyncClient, req: WsGenerate) -> None:
        """Forward one submitted request's deltas; its last message is one done or one error.
        Cancelled only when the connection closes (leaving `deltas` aborts it on the server)."""
        deltas = client.deltas(req.id)
        try:
            async for d in deltas:
                if d.finish_reason:
                    await ws.send(json.dumps(_done(req.id, d)))
                    return
                await ws.send(json.dumps(_delta(req.id, d)))
        except ServerError as e:
            field, message = _ws_field(e.field, req), e.message
            if e.field and field != e.field and message.startswith(f"{e.field}: "):
                message = f"{field}: {message[len(e.field) + 2:]}"
            await ws.send(json.dumps(_error(req.id, message, field, e.code)))
        except ClientTimeout as e:
            await ws.send(json.dumps(_error(req.id, str(e), None, "unavailable")))
        except ConnectionClosed:
            pass
        finally:
            await deltas.aclose()


async def run_bridge(server: str, host: str, port: int, token: str | None = None,
                     ready: asyncio.Future | None = None) -> None:
    bridge = Bridge(server, resolve_token(token))
    async with serve(bridge.handle, host, port, process_request=bridge.process_request,
                     max_size=MAX_MESSAGE_BYTES) as srv:
        bound = srv.sockets[0].getsockname()
        log.info("websocket bridge on ws://%s:%d/ (page: http://%s:%d/%s) -> %s", bound[0], bound[1],
                 bound[0], bound[1], "?token=TOKEN" if bridge.token else "", server)
        if bridge.token:
            log.info("auth: on (bearer token required: Authorization header or ?token=)")
        else:
            log.log(logging.INFO if host in ("127.0.0.1", "localhost", "::1") else logging.WARNING,
                    "auth: off (no --token, no $%s): anyone who can reach %s:%d can use the server",
                    TOKEN_ENV, host, bound[1])
        if ready is not None:
            ready.set_result(bound[1])
        await asyncio.Future()  # until cancelled


def parse_listen(listen: str) -> tuple[str, int]:
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"--listen wants HOST:PORT, got {listen!r}")
    return host, int(port)


def run_bridge_process(server: str, listen: str, token: str | None, daemon_address: str | None,
                       log_level: str = "INFO") -> None:
    """The bridge as a child of the daemon (`overlap serve --ws PORT`)."""
    from runtime.procs import run_listening_child

    def serve(host: str, port: int, ready: asyncio.Future):
        return run_bridge(server, host, port, token, ready)

    run_listening_child("bridge", listen, parse_listen, serve, "ws://{host}:{port}/", daemon_address, log_level)
