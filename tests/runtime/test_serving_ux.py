"""What a new user meets first, with real processes and sockets: a busy port, no server at
--server, an empty --token, whether the bridge has auth, --version, the generate summary, no
progress-bar walls in pipes, and the server's access and throughput log lines (and
--log-level silencing them). Tiny random models keep the servers fast."""

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from importlib.metadata import version
from pathlib import Path

import pytest
import zmq

from overlap.config import EngineConfig
from runtime import cli, ipc
from runtime.client import Client, ClientTimeout
from runtime.daemon import Daemon
from runtime.scheduler_proc import ThroughputLog
from runtime.tokenizer_proc import access_line
from runtime.ws_bridge import TOKEN_ENV, resolve_token

REPO = Path(__file__).resolve().parents[2]


def overlap(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`overlap ARGS` in a fresh process, stdout and stderr pipes (not a terminal)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run([sys.executable, "-m", "runtime", *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def assert_one_line_error(r: subprocess.CompletedProcess, *needles: str) -> str:
    assert r.returncode != 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("overlap: error: "), lines[0]
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def busy_port():
    """A TCP port another program listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# -- a listen address in use: one line, before anything loads ---------------------------------

@pytest.mark.parametrize("where", ["zmq", "ws"])
def test_serve_on_a_busy_port_fails_at_once_naming_it(tiny_dirs, busy_port, where):
    flags = ["--zmq", f"tcp://127.0.0.1:{busy_port}"] if where == "zmq" else \
        ["--zmq", "tcp://127.0.0.1:*", "--ws", str(busy_port)]
    start = time.monotonic()
    r = overlap("serve", "--model", str(tiny_dirs["target"]), *flags)
    elapsed = time.monotonic() - start
    # one line, naming the address and its flag; no process was started, no model loaded
    assert_one_line_error(r, f"127.0.0.1:{busy_port}", f"--{where}", "in use")
    assert r.returncode == 2 and elapsed < 30, elapsed


def test_daemon_checks_every_listen_address_before_loading(busy_port):
    # The library too: a model that does not exist is never looked at.
    daemon = Daemon(EngineConfig(model="/nonexistent/model"), "tcp://127.0.0.1:*", ws_listen=f"127.0.0.1:{busy_port}")
    with pytest.raises(ipc.AddressInUse, match=f"127.0.0.1:{busy_port}"):
        daemon.start()
    daemon.stop()


def test_check_listen_probes(tmp_path, busy_port):
    ipc.check_listen({"--zmq": "tcp://127.0.0.1:*", "--ws": "127.0.0.1:0", "--x": f"ipc://{tmp_path}/free"})
    ipc.check_listen({"--zmq": f"tcp://127.0.0.1:{free_port()}", "--http": f"127.0.0.1:{free_port()}"})
    for address in (f"tcp://127.0.0.1:{busy_port}", f"127.0.0.1:{busy_port}"):
        with pytest.raises(ipc.AddressInUse, match="--http"):
            ipc.check_listen({"--zmq": "tcp://127.0.0.1:*", "--http": address})
    # ZeroMQ would silently take over an ipc path another server listens on
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(f"ipc://{tmp_path}/taken")
    try:
        with pytest.raises(ipc.AddressInUse, match="taken"):
            ipc.check_listen({"--zmq": f"ipc://{tmp_path}/taken"})
    finally:
        ctx.destroy(linger=0)
    ipc.check_listen({"--zmq": f"ipc://{tmp_path}/taken"})  # a stale file is fine


# -- --server with nothing there --------------------------------------------------------------

@pytest.mark.parametrize("listener", ["nothing", "not overlap"])
def test_generate_without_a_server_fails_within_seconds(capsys, listener):
    # The default --timeout (300 s) is for generation; the probe before it is short.
    port = free_port()
    ctx = zmq.Context()
    if listener == "not overlap":  # something accepts the connection but never answers
        ctx.socket(zmq.ROUTER).bind(f"tcp://127.0.0.1:{port}")
    try:
        start = time.monotonic()
        assert cli.main(["generate", "hi", "--server", f"tcp://127.0.0.1:{port}"]) == 2
        elapsed = time.monotonic() - start
    finally:
        ctx.destroy(linger=0)
    err = capsys.readouterr().err
    assert elapsed < cli.PROBE_TIMEOUT_S + 3, elapsed
    assert f"no overlap server answered at tcp://127.0.0.1:{port}" in err and "overlap serve" in err, err


def test_bad_server_address_is_one_line():
    assert_one_line_error(overlap("generate", "hi", "--server", "tcp://nowhere"), "--server tcp://nowhere")


# -- the bridge's token ----------------------------------------------------------------------

def test_an_empty_token_is_an_error(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert resolve_token(None) is None
    assert resolve_token("s") == "s"
    with pytest.raises(ValueError, match="--token is empty"):
        resolve_token("")
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    assert resolve_token(None) == "from-env"
    with pytest.raises(ValueError, match="--token is empty"):  # no longer overrides the variable
        resolve_token("")
    monkeypatch.setenv(TOKEN_ENV, "")
    with pytest.raises(ValueError, match=f"\\${TOKEN_ENV} is set but empty"):
        resolve_token(None)


def test_serve_with_an_empty_token_fails_before_loading(busy_port):
    # `--token "$SECRET"` with SECRET unset: refused, not "no auth"
    r = overlap("serve", "--model", "/nonexistent", "--ws", "0", "--token", "", env={TOKEN_ENV: "x"})
    assert_one_line_error(r, "--token is empty")
    assert_one_line_error(overlap("bridge", "--server", "tcp://127.0.0.1:9", "--token", ""), "--token is empty")
    assert_one_line_error(overlap("serve", "--model", "/nonexistent", "--token", "t"), "give --ws")


def _bridge_startup(token: str | None) -> list[str]:
    """Start `overlap bridge` (no daemon needed to start), return its log up to the auth line."""
    env = {k: v for k, v in os.environ.items() if k != TOKEN_ENV}
    env.update({"PYTHONPATH": str(REPO), **({TOKEN_ENV: token} if token else {})})
    proc = subprocess.Popen([sys.executable, "-m", "runtime", "bridge", "--server", "tcp://127.0.0.1:9",
                             "--listen", "127.0.0.1:0"], cwd=REPO, stderr=subprocess.PIPE, text=True, env=env)
    lines = []
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any("auth:" in line for line in lines):
            line = proc.stderr.readline()
            if not line:
                break
            lines.append(line)
    finally:
        proc.terminate()
        proc.wait(30)
        proc.stderr.close()
    return lines


def test_bridge_says_at_startup_whether_auth_is_on():
    on = _bridge_startup("s3cret")
    assert any("auth: on" in line for line in on), on
    assert not any("s3cret" in line for line in on), on  # never log the secret
    off = _bridge_startup(None)
    assert any("auth: off" in line for line in off), off


# -- --version ---------------------------------------------------------------------------------

def test_version(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"overlap {version('overlap')}"
    r = overlap("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"overlap {version('overlap')}"


# -- generate's summary, progress bars, the server's log lines -------------------------------

def test_generate_summary_names_the_mode_and_acceptance_length(tiny_dirs, capsys):
    args = ["generate", "def f(x):", "--model", str(tiny_dirs["target"]), "--max-tokens", "16"]
    assert cli.main([*args, "--spec", "draft", "--draft-model", str(tiny_dirs["draft"]),
                     "--num-spec-tokens", "3"]) == 0
    summary = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.search(r"spec draft, acceptance length \d\.\d\d, finish: ", summary), summary
    assert cli.main([*args, "--spec", "none"]) == 0
    summary = capsys.readouterr().err.strip().splitlines()[-1]
    assert "spec none, finish: " in summary and "acceptance" not in summary, summary


def test_no_progress_bars_when_stderr_is_not_a_terminal(tiny_dirs, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("def f(x):", "Hello", "1, 2, 3")))
    r = overlap("bench", "--model", str(tiny_dirs["target"]), "--prompts", str(prompts), "--max-tokens", "4",
                "--spec", "none", "--concurrency", "1", "2")
    assert r.returncode == 0, r.stderr
    assert "\r" not in r.stderr, r.stderr[-2000:]


class Server:
    """`overlap serve` as a subprocess on a free port, its stderr collected line by line."""

    def __init__(self, tiny_dirs, *extra: str):
        self.address = f"tcp://127.0.0.1:{free_port()}"
        cmd = [sys.executable, "-m", "runtime", "serve", "--model", str(tiny_dirs["target"]), "--zmq",
               self.address, "--num-pages", "64", "--spec", "draft", "--draft-model", str(tiny_dirs["draft"]),
               "--num-spec-tokens", "3", *extra]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=REPO,
                                     env={**os.environ, "PYTHONPATH": str(REPO)})
        self.lines: list[str] = []
        threading.Thread(target=self._drain, daemon=True).start()
        try:
            with Client(self.address, timeout=10) as c:
                deadline = time.monotonic() + 300
                while True:
                    assert self.proc.poll() is None, "".join(self.lines)
                    try:
                        c.health(timeout=1)
                        break
                    except ClientTimeout:
                        assert time.monotonic() < deadline, "".join(self.lines)
        except BaseException:
            self.stop()
            raise

    def _drain(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)

    def wait_for(self, pattern: str, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if re.search(pattern, line):
                    return line
            assert self.proc.poll() is None, "".join(self.lines)
            time.sleep(0.1)
        raise AssertionError(f"no line matching {pattern!r} in:\n{''.join(self.lines)}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


@pytest.mark.slow
def test_server_logs_each_request_and_its_throughput_and_log_level_silences_them(tiny_dirs):
    # A short interval: with the tiny model 64 tokens take ~0.2 s, and a line needs a full interval.
    server = Server(tiny_dirs, "--stats-interval", "0.02")
    try:
        r = overlap("generate", "def fibonacci(n):", "--server", server.address, "--max-tokens", "64")
        assert r.returncode == 0, r.stderr
        summary = r.stderr.strip().splitlines()[-1]
        assert re.search(r"spec draft, acceptance length \d\.\d\d, finish: length", summary), summary
        assert "\r" not in r.stderr
        access = server.wait_for(r"request \S+: \d+ prompt", 30)
        assert re.search(r"request \w+: \d+ prompt \+ 64 output tokens, TTFT \d+ ms, [\d.]+ tok/s, "
                         r"acceptance length \d\.\d\d, finish length", access), access
        stats = server.wait_for(r"throughput:", 30)
        assert re.search(r"generation [\d.]+ tok/s; running \d+, waiting \d+; KV cache [\d.]+% used", stats), stats
    finally:
        server.stop()
    quiet = Server(tiny_dirs, "--stats-interval", "0.2", "--log-level", "warning")
    try:
        assert overlap("generate", "def f(x):", "--server", quiet.address, "--max-tokens", "32").returncode == 0
        time.sleep(1)
        assert not any("output tokens" in line or "throughput:" in line for line in quiet.lines), quiet.lines
    finally:
        quiet.stop()


def test_access_line_and_throughput_log():
    line = access_line("a1", {"prompt_tokens": 3, "output_tokens": 21, "ttft_s": 0.05, "latency_s": 0.55,
                              "acceptance_length": 2.5}, "length")
    assert line == ("request a1: 3 prompt + 21 output tokens, TTFT 50 ms, 40.0 tok/s, acceptance length 2.50, "
                    "finish length, latency 0.55 s")
    aborted = access_line("a2", {"prompt_tokens": 3, "output_tokens": 0, "ttft_s": None, "latency_s": 0.1}, "abort")
    assert "TTFT -" in aborted and "acceptance length -" in aborted and "finish abort" in aborted
    now = [0.0]
    log = ThroughputLog(10.0, clock=lambda: now[0])
    sched = {"running": 2, "waiting": 1, "free_pages": 48, "total_pages": 64, "preemptions": 0}
    lines = []
    for t in range(0, 25):  # one step a second, 100 generated tokens each, a 16-token prompt at the start
        now[0] = float(t)
        lines.append(log.on_step(16 if t == 0 else 0, 100, sched))
    logged = [(t, line) for t, line in enumerate(lines) if line]
    assert [t for t, _ in logged] == [10, 20]
    assert "prompt 1.6 tok/s, generation 110.0 tok/s" in logged[0][1]  # steps 0..10 over 10 s
    assert "KV cache 25.0% used (16/64 pages)" in logged[0][1]
    now[0] = 1000.0  # after an idle gap a new window starts: idle time does not dilute the rate
    assert log.on_step(0, 100, sched) is None
    now[0] = 1010.0
    assert "generation 20.0 tok/s" in log.on_step(0, 100, sched)
    assert ThroughputLog(0).on_step(0, 100, sched) is None  # 0: off
