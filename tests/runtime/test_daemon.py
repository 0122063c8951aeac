"""The multi-process runtime end to end: a real daemon (three processes, real ZeroMQ sockets)
started by the test, clients in this process and in other processes.

Tiny random models (sharing SmolLM2's tokenizer) keep it fast; the daemon speculates with
the draft-target drafter, and requests with spec=False run the same server without it.
"""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import msgspec
import pytest
import zmq

from overlap.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from runtime import ipc
from runtime.client import Client, RequestRejected, ServerUnavailable
from runtime.daemon import Daemon
from runtime.engine import Engine
from runtime.messages import Generate, SamplingParams, pack_ids

REPO = Path(__file__).resolve().parents[2]
NUM_PAGES = 256


def tiny_config(tiny_dirs) -> EngineConfig:
    return EngineConfig(model=str(tiny_dirs["target"]),
                        spec=SpecConfig(controller="off", method="draft", num_spec_tokens=3, draft_model=str(tiny_dirs["draft"])),
                        cache=CacheConfig(page_size=16, num_pages=NUM_PAGES),
                        scheduler=SchedulerConfig(max_num_seqs=16, max_batched_tokens=256))


@pytest.fixture(scope="module")
def daemon(tiny_dirs):
    d = Daemon(tiny_config(tiny_dirs), "tcp://127.0.0.1:*", ready_timeout_s=300)
    d.start()
    yield d
    d.stop()
    assert not any(p.is_alive() for p in d.procs.values())


@pytest.fixture(scope="module")
def client(daemon):
    with Client(daemon.endpoint, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def reference(tiny_dirs):
    """The in-process engine without speculation: what every greedy request must produce."""
    config = tiny_config(tiny_dirs)
    eng = Engine(config.replace(spec=SpecConfig()), progress=False)
    yield eng
    eng.close()


def prompts(n: int) -> list[list[int]]:
    return [[(7919 * i + 31 * j) % 49000 + 10 for j in range(3 + i % 7)] for i in range(n)]


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def idle(client: Client) -> dict:
    stats = client.stats()
    return stats if stats["free_pages"] == stats["total_pages"] and stats["live_requests"] == 0 else None


# -- end to end ------------------------------------------------------------------------------

CLIENT_SCRIPT = textwrap.dedent("""
    import asyncio, json, sys
    from runtime.client import AsyncClient

    async def one(client, ids, spec):
        text, token_ids, deltas, last = "", [], 0, None
        async for d in client.stream(ids, max_tokens=24, ignore_eos=True, spec=spec):
            text += d.text
            token_ids += d.token_ids
            deltas += 1
            last = d
        return {"text": text, "token_ids": token_ids, "deltas": deltas,
                "finish_reason": last.finish_reason, "stats": last.stats}

    async def main():
        address, prompts = sys.argv[1], json.loads(sys.argv[2])
        async with AsyncClient(address, timeout=120) as client:
            # 16 concurrent streams over one connection, half of them without speculation.
            results = await asyncio.gather(*(one(client, p, i % 2 == 0) for i, p in enumerate(prompts)))
        print(json.dumps(results))

    asyncio.run(main())
""")


def test_sixteen_concurrent_streams_from_another_process_match_the_engine(daemon, reference):
    ps = prompts(16)
    out = subprocess.run([sys.executable, "-c", CLIENT_SCRIPT, daemon.endpoint, json.dumps(ps)],
                         capture_output=True, text=True, timeout=300, cwd=REPO)
    assert out.returncode == 0, out.stderr
    results = json.loads(out.stdout)
    expected = reference.generate(ps, SamplingParams(max_tokens=24, ignore_eos=True))
    for i, (got, want) in enumerate(zip(results, expected)):
        assert got["token_ids"] == want.token_ids, i
        assert got["text"] == want.text, i
        assert got["finish_reason"] == "length"
        assert got["deltas"] > 1  # streamed, not delivered at the end
        if i % 2 == 0:
            assert got["stats"]["drafts"] > 0 and "acceptance_length" in got["stats"]
        else:
            assert "drafts" not in got["stats"]


def test_sync_client_is_shared_by_threads(client, reference):
    ps = prompts(6)
    results = [None] * len(ps)

    def run(i):
        results[i] = client.generate(ps[i], max_tokens=12, ignore_eos=True)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(ps))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    expected = reference.generate(ps, SamplingParams(max_tokens=12, ignore_eos=True))
    assert [r.token_ids for r in results] == [e.token_ids for e in expected]


def test_text_prompt_and_chat_messages(client, reference):
    r = client.generate("The capital of France is", max_tokens=8, ignore_eos=True)
    assert r.token_ids == reference.generate(["The capital of France is"],
                                             SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    chat = client.generate(messages=[{"role": "user", "content": "Hi"}], max_tokens=4, ignore_eos=True)
    want = reference.generate(["Hi"], SamplingParams(max_tokens=4, ignore_eos=True), chat=True)[0]
    assert chat.token_ids == want.token_ids


def test_health_and_stats(client):
    h = client.health()
    assert h["ok"] and h["spec"] == "draft"
    s = client.stats()
    assert s["total_pages"] == NUM_PAGES and {"waiting", "running", "device_busy_s", "plan_s"} <= set(s)


# -- bad input -------------------------------------------------------------------------------

# One naming on the ZeroMQ protocol: the field's path in the `Generate` on the wire (a list
# prompt travels as prompt_token_ids; sampling parameters under params).
@pytest.mark.parametrize("kwargs,field", [
    (dict(prompt=""), "prompt"),
    (dict(prompt=[]), "prompt_token_ids"),
    (dict(prompt=[1, 2, 10**6]), "prompt_token_ids"),
    (dict(prompt="hi", max_tokens=0), "params.max_tokens"),
    (dict(prompt="hi", max_tokens=10**9), "params.max_tokens"),
    (dict(prompt="hi", temperature=-1.0), "params.temperature"),
    (dict(prompt="hi", top_p=0.0), "params.top_p"),
    (dict(prompt="hi", num_spec_tokens=99), "params.num_spec_tokens"),
    (dict(prompt="hi", stop_token_ids=[10**6]), "params.stop_token_ids"),
    (dict(prompt=list(range(10, 1100))), "prompt_token_ids"),  # longer than the context
    (dict(messages=[]), "messages"),
    (dict(messages=[{"role": "user", "content": "hi " * 1100}]), "messages"),  # longer than the context
])
def test_invalid_requests_are_refused_with_the_field(client, kwargs, field):
    prompt = kwargs.pop("prompt", None)
    with pytest.raises(RequestRejected) as e:
        client.generate(prompt, **kwargs)
    assert e.value.field == field and e.value.message.startswith(f"{field}: "), e.value.message


def test_unknown_sampling_parameter_is_refused_by_the_client(client):
    with pytest.raises(TypeError, match="colour"):
        client.generate("hi", colour="red")


def test_malformed_bytes_get_an_error_and_the_server_keeps_serving(daemon, client):
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(daemon.endpoint)
    garbage = [
        b"\xc1\xc1\xc1", b"hello", msgspec.msgpack.encode([1, 2]), msgspec.msgpack.encode({"type": "launch"}),
        msgspec.msgpack.encode({"type": "generate", "request_id": 3}),
        msgspec.msgpack.encode({"type": "generate", "request_id": "a", "params": {"temperature": "hot"}}),
        msgspec.msgpack.encode({"type": "generate", "request_id": "a", "params": {"speed": 9}}),
    ]
    for data in garbage:
        raw.send(data)
        assert raw.poll(10_000), data
        reply = ipc.decode_client_reply(raw.recv())
        assert reply.request_id == "" and "malformed request" in reply.message
    # several frames in one message
    raw.send_multipart([b"a", b"b"])
    assert raw.poll(10_000)
    assert "malformed" in ipc.decode_client_reply(raw.recv()).message
    # a valid request on the same raw socket still works, prompt ids packed
    raw.send(ipc.encode(Generate("ok", prompt_token_ids=pack_ids([5, 6, 7]),
                                 params=SamplingParams(max_tokens=2, ignore_eos=True))))
    got = []
    while not got or not got[-1].finish_reason:
        assert raw.poll(30_000)
        got.append(ipc.decode_client_reply(raw.recv()))
    assert sum(len(d.token_ids) for d in got) == 2
    raw.close()
    assert client.health()["ok"]


def test_malformed_bytes_on_internal_sockets_are_dropped(daemon, client, reference):
    """The scheduler, executor and tokenizer drop (and log) what they cannot decode."""
    ctx = zmq.Context.instance()
    addresses = daemon._addresses
    for address in (addresses.scheduler, addresses.executor, addresses.tokenizer):
        sock = ipc.push(ctx, address)
        for data in (b"\x00garbage", msgspec.msgpack.encode(["execute", 1, 2]), b""):
            sock.send(data)
        sock.close(linger=2000)
    ps = prompts(3)
    got = [client.generate(p, max_tokens=8, ignore_eos=True).token_ids for p in ps]
    assert got == [r.token_ids for r in reference.generate(ps, SamplingParams(max_tokens=8, ignore_eos=True))]
    assert all(p.is_alive() for p in daemon.procs.values())


def test_duplicate_request_id_on_one_connection_is_refused(daemon):
    with Client(daemon.endpoint, timeout=60) as c:  # one connection, two requests with one id
        first = c.submit([5, 6], request_id="same", max_tokens=200, ignore_eos=True)
        with pytest.raises(ValueError, match="already in flight"):
            c.submit([5, 6], request_id="same")
        c.abort(first)
    # and the server's own check, for clients that do not keep track
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(daemon.endpoint)
    long = Generate("dup", prompt_token_ids=pack_ids([5, 6]), params=SamplingParams(max_tokens=500, ignore_eos=True))
    raw.send(ipc.encode(long))
    raw.send(ipc.encode(long))
    errors = []
    while not errors:
        assert raw.poll(30_000)
        reply = ipc.decode_client_reply(raw.recv())
        if type(reply).__name__ == "Error":
            errors.append(reply)
    assert errors[0].field == "request_id" and "already in flight" in errors[0].message
    raw.close()


# -- aborts and disconnects ------------------------------------------------------------------

def test_leaving_a_stream_early_aborts_and_frees_pages(client):
    for i, delta in enumerate(client.stream([11, 12, 13], max_tokens=900, ignore_eos=True)):
        if i == 3:
            break
    wait_for(lambda: idle(client), 30, "pages back after an abandoned stream")


def test_explicit_abort(client):
    rid = client.submit([11, 12, 13], max_tokens=900, ignore_eos=True)
    client.abort(rid)
    last = list(client.deltas(rid))[-1]
    assert last.finish_reason == "abort"
    wait_for(lambda: idle(client), 30, "pages back after an abort")


KILLED_CLIENT = textwrap.dedent("""
    import sys
    from runtime.client import Client
    c = Client(sys.argv[1], timeout=60)
    ids = [c.submit([100 + i, 200, 300], max_tokens=900, ignore_eos=True) for i in range(4)]
    first = c.deltas(ids[0])  # keep it referenced: a dropped generator aborts its request
    next(first)
    print("streaming", flush=True)
    sys.stdin.read()  # until killed
""")


def test_killed_client_frees_its_pages(daemon, client):
    proc = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, daemon.endpoint], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert proc.stdout.readline().strip() == "streaming"
        assert client.stats()["live_requests"] >= 4
        proc.kill()
        proc.wait(30)
    finally:
        proc.kill()
    stats = wait_for(lambda: idle(client), 30, "pages back after the client died")
    assert stats["disconnects"] >= 1


# -- process lifecycle (own daemons, started as `overlap serve`) ------------------------------

def start_serve(tiny_dirs, *extra) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "runtime", "serve", "--model", str(tiny_dirs["target"]), "--zmq",
           "tcp://127.0.0.1:*", "--num-pages", "64", *extra]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=REPO)
    lines = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            raise AssertionError(f"serve exited early: {''.join(lines)}")
        lines.append(line)
        found = re.search(r"serving .* on (tcp://\S+)", line)
        if found:
            # keep draining stderr so the daemon never blocks on a full pipe
            threading.Thread(target=proc.stderr.read, daemon=True).start()
            return proc, found.group(1)
    raise AssertionError("serve did not come up")


def children_of(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.append(int(entry))
    return kids


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def process_title(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()


@pytest.mark.slow  # a daemon of its own, killed or restarted
def test_sigterm_leaves_no_process_behind(tiny_dirs):
    proc, address = start_serve(tiny_dirs)
    try:
        with Client(address, timeout=60) as c:
            assert c.generate([5, 6, 7], max_tokens=3, ignore_eos=True).finish_reason == "length"
        kids = children_of(proc.pid)
        titles = {process_title(k) for k in kids}
        assert {"overlap::tokenizer", "overlap::scheduler", "overlap::executor"} <= titles, titles
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        wait_for(lambda: not any(alive(k) for k in kids), 10, "children to exit")
    finally:
        proc.kill()


@pytest.mark.slow  # a daemon of its own, killed or restarted
def test_executor_death_fails_in_flight_requests_and_the_daemon_exits_nonzero(tiny_dirs):
    proc, address = start_serve(tiny_dirs)
    try:
        kids = children_of(proc.pid)
        executor = next(k for k in kids if process_title(k) == "overlap::executor")
        with Client(address, timeout=60) as c:
            stream = c.stream([5, 6, 7], max_tokens=900, ignore_eos=True)
            next(stream)
            os.kill(executor, signal.SIGKILL)
            start = time.monotonic()
            with pytest.raises(ServerUnavailable, match="executor"):
                for _ in stream:
                    pass
            assert time.monotonic() - start < 10
        assert proc.wait(60) == 1
        wait_for(lambda: not any(alive(k) for k in kids), 10, "children to exit")
    finally:
        proc.kill()


@pytest.mark.slow  # a daemon of its own, killed or restarted
def test_restart_policy_keeps_serving_after_the_executor_dies(tiny_dirs):
    proc, address = start_serve(tiny_dirs, "--on-failure", "restart", "--max-restarts", "1")
    try:
        executor = next(k for k in children_of(proc.pid) if process_title(k) == "overlap::executor")
        with Client(address, timeout=120) as c:
            stream = c.stream([5, 6, 7], max_tokens=900, ignore_eos=True)
            next(stream)
            os.kill(executor, signal.SIGKILL)
            with pytest.raises(ServerUnavailable):
                for _ in stream:
                    pass
            # Fresh processes on the same endpoint; this client reconnects by itself.
            result = wait_for(lambda: _try_generate(c), 120, "the restarted server to answer")
            assert result.finish_reason == "length" and len(result.token_ids) == 4
            assert proc.poll() is None
            assert executor not in children_of(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        proc.kill()


def _try_generate(client: Client):
    try:
        return client.generate([5, 6, 7], max_tokens=4, ignore_eos=True, timeout=5)
    except (ServerUnavailable, TimeoutError):
        return None
