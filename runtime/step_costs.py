"""Step costs: what one forward costs for q rows per sequence, the curve speculation plans with.

    overlap bench --step-costs --json runs/step_costs.json --plot runs/step_costs.png

speedup ≈ acceptance_length / (r(q) + k·c) (docs/architecture.md): r(q) is a target step over
q rows per sequence relative to a 1-row step, c one drafter step relative to a target step.
This measures both directly on the engine's own forward (the model, its KV pool and the
configured attention backend, logits for every row as a verify pass needs), at a fixed
context, for batch 1 and batch 8: the median of several timed runs after warm-up.
"""

from __future__ import annotations

import json
import platform
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from overlap.attention import SeqAttention, make_backend
from overlap.config import HEAD_METHODS, EngineConfig, default_draft_dir, default_head_dir
from overlap.models.llama import LlamaModel

ROWS = (1, 2, 4, 5, 8, 9, 16)
BATCHES = (1, 8)


def on_a_worker_thread(fn):
    """fn() on a thread of its own, as the engine runs its forwards (a CPU stream is a worker
    thread, overlap/device.py), so the curve is measured in the engine's threading: which
    thread opens torch's OpenMP regions changes how they and the kernels' pool.h helpers
    share the cores. (With OpenMP spinning, i.e. torch imported before overlap, the main
    thread measured 8 rows at 32 ms against 20 on a worker; with the passive wait that
    `import overlap` sets, the two agree within the noise: session 15.)"""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="overlap-step-costs") as worker:
        return worker.submit(fn).result()


def _timed_rounds(calls: dict, rounds: int, warmups: int = 1) -> dict:
    """Seconds of each call, once per round, round-robin (a slow spell of the machine lands on
    every call alike), after `warmups` untimed calls each (first touch of buffers, lazy
    kernel loads); on a worker thread, as the engine runs its forwards."""
    def run() -> dict:
        for fn in calls.values():
            for _ in range(warmups):
                fn()
        times = {key: [] for key in calls}
        for _ in range(rounds):
            for key, fn in calls.items():
                start = time.perf_counter()
                fn()
                times[key].append(time.perf_counter() - start)
        return times

    return on_a_worker_thread(run)


def _median_ms(fn, repeats: int) -> float:
    return statistics.median(_timed_rounds({0: fn}, repeats, warmups=2)[0]) * 1e3


class _Step:
    """One forward of sequences with `rows[i]` new tokens each after `context` cached ones."""

    def __init__(self, forward, kv_pool, backend, rows: list[int], context: int, vocab: int):
        page = kv_pool.page_size
        pages_per_seq = -(-(context + max(rows)) // page)
        seqs = [SeqAttention(q, context + q, list(range(b * pages_per_seq, (b + 1) * pages_per_seq)))
                for b, q in enumerate(rows)]
        self.meta = backend.plan(seqs, page)
        gen = torch.Generator().manual_seed(sum(rows) * 100 + len(rows))
        self.ids = torch.randint(0, vocab, (sum(rows),), generator=gen)
        self.positions = torch.cat([torch.arange(context, context + q) for q in rows])
        self.logits_rows = torch.arange(sum(rows))
        self.forward = forward

    def __call__(self):
        return self.forward(self.ids, self.positions, self.meta, self.logits_rows)


def _pool_pages(context: int, page_size: int) -> int:
    return max(BATCHES) * (-(-(context + max(ROWS)) // page_size)) + 1


def measure(model: LlamaModel, config: EngineConfig = EngineConfig(), context: int = 256,
            repeats: int = 7, head_dir=None, draft_dir=None, progress=None) -> dict:
    """The report: target ms per (batch, rows), head and draft-model ms per batch, ratios."""
    page = config.cache.page_size
    backend = make_backend(config.attention_backend, config.device)
    vocab = model.cfg.vocab_size
    kv = model.new_kv_pool(_pool_pages(context, page), page)

    def target(ids, pos, meta, rows):
        return model(ids, pos, backend, kv, meta, rows)

    report: dict = {"context": context, "repeats": repeats, "machine": machine(), "target": {}, "ratio": {}}
    for batch in BATCHES:
        costs = {}
        for rows in ROWS:
            costs[rows] = _median_ms(_Step(target, kv, backend, [rows] * batch, context, vocab), repeats)
            if progress:
                progress(f"target batch {batch} rows {rows}: {costs[rows]:.2f} ms")
        report["target"][batch] = costs
        report["ratio"][batch] = {rows: costs[rows] / costs[1] for rows in ROWS}

    from overlap.speculative.build import drafter_matmul

    # The drafters as the engine would run them (spec.drafter_weights: int8 on the CPU by default).
    weights = drafter_matmul(config, model)
    report["drafter_weights"] = "int8" if weights == "int8" else "bf16"
    pages = _pool_pages(context, page)
    head_step, head_kv, head = _head_step(model, config, head_dir or default_head_dir(), backend, pages)
    report["head_vocab"] = len(head.vocab_ids) if head.vocab_ids is not None else vocab
    draft_step, draft_kv = _draft_step(model, config, draft_dir or default_draft_dir(), backend, pages)

    for name, fn, pool in (("head", head_step, head_kv), ("draft", draft_step, draft_kv)):
        report[name] = {}
        for batch in BATCHES:
            ms = _median_ms(_Step(fn, pool, backend, [1] * batch, context, vocab), repeats)
            report[name][batch] = ms
            if progress:
                progress(f"{name} batch {batch}: {ms:.2f} ms ({ms / report['target'][batch][1]:.3f} of a target step)")
        report[f"{name}_fraction"] = {b: report[name][b] / report["target"][b][1] for b in BATCHES}
    return report


def _head_step(model: LlamaModel, config: EngineConfig, head_dir, backend, pages: int):
    """(forward, its KV pool, the head) of one MTP/EAGLE head step as the engine runs it: its
    weights (spec.drafter_weights) and draft vocabulary, on made-up hidden states."""
    from overlap.models.heads import load_head
    from overlap.speculative.build import drafter_matmul

    head = load_head(head_dir, model, draft_vocab=config.spec.draft_vocab,
                     matmul=drafter_matmul(config, model) or "exact")
    kv = head.new_kv_pool(pages, config.cache.page_size)
    hidden = torch.randn(max(BATCHES), model.cfg.hidden_size).to(model.dtype)

    def step(ids, pos, meta, rows):
        return head(ids, hidden[: ids.numel()], pos, backend, kv, meta, rows)
    return step, kv, head


def _draft_step(model: LlamaModel, config: EngineConfig, draft_dir, backend, pages: int):
    """(forward, its KV pool) of one draft-model step as the engine runs it."""
    from overlap.speculative.build import drafter_matmul
    from overlap.speculative.draft_target import load_draft

    draft = load_draft(draft_dir, model, drafter_matmul(config, model))
    kv = draft.model.new_kv_pool(pages, config.cache.page_size)

    def step(ids, pos, meta, rows):
        h, _ = draft.model(ids, pos, backend, kv, meta)
        return draft.logits(h[rows])
    return step, kv


def machine() -> dict:
    """What the numbers ran on: CPU model, torch threads, the kernel variant."""
    from overlap.kernels import cpu_model, kernels_name

    return {"cpu": cpu_model() or platform.processor(), "threads": torch.get_num_threads(), "kernels": kernels_name(),
            "torch": torch.__version__}


def format_report(report: dict) -> str:
    lines = [f"step costs at context {report['context']} (median of {report['repeats']}; "
             f"{report['machine']['cpu']}, {report['machine']['threads']} threads, kernels "
             f"{report['machine']['kernels']})",
             "rows/seq | " + " | ".join(f"batch {b}: ms (r)" for b in report["target"])]
    for rows in ROWS:
        cells = [f"{report['target'][b][rows]:7.2f} ({report['ratio'][b][rows]:.2f})" for b in report["target"]]
        lines.append(f"{rows:8d} | " + " | ".join(cells))
    for name in ("head", "draft"):
        cells = [f"batch {b}: {report[name][b]:.2f} ms = {report[name + '_fraction'][b]:.3f} of a target step"
                 for b in report[name]]
        lines.append(f"{name} step ({report.get('drafter_weights', 'bf16')} weights): " + "; ".join(cells))
    return "\n".join(lines)


def plot(report: dict, path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    # One panel per batch size: batch 8 costs several times batch 1, and on one axis the
    # batch-1 curve (the one speculation at low load lives on) would look flat.
    fig, axes = plt.subplots(1, len(report["target"]), figsize=(11, 4.2), squeeze=False)
    for ax, (batch, costs) in zip(axes[0], report["target"].items()):
        ax.plot([int(r) for r in costs], list(costs.values()), "o-", color="C0", label="target step")
        for name, style, color in (("head", "--", "C1"), ("draft", ":", "C2")):
            ax.axhline(report[name][batch], color=color, linestyle=style,
                       label=f"{name} step ({report[name + '_fraction'][batch]:.2f} of a 1-row target step)")
        ax.set_title(f"batch {batch}")
        ax.set_xlabel("rows per sequence (q = k+1 or tree size)")
        ax.set_ylabel("ms per step")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    fig.suptitle(f"step cost at context {report['context']} ({report['machine']['cpu']}, "
                 f"kernels {report['machine']['kernels']})", fontsize=10)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# -- the speculation controller's curve ------------------------------------------------------

# What a drafter step costs relative to a target step, as measured on the project's CPU
# (docs/fast_steps.md: head 0.10, draft model 0.18); n-gram drafts cost no device work.
DRAFTER_FRACTION = {"draft": 0.18, "mtp": 0.10, "eagle": 0.10, "ngram": 0.0}
# The target curve of docs/fast_steps.md (total rows → ms, ctx 256: batch 1 and batch 8), the
# prior of a server that has neither a calibration nor a report; corrected online.
DEFAULT_CURVE = {1: 16.8, 2: 17.5, 4: 19.3, 8: 27.6, 16: 36.2, 32: 52.6, 64: 84.5, 128: 162.4}
# Total rows: every verify shape of k <= 5 at batch 1 (k + 1 rows) and EAGLE's 9-row tree,
# then a batch of 8 growing; the decisions are made between neighbouring points.
CALIBRATION_ROWS = (1, 2, 3, 4, 5, 6, 8, 9, 12, 16, 24, 32, 48, 64)
CALIBRATION_ROUNDS = 7
CALIBRATION_VERSION = 3  # in the cache key: a curve measured the older way is measured again (3: the drafter's step)


def spread(total: int, seqs: int) -> list[int]:
    """`total` rows over `seqs` sequences as evenly as they go (9 over 8: 2, 1, 1, ...)."""
    return [total // seqs + (1 if i < total % seqs else 0) for i in range(seqs)]


def calibrate(model: LlamaModel, config: EngineConfig, context: int = 128,
              rounds: int = CALIBRATION_ROUNDS) -> dict[int, float]:
    """Target ms per step vs total query rows, cheaply (a few seconds): up to 8 sequences
    sharing the rows, the shape of a decode or verify batch.

    Timed round-robin, not point after point: each round times every point once, so a slow
    spell of the machine (another process, a frequency step) lands on all points alike
    instead of lifting one of them. A single lifted point decides k: three repeats in a row
    once measured 4 rows at 1.39 of a 1-row step (round-robin calibrations here: 0.91-1.20),
    and the controller then kept mtp:3 at k=1 on 90% of its steps. The median of the rounds per
    point; the controller's cost model makes the curve non-decreasing."""
    page = config.cache.page_size
    backend = make_backend(config.attention_backend, config.device)
    batch_max = 8
    pages = batch_max * (-(-(context + max(CALIBRATION_ROWS)) // page)) + 1
    kv = model.new_kv_pool(pages, page)

    def target(ids, pos, meta, rows):
        return model(ids, pos, backend, kv, meta, rows)

    steps = {total: _Step(target, kv, backend, spread(total, min(total, batch_max)), context,
                          model.cfg.vocab_size) for total in CALIBRATION_ROWS}
    times = _timed_rounds(steps, rounds)
    return {total: statistics.median(ts) * 1e3 for total, ts in times.items()}


def calibrate_drafter(model: LlamaModel, config: EngineConfig, context: int = 128,
                      rounds: int = CALIBRATION_ROUNDS) -> dict[int, float] | None:
    """The configured drafter's step in ms over 1 and 8 sequences (BATCHES), as the engine
    runs it (mtp/eagle: spec.head; draft: spec.draft_model), timed round-robin like the
    target's curve; None for a drafter without device work (n-gram) or without its own
    weights given. The controller prices each drafter level from this, not from a fixed
    fraction of a target step (0.10 for a head that now takes 0.036 here: session 22)."""
    spec = config.spec
    backend = make_backend(config.attention_backend, config.device)
    pages = _pool_pages(context, config.cache.page_size)
    if spec.method in HEAD_METHODS and spec.head:
        step, kv, _ = _head_step(model, config, spec.head, backend, pages)
    elif spec.method == "draft" and spec.draft_model:
        step, kv = _draft_step(model, config, spec.draft_model, backend, pages)
    else:
        return None
    steps = {b: _Step(step, kv, backend, [1] * b, context, model.cfg.vocab_size) for b in BATCHES}
    times = _timed_rounds(steps, rounds)
    return {b: statistics.median(ts) * 1e3 for b, ts in times.items()}


def _cache_path(config: EngineConfig, model_cfg) -> Path:
    """Keyed by what a step's cost depends on: the architecture (not the weights), dtype,
    kernels, backend, threads and the machine. The kernels by their build (sources' hash), not
    only their variant: a kernel change moves the curve (session 18's matmul tiles took a 4-row
    step from 1.49 to 1.13 plain steps), and a curve cached before it made the controller
    draft short or not at all."""
    import hashlib

    from overlap.kernels import build_name

    key = json.dumps([model_cfg.hidden_size, model_cfg.num_layers, model_cfg.vocab_size,
                      model_cfg.intermediate_size, model_cfg.num_heads, model_cfg.num_kv_heads,
                      config.dtype, config.device, config.matmul, config.attention_backend,
                      config.cache.page_size, sorted(machine().items()), build_name(),
                      CALIBRATION_VERSION, _drafter_key(config.spec)], default=str)
    name = hashlib.sha1(key.encode()).hexdigest()[:16]
    return Path.home() / ".cache" / "overlap" / "step_costs" / f"{name}.json"


def _drafter_key(spec) -> list:
    """What the drafter's calibrated step depends on beside the target's. A head's draft
    vocabulary as it will be used: the spec's, else the head's own config.json's (a head whose
    default size changed must not keep the step measured at the old one)."""
    weights = spec.draft_model if spec.method == "draft" else spec.head if spec.method in HEAD_METHODS else None
    vocab = spec.draft_vocab
    if vocab is None and spec.method in HEAD_METHODS:
        from overlap.models.heads import configured_draft_vocab

        try:
            raw = json.loads((Path(spec.head or default_head_dir()) / "config.json").read_text())
            vocab = configured_draft_vocab(raw)
        except (OSError, ValueError):
            pass  # no head there: the head's own load reports it
    return [spec.method, str(weights), vocab, spec.drafter_weights]


def controller_cost_model(config: EngineConfig, model: LlamaModel | None = None, model_cfg=None,
                          progress=None):
    """The curve the controller plans with: spec.step_costs if given (a --step-costs report or
    a calibration), else the cached calibration for this architecture and machine, else (with
    the model at hand) a calibration now, cached; else the documented default."""
    import json

    from overlap.speculative.controller import StepCostModel

    fraction = DRAFTER_FRACTION.get(config.spec.method, 0.1)
    if config.spec.step_costs:
        report = json.loads(Path(config.spec.step_costs).read_text())
        if "target" in report:
            return StepCostModel.from_report(report, config.spec.method)
        return StepCostModel({int(r): ms for r, ms in report["points"].items()}, fraction)
    cfg = model_cfg or (getattr(model, "full_cfg", None) or model.cfg if model is not None else None)
    path = _cache_path(config, cfg) if cfg is not None else None
    if path is not None and path.is_file():
        try:
            cached = json.loads(path.read_text())
            return StepCostModel({int(r): float(ms) for r, ms in cached["points"].items()}, fraction,
                                 drafter_points={int(b): float(ms) for b, ms in
                                                 (cached.get("drafter_points") or {}).items()})
        except (ValueError, KeyError):
            pass  # a torn or old cache: measure again
    if model is None or getattr(model, "full_cfg", None) is not None:  # no model here (or a TP shard)
        return StepCostModel(DEFAULT_CURVE, fraction)
    if progress:
        progress("speculation controller: measuring the step-cost curve (cached for next time)")
    points = calibrate(model, config)
    drafter_points = calibrate_drafter(model, config)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"points": points, "drafter_points": drafter_points, "machine": machine()}))
        tmp.replace(path)
    except OSError:
        pass  # a read-only home: calibrate again next start
    return StepCostModel(points, fraction, drafter_points=drafter_points)


def build_controller(config: EngineConfig, model: LlamaModel | None = None, cost=None, model_cfg=None,
                     progress=None):
    """The scheduler's speculation controller (None when the server does not speculate).
    With it off, no curve is needed: every step verifies the cap (its stats still count k)."""
    from overlap.speculative.controller import ControllerConfig, SpeculationController, StepCostModel

    if config.spec.method == "none":
        return None
    if config.spec.controller not in ("on", "off"):
        raise ValueError(f"spec.controller must be on or off, got {config.spec.controller!r}")
    enabled = config.spec.controller == "on"
    if cost is None:
        cost = controller_cost_model(config, model, model_cfg, progress) if enabled else StepCostModel({1: 1.0})
    return SpeculationController(cost, ControllerConfig(enabled=enabled))
