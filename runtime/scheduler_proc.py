"""The scheduler process: the scheduler core (runtime/scheduler.py) between the tokenizer
process and the executor process. At most one step is in flight; its loop:

  1. take every message that has arrived (new requests, aborts, stats queries, the
     in-flight step's result); block only when there is nothing to schedule;
  2. with no step in flight, plan the next batch and send it to the executor at once;
  3. then send the produced tokens of the finished step to the tokenizer.
Step 2 comes before 3 so the executor gets plan N+1 as early as possible: it is prepared
while the device still runs step N's drafter catch-up.

While busy it logs a throughput line every `stats_interval_s` (logger "overlap.stats", INFO),
as serving engines do: prompt and generation tokens/s, running and waiting requests, KV use.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import zmq

from runtime import ipc
from runtime.messages import (AbortRequest, AddRequest, Execute, FatalError, RequestFailed,
                              SchedulerStats, StatsQuery, StepResult, TokenBatch, TokenUpdate,
                              unpack_ids)
from runtime.pages import PageAllocator
from runtime.prefix_cache import build_prefix_cache
from runtime.procs import ServeSpec, become_child, report_fatal, report_ready
from overlap.config import ModelConfig
from overlap.models.loading import read_model_config
from runtime.scheduler import Scheduler, spec_arguments
from runtime.step_costs import build_controller

stats_log = logging.getLogger("overlap.stats")


class ThroughputLog:
    """Counts tokens between lines and says, every `interval_s` while steps run, how fast
    they went. A window starts at the first step after an idle gap, so idle time does not
    dilute the rate."""

    def __init__(self, interval_s: float, clock=time.monotonic):
        self.interval_s = interval_s
        self.clock = clock
        self.window_start: float | None = None
        self.last_step = 0.0
        self.prompt_tokens = 0
        self.generated_tokens = 0

    def on_step(self, prompt_tokens: int, generated_tokens: int, scheduler_stats: dict) -> str | None:
        """Record one step; returns the line to log when the interval has passed."""
        if self.interval_s <= 0:
            return None
        now = self.clock()
        if self.window_start is None or now - self.last_step > self.interval_s:
            self.window_start, self.prompt_tokens, self.generated_tokens = now, 0, 0
        self.last_step = now
        self.prompt_tokens += prompt_tokens
        self.generated_tokens += generated_tokens
        elapsed = now - self.window_start
        if elapsed < self.interval_s:
            return None
        s = scheduler_stats
        used = s["total_pages"] - s["free_pages"]
        line = (f"throughput: prompt {self.prompt_tokens / elapsed:.1f} tok/s, generation "
                f"{self.generated_tokens / elapsed:.1f} tok/s; running {s['running']}, waiting {s['waiting']}; "
                f"KV cache {100 * used / s['total_pages']:.1f}% used ({used}/{s['total_pages']} pages); "
                f"preemptions {s['preemptions']}")
        self.window_start, self.prompt_tokens, self.generated_tokens = now, 0, 0
        return line


class SchedulerService:
    """The scheduler core behind its three sockets (no blocking calls: the shell owns those)."""

    def __init__(self, spec: ServeSpec, send_to_executor, send_to_tokenizer):
        config = spec.config
        self.allocator = PageAllocator(config.cache.num_pages, config.cache.page_size)
        sched_cfg = dataclasses.replace(config.scheduler, max_model_len=spec.limits.max_model_len)
        # No model in this process: the controller's curve comes from spec.step_costs or the
        # cache an in-process engine or `overlap bench` calibrated, else the documented
        # default; the step times it observes correct it online.
        model_cfg = ModelConfig.from_hf(read_model_config(spec.model_dir)) if config.spec.method != "none" else None
        controller = build_controller(config, model_cfg=model_cfg)
        self.scheduler = Scheduler(sched_cfg, self.allocator, spec.eos_token_ids, controller,
                                   **spec_arguments(config.spec),
                                   prefix_cache=build_prefix_cache(config, self.allocator))
        self.max_waiting = spec.max_waiting
        self.send_to_executor = send_to_executor
        self.send_to_tokenizer = send_to_tokenizer
        self.in_flight = None  # the BatchPlan the executor is running
        self.timing: dict = {}  # the executor's cumulative timing, from the last StepResult
        self.updates: list[TokenUpdate] = []  # produced tokens not yet sent to the tokenizer
        self.steps = 0
        self.started = time.monotonic()
        self.throughput = ThroughputLog(spec.stats_interval_s)

    @property
    def can_schedule(self) -> bool:
        return self.in_flight is None and self.scheduler.has_work()

    def handle(self, msg) -> None:
        if isinstance(msg, StepResult):
            plan, self.in_flight = self.in_flight, None
            self.timing = msg.timing
            self.steps += 1
            generated = 0
            for up in self.scheduler.update(plan, msg.output):
                generated += len(up.new_token_ids)
                self.updates.append(TokenUpdate(up.request_id, up.new_token_ids, up.finish_reason,
                                                up.num_drafts, up.num_accepted,
                                                -1 if up.spec_k is None else up.spec_k))
            line = self.throughput.on_step(self._prompt_tokens(plan), generated, self.scheduler.stats())
            if line:
                stats_log.info("%s", line)
        elif isinstance(msg, AddRequest):
            self._add(msg)
        elif isinstance(msg, AbortRequest):
            self.scheduler.abort(msg.request_id)
        elif isinstance(msg, StatsQuery):
            self.send_to_tokenizer.send(ipc.encode(SchedulerStats(msg.query_id, self.stats())))
        elif isinstance(msg, FatalError):
            raise RuntimeError(msg.message)  # the executor is gone: so is serving

    @staticmethod
    def _prompt_tokens(plan) -> int:
        """Prompt (prefill) tokens the step computed: every chunk that is not a decode."""
        return sum(len(seq.token_ids) for seq in plan.seqs if not seq.is_decode)

    def _add(self, msg: AddRequest) -> None:
        if len(self.scheduler.waiting) >= self.max_waiting:
            self._refuse(msg.request_id, f"server overloaded: {self.max_waiting} requests already waiting",
                         "overloaded")
            return
        try:
            self.scheduler.add(msg.request_id, unpack_ids(msg.prompt_ids), msg.params, msg.seed,
                               msg.num_spec_tokens)
        except ValueError as e:
            self._refuse(msg.request_id, str(e), "bad_request")

    def _refuse(self, request_id: str, message: str, code: str) -> None:
        self.send_to_tokenizer.send(ipc.encode(RequestFailed(request_id, message, code)))

    def schedule(self) -> None:
        plan = self.scheduler.schedule()
        if plan is not None:
            self.in_flight = plan
            self.send_to_executor.send(ipc.encode(Execute(plan)))

    def flush_updates(self) -> None:
        if self.updates:
            self.send_to_tokenizer.send(ipc.encode(TokenBatch(self.updates)))
            self.updates = []

    def stats(self) -> dict:
        return {**self.scheduler.stats(), "steps": self.steps, **self.timing}


def run_scheduler_process(spec: ServeSpec) -> None:
    log = become_child("scheduler", spec.log_level)
    ctx = zmq.Context()
    addresses = spec.addresses
    try:
        recv = ipc.pull(ctx, addresses.scheduler)  # from the tokenizer and the executor
        service = SchedulerService(spec, ipc.push(ctx, addresses.executor), ipc.push(ctx, addresses.tokenizer))
        report_ready(ctx, addresses.daemon, "scheduler")
        serve(service, recv, log)
    except SystemExit:
        pass
    except BaseException as e:  # noqa: BLE001
        report_fatal(ctx, [addresses.daemon, addresses.tokenizer], "scheduler", e, log)
        raise SystemExit(1) from None
    finally:
        ctx.destroy(linger=0)


def serve(service: SchedulerService, recv: zmq.Socket, log) -> None:
    poller = zmq.Poller()
    poller.register(recv, zmq.POLLIN)
    while True:
        # 1. everything that has arrived; wait only if there is nothing to plan
        timeout = 0 if service.can_schedule else None
        while poller.poll(timeout):
            try:
                service.handle(ipc.decode_to_scheduler(recv.recv()))
            except ipc.BadMessage as e:
                log.warning("dropped a malformed message: %s", e)
            timeout = 0
        # 2. plan and send the next step
        if service.can_schedule:
            service.schedule()
        # 3. produced tokens to the tokenizer
        service.flush_updates()
