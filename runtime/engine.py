"""The in-process engine: tokenizer, scheduler core and executor wired together without
sockets. The single-process form of the runtime, for library use and for tests.

    engine = Engine(EngineConfig())
    for delta in engine.stream("def fib(n):", SamplingParams(max_tokens=32)):
        print(delta.text, end="")
"""

from __future__ import annotations

import dataclasses
import random
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

from overlap.attention import make_backend
from overlap.batch import BatchPlan
from overlap.config import EngineConfig, torch_dtype
from overlap.executor import Executor
from overlap.models.llama import LlamaModel, load_llama
from overlap.models.loading import load_tokenizer, resolve_model_dir
from overlap.spec.draft_target import DraftTargetProposer, load_draft
from overlap.spec.ngram import NgramProposer
from runtime.detokenizer import IncrementalDetokenizer
from runtime.messages import RequestError, SamplingParams
from runtime.pages import PageAllocator
from runtime.scheduler import Scheduler, SeqUpdate


@dataclass(frozen=True)
class Delta:
    """A piece of one request's stream: new text and ids; finish_reason on the last one."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None


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

    def record_drafts(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        grow = num_drafts - len(self.drafted_at)
        if grow > 0:
            self.drafted_at += [0] * grow
            self.accepted_at += [0] * grow
        for i in range(num_drafts):
            self.drafted_at[i] += 1
            self.accepted_at[i] += i < num_accepted

    def as_dict(self) -> dict:
        d = {
            "prompt_tokens": self.num_prompt_tokens,
            "output_tokens": self.num_output_tokens,
            "steps": self.num_steps,
            "ttft_s": (self.first_token - self.arrival) if self.first_token else None,
            "latency_s": (self.finished - self.arrival) if self.finished else None,
        }
        if self.num_drafts:
            d.update(drafts=self.num_drafts, draft_tokens=self.num_draft_tokens,
                     accepted_tokens=self.num_accepted_tokens,
                     acceptance_length=1 + self.num_accepted_tokens / self.num_drafts,
                     drafted_per_position=list(self.drafted_at),
                     accepted_per_position=list(self.accepted_at))
        return d


@dataclass(frozen=True)
class Result:
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str
    stats: dict


@dataclass
class _Request:
    request_id: str
    detok: IncrementalDetokenizer
    stats: RequestStats
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    pending: list[Delta] = field(default_factory=list)
    finish_reason: str | None = None


class Engine:
    def __init__(self, config: EngineConfig = EngineConfig(), progress: bool = True):
        model_dir = resolve_model_dir(config.model, progress=progress)
        model = load_llama(model_dir, torch_dtype(config.dtype), config.device)
        self._setup(config, model, load_tokenizer(model_dir))

    @classmethod
    def from_model(cls, config: EngineConfig, model: LlamaModel, tokenizer) -> "Engine":
        """An engine around an already loaded target (tools that hold one reuse it)."""
        engine = cls.__new__(cls)
        engine._setup(config, model, tokenizer)
        return engine

    def _setup(self, config: EngineConfig, model: LlamaModel, tokenizer) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.model = model
        cfg = self.model.cfg
        self.max_model_len = min(config.scheduler.max_model_len, cfg.max_position)
        kv = self.model.new_kv_pool(config.cache.num_pages, config.cache.page_size)
        backend = make_backend(config.attention_backend, config.device)
        self.executor = Executor(self.model, kv, backend, self._make_proposer(config), overlap=config.overlap)
        self.allocator = PageAllocator(config.cache.num_pages, config.cache.page_size)
        sched_cfg = dataclasses.replace(config.scheduler, max_model_len=self.max_model_len)
        self.scheduler = Scheduler(sched_cfg, self.allocator, self._eos_ids())
        self.requests: dict[str, _Request] = {}
        self._seeds = random.Random()

    def _make_proposer(self, config: EngineConfig):
        spec = config.spec
        if spec.method == "none":
            return None
        if spec.method == "ngram":
            return NgramProposer(self.model.cfg.vocab_size, config.device, spec.ngram_min, spec.ngram_max)
        if spec.method == "draft":
            if not spec.draft_model:
                raise ValueError("spec method 'draft' needs spec.draft_model (a draft directory)")
            draft = load_draft(spec.draft_model, self.model)
            return DraftTargetProposer(draft, make_backend(config.attention_backend, config.device),
                                       config.cache.num_pages, config.cache.page_size)
        raise ValueError(f"unknown spec method {spec.method!r} (none | draft | ngram)")

    def _eos_ids(self) -> tuple[int, ...]:
        ids = set(self.model.cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return tuple(sorted(ids))

    # -- requests --------------------------------------------------------------------------

    def encode(self, prompt: str | list[int] | None = None, messages: list[dict] | None = None,
               chat: bool = False) -> list[int]:
        """Prompt text, token ids or chat messages → prompt ids (chat template applied)."""
        if messages is None and chat:
            messages = [{"role": "user", "content": prompt}]
        if messages is not None:
            if not messages:
                raise RequestError("messages", "must not be empty")
            text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            return self.tokenizer.encode(text, add_special_tokens=False)
        if isinstance(prompt, list):
            return list(prompt)
        if not isinstance(prompt, str):
            raise RequestError("prompt", "must be a string, a list of token ids, or use messages")
        return self.tokenizer.encode(prompt)

    def add_request(self, prompt: str | list[int] | None = None, params: SamplingParams = SamplingParams(),
                    request_id: str | None = None, messages: list[dict] | None = None,
                    chat: bool = False) -> str:
        ids = self.encode(prompt, messages, chat)
        self._validate(ids, params)
        request_id = request_id or uuid.uuid4().hex
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        self.scheduler.add(request_id, ids, params, seed, self._num_spec_tokens(params))
        self.requests[request_id] = _Request(
            request_id, IncrementalDetokenizer(self.tokenizer, ids, params.stop),
            RequestStats(num_prompt_tokens=len(ids), arrival=time.perf_counter()))
        return request_id

    def _num_spec_tokens(self, params: SamplingParams) -> int:
        if self.config.spec.method == "none" or not params.spec:
            return 0
        k = params.num_spec_tokens
        return self.config.spec.num_spec_tokens if k is None else k

    def _validate(self, ids: list[int], params: SamplingParams) -> None:
        params.validate()
        if not ids:
            raise RequestError("prompt", "is empty")
        vocab = self.model.cfg.vocab_size
        if any(not 0 <= t < vocab for t in ids):
            raise RequestError("prompt", f"token ids must be in [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise RequestError("prompt", f"{len(ids)} tokens does not fit the context of "
                                         f"{self.max_model_len} tokens (room is needed to generate)")
        pages = self.allocator.pages_for(len(ids) + 1)
        if pages > self.allocator.num_pages:
            raise RequestError("prompt", f"{len(ids)} tokens needs {pages} KV pages; the cache has "
                                         f"{self.allocator.num_pages}")

    def abort(self, request_id: str) -> None:
        if self.scheduler.abort(request_id) is not None:
            self._finish(self.requests[request_id], "abort")

    # -- stepping --------------------------------------------------------------------------

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def step(self) -> list[Delta]:
        """Schedule → run → postprocess one batch; returns the deltas it produced."""
        # 1. schedule (runs while the device finishes the previous step's drafter catch-up)
        plan = self.scheduler.schedule()
        if plan is None:
            return []
        # 2. run: queue the step, wait for its produced ids (the one sync), queue the catch-up
        output = self.executor.execute(plan)
        # 3. postprocess
        return self._postprocess(plan, self.scheduler.update(plan, output))

    def _postprocess(self, plan: BatchPlan, updates: list[SeqUpdate]) -> list[Delta]:
        now = time.perf_counter()
        deltas = []
        for up in updates:
            req = self.requests[up.request_id]
            st = req.stats
            if up.new_token_ids:
                st.first_token = st.first_token or now
                st.token_times.append(now)
                st.num_steps += 1
                st.num_output_tokens += len(up.new_token_ids)
                if up.num_drafts:
                    st.record_drafts(up.num_drafts, up.num_accepted)
            req.output_ids += up.new_token_ids
            text = req.detok.add(up.new_token_ids)
            finish = up.finish_reason
            if req.detok.stopped and finish is None:
                self.scheduler.abort(up.request_id, "stop")
                finish = "stop"
            if finish:
                text += req.detok.flush()
            delta = self._emit(req, text, up.new_token_ids, finish)
            deltas.append(delta)
        return deltas

    def _emit(self, req: _Request, text: str, ids: list[int], finish: str | None) -> Delta:
        req.text += text
        delta = Delta(req.request_id, text, ids, finish)
        req.pending.append(delta)
        if finish:
            self._finish(req, finish)
        return delta

    def _finish(self, req: _Request, reason: str) -> None:
        req.finish_reason = reason
        req.stats.finished = time.perf_counter()

    # -- convenience -----------------------------------------------------------------------

    def stream(self, prompt: str | list[int] | None = None, params: SamplingParams = SamplingParams(),
               **kw) -> Iterator[Delta]:
        """Yield one request's deltas as they are produced (other requests keep running)."""
        request_id = self.add_request(prompt, params, **kw)
        req = self.requests[request_id]
        while True:
            while req.pending:
                delta = req.pending.pop(0)
                yield delta
                if delta.finish_reason:
                    self.requests.pop(request_id, None)
                    return
            self.step()

    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams] = SamplingParams(),
                 chat: bool = False) -> list[Result]:
        """Run a batch of prompts to completion (continuous batching) and return the results."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp, chat=chat) for p, sp in zip(prompts, params_list)]
        while any(self.requests[i].finish_reason is None for i in ids):
            self.step()
        return [self.pop_result(i) for i in ids]

    def pop_result(self, request_id: str) -> Result:
        req = self.requests.pop(request_id)
        return Result(request_id, req.text, req.output_ids, req.finish_reason or "abort",
                      req.stats.as_dict())

    def stats(self) -> dict:
        return {**self.scheduler.stats(), "requests": len(self.requests), **self.executor.timing.as_dict()}

    def close(self) -> None:
        self.executor.close()


__all__ = ["Engine", "Delta", "Result", "SamplingParams", "RequestError"]
