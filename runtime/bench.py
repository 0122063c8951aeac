"""`overlap bench`: throughput and latency of one or more engine variants on a prompt file.

    prompts = load_prompts("prompts/dev.jsonl", limit=4)
    spec = lambda m: EngineConfig(spec=SpecConfig(method=m))
    report = run_bench([("none", spec("none")), ("ngram", spec("ngram"))], prompts, max_tokens=32,
                       concurrencies=[1, 4])
    print(format_report(report))

Per variant and concurrency C, `drive` keeps C requests in flight (a new one is submitted
as soon as one finishes) through a `StreamClient`: anything with `add(prompt_ids, params)
-> request_id` and `step() -> deltas`. `EngineClient` adapts the in-process Engine; a
client of a running server only has to offer the same two calls.

Metrics (per variant and concurrency):
- tokens/s: all output tokens / wall time (prefill included), requests/s likewise.
- TTFT: submission → first delta carrying tokens (queueing included).
- inter-token latency (ITL): per request, the gap between consecutive deltas that carried
  tokens; a delta with n tokens (speculation) counts as n gaps of gap/n each.
- speedup: tokens/s over the first variant's at the same concurrency, measured in this run.
- acceptance length (vLLM's definition): 1 + accepted draft tokens / draft steps, summed over
  all requests; per-position acceptance: accepted / drafted at draft position i, summed over
  requests (a request with fewer positions counts only where it has them).
- identical outputs: each variant's token ids against the first variant's at the same
  concurrency. Greedy speculative decoding is lossless, so anything short of N/N is a bug.
- by prompt kind (when the JSONL lines carry "kind"): acceptance length and decode tokens/s
  per request (tokens after the first delta / time from first to last delta), averaged.
- prefix cache (engines that have one): the share of the prompt tokens of the run's requests
  whose KV was found cached. With `shared_prefix` = N every prompt starts with the same N
  tokens of a long system prompt (`shared_prefix_ids`); the warm-up request caches them, so at
  concurrency 1 every measured request is a cache hit, and the TTFT of a variant with the
  prefix cache against one without (same mode) is the time the cache saves.
The bandwidth floor is the time to read every weight once per decode step at the
machine's measured copy bandwidth; efficiency = floor / measured ms per token (mean ITL at
the lowest concurrency, prefill excluded).
No argparse here: the CLI (runtime/cli.py) parses and calls in.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import queue
import sys
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import msgspec
import numpy as np
import torch

from overlap.config import EngineConfig
from overlap.models.loading import resolve_model_dir
from runtime.engine import Delta, Engine
from runtime.messages import RequestError, SamplingParams

# -- prompts -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prompt:
    text: str
    kind: str | None = None  # e.g. "code", "chat": the report splits acceptance by it


def load_prompts(path: str | Path, limit: int | None = None) -> list[Prompt]:
    """The "prompt" (and optional "kind") field of each JSONL line (blank lines skipped), the
    first `limit` of them."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"prompts file {path} does not exist")
    prompts = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"prompts file {path} line {lineno}: not valid JSON ({e.msg})") from None
            prompt = obj.get("prompt") if isinstance(obj, dict) else None
            if not isinstance(prompt, str) or not prompt:
                raise ValueError(f"prompts file {path} line {lineno}: expected an object with a "
                                 f"non-empty string field \"prompt\"")
            kind = obj.get("kind")
            prompts.append(Prompt(prompt, None if kind is None else str(kind)))
            if limit is not None and len(prompts) >= limit:
                break
    if not prompts:
        raise ValueError(f"prompts file {path} holds no prompts")
    return prompts


# A system prompt long enough to share a few thousand tokens (repeated as needed): the common
# head of every prompt in a shared-prefix run, as a chat service puts in front of each turn.
SYSTEM_PROMPT = (
    "You are a meticulous assistant for a software team. Answer in plain English, precisely and "
    "briefly. When you write code, write Python 3 that follows PEP 8, with type hints and a short "
    "docstring, and explain only what is not obvious from the code. Prefer the standard library. "
    "Never invent an API: if you are not sure a function exists, say so. When a question is "
    "ambiguous, state the assumption you make and answer under it. Keep secrets out of examples: "
    "use placeholders for keys, passwords and hostnames. For shell commands, assume bash on Linux "
    "and quote every variable. For numbers, give units. For dates, use ISO 8601. If the user asks "
    "for a review, list problems by severity, then suggest fixes with the smallest change that "
    "works. If the user asks for a design, name the trade-offs and recommend one option. "
)


def shared_prefix_ids(tokenizer, num_tokens: int) -> list[int]:
    """The first `num_tokens` tokens of SYSTEM_PROMPT repeated: the prefix a shared-prefix run
    puts in front of every prompt."""
    unit = tokenizer.encode(SYSTEM_PROMPT)
    return (unit * (num_tokens // len(unit) + 1))[:num_tokens]


# -- driving requests ----------------------------------------------------------------------


class StreamClient(Protocol):
    """May also offer `stats(request_id) -> dict | None`: a finished request's engine stats
    (RequestStats.as_dict), which carry the speculation counters."""

    def add(self, prompt_ids: list[int], params: SamplingParams) -> str: ...

    def step(self) -> list[Delta]: ...


class EngineClient:
    """The in-process Engine as a StreamClient."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.finished: dict[str, dict] = {}  # request id -> stats, until drive() collects them

    def warm_up(self, prompt_ids: list[int]) -> None:
        self.engine.generate([prompt_ids], SamplingParams(max_tokens=4))

    def counters(self) -> dict:
        return self.engine.stats()

    def add(self, prompt_ids: list[int], params: SamplingParams) -> str:
        return self.engine.add_request(prompt_ids, params)

    def step(self) -> list[Delta]:
        deltas = self.engine.step()
        if not deltas and not self.engine.has_work():
            raise RuntimeError("engine has requests in flight but nothing to run")
        for d in deltas:
            if d.finish_reason:
                # Drop the engine's record (and its queued deltas): we keep our own trace.
                self.finished[d.request_id] = self.engine.pop_result(d.request_id).stats
        return deltas

    def stats(self, request_id: str) -> dict | None:
        return self.finished.pop(request_id, None)


class ServerClient:
    """A running daemon (through the ZeroMQ client library) as a StreamClient. `spec_on`
    False runs the server's requests without speculation (the "none" variant)."""

    def __init__(self, address: str, spec_on: bool, timeout: float = 600.0):
        from runtime.client import Client

        self.client = Client(address, timeout=timeout)
        self.spec_on = spec_on
        self.finished: dict[str, dict] = {}

    def warm_up(self, prompt_ids: list[int]) -> None:
        self.client.generate(prompt_ids, max_tokens=4, spec=self.spec_on)

    def add(self, prompt_ids: list[int], params: SamplingParams) -> str:
        return self.client.submit(prompt_ids, params=msgspec.structs.replace(params, spec=self.spec_on))

    def step(self) -> list[Delta]:
        from runtime.client import _raise
        from runtime.messages import Error

        deltas = []
        for msg in self.client.next_deltas():
            if isinstance(msg, Error):
                _raise(msg)
            if msg.finish_reason:
                self.finished[msg.request_id] = msg.stats or {}
            deltas.append(Delta(msg.request_id, msg.text, msg.token_ids, msg.finish_reason))
        return deltas

    def stats(self, request_id: str) -> dict | None:
        return self.finished.pop(request_id, None)

    def counters(self) -> dict:
        return self.client.stats()

    def close(self) -> None:
        self.client.close()


class HttpClient:
    """The OpenAI-compatible HTTP server (runtime/http_server.py) as a StreamClient, as its
    users reach it: one streamed POST /v1/completions per request (the prompt as token ids,
    `return_token_ids` for exact counts), each read on a thread of its own; the deltas meet in
    one queue that step() drains. `spec_on` False asks for `"speculation": {"mode": "none"}`.
    With `scrape_s`, a thread also GETs /metrics as a run's first request goes out and then
    every `scrape_s` seconds while requests run (the metrics-overhead comparison); counters()
    waits for the scrape a run asked for, so even a run shorter than `scrape_s` counts one. `stats_from`: the daemon's ZeroMQ address, for the
    counters (device timing, prefix cache) the HTTP API does not carry."""

    def __init__(self, url: str, spec_on: bool, token: str | None = None, scrape_s: float | None = None,
                 stats_from: str | None = None, timeout: float = 600.0):
        import httpx

        headers = {"Authorization": f"Bearer {token}"} if token else {}
        base = url.rstrip("/").removesuffix("/v1")
        self.http = httpx.Client(base_url=base, headers=headers, timeout=timeout,
                                 limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        self.spec_on, self.timeout = spec_on, timeout
        self.events: queue.Queue = queue.Queue()
        self.finished: dict[str, dict] = {}
        self.scrapes = 0
        self._scrape_asked = self._scrape_done = 0  # runs that asked for a first scrape / got it
        self._scrape_turn = threading.Condition()
        self._stop = threading.Event()
        self._streams: set[threading.Thread] = set()
        self._zmq = None
        if stats_from:
            from runtime.client import Client

            self._zmq = Client(stats_from, timeout=60)
        self._scraper = None
        if scrape_s:
            self._scraper = threading.Thread(target=self._scrape_every, args=(scrape_s,), daemon=True)
            self._scraper.start()

    def _body(self, prompt_ids: list[int], params: SamplingParams) -> dict:
        body = {"prompt": prompt_ids, "max_tokens": params.max_tokens, "temperature": params.temperature,
                "ignore_eos": params.ignore_eos, "stream": True, "return_token_ids": True}
        if not self.spec_on:
            body["speculation"] = {"mode": "none"}
        return body

    def warm_up(self, prompt_ids: list[int]) -> None:
        r = self.http.post("/v1/completions", json={**self._body(prompt_ids, SamplingParams(max_tokens=4)),
                                                    "stream": False})
        r.raise_for_status()

    def add(self, prompt_ids: list[int], params: SamplingParams) -> str:
        request_id = f"http-{uuid.uuid4().hex}"
        if self._scraper is not None and not self._streams:  # a run starts: scrape now, not a period later
            with self._scrape_turn:
                self._scrape_asked += 1
                self._scrape_turn.notify_all()
        thread = threading.Thread(target=self._stream, args=(request_id, self._body(prompt_ids, params)), daemon=True)
        self._streams.add(thread)
        thread.start()
        return request_id

    def _stream(self, request_id: str, body: dict) -> None:
        try:
            with self.http.stream("POST", "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode(errors='replace')}")
                for line in r.iter_lines():
                    if not line.startswith("data: {"):
                        continue  # blank separators and the final [DONE]
                    chunk = json.loads(line[len("data: "):])
                    if "error" in chunk:
                        raise RuntimeError(f"the server failed the request: {chunk['error']}")
                    if not chunk["choices"]:
                        continue  # the usage chunk
                    choice = chunk["choices"][0]
                    if choice["finish_reason"]:
                        self.finished[request_id] = chunk.get("speculation") or {}
                    self.events.put(Delta(request_id, choice["text"], choice["token_ids"], choice["finish_reason"]))
        except Exception as e:  # noqa: BLE001 - handed to the driving thread, which raises it
            if not self._stop.is_set():  # after close(), a stream cut short is expected, not an error
                self.events.put(e)
        finally:
            self._streams.discard(threading.current_thread())

    def step(self) -> list[Delta]:
        items = [self.events.get(timeout=self.timeout)]
        while not self.events.empty():
            items.append(self.events.get_nowait())
        for item in items:
            if isinstance(item, Exception):
                raise item
        return items

    def _scrape_every(self, period_s: float) -> None:
        while not self._stop.is_set():
            with self._scrape_turn:  # sleep a period, or less when a run starts
                self._scrape_turn.wait_for(lambda: self._scrape_asked > self._scrape_done or self._stop.is_set(),
                                           timeout=period_s)
                asked, idle = self._scrape_asked, not self._streams and asked == self._scrape_done
            if self._stop.is_set():
                return
            if not idle:
                self.http.get("/metrics").raise_for_status()
                self.scrapes += 1
            with self._scrape_turn:
                self._scrape_done = asked
                self._scrape_turn.notify_all()

    def stats(self, request_id: str) -> dict | None:
        return self.finished.pop(request_id, None)

    def counters(self) -> dict:
        if self._scraper is not None:
            with self._scrape_turn:
                self._scrape_turn.wait_for(lambda: self._scrape_done >= self._scrape_asked, timeout=self.timeout)
        return {**(self._zmq.stats() if self._zmq else {}), "metrics_scrapes": self.scrapes}

    def close(self) -> None:
        # One deadline for every thread, not the timeout for each in turn: after a stalled
        # server, close() returns within the client's timeout however many streams were open.
        deadline = time.monotonic() + self.timeout
        self._stop.set()
        with self._scrape_turn:
            self._scrape_turn.notify_all()
        if self._scraper is not None:  # a scrape in flight ends before its client is closed
            self._scraper.join(timeout=self.timeout)
        self.http.close()  # streams still in flight (only after an error) end here...
        for thread in list(self._streams):  # ...and are gone before close() returns
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        if self._zmq:
            self._zmq.close()


def device_timing(before: dict, after: dict) -> dict | None:
    """The executor's device/host timing over one run (difference of its cumulative counters):
    how much of the time between steps the device sat idle, and how much of the host's
    planning (scheduling, messaging, prepare) ran while the device was still busy."""
    keys = ("timed_steps", "device_busy_s", "device_idle_s", "plan_s", "hidden_plan_s")
    if not all(k in after for k in keys):
        return None
    d = {k: after[k] - before.get(k, 0) for k in keys}
    steps = d["timed_steps"]
    device = d["device_busy_s"] + d["device_idle_s"]
    tp = {}
    if after.get("tp_plans"):
        plans = after["tp_plans"] - before.get("tp_plans", 0)
        tp = {"tp_ranks": after["tp_ranks"],
              "tp_bytes_per_step": ((after["tp_plan_bytes"] - before.get("tp_plan_bytes", 0))
                                    + (after["tp_proposal_bytes"] - before.get("tp_proposal_bytes", 0)))
              / max(plans, 1)}
    return {**tp,
        "steps": steps,
        "device_idle_fraction": d["device_idle_s"] / device if device else None,
        "busy_ms_per_step": d["device_busy_s"] * 1e3 / steps if steps else None,
        "idle_ms_per_step": d["device_idle_s"] * 1e3 / steps if steps else None,
        "plan_ms_per_step": d["plan_s"] * 1e3 / steps if steps else None,
        "plan_hidden_fraction": d["hidden_plan_s"] / d["plan_s"] if d["plan_s"] else None,
    }


@dataclass
class Trace:
    """One request's timeline as the client saw it."""

    submitted: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens) per delta with tokens
    finish_reason: str | None = None
    stats: dict | None = None  # the engine's per-request stats, where the client offers them


def drive(client: StreamClient, prompts: Sequence[list[int]], params: SamplingParams,
          concurrency: int, on_finish: Callable[[], None] = lambda: None) -> tuple[list[Trace], float]:
    """Run every prompt with `concurrency` requests in flight; returns the traces and wall time."""
    traces = [Trace() for _ in prompts]
    stats_of = getattr(client, "stats", None)
    in_flight: dict[str, Trace] = {}
    next_prompt, done = 0, 0
    start = time.perf_counter()
    while done < len(prompts):
        # 1. top up: a finished request's seat goes to the next prompt at once
        while next_prompt < len(prompts) and len(in_flight) < concurrency:
            trace = traces[next_prompt]
            trace.submitted = time.perf_counter()
            in_flight[client.add(prompts[next_prompt], params)] = trace
            next_prompt += 1
        # 2. step, and stamp every delta with the time it reached us
        deltas = client.step()
        now = time.perf_counter()
        for d in deltas:
            trace = in_flight[d.request_id]
            if d.token_ids:
                trace.token_ids += d.token_ids
                trace.arrivals.append((now, len(d.token_ids)))
            if d.finish_reason:
                trace.finish_reason = d.finish_reason
                trace.stats = stats_of(d.request_id) if stats_of else None
                del in_flight[d.request_id]
                done += 1
                on_finish()
    return traces, time.perf_counter() - start


def prefix_cache_use(before: dict, after: dict) -> dict | None:
    """Prompt tokens looked up in the prefix cache over one run, and how many hit."""
    keys = ("prefix_cache_queried_tokens", "prefix_cache_hit_tokens")
    if not all(k in after for k in keys):
        return None
    queried, hit = (after[k] - before.get(k, 0) for k in keys)
    return {"queried_tokens": queried, "hit_tokens": hit, "hit_rate": hit / queried if queried else None}


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(traces: list[Trace], wall_s: float) -> dict:
    """Throughput and latency percentiles (latencies in ms) of one drive() run."""
    output_tokens = sum(len(t.token_ids) for t in traces)
    ttft = [(t.arrivals[0][0] - t.submitted) * 1e3 for t in traces if t.arrivals]
    itl: list[float] = []
    for t in traces:
        for (prev, _), (now, n) in zip(t.arrivals, t.arrivals[1:]):
            itl += [(now - prev) * 1e3 / n] * n
    return {
        "requests": len(traces),
        "output_tokens": output_tokens,
        "wall_s": wall_s,
        "tokens_per_s": output_tokens / wall_s,
        "requests_per_s": len(traces) / wall_s,
        "ttft_p50_ms": _pct(ttft, 50), "ttft_p99_ms": _pct(ttft, 99),
        "itl_p50_ms": _pct(itl, 50), "itl_p99_ms": _pct(itl, 99),
        "itl_mean_ms": float(np.mean(itl)) if itl else None,
    }


def decode_tokens_per_s(trace: Trace) -> float | None:
    """One request's decode rate: tokens after the first delta / first-to-last delta time."""
    if len(trace.arrivals) < 2:
        return None
    (first, n_first), (last, _) = trace.arrivals[0], trace.arrivals[-1]
    return (len(trace.token_ids) - n_first) / (last - first) if last > first else None


def acceptance(stats: list[dict | None]) -> dict:
    """Speculation counters summed over requests (RequestStats.as_dict of each)."""
    stats = [s for s in stats if s]
    drafts = sum(s.get("drafts", 0) for s in stats)
    accepted = sum(s.get("accepted_tokens", 0) for s in stats)
    drafted_at: list[int] = []
    accepted_at: list[int] = []
    for s in stats:
        for i, (d, a) in enumerate(zip(s.get("drafted_per_position", []), s.get("accepted_per_position", []))):
            if i == len(drafted_at):
                drafted_at.append(0)
                accepted_at.append(0)
            drafted_at[i] += d
            accepted_at[i] += a
    # What the speculation controller chose per decode step (k, or tree nodes; 0: plain).
    k_hist: dict[str, int] = {}
    for s in stats:
        for k, n in (s.get("k_histogram") or {}).items():
            k_hist[k] = k_hist.get(k, 0) + n
    chosen = sum(k_hist.values())
    return {
        "k_histogram": dict(sorted(k_hist.items(), key=lambda kv: int(kv[0]))),
        "mean_k": sum(int(k) * n for k, n in k_hist.items()) / chosen if chosen else None,
        "drafts": drafts,
        "draft_tokens": sum(s.get("draft_tokens", 0) for s in stats),
        "accepted_tokens": accepted,
        "acceptance_length": 1 + accepted / drafts if drafts else None,
        "acceptance_per_position": [a / d for a, d in zip(accepted_at, drafted_at) if d],
    }


def by_kind(traces: list[Trace], kinds: list[str | None]) -> dict | None:
    """Acceptance length and mean per-request decode tokens/s for each prompt kind."""
    if all(k is None for k in kinds):
        return None
    out = {}
    for kind in dict.fromkeys(kinds):
        mine = [t for t, k in zip(traces, kinds) if k == kind]
        rates = [r for r in map(decode_tokens_per_s, mine) if r is not None]
        out[str(kind)] = {"requests": len(mine),
                          "acceptance_length": acceptance([t.stats for t in mine])["acceptance_length"],
                          "decode_tokens_per_s": float(np.mean(rates)) if rates else None}
    return out


# -- memory-bandwidth floor ----------------------------------------------------------------


def copy_bandwidth(nbytes: int = 256 * 2**20, repeats: int = 5) -> float:
    """Bytes/s of a numpy copy (bytes read + bytes written), best of `repeats`."""
    src = np.ones(nbytes // 8, dtype=np.float64)
    dst = np.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.nbytes / best


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter at its dtype. parameters() yields a shared (tied) tensor once."""
    return sum(p.numel() * p.element_size() for p in model.parameters())


# -- the benchmark -------------------------------------------------------------------------


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    # disable=None: off when stderr is not a terminal (no walls of \r in logs and pipes)
    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, disable=None if enabled else True,
                leave=False)


def encode_prompts(tokenizer, max_model_len: int, prompts: list[Prompt], shared_prefix: int = 0) -> list[list[int]]:
    """Raw prompt text → ids (no chat template), behind `shared_prefix` tokens of the shared
    system prompt; refuse prompts that leave no room to generate."""
    prefix = shared_prefix_ids(tokenizer, shared_prefix) if shared_prefix else []
    ids = [prefix + tokenizer.encode(p.text) for p in prompts]
    for i, p in enumerate(ids):
        if len(p) >= max_model_len:
            raise RequestError(f"prompt {i + 1}", f"{len(p)} tokens does not fit the context of "
                                                  f"{max_model_len} tokens")
    return ids


def bench_variant(client, prompt_ids: list[list[int]], max_tokens: int,
                  concurrencies: list[int], label: str, progress: bool = True,
                  kinds: list[str | None] | None = None) -> list[dict]:
    """One client (engine or server), every concurrency: metrics and outputs per concurrency."""
    # Warm-up: first-call costs (allocator, kernels, lazy imports) stay out of the timings.
    client.warm_up(prompt_ids[0])
    return [bench_once(client, prompt_ids, max_tokens, c, label, progress, kinds) for c in concurrencies]


def bench_once(client, prompt_ids: list[list[int]], max_tokens: int, c: int, label: str,
               progress: bool = True, kinds: list[str | None] | None = None) -> dict:
    """Every prompt through one client at concurrency c: the run's metrics and outputs."""
    params = greedy(max_tokens)
    before = client.counters()
    with _progress(len(prompt_ids), f"{label} c={c}", progress) as bar:
        traces, wall = drive(client, prompt_ids, params, c, on_finish=bar.update)
    return run_metrics(c, traces, wall, before, client.counters(), kinds)


def bench_paired_prompts(clients: list, prompt_ids: list[list[int]], max_tokens: int, desc: str, start: int = 0,
                         progress: bool = True, kinds: list[str | None] | None = None) -> list[dict]:
    """One round at concurrency 1 with the variants interleaved prompt by prompt: each prompt
    runs on every variant back to back (the first variant rotating from prompt to prompt), so
    a slow spell of a shared host, which can last a few seconds or a minute, falls on every
    variant's run of the same prompts rather than on whichever variant ran then (seen on an
    AMD EPYC host: plain decoding at 88 tok/s in one round and 34 in the next). A variant's
    wall time is the sum of its prompts' times; its counters change only while its own
    prompts run, so the round's difference is theirs."""
    params = greedy(max_tokens)
    before = [client.counters() for client in clients]
    traces: list[list[Trace]] = [[] for _ in clients]
    walls = [0.0] * len(clients)
    with _progress(len(prompt_ids), desc, progress) as bar:
        for p, ids in enumerate(prompt_ids):
            for i in [(start + p + j) % len(clients) for j in range(len(clients))]:
                (trace,), wall = drive(clients[i], [ids], params, 1)
                traces[i].append(trace)
                walls[i] += wall
            bar.update()
    return [run_metrics(1, traces[i], walls[i], before[i], clients[i].counters(), kinds)
            for i in range(len(clients))]


def greedy(max_tokens: int) -> SamplingParams:
    """What every benchmarked request asks for: greedy decoding to max_tokens or EOS, so each
    mode's outputs can be checked token for token against the baseline's."""
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=False)


def run_metrics(c: int, traces: list[Trace], wall: float, before: dict, after: dict,
                kinds: list[str | None] | None = None) -> dict:
    """One run's report entry: throughput, latencies, acceptance, device timing and prefix-cache
    use (from the client's counters before and after), and the outputs."""
    kinds = kinds or [None] * len(traces)
    rates = [r for r in map(decode_tokens_per_s, traces) if r is not None]
    return {"concurrency": c, **summarize(traces, wall),
            "decode_tokens_per_s": float(np.mean(rates)) if rates else None,
            **acceptance([t.stats for t in traces]), "by_kind": by_kind(traces, kinds),
            "device": device_timing(before, after), "prefix_cache": prefix_cache_use(before, after),
            "metrics_scrapes": after["metrics_scrapes"] - before["metrics_scrapes"]
            if "metrics_scrapes" in after else None,
            "outputs": [{"kind": k, "token_ids": t.token_ids, "finish_reason": t.finish_reason,
                         "stats": t.stats} for t, k in zip(traces, kinds)]}


def bench_rounds(clients: list, labels: list[str], prompt_ids: list[list[int]], max_tokens: int,
                 concurrencies: list[int], rounds: int, progress: bool = True,
                 kinds: list[str | None] | None = None, interleave: str = "rounds") -> list[list[dict]]:
    """Every variant at every concurrency, `rounds` times, interleaved: round r runs each
    concurrency for every variant back to back (starting from variant r, so no variant is
    always first), so that a slow minute on a shared host falls on every variant alike
    rather than on whichever ran then. Each (variant, concurrency) keeps its median round
    (by tok/s) with every round's tok/s beside it (`rounds_tokens_per_s`), from which the
    speedups are paired round by round (run_bench).

    Every prompt is run once (4 tokens) before round 1: otherwise round 1 meets a cold prefix
    cache and later rounds a warm one, and a variant whose median round is the cold one shows
    another TTFT and prefix-cache hit rate than one whose median is warm (seen: 8% against 87%
    hits, TTFT p50 65 ms against 36, in one run). Primed, every round runs in the same state:
    the prompts' full pages cached, as a repeated prompt finds them.

    interleave="prompts": at concurrency 1 a round interleaves the variants prompt by prompt
    (bench_paired_prompts), pairing them within seconds rather than within a round; other
    concurrencies keep the round's order (a slice of prompts at c > 1 would end in a tail the
    whole run does not have)."""
    for client in clients:
        for ids in prompt_ids:
            client.warm_up(ids)
    done: dict[tuple[int, int], list[dict]] = {}
    for r in range(rounds):
        order = [(i + r) % len(clients) for i in range(len(clients))]
        for c in concurrencies:
            if interleave == "prompts" and c == 1:
                paired = bench_paired_prompts(clients, prompt_ids, max_tokens,
                                              f"{len(clients)} modes, prompt by prompt (round {r + 1}/{rounds})",
                                              r, progress, kinds)
                for i, run in enumerate(paired):
                    done.setdefault((i, c), []).append(run)
                continue
            for i in order:
                run = bench_once(clients[i], prompt_ids, max_tokens, c, f"{labels[i]} (round {r + 1}/{rounds})",
                                 progress, kinds)
                done.setdefault((i, c), []).append(run)
    out = []
    for i in range(len(clients)):
        runs = []
        for c in concurrencies:
            each = done[i, c]
            median = sorted(each, key=lambda x: x["tokens_per_s"])[len(each) // 2]
            runs.append({**median, "rounds_tokens_per_s": [x["tokens_per_s"] for x in each]})
        out.append(runs)
    return out


@dataclass(frozen=True)
class Variant:
    """One column of the comparison: an in-process engine built from `config`, or (with
    `server`) the daemon at that address, whose requests speculate when `spec_on`, reached
    through the ZeroMQ client library or (with `http`) its OpenAI HTTP server."""

    label: str
    config: EngineConfig
    server: str | None = None
    spec_on: bool = True
    http: str | None = None  # the daemon's OpenAI HTTP server: requests go there (HttpClient)
    http_token: str | None = None
    scrape_s: float | None = None  # with http: GET /metrics this often while running


def compare_outputs(ours: list[list[int]], ref: list[list[int]], exact: bool = False) -> dict:
    """Token-for-token agreement, truncated to the shorter output (one may have hit EOS);
    `exact`: the lengths must match too (two runs of the same model and stopping rules)."""
    prefixes, identical = [], 0
    for a, b in zip(ours, ref):
        n = min(len(a), len(b))
        common = next((i for i in range(n) if a[i] != b[i]), n)
        prefixes.append(common)
        identical += (a == b) if exact else common == n
    return {"identical": identical, "compared": len(prefixes), "common_prefix": prefixes}


def run_bench(variants: list[Variant | tuple[str, EngineConfig]], prompts: list[str | Prompt], max_tokens: int,
              concurrencies: list[int], compare_hf: bool = False, progress: bool = True,
              make_engine: Callable[[EngineConfig], Engine] = Engine, shared_prefix: int = 0,
              rounds: int = 1, interleave: str = "rounds") -> dict:
    """Benchmark each variant in turn; speedups and identical outputs are relative to the
    first variant. `shared_prefix`: tokens of a common system prompt in front of every prompt.
    rounds > 1: every variant is loaded at once and the runs are interleaved round by round
    (bench_rounds); each speedup is then the median of the per-round ratios, with their range.
    interleave="prompts": at concurrency 1 the variants alternate prompt by prompt within each
    round (all loaded at once, even with one round).

    The HF reference and the bandwidth efficiency use the first variant at the lowest
    concurrency (1 unless the caller left it out).
    """
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    if interleave not in ("rounds", "prompts"):
        raise ValueError(f"interleave must be 'rounds' or 'prompts', got {interleave!r}")
    variants = [v if isinstance(v, Variant) else Variant(*v) for v in variants]
    prompts = [p if isinstance(p, Prompt) else Prompt(p) for p in prompts]
    kinds = [p.kind for p in prompts]
    base_c = min(concurrencies)
    report: dict = {
        "config": {"num_prompts": len(prompts), "max_tokens": max_tokens, "concurrency": concurrencies,
                   "torch": torch.__version__, "threads": torch.get_num_threads(),
                   "machine": platform.machine(), "cpus": os.cpu_count(),
                   # Other processes on the cores make every timing here noisy; record it.
                   "load_avg_1m": os.getloadavg()[0], "prompt_kinds": kinds, "shared_prefix_tokens": shared_prefix},
        "bandwidth": {"copy_bytes_per_s": copy_bandwidth(), "method": "numpy copy, 256 MB, best of 5"},
        "variants": [],
        "hf": None,
    }
    report["config"]["rounds"] = rounds
    report["config"]["interleave"] = interleave
    prompt_ids: list[list[int]] | None = None
    model_dir = resolve_model_dir(variants[0].config.model, progress=progress)  # cached: no reconversion

    def open_client(v: Variant):
        """(client, closer, weight bytes or None): an in-process engine, or the daemon's connection."""
        nonlocal prompt_ids
        if v.server is None:
            engine = make_engine(v.config)
            prompt_ids = prompt_ids or encode_prompts(engine.tokenizer, engine.max_model_len, prompts, shared_prefix)
            return EngineClient(engine), engine.close, weight_bytes(engine.model)
        client = HttpClient(v.http, v.spec_on, v.http_token, v.scrape_s, stats_from=v.server) if v.http \
            else ServerClient(v.server, v.spec_on)
        if prompt_ids is None:
            from overlap.models.loading import load_tokenizer

            prompt_ids = encode_prompts(load_tokenizer(model_dir), v.config.scheduler.max_model_len, prompts,
                                        shared_prefix)
        return client, client.close, None

    # 1. the engines or server connections, and every concurrency on each: one variant at a
    # time (its weights and KV pool freed before the next loads), or all at once, interleaved.
    if rounds == 1 and interleave == "rounds":
        measured = []
        for v in variants:
            client, close, wbytes = open_client(v)
            try:
                measured.append((bench_variant(client, prompt_ids, max_tokens, concurrencies, v.label, progress,
                                               kinds), wbytes))
            finally:
                close()
            del client
    else:
        opened = []
        try:
            for v in variants:
                opened.append(open_client(v))
            all_runs = bench_rounds([o[0] for o in opened], [v.label for v in variants], prompt_ids, max_tokens,
                                    concurrencies, rounds, progress, kinds, interleave)
        finally:
            for _, close, _ in opened:
                close()
        measured = [(runs, o[2]) for runs, o in zip(all_runs, opened)]
        del opened
    for v, (runs, wbytes) in zip(variants, measured):
        # 2. bandwidth floor for this variant's dtype (in-process variants: we know the weights)
        floor_ms = wbytes / report["bandwidth"]["copy_bytes_per_s"] * 1e3 if wbytes else None
        measured = next(r for r in runs if r["concurrency"] == base_c)["itl_mean_ms"]
        report["variants"].append({
            "label": v.label, "engine_config": dataclasses.asdict(v.config), "server": v.server, "http": v.http,
            "scrape_s": v.scrape_s, "runs": runs,
            "weight_bytes": wbytes, "floor_ms_per_token": floor_ms, "ms_per_token": measured,
            "bandwidth_efficiency": floor_ms / measured if measured and floor_ms else None,
        })
    # 3. speedup and output agreement against the first variant, per concurrency
    base = {r["concurrency"]: r for r in report["variants"][0]["runs"]}
    for i, v in enumerate(report["variants"]):
        for r in v["runs"]:
            ref = base[r["concurrency"]]
            r["speedup"] = r["tokens_per_s"] / ref["tokens_per_s"]
            if "rounds_tokens_per_s" in r:  # paired round by round: both ran within the same minute
                ratios = [a / b for a, b in zip(r["rounds_tokens_per_s"], ref["rounds_tokens_per_s"])]
                r["speedup"] = float(np.median(ratios))
                r["speedup_rounds"] = ratios
            r["vs_baseline"] = None if i == 0 else compare_outputs(
                [o["token_ids"] for o in r["outputs"]], [o["token_ids"] for o in ref["outputs"]], exact=True)
    report["config"]["prompt_tokens"] = [len(p) for p in prompt_ids or []]
    # 4. transformers reference, batch 1, same ids and dtype as the first variant
    if compare_hf:
        from runtime.hf_reference import run_reference

        first = report["variants"][0]
        hf = run_reference(model_dir, first["engine_config"]["dtype"], prompt_ids, max_tokens, progress)
        ours = next(r for r in first["runs"] if r["concurrency"] == base_c)
        hf["ours_concurrency"] = base_c
        hf["speed_ratio"] = ours["tokens_per_s"] / hf["tokens_per_s"]
        hf.update(compare_outputs([o["token_ids"] for o in ours["outputs"]], hf["token_ids"]))
        report["hf"] = hf
    return report


# -- output --------------------------------------------------------------------------------


def _fmt(v, spec: str = ".1f") -> str:
    return "-" if v is None else format(v, spec)


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(h.ljust(w) if i == 0 else h.rjust(w) for i, (h, w) in enumerate(zip(row, widths)))
             for row in [header, *rows]]
    return "\n".join(lines)


def _device_cells(d: dict | None) -> list[str]:
    if not d:
        return ["-", "-", "-"]
    pct = lambda x: "-" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    return [pct(d["device_idle_fraction"]), _fmt(d["plan_ms_per_step"], ".2f"), pct(d["plan_hidden_fraction"])]


def _speedup_cell(run: dict) -> str:
    """0.98x, or with rounds the median of the paired ratios and their range: 0.98x (0.95-1.02)."""
    cell = _fmt(run["speedup"], ".2f") + "x"
    ratios = run.get("speedup_rounds")
    if ratios and len(ratios) > 1:
        cell += f" ({min(ratios):.2f}-{max(ratios):.2f})"
    return cell


def format_report(report: dict) -> str:
    """The terminal table: one row per (variant, concurrency), then bandwidth and HF lines."""
    header = ["variant", "conc", "reqs", "out tok", "wall s", "tok/s", "req/s", "TTFT p50 ms",
              "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "speedup", "acc len", "acc/pos", "mean k", "identical",
              "dev idle", "plan ms", "hidden"]
    rows, kind_lines = [], []
    for v in report["variants"]:
        for r in v["runs"]:
            same = r.get("vs_baseline")
            rows.append([v["label"], str(r["concurrency"]), str(r["requests"]), str(r["output_tokens"]),
                         _fmt(r["wall_s"], ".2f"), _fmt(r["tokens_per_s"]), _fmt(r["requests_per_s"], ".2f"),
                         _fmt(r["ttft_p50_ms"]), _fmt(r["ttft_p99_ms"]), _fmt(r["itl_p50_ms"]),
                         _fmt(r["itl_p99_ms"]), _speedup_cell(r),
                         _fmt(r.get("acceptance_length"), ".2f"),
                         " ".join(f"{x:.2f}" for x in r.get("acceptance_per_position") or []) or "-",
                         _fmt(r.get("mean_k"), ".2f"),
                         f"{same['identical']}/{same['compared']}" if same else "-",
                         *_device_cells(r.get("device"))])
            if r.get("by_kind"):
                kind_lines.append(f"  {v['label']} c={r['concurrency']}: " + " | ".join(
                    f"{k} (n={m['requests']}) acc len {_fmt(m['acceptance_length'], '.2f')}, "
                    f"decode {_fmt(m['decode_tokens_per_s'])} tok/s" for k, m in r["by_kind"].items()))
    out = [_table(header, rows)]
    if len(report["variants"]) > 1:
        out.append(f"identical: token ids equal to {report['variants'][0]['label']}'s at the same "
                   f"concurrency (greedy speculation must match exactly)")
    if any(r.get("mean_k") is not None for v in report["variants"] for r in v["runs"]):
        out.append("mean k: drafts (EAGLE: tree nodes) verified per decode step of a speculating request, "
                   "as the speculation controller chose them (0 = plain decode); k per variant and "
                   "concurrency: " + "; ".join(
                       f"{v['label']} c={r['concurrency']} {r['k_histogram']}" for v in report["variants"]
                       for r in v["runs"] if r.get("k_histogram")))
    out.append("dev idle: share of device time idle between and inside steps (waiting for the host); "
               "plan ms: host time per step from one step's ids to the next step's launch; hidden: "
               "share of it that ran while the device was busy")
    if kind_lines:
        out += ["by prompt kind (per-request decode tok/s, averaged):", *kind_lines]
    out += prefix_cache_lines(report)
    out.append("")
    bw = report["bandwidth"]["copy_bytes_per_s"]
    c = min(report["config"]["concurrency"])
    out.append(f"memory bandwidth: {bw / 1e9:.2f} GB/s ({report['bandwidth']['method']})")
    for v in report["variants"]:
        if v["weight_bytes"] is None:
            continue  # a server variant: its weights live in another process
        out.append(f"[{v['label']}] weights {v['weight_bytes'] / 1e6:.1f} MB/token "
                   f"({v['engine_config']['dtype']}) -> floor {v['floor_ms_per_token']:.2f} ms/token; "
                   f"measured {_fmt(v['ms_per_token'], '.2f')} ms/token (mean ITL, c={c}); "
                   f"bandwidth efficiency {_fmt(v['bandwidth_efficiency'], '.2f')}")
    cfg = report["config"]
    if cfg["load_avg_1m"] > 0.5 * (cfg["cpus"] or 1):
        out.append(f"note: load average {cfg['load_avg_1m']:.1f} on {cfg['cpus']} CPUs at the start: "
                   f"other processes compete for the cores, timings are noisy")
    hf = report.get("hf")
    if hf:
        out.append(f"HF transformers ({hf['dtype']}, batch 1): {hf['tokens_per_s']:.1f} tok/s; "
                   f"ours/HF at c={hf['ours_concurrency']}: {hf['speed_ratio']:.2f}x; identical outputs "
                   f"{hf['identical']}/{hf['compared']} (common prefix per prompt: "
                   f"{' '.join(map(str, hf['common_prefix']))})")
    return "\n".join(out)


def ttft_with_and_without_cache(report: dict) -> list[dict]:
    """Pairs of runs of the same mode and concurrency, with the prefix cache and without (the
    variant labelled "<mode> no-prefix-cache"): TTFT p50 of each and the ratio."""
    by_label = {v["label"]: v for v in report["variants"]}
    pairs = []
    for v in report["variants"]:
        off = by_label.get(f"{v['label']} no-prefix-cache")
        if off is None:
            continue
        off_runs = {r["concurrency"]: r for r in off["runs"]}
        for r in v["runs"]:
            other = off_runs.get(r["concurrency"])
            if other and r["ttft_p50_ms"] and other["ttft_p50_ms"]:
                pairs.append({"mode": v["label"], "concurrency": r["concurrency"], "ttft_p50_ms_cached":
                              r["ttft_p50_ms"], "ttft_p50_ms_uncached": other["ttft_p50_ms"],
                              "ratio": other["ttft_p50_ms"] / r["ttft_p50_ms"],
                              "hit_rate": (r.get("prefix_cache") or {}).get("hit_rate")})
    return pairs


def prefix_cache_lines(report: dict) -> list[str]:
    lines = []
    for v in report["variants"]:
        for r in v["runs"]:
            use = r.get("prefix_cache")
            if use and use["queried_tokens"]:
                lines.append(f"  {v['label']} c={r['concurrency']}: hit rate {100 * use['hit_rate']:.1f}% "
                             f"({use['hit_tokens']} of {use['queried_tokens']} prompt tokens cached)")
    if lines:
        shared = report["config"].get("shared_prefix_tokens")
        lines.insert(0, "prefix cache" + (f" (every prompt starts with the same {shared} tokens):" if shared else ":"))
    for p in ttft_with_and_without_cache(report):
        lines.append(f"  TTFT p50 {p['mode']} c={p['concurrency']}: {p['ttft_p50_ms_cached']:.1f} ms with the prefix "
                     f"cache, {p['ttft_p50_ms_uncached']:.1f} ms without ({p['ratio']:.1f}x lower)")
    return lines


def write_report(report: dict, path: str | Path) -> None:
    Path(path).write_text(json.dumps(report, indent=2) + "\n")
