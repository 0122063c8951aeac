"""The in-process engine: tokenizer, scheduler core and executor wired together without
sockets. The single-process form of the runtime, for library use and for tests.

    engine = Engine(EngineConfig())
    for delta in engine.stream("def fib(n):", SamplingParams(max_tokens=32)):
        print(delta.text, end="")
"""

from __future__ import annotations

import dataclasses
import random
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field

from overlap.batch import BatchPlan
from overlap.config import EngineConfig, torch_dtype
from overlap.executor import build_executor
from overlap.models.llama import LlamaModel, load_llama
from overlap.models.loading import load_tokenizer, resolve_model_dir
from runtime.frontend import RequestLimits, RequestState, encode_prompt, eos_token_ids, validate_request
from runtime.messages import RequestError, SamplingParams
from runtime.pages import PageAllocator
from runtime.prefix_cache import build_prefix_cache
from runtime.results import Result
from runtime.scheduler import Scheduler, SeqUpdate, spec_arguments
from runtime.step_costs import build_controller


@dataclass(frozen=True)
class Delta:
    """A piece of one request's stream: new text and ids; finish_reason on the last one."""

    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stats: dict | None = None  # usage, latency and speculation stats (last delta only)
    # How each token came (runtime/origins.py): per token id, 0 = the target's own token, d = a
    # draft accepted at depth d; and `text` as (characters, depth) runs, one per token.
    token_depths: list[int] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class _Request:
    state: RequestState
    pending: list[Delta] = field(default_factory=list)


class Engine:
    def __init__(self, config: EngineConfig = EngineConfig(), progress: bool = True, cost_model=None,
                 controller=None):
        """cost_model: the speculation controller's step-cost model (tests script one); None:
        spec.step_costs, the cached calibration, or one measured now (runtime/step_costs.py).
        controller: a whole controller in its place (tests force choices with one)."""
        self._cost_model, self._controller = cost_model, controller
        model_dir = resolve_model_dir(config.model, progress=progress)
        if config.tensor_parallel > 1:
            import tempfile

            from overlap.tp_group import start_group

            self._rendezvous = tempfile.TemporaryDirectory(prefix="overlap-tp-")
            executor, model = start_group(config, str(model_dir), self._rendezvous.name)
            self._setup(config, model, load_tokenizer(model_dir), executor)
            return
        model = load_llama(model_dir, torch_dtype(config.dtype), config.device, config.matmul)
        self._setup(config, model, load_tokenizer(model_dir))

    @classmethod
    def from_model(cls, config: EngineConfig, model: LlamaModel, tokenizer, cost_model=None) -> "Engine":
        """An engine around an already loaded target (tools that hold one reuse it)."""
        engine = cls.__new__(cls)
        engine._cost_model, engine._controller = cost_model, None
        engine._setup(config, model, tokenizer)
        return engine

    def _setup(self, config: EngineConfig, model: LlamaModel, tokenizer, executor=None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.model = model
        cfg = getattr(model, "full_cfg", model.cfg)  # a tensor-parallel shard's local config is smaller
        self.limits = RequestLimits.of(config, cfg)
        self.max_model_len = self.limits.max_model_len
        self.executor = executor or build_executor(config, self.model)
        self.allocator = PageAllocator(config.cache.num_pages, config.cache.page_size)
        sched_cfg = dataclasses.replace(config.scheduler, max_model_len=self.max_model_len)
        self.controller = self._controller or build_controller(config, model, self._cost_model)
        self.scheduler = Scheduler(sched_cfg, self.allocator, self._eos_ids(), self.controller,
                                   **spec_arguments(config.spec),
                                   prefix_cache=build_prefix_cache(config, self.allocator))
        self.requests: dict[str, _Request] = {}
        self._seeds = random.Random()

    def _eos_ids(self) -> tuple[int, ...]:
        return eos_token_ids(getattr(self.model, "full_cfg", self.model.cfg), self.tokenizer)

    # -- requests --------------------------------------------------------------------------

    def encode(self, prompt: str | list[int] | None = None, messages: list[dict] | None = None,
               chat: bool = False) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, messages, chat)

    def add_request(self, prompt: str | list[int] | None = None, params: SamplingParams = SamplingParams(),
                    request_id: str | None = None, messages: list[dict] | None = None,
                    chat: bool = False) -> str:
        ids = self.encode(prompt, messages, chat)
        validate_request(ids, params, self.limits)
        request_id = request_id or uuid.uuid4().hex
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        self.scheduler.add(request_id, ids, params, seed, self.limits.num_spec_tokens(params))
        self.requests[request_id] = _Request(RequestState(request_id, self.tokenizer, ids, params))
        return request_id

    def abort(self, request_id: str) -> None:
        if self.scheduler.abort(request_id) is not None:
            self.requests[request_id].state.finish("abort")

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
        deltas = []
        for up in updates:
            req = self.requests[up.request_id]
            got = req.state.on_tokens(up.new_token_ids, up.finish_reason, up.num_drafts, up.num_accepted,
                                      up.spec_k)
            if got.by_stop_string:
                self.scheduler.abort(up.request_id, "stop")
            delta = Delta(up.request_id, got.text, up.new_token_ids, got.finish_reason,
                          req.state.stats.as_dict() if got.finish_reason else None, got.token_depths, got.spans)
            req.pending.append(delta)
            deltas.append(delta)
        return deltas

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
        while any(self.requests[i].state.finish_reason is None for i in ids):
            self.step()
        return [self.pop_result(i) for i in ids]

    def pop_result(self, request_id: str) -> Result:
        st = self.requests.pop(request_id).state
        return Result(request_id, st.text, st.output_ids, st.finish_reason or "abort", st.stats.as_dict())

    def stats(self) -> dict:
        return {**self.scheduler.stats(), "requests": len(self.requests), **self.executor.timing.as_dict()}

    def close(self) -> None:
        self.executor.close()


__all__ = ["Engine", "Delta", "Result", "SamplingParams", "RequestError"]
