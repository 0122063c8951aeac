"""What every process shell does the same way: name itself, die with its parent, leave
Ctrl-C to the daemon, and report a fatal error upstream instead of hanging."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass

import zmq

from overlap.config import EngineConfig

from runtime import ipc
from runtime.frontend import RequestLimits
from runtime.messages import FatalError, Ready

PR_SET_PDEATHSIG = 1


def become_child(role: str, log_level: str = "INFO") -> logging.Logger:
    """Call first thing in a child process's entry point."""
    import setproctitle

    setproctitle.setproctitle(f"overlap::{role}")
    parent = os.getppid()
    # Linux delivers SIGTERM to us when the daemon dies, even by SIGKILL: no orphans.
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except (AttributeError, OSError):
        _watch_parent(parent)  # not Linux: poll instead
    if os.getppid() != parent:  # the parent died before prctl took effect
        os._exit(1)
    # Ctrl-C reaches the whole process group; the daemon alone decides how to shut down.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_once)
    logging.basicConfig(level=log_level, format=f"%(asctime)s {role} %(levelname)s %(message)s",
                        stream=sys.stderr)
    return logging.getLogger(f"overlap.{role}")


def _exit_once(*_) -> None:
    # Unwind (closing sockets in `finally` blocks) on the first SIGTERM; a second one while
    # unwinding must not interrupt the cleanup with another SystemExit.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(0)


def _watch_parent(parent: int) -> None:
    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def report_ready(ctx: zmq.Context, daemon_address: str, role: str, endpoint: str = "") -> None:
    sock = ipc.push(ctx, daemon_address)
    sock.send(ipc.encode(Ready(role, os.getpid(), endpoint)))
    sock.close()


def report_fatal(ctx: zmq.Context, addresses: list[str], role: str, error: BaseException,
                 log: logging.Logger) -> None:
    """Tell the daemon (and whoever holds in-flight requests) why this process is ending."""
    log.error("fatal: %s\n%s", error, "".join(traceback.format_exception(error)))
    msg = ipc.encode(FatalError(role, f"{role} process failed: {error!r}"))
    for address in addresses:
        sock = ipc.push(ctx, address)
        sock.send(msg)
        sock.close(linger=1000)


def run_listening_child(role: str, listen: str, parse, serve, endpoint: str, daemon_address: str | None,
                        log_level: str = "INFO") -> None:
    """A listening child of the daemon (the websocket bridge, the HTTP server), run to its end.

    parse(listen) → (host, port); serve(host, port, ready) is the server coroutine, which
    resolves `ready` with the bound port once it listens. The daemon then hears Ready with
    endpoint.format(host=..., port=...), or a FatalError with what stopped the server (a bad
    address, a port taken, a crash), and this process exits 1.
    """
    import asyncio

    import uvloop

    log_ = become_child(role, log_level)
    ctx = zmq.Context()

    async def main() -> None:
        host, port = parse(listen)
        ready = asyncio.get_running_loop().create_future()
        serving = asyncio.create_task(serve(host, port, ready))
        done, _ = await asyncio.wait([serving, ready], return_when=asyncio.FIRST_COMPLETED)
        if serving in done:
            serving.result()  # failed to start: raise why
        if daemon_address:
            report_ready(ctx, daemon_address, role, endpoint.format(host=host, port=ready.result()))
        await serving

    try:
        uvloop.run(main())
    except SystemExit:
        pass
    except BaseException as e:  # noqa: BLE001
        if daemon_address:
            report_fatal(ctx, [daemon_address], role, e, log_)
        raise SystemExit(1) from None
    finally:
        ctx.destroy(linger=0)


@dataclass(frozen=True)
class ServeSpec:
    """What the daemon hands each child process (pickled by multiprocessing at spawn)."""

    config: EngineConfig
    model_dir: str  # the converted HF-style directory (conversion is done once, by the daemon)
    model_name: str
    eos_token_ids: tuple[int, ...]
    limits: RequestLimits  # what a request may ask for (validated by the tokenizer process)
    addresses: ipc.Addresses
    max_waiting: int = 1024  # admission queue bound (the scheduler refuses beyond it)
    log_level: str = "INFO"  # the access lines and the periodic throughput line are INFO
    stats_interval_s: float = 10.0  # the scheduler's throughput / KV-usage line while busy (0: off)
