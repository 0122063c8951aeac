"""The daemon: starts the tokenizer, scheduler and executor processes (and the websocket
bridge and the OpenAI-compatible HTTP server, if asked), waits until they are ready, serves
until SIGINT/SIGTERM, and shuts them down without leaving any behind.

    with Daemon(EngineConfig(), "tcp://127.0.0.1:*") as d:   # "*": any free port
        print(d.endpoint)                                     # where clients connect

Startup: the model is converted (once, cached) and its limits read here, then the three
children are spawned with a `ServeSpec`; each binds its input socket and reports `Ready`
(or `FatalError`) on the daemon's control socket.

When a child dies while serving, the tokenizer is told first, so every in-flight request
gets an error at once instead of waiting for its timeout. Then, by `on_failure`:
  "exit"     stop everything and exit non-zero with the reason (a supervisor restarts us);
  "restart"  stop the remaining children and start a fresh set on the same client endpoint
             (clients' ZeroMQ sockets reconnect by themselves), up to `max_restarts` times.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import signal
import sys
import threading
import time

import zmq

from overlap.config import EngineConfig, ModelConfig
from overlap.models.loading import load_tokenizer, read_model_config, resolve_model_dir
from runtime import ipc
from runtime.executor_proc import run_executor_process
from runtime.frontend import RequestLimits, eos_token_ids
from runtime.messages import FatalError, Ready
from runtime.procs import ServeSpec
from runtime.scheduler_proc import run_scheduler_process
from runtime.tokenizer_proc import run_tokenizer_process

DEFAULT_ADDRESS = "tcp://127.0.0.1:5557"
ROLES = {"executor": run_executor_process, "scheduler": run_scheduler_process,
         "tokenizer": run_tokenizer_process}
log = logging.getLogger("overlap.daemon")


class DaemonError(RuntimeError):
    pass


class Daemon:
    def __init__(self, config: EngineConfig, address: str = DEFAULT_ADDRESS, ready_timeout_s: float = 900.0,
                 max_waiting: int = 1024, ws_listen: str | None = None, ws_token: str | None = None,
                 on_failure: str = "exit", max_restarts: int = 3, log_level: str = "INFO",
                 stats_interval_s: float = 10.0, http_listen: str | None = None, http_token: str | None = None):
        if on_failure not in ("exit", "restart"):
            raise ValueError(f"on_failure must be exit or restart, got {on_failure!r}")
        self.config = config
        self.address = address
        self.ready_timeout_s = ready_timeout_s
        self.max_waiting = max_waiting
        self.ws_listen = ws_listen
        self.ws_token = ws_token
        self.http_listen = http_listen  # HOST:PORT of the OpenAI-compatible HTTP server (runtime/http_server.py)
        self.http_token = http_token
        self.on_failure = on_failure
        self.max_restarts = max_restarts
        self.log_level = log_level.upper()
        self.stats_interval_s = stats_interval_s
        self.restarts = 0
        self.endpoint: str | None = None  # the client endpoint as bound
        self.ws_endpoint: str | None = None
        self.http_endpoint: str | None = None
        self.procs: dict[str, mp.Process] = {}
        self._bridge: mp.Process | None = None
        self._http: mp.Process | None = None
        self._spawn = mp.get_context("spawn")  # not fork: a forked torch/zmq process is unsafe
        self._ctx = zmq.Context()
        self._root: str | None = None
        self._control: zmq.Socket | None = None
        self._stop = threading.Event()

    # -- lifecycle -------------------------------------------------------------------------

    def listen_addresses(self) -> dict[str, str]:
        """Every address this server listens on, by the flag that sets it."""
        return {"--zmq": self.address, **({"--ws": self.ws_listen} if self.ws_listen else {}),
                **({"--http": self.http_listen} if self.http_listen else {})}

    def start(self) -> "Daemon":
        # 0. every listen address, before anything loads: a busy port fails in milliseconds
        ipc.check_listen(self.listen_addresses())
        # 1. model and limits, before any process starts (conversion is cached)
        model_dir = str(resolve_model_dir(self.config.model, progress=sys.stderr.isatty()))
        model_cfg = ModelConfig.from_hf(read_model_config(model_dir))
        tokenizer = load_tokenizer(model_dir)
        self._spec_args = (self.config, model_dir, self.config.model or "SmolLM2-135M-Instruct (shipped)",
                           eos_token_ids(model_cfg, tokenizer), RequestLimits.of(self.config, model_cfg))
        try:
            # 2. the three children, until each said it is ready
            self._start_children(self.address)
            # 3. the websocket bridge, a client of the endpoint just bound
            if self.ws_listen:
                self._start_bridge()
            # 4. the HTTP server, likewise
            if self.http_listen:
                self._start_http()
        except BaseException:
            self.stop()
            raise
        return self

    def _start_children(self, address: str) -> None:
        addresses, self._root = ipc.Addresses.private(address)
        self._addresses = addresses
        self._control = ipc.pull(self._ctx, addresses.daemon)
        spec = ServeSpec(*self._spec_args, addresses, self.max_waiting, self.log_level, self.stats_interval_s)
        self.procs = {}
        for role, entry in ROLES.items():
            proc = self._spawn.Process(target=entry, args=(spec,), name=f"overlap-{role}")
            proc.start()
            self.procs[role] = proc
        self._wait_ready(set(ROLES))

    def _start_bridge(self) -> None:
        from runtime.ws_bridge import run_bridge_process

        self._bridge = self._spawn.Process(target=run_bridge_process, name="overlap-bridge",
                                           args=(self.endpoint, self.ws_listen, self.ws_token,
                                                 self._addresses.daemon, self.log_level))
        self._bridge.start()
        self.procs["bridge"] = self._bridge
        self._wait_ready({"bridge"})

    def _start_http(self) -> None:
        from runtime.http_server import run_http_process

        self._http = self._spawn.Process(target=run_http_process, name="overlap-http",
                                         args=(self.endpoint, self.http_listen, self.http_token,
                                               self._addresses.daemon, self.log_level))
        self._http.start()
        self.procs["http"] = self._http
        self._wait_ready({"http"})

    def _wait_ready(self, roles: set[str]) -> None:
        ready: set[str] = set()
        deadline = time.monotonic() + self.ready_timeout_s
        while ready != roles:
            if time.monotonic() > deadline:
                raise DaemonError(f"processes not ready after {self.ready_timeout_s:.0f} s: {sorted(roles - ready)}")
            if self._stop.is_set():
                raise DaemonError("interrupted while starting")
            msg = self._poll_control(0.2)
            if isinstance(msg, FatalError):
                raise DaemonError(msg.message)
            if isinstance(msg, Ready):
                ready.add(msg.role)
                if msg.role == "tokenizer":
                    self.endpoint = msg.endpoint
                if msg.role == "bridge":
                    self.ws_endpoint = msg.endpoint
                if msg.role == "http":
                    self.http_endpoint = msg.endpoint
                log.info("%s ready (pid %d)", msg.role, msg.pid)
            dead = self._dead_child()
            if dead:
                raise DaemonError(f"{dead} process exited during startup "
                                  f"(exit code {self.procs[dead].exitcode}); see its log above")

    def _poll_control(self, timeout_s: float):
        if not self._control.poll(int(timeout_s * 1000)):
            return None
        try:
            return ipc.decode_to_daemon(self._control.recv())
        except ipc.BadMessage as e:
            log.warning("dropped a malformed control message: %s", e)
            return None

    def _dead_child(self) -> str | None:
        return next((role for role, p in self.procs.items() if not p.is_alive()), None)

    def wait(self) -> int:
        """Serve until `request_stop()` (0), or until a child fails and cannot be restarted (1)."""
        while not self._stop.is_set():
            msg = self._poll_control(0.5)
            reason = msg.message if isinstance(msg, FatalError) else None
            dead = self._dead_child()
            if dead and reason is None:
                reason = f"{dead} process died (exit code {self.procs[dead].exitcode})"
            if reason is None:
                continue
            log.error("%s", reason)
            self._tell_tokenizer(reason)
            if self.on_failure != "restart" or self.restarts >= self.max_restarts:
                log.error("shutting down%s", "" if self.on_failure != "restart" else
                          f" after {self.restarts} restarts")
                return 1
            self.restarts += 1
            log.warning("restarting the server processes (%d/%d)", self.restarts, self.max_restarts)
            self._stop_children(keep_bridge=True)  # and the HTTP server: both are clients
            try:
                self._start_children(self.endpoint)  # same endpoint: clients reconnect
            except DaemonError as e:
                log.error("restart failed: %s", e)
                return 1
            if self._bridge is not None:
                self.procs["bridge"] = self._bridge
            if self._http is not None:
                self.procs["http"] = self._http
        return 0

    def _tell_tokenizer(self, reason: str) -> None:
        """In-flight requests get an error now rather than waiting for their timeout."""
        tokenizer = self.procs.get("tokenizer")
        if tokenizer is not None and tokenizer.is_alive():
            sock = ipc.push(self._ctx, self._addresses.tokenizer)
            sock.send(ipc.encode(FatalError("daemon", f"server failure: {reason}")))
            sock.close(linger=2000)
            time.sleep(0.2)  # let the tokenizer send the errors before it is stopped

    def request_stop(self) -> None:
        self._stop.set()

    def _stop_children(self, keep_bridge: bool = False, timeout_s: float = 10.0) -> None:
        """SIGTERM the children, then SIGKILL what is still there; remove their sockets."""
        procs = {r: p for r, p in self.procs.items() if not (keep_bridge and r in ("bridge", "http"))}
        for proc in procs.values():
            if proc.is_alive():
                proc.terminate()
        deadline = time.monotonic() + timeout_s
        for role, proc in procs.items():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                log.warning("%s did not stop in %.0f s: killing it", role, timeout_s)
                proc.kill()
                proc.join()
        if self._control is not None:
            self._control.close(linger=0)
            self._control = None
        if self._root:
            ipc.remove_private(self._root)
            self._root = None

    def stop(self) -> None:
        self._stop_children()
        self._ctx.destroy(linger=0)

    def __enter__(self) -> "Daemon":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def serve(config: EngineConfig, address: str = DEFAULT_ADDRESS, **daemon_options) -> int:
    """`overlap serve`: run until SIGINT/SIGTERM; the exit code says whether a child failed.

    A listen address that is taken raises `ipc.AddressInUse` before anything is logged or
    loaded; a child that fails to start raises `DaemonError`."""
    daemon = Daemon(config, address, **daemon_options)
    ipc.check_listen(daemon.listen_addresses())
    logging.basicConfig(level=daemon.log_level, format="%(asctime)s daemon %(levelname)s %(message)s",
                        stream=sys.stderr)
    if "127.0.0.1" not in address and "localhost" not in address and not address.startswith("ipc://"):
        log.warning("listening on %s: beyond loopback, anyone who can reach it can use the server", address)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: daemon.request_stop())
    try:
        daemon.start()
        log.info("serving %s (spec: %s) on %s%s%s", config.model or "the shipped model", config.spec.method,
                 daemon.endpoint, f" and {daemon.ws_endpoint}" if daemon.ws_endpoint else "",
                 f" and {daemon.http_endpoint}" if daemon.http_endpoint else "")
        code = daemon.wait()
    finally:
        log.info("shutting down")
        daemon.stop()
    return code
