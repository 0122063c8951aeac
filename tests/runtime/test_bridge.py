"""The websocket bridge and the server's robustness, against a live daemon (tiny random models,
draft-target speculation, the bridge as a fourth process with a bearer token): streaming
equal to the client library, cancel, auth, bad input on every entry point, a hypothesis
fuzz of the ZeroMQ socket, disconnects freeing pages, the load-test tool, and the browser
page in headless Chromium."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import quote

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from overlap.config import CacheConfig, EngineConfig, SchedulerConfig, SpecConfig
from runtime import ipc
from runtime.client import Client
from runtime.daemon import Daemon
from runtime.messages import Generate, Health, SamplingParams, pack_ids
from runtime.ws_bridge import Bridge

REPO = Path(__file__).resolve().parents[2]
TOKEN = "s3cret-token"
ARTIFACTS = Path(os.environ.get("OVERLAP_ARTIFACTS", REPO / "runs" / "artifacts"))


@pytest.fixture(scope="module")
def daemon(tiny_dirs):
    config = EngineConfig(model=str(tiny_dirs["target"]),
                          spec=SpecConfig(controller="off", method="draft", num_spec_tokens=3, draft_model=str(tiny_dirs["draft"])),
                          cache=CacheConfig(page_size=16, num_pages=256),
                          scheduler=SchedulerConfig(max_num_seqs=16, max_batched_tokens=256))
    d = Daemon(config, "tcp://127.0.0.1:*", ready_timeout_s=300, ws_listen="127.0.0.1:0", ws_token=TOKEN)
    d.start()
    yield d
    d.stop()


@pytest.fixture(scope="module")
def client(daemon):
    with Client(daemon.endpoint, timeout=120) as c:
        yield c


def ws_connect(daemon, token=TOKEN, **kw):
    headers = {"Authorization": f"Bearer {token}"} if token else None
    return connect(daemon.ws_endpoint, additional_headers=headers, open_timeout=30, **kw)


def ws_run(ws, request: dict, timeout: float = 120) -> list[dict]:
    """Send one request; collect its messages up to done/error."""
    ws.send(json.dumps(request))
    got = []
    while True:
        msg = json.loads(ws.recv(timeout=timeout))
        if msg.get("id") != request.get("id"):
            continue
        got.append(msg)
        if msg["type"] in ("done", "error"):
            return got


def wait_idle(client: Client, timeout_s: float = 30) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = client.stats()
        if s["free_pages"] == s["total_pages"] and s["live_requests"] == 0:
            return s
        time.sleep(0.1)
    raise AssertionError(f"server not idle after {timeout_s} s: {client.stats()}")


# -- streaming -------------------------------------------------------------------------------

def test_ws_stream_equals_the_client_library(daemon, client):
    want = client.generate("def fibonacci(n):", max_tokens=20, ignore_eos=True)
    with ws_connect(daemon) as ws:
        msgs = ws_run(ws, {"id": "a", "prompt": "def fibonacci(n):", "params": {"max_tokens": 20, "ignore_eos": True}})
    assert [m["type"] for m in msgs[:-1]] == ["delta"] * (len(msgs) - 1) and len(msgs) > 2
    done = msgs[-1]
    assert "".join(m["text"] for m in msgs) == want.text
    assert [t for m in msgs for t in m["token_ids"]] == want.token_ids
    assert done["finish_reason"] == "length" and done["usage"]["completion_tokens"] == 20
    assert done["spec"]["drafts"] > 0 and len(done["spec"]["accepted_per_position"]) == 3


def test_ws_info_and_token_origins(daemon):
    """{"type": "info"} names the model and the speculation mode; every delta says how each token
    came (depths aligned with token_ids) and cuts its text into pieces per token (runtime/origins.py)."""
    with ws_connect(daemon) as ws:
        ws.send(json.dumps({"type": "info"}))
        info = json.loads(ws.recv(timeout=60))
        assert info == {"type": "info", "model": str(daemon.config.model), "spec": "draft", "num_spec_tokens": 3}
        msgs = ws_run(ws, {"id": "o", "prompt": "def fibonacci(n):", "params": {"max_tokens": 20, "ignore_eos": True}})
        off = ws_run(ws, {"id": "p", "prompt": "def fibonacci(n):", "params": {"max_tokens": 20, "ignore_eos": True},
                          "spec": {"mode": "none"}})
    for m in msgs + off:
        assert len(m["depths"]) == len(m["token_ids"]) and "".join(p for p, _ in m["pieces"]) == m["text"], m
    depths = [d for m in msgs for d in m["depths"]]
    assert sum(d > 0 for d in depths) == msgs[-1]["spec"]["accepted_tokens"]
    assert max(depths) <= 3 and {d for m in off for d in m["depths"]} == {0}


def test_ws_chat_spec_off_and_several_requests_with_cancel(daemon, client):
    with ws_connect(daemon) as ws:
        ws.send(json.dumps({"id": "long", "prompt": [5, 6, 7], "params": {"max_tokens": 900, "ignore_eos": True}}))
        short = ws_run(ws, {"id": "chat", "messages": [{"role": "user", "content": "Hi"}],
                            "params": {"max_tokens": 6, "ignore_eos": True}, "spec": {"mode": "none"}})
        assert short[-1]["finish_reason"] == "length" and short[-1]["spec"] is None
        ws.send(json.dumps({"type": "cancel", "id": "long"}))
        while True:
            msg = json.loads(ws.recv(timeout=60))
            if msg["id"] == "long" and msg["type"] == "done":
                assert msg["finish_reason"] == "abort"
                usage = msg["usage"]  # the usage so far, not nulls
                assert usage["prompt_tokens"] == 3 and 0 < usage["completion_tokens"] < 900, usage
                assert usage["ttft_s"] > 0 and usage["latency_s"] >= usage["ttft_s"], usage
                break
    wait_idle(client)


def test_ws_cancel_before_the_first_delta_ends_the_request_once_with_usage(daemon, client):
    with ws_connect(daemon) as ws:
        for i in range(3):  # the cancel lands before, or just after, the request starts running
            rid = f"c{i}"
            ws.send(json.dumps({"id": rid, "prompt": [5, 6, 7], "params": {"max_tokens": 900, "ignore_eos": True}}))
            ws.send(json.dumps({"type": "cancel", "id": rid}))
            got = []
            while not got or got[-1]["type"] == "delta":
                msg = json.loads(ws.recv(timeout=60))
                assert msg["id"] == rid, msg
                got.append(msg)
            done = got[-1]
            assert done["type"] == "done" and done["finish_reason"] == "abort", done
            assert done["usage"]["prompt_tokens"] == 3 and done["usage"]["latency_s"] > 0, done
            assert done["usage"]["completion_tokens"] == sum(len(m["token_ids"]) for m in got) < 900, done
        # nothing more arrives for a cancelled request: the next message is the next request's
        after = ws_run(ws, {"id": "after", "prompt": "hi", "params": {"max_tokens": 2, "ignore_eos": True}})
        assert all(m["id"] == "after" for m in after)
        ws.send(json.dumps({"type": "cancel", "id": "after"}))  # finished already: ignored, no reply
        ws.send(json.dumps({"id": "last", "prompt": "hi", "params": {"max_tokens": 1}}))
        assert json.loads(ws.recv(timeout=60))["id"] == "last"
    wait_idle(client)


def test_ws_auth(daemon):
    for token in (None, "wrong"):
        with pytest.raises(InvalidStatus) as e:
            ws_connect(daemon, token)
        assert e.value.response.status_code == 401
    # browsers cannot set headers: the token also works as a query parameter
    with connect(f"{daemon.ws_endpoint}?token={TOKEN}", open_timeout=30) as ws:
        assert ws_run(ws, {"id": "q", "prompt": "hi", "params": {"max_tokens": 2}})[-1]["type"] == "done"


@pytest.mark.parametrize("request_,field", [
    ("{not json", None),
    ('["a list"]', None),
    ({"id": "x", "prompt": "hi", "colour": "red"}, "colour"),
    ({"id": "x", "prompt": "hi", "params": {"max_tokens": "many"}}, "params.max_tokens"),
    # One naming: the path of the value in the websocket request, whichever side checks it
    # (the bridge decoding it, or the server validating it).
    ({"id": "x", "prompt": "hi", "params": {"max_tokens": 10**9}}, "params.max_tokens"),
    ({"id": "x", "prompt": "hi", "params": {"max_tokens": 0}}, "params.max_tokens"),
    ({"id": "x", "prompt": "hi", "params": {"temperature": -2}}, "params.temperature"),
    ({"id": "x", "prompt": "hi", "params": {"stop": [""]}}, "params.stop"),
    ({"id": "x", "prompt": "hi", "params": {"num_spec_tokens": 99}}, "params.num_spec_tokens"),
    ({"id": "x", "prompt": "hi", "spec": {"num_spec_tokens": 99}}, "spec.num_spec_tokens"),
    ({"id": "x", "prompt": "hi", "spec": {"mode": "eagle"}}, "spec.mode"),
    ({"id": "x", "prompt": [1, 2, 99999999]}, "prompt"),
    ({"id": "x", "prompt": ""}, "prompt"),
    ({"id": "x", "prompt": list(range(10, 1200))}, "prompt"),  # longer than the context
    ({"id": "x"}, "prompt"),
    ({"id": "x", "prompt": "hi", "messages": [{"role": "user", "content": "hi"}]}, "prompt"),
    ({"id": "x", "messages": []}, "messages"),
    ({"type": "launch", "id": "x"}, "type"),
])
def test_ws_bad_input_names_the_field_and_the_connection_keeps_serving(daemon, request_, field):
    with ws_connect(daemon) as ws:
        ws.send(request_ if isinstance(request_, str) else json.dumps(request_))
        msg = json.loads(ws.recv(timeout=60))
        assert msg["type"] == "error" and msg["message"], msg
        assert msg["field"] == field, msg
        # the message speaks the websocket protocol too: it has no prompt_token_ids or request_id
        assert "prompt_token_ids" not in msg["message"] and "request_id" not in msg["message"], msg
        ok = ws_run(ws, {"id": "ok", "prompt": "hi", "params": {"max_tokens": 3, "ignore_eos": True}})
        assert ok[-1]["type"] == "done" and ok[-1]["usage"]["completion_tokens"] == 3


def test_closing_the_websocket_frees_pages(daemon, client):
    with ws_connect(daemon) as ws:
        ws.send(json.dumps({"id": "l", "prompt": [9, 9, 9], "params": {"max_tokens": 900, "ignore_eos": True}}))
        assert json.loads(ws.recv(timeout=60))["type"] == "delta"
        assert client.stats()["live_requests"] >= 1
    wait_idle(client)


def test_page_is_served(daemon):
    url = daemon.ws_endpoint.replace("ws://", "http://")
    with urllib.request.urlopen(url, timeout=30) as r:
        assert r.headers["Content-Type"].startswith("text/html") and b"new WebSocket" in r.read()
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(url + "nope", timeout=30)


PAGE_HARNESS = """
const [script, meta, search] = JSON.parse(require("fs").readFileSync(0, "utf8"));
const elements = {};
const el = (id) => elements[id] ??= { value: "", textContent: "", disabled: false, checked: false, dataset: {} };
globalThis.document = { getElementById: el, querySelector: () => ({ content: meta }) };
globalThis.location = { search, host: "127.0.0.1:8765", origin: "http://127.0.0.1:8765", pathname: "/" };
const sockets = [];
globalThis.WebSocket = class { constructor(url) { this.url = url; this.readyState = 0; sockets.push(this); }
                               send() { throw new Error("sent on a socket that never opened"); } };
WebSocket.OPEN = 1;
eval(script);
for (const ws of sockets) ws.onclose({ code: 1006, reason: "" });  // what a refused handshake looks like
el("go").onclick();  // clicking Generate now must not start a request that can never finish
console.log(JSON.stringify({ status: el("status").textContent, go: el("go").disabled,
                             stop: el("stop").disabled, sockets: sockets.map((s) => s.url) }));
"""


def run_page(html: str, search: str) -> dict:
    """Run the page's script in node against a fake DOM whose websocket is refused."""
    script = html.split("<script>", 1)[1].split("</script>", 1)[0]
    meta = re.search(r'<meta name="overlap-auth" content="(\w+)">', html).group(1)
    r = subprocess.run(["node", "-e", PAGE_HARNESS], input=json.dumps([script, meta, search]),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


@pytest.mark.skipif(shutil.which("node") is None, reason="needs node")
def test_page_without_the_needed_token_says_so(daemon):
    with urllib.request.urlopen(daemon.ws_endpoint.replace("ws://", "http://"), timeout=30) as r:
        html = r.read().decode()  # this bridge has a token: the page is told so
    no_token = run_page(html, "")
    assert no_token["sockets"] == [] and "requires a token" in no_token["status"], no_token
    assert "?token=" in no_token["status"] and no_token["go"] and no_token["stop"]
    wrong = run_page(html, "?token=nope")
    assert "wrong token" in wrong["status"] and wrong["go"], wrong
    # a bridge without a token: the page connects without one, and says so if that fails
    open_page = run_page(Bridge("tcp://127.0.0.1:9").page, "")
    assert open_page["sockets"] == ["ws://127.0.0.1:8765/"] and "could not connect" in open_page["status"]


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")


class Chromium:
    """Headless Chromium driven over the DevTools protocol (a websocket: the same library)."""

    def __init__(self, url: str, profile: Path):
        import socket

        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.proc = subprocess.Popen([_chromium(), "--headless", "--no-sandbox", "--disable-gpu",
                                      "--window-size=900,700", f"--remote-debugging-port={port}",
                                      f"--user-data-dir={profile}", url],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=5) as r:
                    pages = [t for t in json.loads(r.read()) if t["type"] == "page"]
                if pages:
                    break
            except OSError:
                pass
            assert time.monotonic() < deadline, "chromium did not start"
            time.sleep(0.2)
        self._connection = connect(pages[0]["webSocketDebuggerUrl"], max_size=None, open_timeout=30)
        self.ws = self._connection.__enter__()
        self.calls = 0

    def call(self, method: str, **params) -> dict:
        self.calls += 1
        self.ws.send(json.dumps({"id": self.calls, "method": method, "params": params}))
        while True:
            msg = json.loads(self.ws.recv(timeout=60))
            if msg.get("id") == self.calls:
                return msg["result"]

    def eval(self, expression: str):
        return self.call("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")

    def close(self) -> None:
        self._connection.__exit__(None, None, None)
        self.proc.kill()
        self.proc.wait(30)


@pytest.mark.skipif(_chromium() is None, reason="needs Chromium (Debian: apt-get install chromium)")
def test_browser_page_streams_a_completion(daemon, client, tmp_path):
    import base64

    want = client.generate("def fibonacci(n):", max_tokens=24, ignore_eos=True).text
    base = daemon.ws_endpoint.replace("ws://", "http://")
    url = f"{base}?token={TOKEN}&autorun=1&max_tokens=24&prompt={quote('def fibonacci(n):')}"
    browser = Chromium(url, tmp_path / "profile")
    try:
        deadline = time.monotonic() + 120
        while browser.eval("document.getElementById('status').dataset.finished || ''") != "length":
            assert time.monotonic() < deadline, browser.eval("document.getElementById('status').textContent")
            time.sleep(0.2)
        assert browser.eval("document.getElementById('output').textContent") == want
        shot = base64.b64decode(browser.call("Page.captureScreenshot", format="png")["data"])
    finally:
        browser.close()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "bridge_page.png").write_bytes(shot)
    assert shot[:8] == b"\x89PNG\r\n\x1a\n" and len(shot) > 5000


# -- fuzzing the ZeroMQ socket ---------------------------------------------------------------

FIELDS = ["request_id", "prompt", "messages", "prompt_token_ids", "params", "type", "query_id"]
VALUES = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(allow_nan=True),
                   st.text(max_size=40), st.binary(max_size=40),
                   st.lists(st.integers(-5, 60000), max_size=8),
                   st.dictionaries(st.sampled_from(["max_tokens", "temperature", "top_p", "top_k", "seed",
                                                    "stop", "spec", "num_spec_tokens", "bogus"]),
                                   st.one_of(st.integers(-10, 10**12), st.floats(allow_nan=True),
                                             st.text(max_size=5), st.lists(st.text(max_size=3), max_size=3)),
                                   max_size=4))
VALID = ipc.encode(Generate("fuzz", prompt="hi", params=SamplingParams(max_tokens=2)))
MESSAGES = st.one_of(
    st.binary(max_size=200),
    st.builds(lambda d, t: msgspec.msgpack.encode({"type": t, **d}),
              st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=5),
              st.sampled_from(["generate", "abort", "health", "stats", "delta", "x"])),
    st.builds(lambda i, b: VALID[:i] + bytes([b]) + VALID[i + 1:],
              st.integers(0, len(VALID) - 1), st.integers(0, 255)),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                    HealthCheck.too_slow])
@given(data=MESSAGES)
def test_fuzz_the_zmq_socket(daemon, data):
    ctx = zmq.Context.instance()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(daemon.endpoint)
    try:
        raw.send(data)
        # Every message gets an answer (an error, a reply, or a stream), or none for a valid
        # abort of an unknown id; either way the server must still answer health checks.
        raw.send(ipc.encode(Health("h")))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert raw.poll(30_000), "no answer"
            reply = ipc.decode_client_reply(raw.recv())
            if getattr(reply, "query_id", None) == "h":
                assert reply.ok
                break
    finally:
        raw.close()


def test_after_fuzzing_the_server_is_correct_and_idle(daemon, client):
    # Runs after the fuzz test in file order: normal service, the right tokens, no leak.
    a = client.generate([5, 6, 7, 8], max_tokens=12, ignore_eos=True)
    b = client.generate([5, 6, 7, 8], max_tokens=12, ignore_eos=True, spec=False)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 12
    wait_idle(client)


# -- the load-test tool ----------------------------------------------------------------------

@pytest.mark.parametrize("path", ["zmq", "ws"])
def test_loadtest_with_disconnects_loses_nothing_and_frees_pages(daemon, client, tmp_path, path):
    out = tmp_path / "load.json"
    target = ["--server", daemon.endpoint] if path == "zmq" else \
        ["--ws", f"{daemon.ws_endpoint}?token={TOKEN}", "--server", daemon.endpoint]
    r = subprocess.run([sys.executable, "tools/loadtest.py", *target, "--requests", "40", "--concurrency", "8",
                        "--max-tokens", "8", "--disconnect-fraction", "0.2", "--time-limit", "300",
                        "--json", str(out)], capture_output=True, text=True, timeout=400, cwd=REPO)
    assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads(out.read_text())
    assert report["lost"] == 0 and report["errored"] == 0
    assert report["completed"] == 32 and report["disconnected"] == 8
    assert report["after"]["pages_all_free"] and report["tokens_per_s"] > 0


def test_packed_prompt_ids_through_a_raw_socket(daemon):
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(daemon.endpoint)
    raw.send(ipc.encode(Generate("p", prompt_token_ids=pack_ids([3, 4]), params=SamplingParams(max_tokens=2))))
    assert raw.poll(30_000)
    assert ipc.decode_client_reply(raw.recv()).request_id == "p"
    raw.close()
