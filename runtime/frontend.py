"""The request side of the runtime, shared by the in-process engine and the tokenizer
process: prompt encoding (chat template), validation against the server's limits, and the
per-request state that turns produced token ids into text deltas and stats."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import NamedTuple

from overlap.config import EngineConfig, ModelConfig, tree_tokens
from runtime.detokenizer import IncrementalDetokenizer
from runtime.messages import RequestError, SamplingParams
from runtime.origins import spans, token_depths

MAX_NUM_SPEC_TOKENS = 16


@dataclass(frozen=True)
class RequestLimits:
    vocab_size: int
    max_model_len: int
    num_pages: int
    page_size: int
    default_num_spec_tokens: int  # 0 when the server does not speculate
    tree: bool = False  # EAGLE: a request's k is the tree size (its own num_spec_tokens only turns it off at 0)

    @classmethod
    def of(cls, config: EngineConfig, model: ModelConfig) -> "RequestLimits":
        method = config.spec.method
        spec = 0 if method == "none" else tree_tokens(config) if method == "eagle" else config.spec.num_spec_tokens
        return cls(model.vocab_size, min(config.scheduler.max_model_len, model.max_position),
                   config.cache.num_pages, config.cache.page_size, spec, tree=config.spec.method == "eagle")

    def num_spec_tokens(self, params: SamplingParams) -> int:
        if not self.default_num_spec_tokens or not params.spec:
            return 0
        if self.tree:
            return 0 if params.num_spec_tokens == 0 else self.default_num_spec_tokens
        return self.default_num_spec_tokens if params.num_spec_tokens is None else params.num_spec_tokens


def eos_token_ids(model: ModelConfig, tokenizer) -> tuple[int, ...]:
    """Every id that ends generation: the model config's and the tokenizer's."""
    ids = set(model.eos_token_ids)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


def encode_prompt(tokenizer, prompt: str | list[int] | None = None, messages: list[dict] | None = None,
                  chat: bool = False) -> list[int]:
    """Prompt text, token ids or chat messages → prompt ids (chat template applied)."""
    if messages is None and chat:
        messages = [{"role": "user", "content": prompt}]
    if messages is not None:
        if not messages:
            raise RequestError("messages", "must not be empty")
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return tokenizer.encode(text, add_special_tokens=False)
    if isinstance(prompt, list):
        return list(prompt)
    if not isinstance(prompt, str):
        raise RequestError("prompt", "must be a string, a list of token ids, or use messages")
    return tokenizer.encode(prompt)


def validate_request(ids: list[int], params: SamplingParams, limits: RequestLimits) -> None:
    params.validate(MAX_NUM_SPEC_TOKENS)
    if params.max_tokens > limits.max_model_len:
        raise RequestError("max_tokens", f"must be <= {limits.max_model_len} (the context length), "
                                         f"got {params.max_tokens}")
    if not ids:
        raise RequestError("prompt", "is empty")
    if any(not 0 <= t < limits.vocab_size for t in ids):
        raise RequestError("prompt", f"token ids must be in [0, {limits.vocab_size})")
    if len(ids) >= limits.max_model_len:
        raise RequestError("prompt", f"{len(ids)} tokens does not fit the context of "
                                     f"{limits.max_model_len} tokens (room is needed to generate)")
    pages = -(-(len(ids) + 1) // limits.page_size)
    if pages > limits.num_pages:
        raise RequestError("prompt", f"{len(ids)} tokens needs {pages} KV pages; the cache has "
                                     f"{limits.num_pages}")
    if any(not 0 <= t < limits.vocab_size for t in params.stop_token_ids):
        raise RequestError("stop_token_ids", f"token ids must be in [0, {limits.vocab_size})")


@dataclass
class RequestStats:
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_steps: int = 0  # decode steps that produced tokens
    num_drafts: int = 0  # steps that proposed drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    arrival: float = 0.0
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None
    drafted_at: list[int] = field(default_factory=list)  # [i]: steps with a draft at position i
    accepted_at: list[int] = field(default_factory=list)  # [i]: of which the target accepted
    rejected_at: list[int] = field(default_factory=list)  # [i]: steps whose first rejection was at position i
    k_chosen: dict[int, int] = field(default_factory=dict)  # k (or tree nodes) → decode steps that verified it

    def record_drafts(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        grow = num_drafts - len(self.drafted_at)
        if grow > 0:
            self.drafted_at += [0] * grow
            self.accepted_at += [0] * grow
            self.rejected_at += [0] * grow
        for i in range(num_drafts):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < num_accepted
        if num_accepted < num_drafts:
            self.rejected_at[num_accepted] += 1

    def as_dict(self) -> dict:
        d = {
            "prompt_tokens": self.num_prompt_tokens,
            "output_tokens": self.num_output_tokens,
            "steps": self.num_steps,
            "ttft_s": (self.first_token - self.arrival) if self.first_token else None,
            "latency_s": (self.finished - self.arrival) if self.finished else None,
        }
        if self.k_chosen:
            steps = sum(self.k_chosen.values())
            d.update(k_histogram={str(k): n for k, n in sorted(self.k_chosen.items())},
                     mean_k=sum(k * n for k, n in self.k_chosen.items()) / steps)
        if self.num_drafts:
            d.update(drafts=self.num_drafts, draft_tokens=self.num_draft_tokens,
                     accepted_tokens=self.num_accepted_tokens,
                     acceptance_length=1 + self.num_accepted_tokens / self.num_drafts,
                     drafted_per_position=list(self.drafted_at),
                     accepted_per_position=list(self.accepted_at),
                     rejected_per_position=list(self.rejected_at))
        return d


class StepText(NamedTuple):
    """What one step's tokens added to a request's stream."""

    text: str  # new text that is final
    finish_reason: str | None
    by_stop_string: bool  # a stop string ended it: the caller must tell the scheduler
    token_depths: list[int]  # per new token: 0 the target's own, d a draft accepted at depth d
    spans: list[tuple[int, int]]  # `text` as (characters, depth) runs, one per token (runtime/origins.py)


class RequestState:
    """One request between admission and its last delta: detokenizer, output, stats."""

    def __init__(self, request_id: str, tokenizer, prompt_ids: list[int], params: SamplingParams):
        self.request_id = request_id
        self.detok = IncrementalDetokenizer(tokenizer, prompt_ids, params.stop)
        self.stats = RequestStats(num_prompt_tokens=len(prompt_ids), arrival=time.perf_counter())
        self.output_ids: list[int] = []
        self.depths: list[int] = []  # per output token, as StepText.token_depths
        self.text = ""
        self.finish_reason: str | None = None

    def on_tokens(self, new_ids: list[int], finish_reason: str | None, num_drafts: int = 0,
                  num_accepted: int = 0, spec_k: int | None = None) -> StepText:
        """Apply one step's tokens (`num_accepted` of them accepted drafts, runtime/origins.py;
        `spec_k` the drafts the controller chose). When a stop string ended the request the
        caller must also tell the scheduler."""
        st = self.stats
        now = time.perf_counter()
        if new_ids:
            st.first_token = st.first_token or now
            st.token_times.append(now)
            st.num_steps += 1
            st.num_output_tokens += len(new_ids)
            if num_drafts:
                st.record_drafts(num_drafts, num_accepted)
            if spec_k is not None and spec_k >= 0:  # the controller's choice for this step
                st.k_chosen[spec_k] = st.k_chosen.get(spec_k, 0) + 1
        self.output_ids += new_ids
        depths = token_depths(len(new_ids), num_accepted)
        self.depths += depths
        start = self.detok.sent
        text = self.detok.add(new_ids)
        by_stop_string = self.detok.stopped and finish_reason is None
        if by_stop_string:
            finish_reason = "stop"
        if finish_reason:
            text += self.detok.flush()
            self.finish(finish_reason)
        self.text += text
        runs = spans(self.detok.token_ends, self.depths, start, start + len(text)) if text else []
        return StepText(text, finish_reason, by_stop_string, depths, runs)

    def finish(self, reason: str) -> None:
        self.finish_reason = reason
        self.stats.finished = time.perf_counter()
