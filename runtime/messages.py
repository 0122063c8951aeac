"""Every Struct that crosses a process boundary, and the request parameters they carry.

Three conversations, each a tagged union (msgpack maps/arrays with a "type" tag, decoded
with one `msgspec.msgpack.Decoder` per union in runtime/ipc.py):
  client    ⇄ tokenizer   ClientRequest / ClientReply
  tokenizer ⇄ scheduler   ToScheduler (also from the executor) / ToTokenizer
  scheduler ⇄ executor    ToExecutor / ToScheduler
Token ids that can be long (prompts) travel as packed little-endian int32 bytes (`TokenIds`),
not as msgpack lists of ints: one memcpy instead of a Python int per token on each side.
The executor's `BatchPlan` (overlap/batch.py) is carried unconverted inside `Execute`.
"""

from __future__ import annotations

import sys
from array import array

import msgspec

from overlap.batch import BatchPlan, StepOutput


class RequestError(ValueError):
    """A request the server refuses; `field` names the offending field."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class SamplingParams(msgspec.Struct, frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    max_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int | None = None  # None: the server draws one
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    spec: bool = True  # False switches speculation off for this request
    num_spec_tokens: int | None = None  # None: the engine's default

    def validate(self, max_num_spec_tokens: int = 16) -> None:
        if self.max_tokens <= 0:
            raise RequestError("max_tokens", f"must be > 0, got {self.max_tokens}")
        if not self.temperature >= 0 or self.temperature > 100:  # also rejects NaN
            raise RequestError("temperature", f"must be in [0, 100], got {self.temperature}")
        if self.top_k < 0:
            raise RequestError("top_k", f"must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise RequestError("top_p", f"must be in (0, 1], got {self.top_p}")
        if self.seed is not None and not 0 <= self.seed < 2**63:
            raise RequestError("seed", f"must be in [0, 2^63), got {self.seed}")
        if any(not s for s in self.stop):
            raise RequestError("stop", "stop strings must be non-empty")
        if self.num_spec_tokens is not None and not 0 <= self.num_spec_tokens <= max_num_spec_tokens:
            raise RequestError("num_spec_tokens",
                               f"must be in [0, {max_num_spec_tokens}], got {self.num_spec_tokens}")


# -- packed token ids ------------------------------------------------------------------------

def pack_ids(ids: list[int]) -> bytes:
    """list of token ids → int32 little-endian bytes."""
    a = array("i", ids)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def unpack_ids(data: bytes) -> list[int]:
    if len(data) % 4:
        raise RequestError("prompt_token_ids", "packed token ids must be a multiple of 4 bytes")
    a = array("i")
    a.frombytes(data)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tolist()


# -- client ⇄ tokenizer ----------------------------------------------------------------------

class ChatMessage(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    role: str
    content: str


class Generate(msgspec.Struct, tag="generate", frozen=True, omit_defaults=True, forbid_unknown_fields=True):
    """Exactly one of prompt, messages, prompt_token_ids (packed int32)."""

    request_id: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    prompt_token_ids: bytes | None = None
    params: SamplingParams = SamplingParams()


class Abort(msgspec.Struct, tag="abort", frozen=True, forbid_unknown_fields=True):
    request_id: str


class Health(msgspec.Struct, tag="health", frozen=True, forbid_unknown_fields=True):
    query_id: str = ""


class Stats(msgspec.Struct, tag="stats", frozen=True, forbid_unknown_fields=True):
    query_id: str = ""


ClientRequest = Generate | Abort | Health | Stats


class Delta(msgspec.Struct, tag="delta", frozen=True, omit_defaults=True):
    """New text and ids of one request; the last one has finish_reason and the stats."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stats: dict | None = None  # usage, latency and speculation stats (last delta only)
    # Added fields (older clients ignore them): each token's origin, 0 = the target's own token,
    # d = a draft accepted at depth d, aligned with token_ids; and `text` cut per token into
    # (characters, depth) runs. runtime/origins.py defines both.
    token_depths: list[int] = []
    spans: list[tuple[int, int]] = []


class Error(msgspec.Struct, tag="error", frozen=True, omit_defaults=True):
    """A refused or failed request (request_id set) or an undecodable message (request_id "")."""

    request_id: str
    message: str
    field: str | None = None  # the request field at fault, for validation errors
    code: str = "bad_request"  # bad_request | overloaded | internal | unavailable


class HealthReply(msgspec.Struct, tag="health_reply", frozen=True):
    query_id: str
    ok: bool
    model: str
    spec: str
    uptime_s: float
    num_spec_tokens: int = 0  # drafts per step by default (tree nodes for eagle); 0 without speculation


class StatsReply(msgspec.Struct, tag="stats_reply", frozen=True):
    query_id: str
    stats: dict


ClientReply = Delta | Error | HealthReply | StatsReply


# -- tokenizer ⇄ scheduler ⇄ executor --------------------------------------------------------

class AddRequest(msgspec.Struct, tag="add", frozen=True, array_like=True):
    request_id: str
    prompt_ids: bytes  # packed int32
    params: SamplingParams
    seed: int
    num_spec_tokens: int


class AbortRequest(msgspec.Struct, tag="abort", frozen=True, array_like=True):
    request_id: str


class StatsQuery(msgspec.Struct, tag="stats", frozen=True, array_like=True):
    query_id: str


class TokenUpdate(msgspec.Struct, frozen=True, array_like=True, omit_defaults=True):
    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None
    num_drafts: int = 0
    num_accepted: int = 0
    spec_k: int = -1  # drafts (or tree nodes) the controller chose this step; -1: not a speculating decode


class TokenBatch(msgspec.Struct, tag="tokens", frozen=True, array_like=True):
    updates: list[TokenUpdate]


class SchedulerStats(msgspec.Struct, tag="stats_reply", frozen=True, array_like=True):
    query_id: str
    stats: dict


class RequestFailed(msgspec.Struct, tag="failed", frozen=True, array_like=True):
    """The scheduler refused or lost a request (the tokenizer tells its client)."""

    request_id: str
    message: str
    code: str


class FatalError(msgspec.Struct, tag="fatal", frozen=True, array_like=True):
    """A process hit an error it cannot serve through; in-flight requests get `message`."""

    role: str
    message: str


class Execute(msgspec.Struct, tag="execute", frozen=True, array_like=True):
    plan: BatchPlan


class Shutdown(msgspec.Struct, tag="shutdown", frozen=True, array_like=True):
    pass


class StepResult(msgspec.Struct, tag="result", frozen=True, array_like=True):
    output: StepOutput
    timing: dict  # the executor's cumulative device/host timing (Executor.timing)


class Ready(msgspec.Struct, tag="ready", frozen=True, array_like=True):
    """A process finished starting (to the daemon's control socket)."""

    role: str
    pid: int
    endpoint: str = ""  # the tokenizer's client endpoint as bound (resolves tcp://...:*)


ToScheduler = AddRequest | AbortRequest | StatsQuery | StepResult | FatalError
ToTokenizer = TokenBatch | SchedulerStats | RequestFailed | FatalError
ToExecutor = Execute | Shutdown
ToDaemon = Ready | FatalError
