"""Load test a running daemon: N requests at concurrency C, through the ZeroMQ client library
or through the websocket bridge, bounded in count and in time.

    python tools/loadtest.py --server tcp://127.0.0.1:5557 --requests 1000 --concurrency 64
    python tools/loadtest.py --ws ws://127.0.0.1:8765/ --requests 200 --concurrency 16
    python tools/loadtest.py --server ADDR --disconnect-fraction 0.2    # clients vanish mid-stream

Each of the C workers holds one connection and runs its share of the requests one after
another. A request picked to disconnect (a fixed, seeded choice) closes its worker's
connection after its first delta, without aborting; the worker then reconnects. The server
must notice and free the request's pages. Every request ends in one of:
  completed     its final delta arrived;
  errored       the server answered with an error (refused, overloaded, failed);
  disconnected  abandoned on purpose (not a failure);
  lost          none of the above before the deadline: must be 0.
Afterwards the daemon's stats() must come back to idle (every page free, no live request)
within --settle seconds. Reported: the counts, output tokens/s, TTFT and inter-token latency
p50/p99 (ms), and the page check. `--json OUT` writes it all.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.client import AsyncClient, ServerError  # noqa: E402

PROMPTS = [  # short, varied; not the benchmark prompts
    "The quick brown fox", "def add(a, b):", "List three colours:", "Once upon a time",
    "import os\nimport sys\n", "The capital of Italy is", "for i in range(", "Dear team,",
]


@dataclass
class Outcome:
    status: str = "lost"  # completed | errored | disconnected | lost
    submitted: float = 0.0
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens) per delta
    error: str | None = None


@dataclass
class Plan:
    requests: int
    concurrency: int
    max_tokens: int
    disconnect: set[int]  # request indices that abandon their stream
    deadline: float  # monotonic time after which unfinished requests count as lost
    spec: bool = True


async def zmq_worker(address: str, queue: asyncio.Queue, plan: Plan, outcomes: list[Outcome]) -> None:
    client = AsyncClient(address, timeout=max(1.0, plan.deadline - time.monotonic()))
    try:
        while not queue.empty():
            i = queue.get_nowait()
            out = outcomes[i]
            out.submitted = time.perf_counter()
            try:
                stream = client.stream(PROMPTS[i % len(PROMPTS)], max_tokens=plan.max_tokens, ignore_eos=True,
                                       spec=plan.spec, timeout=max(0.1, plan.deadline - time.monotonic()))
                async for d in stream:
                    if d.token_ids:
                        out.arrivals.append((time.perf_counter(), len(d.token_ids)))
                    if i in plan.disconnect:
                        # Vanish: drop the connection without an abort, as a killed client
                        # would (a closed client sends nothing, not even the stream's abort).
                        client.close()
                        client = AsyncClient(address, timeout=client.timeout)
                        out.status = "disconnected"
                        break
                    if d.finish_reason:
                        out.status = "completed"
            except ServerError as e:
                out.status, out.error = "errored", f"{e.code}: {e.message}"
            except TimeoutError:
                out.status = "lost"
    finally:
        client.close()


async def ws_worker(url: str, queue: asyncio.Queue, plan: Plan, outcomes: list[Outcome]) -> None:
    from websockets.asyncio.client import connect

    ws = await connect(url)
    try:
        while not queue.empty():
            i = queue.get_nowait()
            out = outcomes[i]
            out.submitted = time.perf_counter()
            await ws.send(json.dumps({"type": "generate", "id": str(i), "prompt": PROMPTS[i % len(PROMPTS)],
                                      "params": {"max_tokens": plan.max_tokens, "ignore_eos": True},
                                      "spec": {"mode": None if plan.spec else "none"}}))
            while True:
                left = plan.deadline - time.monotonic()
                try:
                    msg = json.loads(await asyncio.wait_for(ws.recv(), max(0.1, left)))
                except asyncio.TimeoutError:
                    out.status = "lost"
                    return
                if msg.get("id") != str(i):
                    continue
                if msg["type"] == "error":
                    out.status, out.error = "errored", f"{msg['code']}: {msg['message']}"
                    break
                if msg["token_ids"]:
                    out.arrivals.append((time.perf_counter(), len(msg["token_ids"])))
                if i in plan.disconnect:
                    await ws.close()
                    ws = await connect(url)
                    out.status = "disconnected"
                    break
                if msg["type"] == "done":
                    out.status = "completed"
                    break
    finally:
        await ws.close()


def _pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


def summarize(outcomes: list[Outcome], wall_s: float) -> dict:
    counts = {s: sum(o.status == s for o in outcomes) for s in ("completed", "errored", "disconnected", "lost")}
    done = [o for o in outcomes if o.status == "completed"]
    tokens = sum(n for o in outcomes for _, n in o.arrivals)
    ttft = [(o.arrivals[0][0] - o.submitted) * 1e3 for o in done if o.arrivals]
    itl = []
    for o in done:
        for (prev, _), (now, n) in zip(o.arrivals, o.arrivals[1:]):
            itl += [(now - prev) * 1e3 / n] * n
    errors: dict[str, int] = {}
    for o in outcomes:
        if o.error:
            errors[o.error] = errors.get(o.error, 0) + 1
    return {**counts, "requests": len(outcomes), "wall_s": wall_s, "output_tokens": tokens,
            "tokens_per_s": tokens / wall_s if wall_s else None,
            "ttft_p50_ms": _pct(ttft, 50), "ttft_p99_ms": _pct(ttft, 99),
            "itl_p50_ms": _pct(itl, 50), "itl_p99_ms": _pct(itl, 99), "errors": errors}


async def settle(address: str, timeout_s: float) -> dict:
    """Wait until the daemon is idle again: every page free, no live request."""
    async with AsyncClient(address, timeout=30) as client:
        deadline = time.monotonic() + timeout_s
        while True:
            stats = await client.stats()
            idle = stats["free_pages"] == stats["total_pages"] and stats["live_requests"] == 0
            if idle or time.monotonic() > deadline:
                return {"pages_all_free": idle, "free_pages": stats["free_pages"],
                        "total_pages": stats["total_pages"], "live_requests": stats["live_requests"],
                        "disconnects_seen": stats.get("disconnects")}
            await asyncio.sleep(0.2)


async def run(args) -> dict:
    rng = random.Random(args.seed)
    n_drop = round(args.requests * args.disconnect_fraction)
    plan = Plan(args.requests, args.concurrency, args.max_tokens, set(rng.sample(range(args.requests), n_drop)),
                time.monotonic() + args.time_limit, spec=not args.no_spec)
    outcomes = [Outcome() for _ in range(args.requests)]
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(args.requests):
        queue.put_nowait(i)
    worker = (lambda: ws_worker(args.ws, queue, plan, outcomes)) if args.ws else \
        (lambda: zmq_worker(args.server, queue, plan, outcomes))
    start = time.perf_counter()
    bar = asyncio.create_task(_progress(outcomes, args.requests)) if sys.stderr.isatty() else None
    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    wall = time.perf_counter() - start
    if bar:
        bar.cancel()
    report = {"path": "websocket" if args.ws else "zeromq", "concurrency": args.concurrency,
              "max_tokens": args.max_tokens, "disconnect_fraction": args.disconnect_fraction,
              **summarize(outcomes, wall)}
    if args.server:
        report["after"] = await settle(args.server, args.settle)
    return report


async def _progress(outcomes: list[Outcome], total: int) -> None:
    from tqdm import tqdm

    with tqdm(total=total, unit="req", file=sys.stderr) as bar:
        while True:
            bar.n = sum(o.status != "lost" for o in outcomes)
            bar.refresh()
            await asyncio.sleep(0.5)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", metavar="ADDRESS", help="the daemon's ZeroMQ address (also used for the page check)")
    p.add_argument("--ws", metavar="URL", help="go through the websocket bridge at this ws:// URL instead")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--disconnect-fraction", type=float, default=0.0)
    p.add_argument("--no-spec", action="store_true", help="requests without speculation")
    p.add_argument("--time-limit", type=float, default=900.0, help="seconds before unfinished requests are lost")
    p.add_argument("--settle", type=float, default=30.0, help="seconds for the pages to come back afterwards")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="OUT")
    args = p.parse_args(argv)
    if not args.server and not args.ws:
        p.error("give --server (and/or --ws)")
    if args.requests < 1 or args.concurrency < 1 or not 0 <= args.disconnect_fraction <= 1:
        p.error("--requests and --concurrency must be >= 1, --disconnect-fraction in [0, 1]")
    report = asyncio.run(run(args))
    print(json.dumps({k: v for k, v in report.items()}, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    ok = report["lost"] == 0 and report.get("after", {}).get("pages_all_free", True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
