"""The OpenAI-compatible HTTP server: OpenAI's REST API <-> the daemon through AsyncClient.

    overlap serve --http 8000 ...                       (the daemon starts it as a process of its own)
    overlap http --server tcp://127.0.0.1:5557 --listen 127.0.0.1:8000 [--token SECRET]

Endpoints:
  POST /v1/completions        prompt: a string, token ids, or a list holding one of either
  POST /v1/chat/completions   messages: [{"role": system|developer|user|assistant, "content": str | [text parts]}]
  GET  /v1/models             the one model the daemon serves
  GET  /health                200 {"status": "ok", ...} when the daemon answers, else 503
  GET  /metrics               Prometheus text format (runtime/metrics.py)

Both generation endpoints take `max_tokens` (chat: also `max_completion_tokens`; default 16
for completions, as OpenAI's, and 128 for chat), `temperature` (default 1.0, as OpenAI's: send
0 for greedy), `top_p`, `seed`, `stop` (a string or a list), `stream`, `stream_options:
{"include_usage": true}` and `n` (1 only). `model` may be anything: one model is served and
responses name it. Streams are server-sent events, `data: {chunk}` per delta, ending with
`data: [DONE]`. Extensions (body fields OpenAI does not have):
  "speculation": {"mode": "none"}           this request without drafts (or the server's own mode)
  "speculation": {"num_spec_tokens": 2}     this request's chain length (0 = no drafts; for an
                                            EAGLE server only 0 or the tree's size)
  "top_k": 40, "ignore_eos": true           as in SamplingParams (runtime/messages.py)
  "return_token_ids": true                  each choice (and each streamed chunk's) also carries
                                            the generated "token_ids" (vLLM's extension of the
                                            same name): exact token counts for benchmarks
and a response's (or the final chunk's) "speculation" field reports the request's drafts,
acceptance per position and acceptance length when it speculated.

Errors have OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, with `param`
naming the offending body field: 400 for a bad request (a wrong type, an out-of-range value,
an unknown or unsupported parameter such as `n: 2`, `logprobs` or `tools`), 401 for a missing
or wrong bearer token, 503 when the daemon is overloaded or unreachable. A request is checked
by the daemon before its response starts, so a streamed request that is refused still gets a
400 (its headers are sent with the first token). With a token (`--token`, else
$OVERLAP_BRIDGE_TOKEN: the websocket bridge's option) every endpoint but /health needs
`Authorization: Bearer TOKEN` (the `api_key` of OpenAI's clients).

A client that disconnects (mid-stream or while waiting) has its request aborted on the
daemon, which frees its KV pages at once.

Why Starlette + uvicorn: they are the ASGI stack most Python model servers use (vLLM's and
SGLang's OpenAI servers are FastAPI, i.e. Starlette, on uvicorn), actively maintained, pure
Python, with streaming responses, HTTP/1.1 keep-alive and graceful shutdown done right; and
an ASGI app lets us see a client's disconnect (`http.disconnect`) while its stream is idle,
which is what aborts the request. We use Starlette without FastAPI's pydantic layer: request
bodies are checked with msgspec (as everywhere in overlap), which names the field at fault in
the OpenAI error shape; there is no OpenAPI page to generate.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import re
import signal
import socket
import time
import uuid
from typing import Any

import anyio
import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from runtime.client import AsyncClient, ClientTimeout, ServerError
from runtime.messages import RequestError, SamplingParams
from runtime.metrics import Metrics

log = logging.getLogger("overlap.http")
DEFAULT_LISTEN = "127.0.0.1:8000"
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_DEFAULT_MAX_TOKENS = SamplingParams().max_tokens
DEFAULT_TEMPERATURE = 1.0  # OpenAI's default
MAX_BODY_BYTES = 8 << 20
STATS_TIMEOUT_S = 5.0
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


# -- request bodies ----------------------------------------------------------------------------

class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False


class Speculation(msgspec.Struct, forbid_unknown_fields=True):
    mode: str | None = None  # "none", or the server's own mode
    num_spec_tokens: int | None = None


class _Body(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The fields both endpoints share (OpenAI's, then overlap's extensions)."""
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict | None = None
    user: str | None = None
    top_k: int | None = None  # extension
    ignore_eos: bool = False  # extension
    speculation: Speculation | None = None  # extension
    return_token_ids: bool = False  # extension (vLLM's): token ids beside the text


class CompletionBody(_Body, forbid_unknown_fields=True, kw_only=True):
    prompt: Any = None
    best_of: int | None = None
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = None


class ChatBody(_Body, forbid_unknown_fields=True, kw_only=True):
    messages: Any = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None


class ApiError(Exception):
    """An error in OpenAI's shape; `param` names the body field at fault."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 kind: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.kind = kind
        self.code = code

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.param, self.kind, self.code), status_code=self.status)


def error_body(message: str, param: str | None = None, kind: str = "invalid_request_error",
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def decode_body(raw: bytes, struct: type) -> Any:
    """JSON bytes → the endpoint's body struct, or ApiError naming the field (`max_tokens`,
    `stream_options.include_usage`, `speculation.mode`, an unknown `tools`, ...)."""
    try:
        obj = json.loads(raw)
    except ValueError as e:
        raise ApiError(f"the body is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ApiError("the body must be a JSON object")
    try:
        return msgspec.convert(obj, struct)
    except msgspec.ValidationError as e:
        text = str(e)
        where = re.search(r"at `\$\.?([^`]*)`", text)
        field = (where.group(1) if where else "") or None
        unknown = re.search(r"unknown field `([^`]*)`", text)
        if unknown:
            field = ".".join(filter(None, [field, unknown.group(1)]))
            raise ApiError(f"unsupported parameter: {field}", field) from None
        if field:
            field = re.sub(r"\.\[", "[", field)
            text = re.sub(r" - at `[^`]*`$", "", text)
            raise ApiError(f"{field}: {text}", field) from None
        raise ApiError(text) from None


def _refuse_unsupported(body) -> None:
    """What we do not implement is an error naming the field, never silently ignored."""
    if body.n not in (None, 1):
        raise ApiError(f"only n=1 is supported, got n={body.n} (send concurrent requests instead)", "n")
    if getattr(body, "best_of", None) not in (None, 1):
        raise ApiError(f"only best_of=1 is supported, got {body.best_of}", "best_of")
    if getattr(body, "echo", False):
        raise ApiError("echo is not supported", "echo")
    if getattr(body, "suffix", None) is not None:
        raise ApiError("suffix is not supported", "suffix")
    if body.logprobs:
        raise ApiError("logprobs are not supported", "logprobs")
    if getattr(body, "top_logprobs", None):
        raise ApiError("top_logprobs is not supported", "top_logprobs")
    for name in ("frequency_penalty", "presence_penalty"):
        if getattr(body, name) not in (None, 0, 0.0):
            raise ApiError(f"{name} is not supported (only 0)", name)
    if body.logit_bias:
        raise ApiError("logit_bias is not supported", "logit_bias")
    if body.stream_options is not None and not body.stream:
        raise ApiError("stream_options is only allowed with stream: true", "stream_options")


def sampling_params(body, served_mode: str, default_max_tokens: int) -> tuple[SamplingParams, str]:
    """The body's sampling fields → SamplingParams, and the name `max_tokens` was given under."""
    _refuse_unsupported(body)
    max_name, max_tokens = "max_tokens", body.max_tokens
    if getattr(body, "max_completion_tokens", None) is not None:
        if max_tokens is not None and max_tokens != body.max_completion_tokens:
            raise ApiError("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
        max_name, max_tokens = "max_completion_tokens", body.max_completion_tokens
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    fields: dict = {"max_tokens": default_max_tokens if max_tokens is None else max_tokens,
                    "temperature": DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
                    "stop": stop, "ignore_eos": body.ignore_eos}
    for name in ("top_p", "seed", "top_k"):
        if getattr(body, name) is not None:
            fields[name] = getattr(body, name)
    spec = body.speculation
    if spec is not None:
        if spec.mode is not None and spec.mode not in ("none", served_mode):
            raise ApiError(f"speculation mode {spec.mode!r} is not available: this server runs {served_mode!r} "
                           "(or use 'none')", "speculation.mode")
        if spec.mode == "none":
            fields["spec"] = False
        if spec.num_spec_tokens is not None:
            fields["num_spec_tokens"] = spec.num_spec_tokens
    params = SamplingParams(**fields)
    try:
        params.validate()  # the daemon checks again (with the model's limits); this names the field early
    except RequestError as e:
        field = e.field
        raise ApiError(f"{_param(field, max_name)}: {e.message}", _param(field, max_name)) from None
    return params, max_name


def _param(field: str | None, max_name: str = "max_tokens") -> str | None:
    """A SamplingParams field or a daemon error's field (a path in the ZeroMQ `Generate`) →
    the HTTP body's name for it."""
    if field is None:
        return None
    field = field.removeprefix("params.")
    return {"max_tokens": max_name, "num_spec_tokens": "speculation.num_spec_tokens", "spec": "speculation.mode",
            "prompt_token_ids": "prompt"}.get(field, field)


def completion_prompt(prompt: Any) -> str | list[int]:
    """OpenAI's prompt forms: text, token ids, or a list of one of either."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) != 1:
            raise ApiError(f"one prompt per request (got {len(prompt)}): send concurrent requests instead", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError("prompt is empty", "prompt")
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    if prompt is None:
        raise ApiError("prompt is required", "prompt")
    raise ApiError("prompt must be a non-empty string, a list of token ids, or a list holding one of either",
                   "prompt")


def chat_messages(messages: Any) -> list[dict]:
    if messages is None:
        raise ApiError("messages is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise ApiError("a message is an object with role and content", f"messages[{i}]")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise ApiError(f"role must be one of {', '.join(CHAT_ROLES)}, got {role!r}", f"messages[{i}].role")
        unknown = set(m) - {"role", "content", "name"}
        if unknown:
            name = sorted(unknown)[0]
            raise ApiError(f"unsupported message field: {name}", f"messages[{i}].{name}")
        content = m.get("content")
        if content is None:
            content = ""
        elif isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError("only text content parts ({\"type\": \"text\", \"text\": ...}) are supported",
                                   f"messages[{i}].content[{j}]")
                parts.append(part["text"])
            content = "".join(parts)
        elif not isinstance(content, str):
            raise ApiError("content must be a string or a list of text parts", f"messages[{i}].content")
        out.append({"role": CHAT_ROLES[role], "content": content})
    return out


# -- responses -----------------------------------------------------------------------------

def usage(stats: dict | None) -> dict:
    stats = stats or {}
    prompt, completion = stats.get("prompt_tokens", 0), stats.get("output_tokens", 0)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def speculation_report(stats: dict | None) -> dict | None:
    stats = stats or {}
    if "drafts" not in stats:
        return None
    return {k: stats[k] for k in ("drafts", "draft_tokens", "accepted_tokens", "acceptance_length",
                                  "drafted_per_position", "accepted_per_position") if k in stats}


def _sse(obj: dict | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, separators=(',', ':'))}\n\n".encode()


class SSEResponse(StreamingResponse):
    """A server-sent event stream that ends its generator when the client goes away: the
    stream and a listener for `http.disconnect` run side by side, the first to end cancels the
    other, and the generator is always closed here (its `finally` aborts an unfinished
    request) instead of whenever it is garbage-collected."""

    def __init__(self, content, **kw):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}, **kw)

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # uvicorn's ClientDisconnected: the client is gone
                        pass
                    tg.cancel_scope.cancel()

                async def watch() -> None:
                    await self.listen_for_disconnect(receive)
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                tg.start_soon(watch)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


class _ClientGone(Exception):
    pass


async def _unless_disconnected(request: Request, awaitable):
    """Await `awaitable`, unless the client disconnects first (then cancel it, raise _ClientGone)."""
    task = asyncio.ensure_future(awaitable)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait([task, watch], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, watch):
            if not t.done():
                t.cancel()
        await asyncio.gather(task, watch, return_exceptions=True)
    if task.cancelled():
        raise _ClientGone()
    return task.result()


# -- the server --------------------------------------------------------------------------------

class OpenAIServer:
    def __init__(self, server: str, token: str | None = None, timeout: float = 300.0):
        self.server = server
        self.token = token
        self.timeout = timeout
        self.client: AsyncClient | None = None
        self.model = "unknown"
        self.served_mode = "none"
        self.created = int(time.time())
        self.metrics = Metrics()
        self.app = Starlette(
            routes=[Route("/v1/completions", self.completions, methods=["POST"]),
                    Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                    Route("/v1/models", self.models, methods=["GET"]),
                    Route("/health", self.health, methods=["GET"]),
                    Route("/metrics", self.scrape, methods=["GET"])],
            exception_handlers={HTTPException: self._http_error, ApiError: self._api_error},
            lifespan=self._lifespan)

    @contextlib.asynccontextmanager
    async def _lifespan(self, app):
        self.client = AsyncClient(self.server, timeout=self.timeout)
        try:
            await self.connect()
            yield
        finally:
            self.client.close()

    async def connect(self, timeout: float = 10.0) -> None:
        """Learn the model and the speculative mode the daemon serves."""
        h = await self.client.health(timeout=timeout)
        self.model, self.served_mode = h["model"], h["spec"]

    # -- plumbing --------------------------------------------------------------------------

    @staticmethod
    async def _http_error(request: Request, exc: HTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(f"{request.method} {request.url.path}: {exc.detail}", None, kind),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @staticmethod
    async def _api_error(request: Request, exc: ApiError) -> Response:
        return exc.response()

    def _authorize(self, request: Request) -> None:
        if self.token is None:
            return
        given = request.headers.get("Authorization", "")
        given = given[len("Bearer "):] if given.startswith("Bearer ") else None
        if given is None or not hmac.compare_digest(given.encode(), self.token.encode()):
            raise ApiError("missing or wrong bearer token (Authorization: Bearer TOKEN)", None, 401,
                           "authentication_error", "invalid_api_key")

    async def _body(self, request: Request, struct: type):
        self._authorize(request)
        raw = await request.body()
        if len(raw) > MAX_BODY_BYTES:
            raise ApiError(f"the body is larger than {MAX_BODY_BYTES} bytes", None, 413)
        return decode_body(raw, struct)

    # -- endpoints -------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        try:
            h = await self.client.health(timeout=STATS_TIMEOUT_S)
        except (ClientTimeout, ServerError) as e:
            return JSONResponse({"status": "unavailable", "error": str(e)}, status_code=503)
        ok = bool(h.get("ok"))
        return JSONResponse({"status": "ok" if ok else "unavailable", "model": h["model"], "speculation": h["spec"],
                             "uptime_s": h["uptime_s"]}, status_code=200 if ok else 503)

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        return JSONResponse({"object": "list", "data": [{"id": self.model, "object": "model", "created": self.created,
                                                         "owned_by": "overlap"}]})

    async def scrape(self, request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        self._authorize(request)
        try:
            self.metrics.daemon.latest = await self.client.stats(timeout=STATS_TIMEOUT_S)
        except (ClientTimeout, ServerError):
            self.metrics.daemon.latest = None
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def completions(self, request: Request) -> Response:
        body = await self._body(request, CompletionBody)
        prompt = completion_prompt(body.prompt)
        params, max_name = sampling_params(body, self.served_mode, COMPLETION_DEFAULT_MAX_TOKENS)
        return await self._generate(request, body, params, max_name, "cmpl", prompt=prompt)

    async def chat_completions(self, request: Request) -> Response:
        body = await self._body(request, ChatBody)
        messages = chat_messages(body.messages)
        params, max_name = sampling_params(body, self.served_mode, CHAT_DEFAULT_MAX_TOKENS)
        return await self._generate(request, body, params, max_name, "chatcmpl", messages=messages)

    async def _generate(self, request: Request, body, params: SamplingParams, max_name: str, kind: str,
                        prompt=None, messages=None) -> Response:
        chat = kind == "chatcmpl"
        rid = f"{kind}-{uuid.uuid4().hex}"
        run = _Run(self, rid, max_name)
        try:
            await self.client.submit(prompt, messages=messages, request_id=rid, params=params)
        except ServerError as e:
            raise run.api_error(e) from None
        self.metrics.in_flight.inc()
        deltas = self.client.deltas(rid)
        try:
            first = await _unless_disconnected(request, deltas.__anext__())
        except BaseException as e:
            await run.end(deltas, None, None)
            if isinstance(e, _ClientGone):
                self.metrics.request_finished("abort", None, [])
                return Response(status_code=499)
            if isinstance(e, ServerError):
                error = run.api_error(e)
                if error.status != 400:  # a refused request is not counted as one that ran
                    self.metrics.request_finished("error", None, [])
                return error.response()
            if isinstance(e, ClientTimeout):
                self.metrics.request_finished("error", None, [])
                return ApiError(str(e), None, 504, "server_error", "timeout").response()
            raise
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return SSEResponse(run.events(first, deltas, chat, include_usage, body.return_token_ids))
        try:
            text, token_ids, finish, stats = await _unless_disconnected(request, run.collect(first, deltas))
        except _ClientGone:
            return Response(status_code=499)
        except ServerError as e:
            return run.api_error(e).response()
        except ClientTimeout as e:
            return ApiError(str(e), None, 504, "server_error", "timeout").response()
        choice = {"index": 0, "logprobs": None, "finish_reason": finish}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        if body.return_token_ids:
            choice["token_ids"] = token_ids
        out = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
               "model": self.model, "choices": [choice], "usage": usage(stats)}
        spec = speculation_report(stats)
        if spec is not None:
            out["speculation"] = spec
        return JSONResponse(out)


class _Run:
    """One generation request: forwards its deltas, and when it ends (finished, failed, or
    abandoned by its client) aborts it if unfinished and records its metrics, exactly once."""

    def __init__(self, server: OpenAIServer, rid: str, max_name: str):
        self.server = server
        self.rid = rid
        self.max_name = max_name
        self.delta_times: list[tuple[float, int]] = []
        self.ended = False

    def api_error(self, e: ServerError) -> ApiError:
        param = _param(e.field, self.max_name)
        message = e.message
        if e.field and param != e.field and message.startswith(f"{e.field}: "):
            message = f"{param}: {message[len(e.field) + 2:]}"
        if e.code == "bad_request":
            return ApiError(message, param)
        if e.code in ("overloaded", "unavailable"):
            return ApiError(message, None, 503, "server_error", e.code)
        return ApiError(message, None, 500, "server_error", e.code)

    def note(self, d) -> None:
        if d.token_ids:
            self.delta_times.append((time.perf_counter(), len(d.token_ids)))

    async def end(self, deltas, finish: str | None, stats: dict | None, failed: bool = False) -> None:
        """Close the request's delta stream (aborting it on the daemon if it has not finished)
        and record it; safe to call again."""
        if self.ended:
            return
        self.ended = True
        with anyio.CancelScope(shield=True):
            await deltas.aclose()
            if finish is None:
                await self.server.client.abort(self.rid)  # idempotent: a finished request ignores it
        self.server.metrics.in_flight.dec()
        if finish is not None or failed:
            self.server.metrics.request_finished("error" if failed else finish, stats, self.delta_times)

    async def collect(self, first, deltas) -> tuple[str, list[int], str, dict]:
        text, token_ids, d = [], [], first
        finish = stats = None
        try:
            while True:
                self.note(d)
                text.append(d.text)
                token_ids += d.token_ids
                if d.finish_reason:
                    finish, stats = d.finish_reason, d.stats or {}
                    return "".join(text), token_ids, finish, stats
                d = await deltas.__anext__()
        except (ServerError, ClientTimeout):
            await self.end(deltas, None, None, failed=True)
            raise
        finally:
            if finish is None and not self.ended:
                self.server.metrics.request_finished("abort", None, [])
            await self.end(deltas, finish, stats)

    async def events(self, first, deltas, chat: bool, include_usage: bool, return_token_ids: bool = False):
        """The SSE byte chunks of one streamed request, `data: [DONE]` last."""
        created, model = int(time.time()), self.server.model
        obj = "chat.completion.chunk" if chat else "text_completion"
        finish = stats = None

        def chunk(text: str | None, finish_reason: str | None, role: bool = False, token_ids=(), **extra) -> dict:
            if chat:
                delta = {"role": "assistant", "content": ""} if role else ({} if text is None else {"content": text})
                choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            else:
                choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            if return_token_ids:
                choice["token_ids"] = list(token_ids)
            out = {"id": self.rid, "object": obj, "created": created, "model": model, "choices": [choice], **extra}
            if include_usage:
                out["usage"] = None
            return out

        try:
            if chat:
                yield _sse(chunk(None, None, role=True))
            d = first
            while True:
                self.note(d)
                if d.finish_reason:
                    finish, stats = d.finish_reason, d.stats or {}
                    spec = speculation_report(stats)
                    yield _sse(chunk(d.text or (None if chat else ""), finish, token_ids=d.token_ids,
                                     **({"speculation": spec} if spec is not None else {})))
                    break
                # Token ids whose text the detokenizer still holds back (an incomplete
                # character) get a chunk of their own when the client asked for ids.
                if d.text or (return_token_ids and d.token_ids):
                    yield _sse(chunk(d.text, None, token_ids=d.token_ids))
                try:
                    d = await deltas.__anext__()
                except (ServerError, ClientTimeout) as e:
                    err = self.api_error(e) if isinstance(e, ServerError) else \
                        ApiError(str(e), None, 504, "server_error", "timeout")
                    await self.end(deltas, None, None, failed=True)
                    yield _sse(error_body(err.message, err.param, err.kind, err.code))
                    yield _sse("[DONE]")
                    return
            if include_usage:
                yield _sse({"id": self.rid, "object": obj, "created": created, "model": model, "choices": [],
                            "usage": usage(stats)})
            yield _sse("[DONE]")
        finally:
            if finish is None and not self.ended:
                self.server.metrics.request_finished("abort", None, [])
            await self.end(deltas, finish, stats)


# -- running it ----------------------------------------------------------------------------

def parse_listen(listen: str) -> tuple[str, int]:
    """`HOST:PORT` (or a bare PORT: loopback) → (host, port)."""
    if listen.isdigit():
        return "127.0.0.1", int(listen)
    host, _, port = listen.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"an HTTP listen address is [HOST:]PORT, got {listen!r}")
    return host.strip("[]"), int(port)


def bind(host: str, port: int) -> socket.socket:
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        raise ConnectionError(f"cannot listen on {host}:{port} (--http): {e.strerror or e}") from None
    return sock


def _log_auth(token: str | None, host: str, port: int) -> None:
    from runtime.ws_bridge import TOKEN_ENV

    if token:
        log.info("auth: on (Authorization: Bearer TOKEN required on /v1/* and /metrics)")
    else:
        log.log(logging.INFO if host in ("127.0.0.1", "localhost", "::1") else logging.WARNING,
                "auth: off (no --token, no $%s): anyone who can reach %s:%d can use the server",
                TOKEN_ENV, host, port)


async def run_http(server: str, host: str, port: int, token: str | None = None, ready: asyncio.Future | None = None,
                   stop: asyncio.Event | None = None, timeout: float = 300.0) -> None:
    """Serve until SIGINT/SIGTERM, or, given `stop`, until it is set (then the caller owns
    the signals); either way open streams get a few seconds to end."""
    app = OpenAIServer(server, token, timeout)
    sock = bind(host, port)
    bound = sock.getsockname()[1]
    config = uvicorn.Config(app.app, log_level="warning", access_log=False, lifespan="on",
                            timeout_graceful_shutdown=3, loop="none")
    uv = uvicorn.Server(config) if stop is None else _ChildServer(config)
    serving = asyncio.ensure_future(uv.serve(sockets=[sock]))
    if stop is not None:
        async def stop_when_told() -> None:
            await stop.wait()
            uv.should_exit = True

        stopper = asyncio.ensure_future(stop_when_told())
        serving.add_done_callback(lambda _: stopper.cancel())
    while not uv.started and not serving.done():
        await asyncio.sleep(0.02)
    if serving.done():
        serving.result()
        raise ConnectionError(f"the HTTP server did not start (is a daemon answering at {server}?)")
    log.info("OpenAI-compatible HTTP server on http://%s:%d/v1 -> %s (model %s, speculation %s)", host, bound,
             server, app.model, app.served_mode)
    _log_auth(token, host, bound)
    if ready is not None:
        ready.set_result(bound)
    try:
        await serving
    finally:
        sock.close()


class _ChildServer(uvicorn.Server):
    """uvicorn's server without its signal handlers: as the daemon's child, SIGTERM is the
    daemon's business (runtime/procs.py)."""

    def capture_signals(self):
        return contextlib.nullcontext()


def run_http_process(server: str, listen: str, token: str | None, daemon_address: str | None,
                     log_level: str = "INFO") -> None:
    """The HTTP server as a child of the daemon (`overlap serve --http PORT`)."""
    from runtime.procs import run_listening_child

    async def serve(host: str, port: int, ready: asyncio.Future) -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)  # from the daemon: a graceful stop
        await run_http(server, host, port, token, ready, stop)

    run_listening_child("http", listen, parse_listen, serve, "http://{host}:{port}/v1", daemon_address, log_level)
