"""The executor process ("GPU process"): models, KV pools, sampler and drafter, running the
BatchPlans the scheduler sends. Its loop is the pipelined step:

  1. receive plan N (the scheduler made it while the device ran step N-1's catch-up);
  2. prepare it on the host and queue its device work (Executor.submit);
  3. wait for its produced ids (the step's EventFuture: the one sync) and send them to the
     scheduler at once, so planning N+1 starts now;
  4. queue the drafter's catch-up for N (Executor.finish) without waiting for it.
"""

from __future__ import annotations

import zmq

from overlap.config import torch_dtype
from overlap.executor import build_executor
from overlap.models.llama import load_llama
from runtime import ipc
from runtime.messages import Execute, Shutdown, StepResult
from runtime.procs import ServeSpec, become_child, report_fatal, report_ready

# A step that has not produced its ids after this long means a hung device: fail loudly.
STEP_TIMEOUT_S = 600.0


def run_executor_process(spec: ServeSpec) -> None:
    log = become_child("executor", spec.log_level)
    ctx = zmq.Context()
    addresses = spec.addresses
    executor = None
    try:
        recv_from_scheduler = ipc.pull(ctx, addresses.executor)
        send_to_scheduler = ipc.push(ctx, addresses.scheduler)
        config = spec.config
        if config.tensor_parallel > 1:
            # This process becomes rank 0 of a group; ranks 1.. are its children.
            import tempfile

            from overlap.tp_group import start_group

            rendezvous = tempfile.TemporaryDirectory(prefix="overlap-tp-")
            executor, _ = start_group(config, spec.model_dir, rendezvous.name)
        else:
            model = load_llama(spec.model_dir, torch_dtype(config.dtype), config.device, config.matmul)
            executor = build_executor(config, model)
        report_ready(ctx, addresses.daemon, "executor")
        serve(executor, recv_from_scheduler, send_to_scheduler, log)
    except SystemExit:
        pass
    except BaseException as e:  # noqa: BLE001 - whatever it was, the daemon must hear of it
        report_fatal(ctx, [addresses.daemon, addresses.scheduler], "executor", e, log)
        raise SystemExit(1) from None
    finally:
        if executor is not None:
            executor.close()
        ctx.destroy(linger=0)


def serve(executor, recv_from_scheduler: zmq.Socket, send_to_scheduler: zmq.Socket, log) -> None:
    while True:
        # 1. the next plan
        try:
            msg = ipc.decode_to_executor(recv_from_scheduler.recv())
        except ipc.BadMessage as e:
            log.warning("dropped a malformed message from the scheduler: %s", e)
            continue
        if isinstance(msg, Shutdown):
            return
        assert isinstance(msg, Execute)
        # 2. prepare and queue the device work
        step = executor.submit(msg.plan)
        # 3. the one sync: produced ids on the host, straight to the scheduler
        output = step.output.result(timeout=STEP_TIMEOUT_S)
        send_to_scheduler.send(ipc.encode(StepResult(output, executor.timing.as_dict())))
        # 4. the drafter's catch-up runs on the device while the scheduler plans N+1
        executor.finish(step, output)
