"""Prometheus metrics for the HTTP server (`GET /metrics`), collected off the hot path.

Two sources, neither of which asks the executor for anything per token:

- **per request**, from the final stats every request's last `Delta` already carries (usage,
  TTFT, latency, drafts per position) plus the arrival time of each delta, which the HTTP
  handler notes as it forwards it; observed once, when the request ends. These describe the
  requests that went through this HTTP server.
- **server-wide**, from the daemon's `stats()` (the scheduler's queues and pages, the
  executor's cumulative device busy/idle time, the tokenizer's request counts), asked for at
  scrape time: one query per scrape, answered by the scheduler between steps.

Names follow Prometheus conventions (`_total` counters, `_seconds` units); a scrape that
cannot reach the daemon reports `overlap_daemon_up 0` and leaves the server-wide series out.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                   20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5)
ACCEPTANCE_BUCKETS = (1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0, 12.0, 17.0)
DRAFTS_PER_STEP_BUCKETS = (0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 5.0, 6.0, 8.0, 12.0, 16.0)


class DaemonStats(Collector):
    """The last `stats()` of the daemon as Prometheus families (set just before a scrape)."""

    def __init__(self) -> None:
        self.latest: dict | None = None

    def collect(self):
        s = self.latest
        up = GaugeMetricFamily("overlap_daemon_up", "1 if the daemon answered the stats query of this scrape")
        up.add_metric([], 0.0 if s is None or "error" in s else 1.0)
        yield up
        if s is None:
            return

        def gauge(name: str, doc: str, key: str):
            if key in s:
                yield GaugeMetricFamily(name, doc, value=float(s[key]))

        def counter(name: str, doc: str, key: str):
            if key in s:
                yield CounterMetricFamily(name, doc, value=float(s[key]))

        yield from gauge("overlap_requests_running", "Requests in the running batch (server-wide)", "running")
        yield from gauge("overlap_requests_waiting", "Requests waiting to be scheduled (server-wide)", "waiting")
        if "free_pages" in s and "total_pages" in s:
            yield GaugeMetricFamily("overlap_kv_pages_free", "Free KV-cache pages", value=float(s["free_pages"]))
            yield GaugeMetricFamily("overlap_kv_pages_used", "KV-cache pages held by requests",
                                    value=float(s["total_pages"] - s["free_pages"]))
            yield GaugeMetricFamily("overlap_kv_pages_total", "KV-cache pages", value=float(s["total_pages"]))
        yield from counter("overlap_preemptions", "Sequences preempted (recomputed later) for lack of pages",
                           "preemptions")
        yield from counter("overlap_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache "
                           "at admission", "prefix_cache_queried_tokens")
        yield from counter("overlap_prefix_cache_hit_tokens", "Prompt tokens whose KV was found in the prefix cache "
                           "(hit rate = hit / queried)", "prefix_cache_hit_tokens")
        yield from gauge("overlap_prefix_cache_pages", "KV pages in the prefix cache (held or evictable)",
                         "prefix_cache_pages")
        yield from counter("overlap_prefix_cache_evictions", "Cached KV pages evicted to make room",
                           "prefix_cache_evictions")
        yield from counter("overlap_steps", "Steps the executor ran", "steps")
        yield from gauge("overlap_spec_mean_k", "Drafts (EAGLE: tree nodes) the speculation controller chose per "
                         "speculating decode, averaged over the server's life", "spec_mean_k")
        yield from counter("overlap_spec_detached", "Requests the speculation controller stopped speculating "
                           "for (many steps without drafts: the drafter stops following them)", "spec_detached")
        yield from counter("overlap_device_busy_seconds", "Device time spent running steps", "device_busy_s")
        yield from counter("overlap_device_idle_seconds", "Device time idle between and inside steps",
                           "device_idle_s")
        yield from counter("overlap_host_plan_seconds", "Host time preparing steps", "plan_s")
        yield from counter("overlap_host_plan_hidden_seconds", "Host preparation time hidden under device work",
                           "hidden_plan_s")
        events = CounterMetricFamily("overlap_server_requests", "Requests seen by the daemon (all clients), by event",
                                     labels=["event"])
        for event in ("received", "rejected", "finished", "aborted"):
            if event in s:
                events.add_metric([event], float(s[event]))
        yield events
        yield from counter("overlap_client_disconnects", "ZeroMQ client connections found gone mid-request",
                           "disconnects")


class Metrics:
    """The HTTP server's registry: per-request series and the daemon's stats."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.in_flight = Gauge("overlap_http_requests_in_flight", "Generation requests this HTTP server is serving",
                               registry=r)
        self.finished = Counter("overlap_requests_finished", "Requests served over HTTP that ended, by reason "
                                "(stop, length, abort = the client went away, error)", ["reason"], registry=r)
        for reason in ("stop", "length", "abort", "error"):
            self.finished.labels(reason)
        self.prompt_tokens = Counter("overlap_prompt_tokens", "Prompt tokens of requests served over HTTP", registry=r)
        self.generation_tokens = Counter("overlap_generation_tokens", "Tokens generated for requests served over HTTP",
                                         registry=r)
        self.ttft = Histogram("overlap_time_to_first_token_seconds", "Time from arrival to the first token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("overlap_inter_token_latency_seconds", "Time between output tokens (a delta of n "
                             "tokens counts its gap / n for each)", buckets=ITL_BUCKETS, registry=r)
        self.latency = Histogram("overlap_request_latency_seconds", "Time from arrival to the last token",
                                 buckets=LATENCY_BUCKETS, registry=r)
        self.draft_steps = Counter("overlap_spec_draft_steps", "Steps that verified drafts", registry=r)
        self.draft_tokens = Counter("overlap_spec_draft_tokens", "Draft tokens proposed and verified", registry=r)
        self.accepted_tokens = Counter("overlap_spec_accepted_tokens", "Draft tokens the target accepted",
                                       registry=r)
        self.drafted_at = Counter("overlap_spec_draft_tokens_by_position",
                                  "Draft tokens proposed at each chain position (0 = first)", ["position"],
                                  registry=r)
        self.accepted_at = Counter("overlap_spec_accepted_tokens_by_position",
                                   "Draft tokens accepted at each chain position (0 = first)", ["position"],
                                   registry=r)
        self.acceptance_length = Histogram("overlap_spec_acceptance_length", "Tokens per verify step of a request "
                                           "(1 + accepted drafts / draft steps)", buckets=ACCEPTANCE_BUCKETS,
                                           registry=r)
        self.drafts_per_step = Histogram("overlap_spec_draft_tokens_per_step", "Draft tokens chosen per verify "
                                         "step of a request (its mean)", buckets=DRAFTS_PER_STEP_BUCKETS, registry=r)
        self.daemon = DaemonStats()
        r.register(self.daemon)

    def request_finished(self, reason: str, stats: dict | None, delta_times: list[tuple[float, int]]) -> None:
        """One request ended: `stats` is its final delta's (None when it never got one), and
        `delta_times` the (arrival time, tokens) of each delta that carried tokens."""
        self.finished.labels(reason if reason in ("stop", "length", "abort") else "error").inc()
        if not stats:
            return
        self.prompt_tokens.inc(stats.get("prompt_tokens") or 0)
        self.generation_tokens.inc(stats.get("output_tokens") or 0)
        if stats.get("ttft_s") is not None:
            self.ttft.observe(stats["ttft_s"])
        if stats.get("latency_s") is not None and stats.get("output_tokens"):
            self.latency.observe(stats["latency_s"])
        for (t0, _), (t1, n) in zip(delta_times, delta_times[1:]):
            gap = (t1 - t0) / n
            for _ in range(n):
                self.itl.observe(gap)
        if stats.get("drafts"):
            self.draft_steps.inc(stats["drafts"])
            self.draft_tokens.inc(stats["draft_tokens"])
            self.accepted_tokens.inc(stats["accepted_tokens"])
            for i, n in enumerate(stats.get("drafted_per_position", [])):
                self.drafted_at.labels(str(i)).inc(n)
            for i, n in enumerate(stats.get("accepted_per_position", [])):
                self.accepted_at.labels(str(i)).inc(n)
            self.acceptance_length.observe(stats["acceptance_length"])
            self.drafts_per_step.observe(stats["draft_tokens"] / stats["drafts"])
