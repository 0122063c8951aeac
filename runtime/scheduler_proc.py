"""The scheduler process: the scheduler core (runtime/scheduler.py) between the tokenizer
process and the executor process. At most one step is in flight; its loop:

  1. take every message that has arrived (new requests, aborts, stats queries, the
     in-flight step's result); block only when there is nothing to schedule;
  2. with no step in flight, plan the next batch and send it to the executor at once;
  3. then send the produced tokens of the finished step to the tokenizer.
Step 2 comes before 3 so the executor gets plan N+1 as early as possible: it is prepared
while the device still runs step N's drafter catch-up.
"""

from __future__ import annotations

import dataclasses
import time

import zmq

from runtime import ipc
from runtime.messages import (AbortRequest, AddRequest, Execute, FatalError, RequestFailed,
                              SchedulerStats, StatsQuery, StepResult, TokenBatch, TokenUpdate,
                              unpack_ids)
from runtime.pages import PageAllocator
from runtime.procs import ServeSpec, become_child, report_fatal, report_ready
from runtime.scheduler import Scheduler


class SchedulerService:
    """The scheduler core behind its three sockets (no blocking calls: the shell owns those)."""

    def __init__(self, spec: ServeSpec, send_to_executor, send_to_tokenizer):
        config = spec.config
        self.allocator = PageAllocator(config.cache.num_pages, config.cache.page_size)
        sched_cfg = dataclasses.replace(config.scheduler, max_model_len=spec.limits.max_model_len)
        self.scheduler = Scheduler(sched_cfg, self.allocator, spec.eos_token_ids)
        self.max_waiting = spec.max_waiting
        self.send_to_executor = send_to_executor
        self.send_to_tokenizer = send_to_tokenizer
        self.in_flight = None  # the BatchPlan the executor is running
        self.timing: dict = {}  # the executor's cumulative timing, from the last StepResult
        self.updates: list[TokenUpdate] = []  # produced tokens not yet sent to the tokenizer
        self.steps = 0
        self.started = time.monotonic()

    @property
    def can_schedule(self) -> bool:
        return self.in_flight is None and self.scheduler.has_work()

    def handle(self, msg) -> None:
        if isinstance(msg, StepResult):
            plan, self.in_flight = self.in_flight, None
            self.timing = msg.timing
            self.steps += 1
            for up in self.scheduler.update(plan, msg.output):
                self.updates.append(TokenUpdate(up.request_id, up.new_token_ids, up.finish_reason,
                                                up.num_drafts, up.num_accepted))
        elif isinstance(msg, AddRequest):
            self._add(msg)
        elif isinstance(msg, AbortRequest):
            self.scheduler.abort(msg.request_id)
        elif isinstance(msg, StatsQuery):
            self.send_to_tokenizer.send(ipc.encode(SchedulerStats(msg.query_id, self.stats())))
        elif isinstance(msg, FatalError):
            raise RuntimeError(msg.message)  # the executor is gone: so is serving

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
    log = become_child("scheduler")
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
