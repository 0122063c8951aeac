"""One-call GPU acceptance check: `python tools/gpu_check.py` on a machine with CUDA.

Air-gapped machines (a CUDA torch, nothing else): stage a bundle where packages can be
reached (`python tools/gpu_bundle.py --out gpu_bundle`), copy it over, then
    python gpu_bundle/project/tools/gpu_check.py --bundle gpu_bundle
installs the bundle into a temporary path and runs, in order, one line per step and a JSON
report (--report, default gpu_check_report.json): (1) `executor`: the executor on CUDA with the
torch-only backend, overlap on vs off identical, and a sync census under
torch.cuda.set_sync_debug_mode("warn") (at most the one documented collect point per step);
(2) `kernels`: FlashInfer decode/prefill/masked kernels vs the reference (bf16, head_dim 64,
q_len <= 64); (3) `graphs` with FlashInfer; (4) `e2e`: a model of the shipped model's exact
shapes with seeded random weights built on the device (real weights with --model DIR), spec
none/draft/mtp/eagle greedy identical, tok/s, device idle fraction, graphs captured. Without
a CUDA device it stops cleanly with "no CUDA device" after checking the bundle imports.

Sections (each a function returning table rows; later work adds TP, ...):
  kernels  FlashInfer vs the reference backend on random paged batches: max abs error,
           PASS/FAIL, plan time (ms, host) and run time (ms, CUDA events) per case;
  model    the shipped SmolLM2 in bf16 on CUDA: one prefill (and one decode step after it)
           with the reference backend vs FlashInfer: top-1 agreement and max abs logit diff;
  graphs   CUDA graphs (overlap/graphs.py) on a tiny random bf16 model with FlashInfer:
           buckets captured for decode (q_len 1) and verify (q_len 5), replayed over rounds
           of fresh tokens, lengths and page tables for batches that fill a bucket, need
           padding or exceed every bucket (eager fallback), against the eager unpadded
           FlashInfer forward: max abs logit diff, top-1 agreement, bit-exact or not, KV
           diff outside the scratch page, and step time (ms) replayed vs eager;
  pipeline the shipped SmolLM2 + draft through the in-process Engine on CUDA (streams,
           events, pinned copies, graphs): draft vs none, overlap on vs off (exact), graphs
           vs eager, with tokens/s, device idle fraction and hidden planning per run;
  tp       TP=2 over NCCL on two GPUs (skipped with one): greedy tokens against TP=1.

Exits 1 if any check fails, 2 if flashinfer cannot be imported on a CUDA machine, and 0
with "SKIP: no CUDA device" where there is no GPU, so it runs anywhere.
The first run on a machine JIT-compiles FlashInfer's kernels (minutes; one module per dtype
and wrapper kind): `--dtypes bf16` halves that.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
import traceback
import warnings
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import torch

# Run from a checkout (or a bundle's project/) without installing the package.
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
BUNDLE_PACKAGES = ("msgspec", "zmq", "gguf", "websockets", "safetensors", "yaml")


def use_bundle(bundle: Path) -> dict:
    """Install the bundle's wheels into a temporary path and put it, the bundle's trimmed
    flashinfer and its project first on sys.path; → where each module was imported from."""
    tmp = Path(tempfile.mkdtemp(prefix="overlap-gpu-check-"))
    site = tmp / "site"
    wheels = sorted((bundle / "wheels").glob("*.whl")) if (bundle / "wheels").is_dir() else []
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    for wheel in wheels:  # unpacked by hand: no pip or network needed on the GPU machine
        name = wheel.name
        if tag in name or "-py3-none-" in name or "-py2.py3-none-" in name:
            with zipfile.ZipFile(wheel) as zf:
                zf.extractall(site)
    paths = [site, bundle / "site", bundle / "flashinfer", bundle / "project", bundle / "project" / "tests"]
    sys.path[:0] = [str(p) for p in paths if p.is_dir()]
    found = {}
    for module in BUNDLE_PACKAGES + ("overlap", "runtime.engine", "attention_oracle"):
        found[module] = getattr(__import__(module, fromlist=["_"]), "__file__", None)
    return {"install_dir": str(tmp), "modules": found}

DEVICE = "cuda"  # one place, so the script can be dry-run elsewhere with stand-ins
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
KERNEL_TOL = 2e-2  # max abs error vs the fp64 reference (outputs are O(1))
# Whole model, bf16 through every layer: attention rounding differs (FlashInfer rounds the
# softmax weights to bf16), so logits drift a little; a broken mask or page table moves
# them by whole units and scrambles the argmax.
MODEL_TOP1 = 0.95
MODEL_MAX_ABS = 1.0
TIMING_ITERS = 20


@dataclass
class Row:
    section: str
    name: str
    ok: bool | None  # None = skipped
    cols: dict[str, str] = field(default_factory=dict)

    @property
    def status(self) -> str:
        return "SKIP" if self.ok is None else "PASS" if self.ok else "FAIL"


# -- kernels ----------------------------------------------------------------------------------

@dataclass(frozen=True)
class KernelCase:
    name: str
    kind: str  # a batch kind of overlap.attention.testing
    page_size: int
    batch: int
    max_cached: int


KERNEL_CASES = [
    KernelCase("decode b32", "decode", 16, 32, 2000),
    KernelCase("decode b32", "decode", 1, 32, 2000),
    KernelCase("mixed prefill+decode", "mixed", 16, 8, 500),
    KernelCase("mixed prefill+decode", "mixed", 1, 8, 500),
    KernelCase("mixed prefill+decode", "mixed", 5, 8, 500),
    KernelCase("verify q_len=5 b32", "verify", 16, 32, 1000),
    KernelCase("verify q_len=5 b32", "verify", 1, 32, 1000),
    KernelCase("tree mask b16", "tree", 16, 16, 500),
    KernelCase("tree mask b16", "tree", 1, 16, 500),
]


def check_kernels(args) -> list[Row]:
    from overlap.attention.flashinfer import FlashInferBackend
    from overlap.attention.torch_paged import TorchBackend

    fi, ref = FlashInferBackend(DEVICE), TorchBackend(DEVICE)
    rows = []
    for dtype_name in args.dtypes:
        for case in KERNEL_CASES:
            rows.append(_kernel_row(case, DTYPES[dtype_name], dtype_name, fi, ref, args.seed))
    return rows


MAX_Q_LEN = 64  # longer prefill rows would compile another kernel family (tile 128): minutes


def _kernel_row(case: KernelCase, dtype, dtype_name: str, fi, ref, seed: int) -> Row:
    import dataclasses

    from attention_oracle import max_abs_error, random_paged_batch, random_specs

    specs = random_specs(case.kind, random.Random(seed), batch=case.batch, max_cached=case.max_cached)
    specs = [dataclasses.replace(s, new=min(s.new, MAX_Q_LEN)) for s in specs]
    batch = random_paged_batch(specs, case.page_size, dtype=dtype, device=DEVICE, seed=seed)
    name = f"{case.name} page={case.page_size} {dtype_name}"
    try:
        out = batch_run(fi, batch)  # first call: JIT compile / module load, untimed
        expected = batch_run(ref, batch)
        err = max_abs_error(out, expected)
        oracle_err = max_abs_error(expected, batch.expected)  # the reference itself
        plan_ms, run_ms = _time_plan_and_run(fi, batch)
    except Exception as exc:  # report every case, not just the first failure
        return Row("kernels", name, False, {"error": f"{type(exc).__name__}: {exc}"[:200]})
    cols = {"T": str(sum(s.q_len for s in batch.seqs)), "max_err": f"{err:.2e}",
            "plan_ms": f"{plan_ms:.3f}", "run_ms": f"{run_ms:.3f}"}
    if oracle_err >= KERNEL_TOL:
        cols["error"] = f"reference vs dense oracle {oracle_err:.2e}"
    return Row("kernels", name, err < KERNEL_TOL and oracle_err < KERNEL_TOL, cols)


def batch_run(backend, batch) -> torch.Tensor:
    """[T, H, D]: one step of the batch through the backend (plan + run of its layer)."""
    out = backend.run(batch.layer, batch.q, batch.pool, batch.plan(backend))
    torch.cuda.synchronize()
    return out


def _time_plan_and_run(backend, batch) -> tuple[float, float]:
    """(mean plan ms on the host, mean run ms on the device) over TIMING_ITERS each."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(TIMING_ITERS):
        meta = batch.plan(backend)
    plan_ms = (time.perf_counter() - t0) * 1e3 / TIMING_ITERS
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(TIMING_ITERS):
        backend.run(batch.layer, batch.q, batch.pool, meta)
    end.record()
    torch.cuda.synchronize()
    return plan_ms, start.elapsed_time(end) / TIMING_ITERS


# -- whole model ------------------------------------------------------------------------------

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. Speculative decoding lets a small model "
    "propose tokens that a large model verifies in one pass.",
    "Paged attention stores the key and value cache in fixed-size pages, so sequences of "
    "different lengths share one pool without fragmentation. " * 3,
]
MODEL_PAGE = 16


def check_model(args) -> list[Row]:
    from overlap.attention.flashinfer import FlashInferBackend
    from overlap.models.llama import load_llama
    from overlap.models.loading import load_tokenizer, resolve_model_dir

    try:
        model_dir = resolve_model_dir(None, progress=False)
        tokenizer = load_tokenizer(model_dir)
    except Exception as exc:  # the model package (or gguf/transformers) is not installed
        return [Row("model", "load SmolLM2", None, {"why": f"{type(exc).__name__}: {exc}"[:200]})]
    model = load_llama(model_dir, torch.bfloat16, DEVICE)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    from attention_oracle import max_abs_error
    from overlap.attention.torch_paged import TorchBackend

    ref = _prefill_then_decode(model, TorchBackend(DEVICE), prompts)
    fi = _prefill_then_decode(model, FlashInferBackend(DEVICE), prompts)
    rows = []
    for step, (a, b) in zip(("prefill", "decode"), zip(ref, fi)):
        top1 = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
        diff = max_abs_error(b, a)
        rows.append(Row("model", f"SmolLM2 bf16 {step} ({a.shape[0]} rows)",
                        top1 >= MODEL_TOP1 and diff <= MODEL_MAX_ABS,
                        {"top1": f"{top1:.3f}", "max_abs": f"{diff:.3f}"}))
    return rows


def _prefill_then_decode(model, backend, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [sum(prompt lens), vocab] f32 of one batched prefill, then [B, vocab] of one
    decode step feeding each sequence a fixed token (the same for every backend)."""
    from overlap.attention.base import SeqAttention

    dev = DEVICE
    pages = [-(-(len(p) + 1) // MODEL_PAGE) for p in prompts]
    kv = model.new_kv_pool(sum(pages) + 1, MODEL_PAGE)
    # Shuffled pages and page 0 unused, so an off-by-one or misordered page index shows.
    free = list(range(1, sum(pages) + 1))
    random.Random(0).shuffle(free)
    tables = [[free.pop() for _ in range(n)] for n in pages]
    dims = (model.cfg.num_heads, model.cfg.num_kv_heads, model.cfg.head_dim, model.dtype)

    ids = torch.tensor([t for p in prompts for t in p], device=dev)
    pos = torch.cat([torch.arange(len(p)) for p in prompts]).to(dev)
    meta = backend.plan([SeqAttention(len(p), len(p), t) for p, t in zip(prompts, tables)], MODEL_PAGE, *dims)
    _, prefill = model(ids, pos, backend, kv, meta, torch.arange(len(ids), device=dev))

    nxt = torch.tensor([p[0] for p in prompts], device=dev)  # fixed, not sampled: same input for both
    pos = torch.tensor([len(p) for p in prompts], device=dev)
    meta = backend.plan([SeqAttention(1, len(p) + 1, t) for p, t in zip(prompts, tables)], MODEL_PAGE, *dims)
    _, decode = model(nxt, pos, backend, kv, meta, torch.arange(len(prompts), device=dev))
    torch.cuda.synchronize()
    return prefill, decode


# -- CUDA graphs ------------------------------------------------------------------------------

GRAPH_BUCKETS = (1, 4, 8, 16)
# Per round: exact buckets, padded batches, and one past the last bucket (eager fallback).
GRAPH_BATCHES = (1, 3, 4, 8, 13, 16, 21)
GRAPH_ROUNDS = 3  # fresh tokens, cached lengths and page tables each round: real replays
GRAPH_PAGE = 16
GRAPH_MAX_CACHED = 300
# Graph and eager runs may round differently in bf16 (GEMMs over padded row counts pick
# other kernels; FlashInfer's graph-mode schedule splits KV differently): on this model the
# whole bf16-vs-f32 gap is ~0.1, while one wrong page in a page table moves logits by ~5.
GRAPH_MAX_ABS = 0.25
GRAPH_TOP1 = 0.98


def check_graphs(args) -> list[Row]:
    from overlap.attention.flashinfer import FlashInferBackend

    model = _tiny_model(args.seed)
    backend = FlashInferBackend(DEVICE)
    rows = []
    for q_len, kind in ((1, "decode"), (5, "verify")):
        rows += _graph_rows(model, backend, q_len, kind, args.seed)
    return rows


def _tiny_model(seed: int):
    """A random 2-layer Llama in bf16 on the device (head_dim 64, GQA 2: FlashInfer shapes)."""
    from overlap.config import ModelConfig
    from overlap.models.llama import LlamaModel

    cfg = ModelConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=64, rms_norm_eps=1e-5,
                      rope_theta=10000.0, max_position=2048, tie_word_embeddings=True)
    model = LlamaModel(cfg, torch.bfloat16, DEVICE)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:  # scaled up so the argmax is well separated
                p.normal_(0, 0.08, generator=gen)
    return model.eval()


def _graph_rows(model, backend, q_len: int, kind: str, seed: int) -> list[Row]:
    from overlap.graphs import GraphRunner, bucket_for

    rng = random.Random(seed)
    num_pages = max(GRAPH_BATCHES) * -(-(GRAPH_MAX_CACHED + q_len) // GRAPH_PAGE)
    scratch = num_pages  # the one page more than the "scheduler" hands out
    kv_graph = model.new_kv_pool(num_pages + 1, GRAPH_PAGE)
    kv_eager = model.new_kv_pool(num_pages + 1, GRAPH_PAGE)
    # Random KV everywhere (as if earlier steps wrote it), the same in both pools: a page
    # read or written by mistake changes the results by whole units.
    for graph_cache, eager_cache in zip(kv_graph.k + kv_graph.v, kv_eager.k + kv_eager.v):
        graph_cache.normal_()
        eager_cache.copy_(graph_cache)
    name = f"{kind} q_len={q_len}"
    try:
        runner = GraphRunner(model, kv_graph, backend, q_len, scratch_page=scratch,
                             buckets=GRAPH_BUCKETS, use_graphs=True)
        t0 = time.perf_counter()
        runner.capture_all()
        capture_s = time.perf_counter() - t0
    except Exception as exc:
        traceback.print_exc()
        return [Row("graphs", f"{name} capture", False, {"error": f"{type(exc).__name__}: {exc}"[:200]})]
    out = [Row("graphs", f"{name} capture {GRAPH_BUCKETS}", runner.captured == list(GRAPH_BUCKETS),
               {"capture_s": f"{capture_s:.2f}"})]
    for b in GRAPH_BATCHES:
        size = bucket_for(b, GRAPH_BUCKETS)
        label = f"{name} b={b} " + (f"graph {size}" if size is not None else "eager fallback")
        try:
            out.append(_graph_row(model, backend, runner, kv_graph, kv_eager, b, label, rng))
        except Exception as exc:  # report every batch, not just the first failure
            traceback.print_exc()
            out.append(Row("graphs", label, False, {"error": f"{type(exc).__name__}: {exc}"[:200]}))
    return out


def _graph_row(model, backend, runner, kv_graph, kv_eager, b: int, label: str, rng) -> Row:
    """GRAPH_ROUNDS steps of batch b through the runner and the eager forward, then timing."""
    from attention_oracle import max_abs_error

    q_len, scratch = runner.q_len, runner.scratch_page
    max_abs, kv_diff, top1, exact = 0.0, 0.0, 1.0, True
    for _ in range(GRAPH_ROUNDS):
        ids, pos, seqs = _graph_step(b, q_len, scratch, rng)
        logits_rows = torch.arange(b * q_len, device=DEVICE)
        _, logits = runner.forward(ids, pos, seqs, logits_rows)
        _, want = _eager_forward(model, backend, kv_eager, ids, pos, seqs, logits_rows)
        torch.cuda.synchronize()
        max_abs = max(max_abs, max_abs_error(logits, want))
        top1 = min(top1, (logits.argmax(-1) == want.argmax(-1)).float().mean().item())
        exact = exact and torch.equal(logits, want)
        # Both runs wrote the same real slots; padding rows may only have written the
        # scratch page, so every other page must agree (within bf16 rounding).
        for graph_cache, eager_cache in zip(kv_graph.k + kv_graph.v, kv_eager.k + kv_eager.v):
            kv_diff = max(kv_diff, max_abs_error(graph_cache[:scratch], eager_cache[:scratch]))
    graph_ms = _step_ms(lambda: runner.forward(ids, pos, seqs, logits_rows))
    eager_ms = _step_ms(lambda: _eager_forward(model, backend, kv_eager, ids, pos, seqs, logits_rows))
    ok = max_abs <= GRAPH_MAX_ABS and top1 >= GRAPH_TOP1 and kv_diff <= GRAPH_MAX_ABS
    return Row("graphs", label, ok, {"max_abs": f"{max_abs:.3f}", "top1": f"{top1:.3f}",
                                     "exact": "yes" if exact else "no", "kv_diff": f"{kv_diff:.3f}",
                                     "graph_ms": f"{graph_ms:.3f}", "eager_ms": f"{eager_ms:.3f}"})


def _graph_step(b: int, q_len: int, scratch: int, rng):
    """b sequences with random cached lengths on shuffled pages, never the scratch page:
    (ids [b*q_len] i64, positions [b*q_len] i64 on the device, their SeqAttention list)."""
    from overlap.attention.base import SeqAttention

    free = list(range(scratch))
    rng.shuffle(free)
    ids, pos, seqs = [], [], []
    for _ in range(b):
        cached = rng.randint(1, GRAPH_MAX_CACHED)
        kv_len = cached + q_len
        table = [free.pop() for _ in range(-(-kv_len // GRAPH_PAGE))]
        ids += [rng.randrange(1, 1024) for _ in range(q_len)]
        pos += range(cached, kv_len)
        seqs.append(SeqAttention(q_len, kv_len, table))
    return torch.tensor(ids, device=DEVICE), torch.tensor(pos, device=DEVICE), seqs


def _eager_forward(model, backend, kv, ids, pos, seqs, logits_rows):
    meta = backend.plan(seqs, kv.page_size, model.cfg.num_heads, model.cfg.num_kv_heads,
                        model.cfg.head_dim, model.dtype)
    return model(ids, pos, backend, kv, meta, logits_rows)


def _step_ms(step) -> float:
    """Mean wall ms of one step (host planning included) over TIMING_ITERS, after one warm-up."""
    step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(TIMING_ITERS):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3 / TIMING_ITERS


# -- the pipelined engine ---------------------------------------------------------------------

PIPELINE_PROMPTS = ["def fibonacci(n):", "The capital of France is", "Write a haiku about the sea.",
                    "import numpy as np\n\ndef softmax(x):", "Once upon a time", "SELECT name FROM",
                    "The three laws of motion are", "for i in range(10):"]
PIPELINE_TOKENS = 48
PIPELINE_AGREE = 0.9  # bf16 graph vs eager may round apart late in a sequence; garbage fails at once


def check_pipeline(args) -> list[Row]:
    """The shipped SmolLM2 + its draft through the in-process Engine on CUDA: real streams,
    events, pinned copies, graphs. Overlap on/off must agree exactly (same kernels, same
    order); draft vs none and graphs vs eager must agree on the greedy tokens (bf16 rounding
    may split a sequence late); reports the device idle fraction and hidden planning time."""
    from overlap.config import EngineConfig, SpecConfig, default_draft_dir, default_head_dir
    from runtime.engine import Engine
    from runtime.messages import SamplingParams

    params = SamplingParams(max_tokens=PIPELINE_TOKENS, ignore_eos=True)

    def run(**kw):
        spec = kw.pop("spec", "draft")
        k = kw.pop("k", 3)
        config = EngineConfig(device=DEVICE, spec=SpecConfig(method=spec, num_spec_tokens=k,
                                                             draft_model=str(default_draft_dir()),
                                                             head=str(default_head_dir())), **kw)
        engine = Engine(config, progress=False)
        engine.generate(PIPELINE_PROMPTS[:1], SamplingParams(max_tokens=4))  # warm-up, captures
        before = engine.stats()
        t0 = time.perf_counter()
        out = [r.token_ids for r in engine.generate(PIPELINE_PROMPTS, params)]
        wall = time.perf_counter() - t0
        after = engine.stats()
        engine.close()
        busy = after["device_busy_s"] - before["device_busy_s"]
        idle = after["device_idle_s"] - before["device_idle_s"]
        plan = after["plan_s"] - before["plan_s"]
        hidden = after["hidden_plan_s"] - before["hidden_plan_s"]
        timing = {"tok/s": f"{sum(map(len, out)) / wall:.0f}",
                  "idle": f"{100 * idle / max(busy + idle, 1e-9):.1f}%",
                  "plan hidden": f"{100 * hidden / max(plan, 1e-9):.0f}%"}
        return out, timing

    def agreement(a, b) -> float:
        same = sum(next((i for i, (x, y) in enumerate(zip(p, q)) if x != y), min(len(p), len(q)))
                   for p, q in zip(a, b))
        return same / sum(map(len, b))

    base, t_base = run(spec="none")
    draft, t_draft = run()
    no_overlap, t_no = run(overlap=False)
    eager, t_eager = run(graphs="off")
    rows = [
        Row("pipeline", "draft == none (greedy, graphs, overlap)", agreement(draft, base) >= PIPELINE_AGREE,
            {"agree": f"{agreement(draft, base):.3f}", **t_draft}),
        Row("pipeline", "none (graphs, overlap)", True, t_base),
        Row("pipeline", "overlap off == on (exact)", no_overlap == draft, t_no),
        Row("pipeline", "graphs off vs on", agreement(eager, draft) >= PIPELINE_AGREE,
            {"agree": f"{agreement(eager, draft):.3f}", **t_eager}),
    ]
    if (default_head_dir() / "config.json").is_file():
        for label, kw in (("mtp k=1 (no-sync)", dict(spec="mtp", k=1)), ("mtp k=3", dict(spec="mtp", k=3)),
                          ("eagle tree", dict(spec="eagle"))):
            out, timing = run(**kw)
            agree = agreement(out, base)
            rows.append(Row("pipeline", f"{label} == none (greedy)", agree >= PIPELINE_AGREE,
                            {"agree": f"{agree:.3f}", **timing}))
    return rows


# -- tensor parallelism -----------------------------------------------------------------------

def check_tp(args) -> list[Row]:
    """TP=2 over NCCL (two GPUs): the shipped SmolLM2 sharded 2/1 KV heads, greedy tokens
    against TP=1, without and with the draft model (drafts broadcast from the leader)."""
    if torch.cuda.device_count() < 2:
        return [Row("tp", "TP=2 NCCL", None, {"why": f"{torch.cuda.device_count()} GPU(s); needs 2"})]
    from overlap.config import EngineConfig, SpecConfig, default_draft_dir
    from runtime.engine import Engine
    from runtime.messages import SamplingParams

    params = SamplingParams(max_tokens=PIPELINE_TOKENS, ignore_eos=True)
    rows = []
    for spec in (SpecConfig(), SpecConfig(method="draft", num_spec_tokens=3, draft_model=str(default_draft_dir()))):
        outs = []
        for tp in (1, 2):
            engine = Engine(EngineConfig(device=DEVICE, spec=spec, tensor_parallel=tp), progress=False)
            t0 = time.perf_counter()
            outs.append([r.token_ids for r in engine.generate(PIPELINE_PROMPTS, params)])
            wall = time.perf_counter() - t0
            stats = engine.stats()
            engine.close()
        same = sum(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a)) for a, b in zip(*outs))
        agree = same / sum(map(len, outs[0]))
        rows.append(Row("tp", f"TP=2 == TP=1 ({spec.method})", agree >= PIPELINE_AGREE,
                        {"agree": f"{agree:.3f}", "tok/s tp2": f"{sum(map(len, outs[1])) / wall:.0f}",
                         "plan bytes": str(stats.get("tp_plan_bytes", 0))}))
    return rows


# -- step 1: the executor with the torch-only backend, and its syncs ---------------------------

SMOL_SHAPES = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                   num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0, max_position=8192,
                   tie_word_embeddings=True)  # SmolLM2-135M, the shipped model
E2E_PROMPTS = [[1, 504, 3458, 282, 4649, 314, 30],   # token ids: no tokenizer is needed here
               [1, 2683, 253, 3540, 1191, 12] * 3, [1, 7, 8, 9, 10], [1] + list(range(300, 340))]


class _NoTokenizer:
    """Token ids in, token ids out: the check needs no tokenizer package."""

    eos_token_id = None

    def decode(self, ids, **kwargs) -> str:
        return ""

    def convert_ids_to_tokens(self, ids):
        return [""] * len(ids)


def _random_model(shapes: dict, seed: int, model_dir: str | None = None):
    from overlap.config import ModelConfig
    from overlap.models.llama import LlamaModel, load_llama

    if model_dir:
        return load_llama(model_dir, torch.bfloat16, DEVICE)
    cfg = ModelConfig(**shapes)
    model = LlamaModel(cfg, torch.bfloat16, DEVICE)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    with torch.no_grad():  # built on the device: nothing to load or copy
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, 0.05, generator=gen)
    return model.eval()


def _engine_run(model, backend: str, spec: str = "none", k: int = 3, prompts=None, tokens: int = 32,
                lookup: int = 0, **kw):
    """Greedy tokens of `prompts` through the in-process engine → (tokens, stats, executor).
    lookup: a lookup branch of that many tokens beside the drafter's drafts (1-token matches,
    so that the random model's repetitions branch on many steps)."""
    from overlap.config import HEAD_METHODS, CacheConfig, EngineConfig, SpecConfig, default_draft_dir, default_head_dir
    from runtime.engine import Engine
    from runtime.messages import SamplingParams

    spec_cfg = SpecConfig(method=spec, num_spec_tokens=None if spec == "eagle" else k,
                          draft_model=str(default_draft_dir()) if spec == "draft" else None,
                          head=str(default_head_dir()) if spec in HEAD_METHODS else None,
                          lookup_branch=lookup, lookup_min_match=1)
    config = EngineConfig(device=DEVICE, attention_backend=backend, spec=spec_cfg,
                          cache=CacheConfig(page_size=16, num_pages=1024), **kw)
    engine = Engine.from_model(config, model, _NoTokenizer())
    engine.generate([p[:4] for p in (prompts or E2E_PROMPTS)[:1]], SamplingParams(max_tokens=4, ignore_eos=True))
    before = engine.stats()
    t0 = time.perf_counter()
    out = [r.token_ids for r in engine.generate(prompts or E2E_PROMPTS, SamplingParams(max_tokens=tokens,
                                                                                       ignore_eos=True))]
    wall = time.perf_counter() - t0
    after = engine.stats()
    busy = after["device_busy_s"] - before["device_busy_s"]
    idle = after["device_idle_s"] - before["device_idle_s"]
    stats = {"tok/s": f"{sum(map(len, out)) / wall:.0f}", "idle": f"{100 * idle / max(busy + idle, 1e-9):.1f}%",
             "steps": after["timed_steps"] - before["timed_steps"],
             "graphs": sum(len(r["captured"]) for r in engine.executor.graph_report)}
    executor = engine.executor
    engine.close()
    return out, stats, executor


def check_executor(args) -> list[Row]:
    """The executor with the torch-only backend (graphs as configured: this backend runs them
    eagerly), overlap on vs off identical, and the syncs counted by torch's sync debug mode."""
    model = _random_model(dict(SMOL_SHAPES, num_layers=4), args.seed)
    on, t_on, _ = _engine_run(model, "torch", graphs="auto")
    off, t_off, _ = _engine_run(model, "torch", graphs="auto", overlap=False)
    rows = [Row("executor", "torch backend: overlap on == off (greedy)", on == off, t_on)]
    if DEVICE == "cuda":
        torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _, t_sync, _ = _engine_run(model, "torch", graphs="auto")
    finally:
        if DEVICE == "cuda":
            torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if "synchroniz" in str(w.message)]
    where = sorted({f"{Path(w.filename).name}:{w.lineno}" for w in syncs})
    # The warm-up request's steps count too: at most one sync (the collect point) per step.
    steps = t_sync["steps"] + 8
    rows.append(Row("executor", "sync census (set_sync_debug_mode warn)", len(syncs) <= steps,
                    {"syncs": str(len(syncs)), "steps": str(t_sync["steps"]), "where": ",".join(where)[:200]}))
    rows[0].cols["off tok/s"] = t_off["tok/s"]
    return rows


# -- step 4: end to end on the shipped model's shapes -------------------------------------------

def check_e2e(args) -> list[Row]:
    """Spec none/draft/mtp/eagle greedy identical on a model of the shipped model's exact
    shapes (seeded random weights built on the device, or --model DIR), FlashInfer and graphs
    when available: tok/s, device idle fraction, graphs captured."""
    from overlap.attention import flashinfer_problem

    model = _random_model(SMOL_SHAPES if DEVICE == "cuda" else args.cpu_shapes, args.seed, args.model)
    backend = "auto" if DEVICE == "cuda" and flashinfer_problem() is None else ("torch" if DEVICE == "cuda" else "cpu")
    base, t_base, _ = _engine_run(model, backend)
    rows = [Row("e2e", f"spec none ({backend})", True, t_base)]
    # The lookup branch (lookup_branch.py) beside each model drafter: its tokens staged from the
    # host and merged on the device, tree verification with the torch tree walk (the CPU runs
    # tree_walk.cpp instead), and the draft model's catch-up after a branch was followed.
    for spec, k, lookup in (("draft", 3, 0), ("mtp", 1, 0), ("mtp", 3, 0), ("eagle", 0, 0),
                            ("draft", 3, 4), ("mtp", 3, 4), ("eagle", 0, 4)):
        label = f"spec {spec}{k or ''}" + (f" +lookup {lookup}" if lookup else "")
        try:
            out, stats, _ = _engine_run(model, backend, spec=spec, k=k, lookup=lookup)
            rows.append(Row("e2e", f"{label} == none (greedy)", out == base, stats))
        except Exception as exc:
            traceback.print_exc()
            rows.append(Row("e2e", label, False, {"error": f"{type(exc).__name__}: {exc}"[:200]}))
    return rows


# -- driver -----------------------------------------------------------------------------------

# In the order the air-gapped check runs them (steps 1-4); model, pipeline and tp need the
# shipped model package and run when asked for (--sections).
STEPS = ("executor", "kernels", "graphs", "e2e")
SECTIONS = {"executor": check_executor, "kernels": check_kernels, "graphs": check_graphs, "e2e": check_e2e,
            "model": check_model, "pipeline": check_pipeline, "tp": check_tp}
NEEDS_FLASHINFER = ("kernels", "graphs", "model")


def print_table(rows: list[Row]) -> None:
    keys = []
    for r in rows:
        keys += [k for k in r.cols if k not in keys]
    header = ["section", "check", "status"] + keys
    table = [[r.section, r.name, r.status] + [r.cols.get(k, "") for k in keys] for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *table)]
    for line in [header] + table:
        print("  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip())


def main(argv: list[str] | None = None) -> int:
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default=",".join(STEPS),
                        help=f"comma-separated, from: {', '.join(SECTIONS)} (default: {','.join(STEPS)})")
    parser.add_argument("--dtypes", default="bf16", help="comma-separated: bf16, fp16")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bundle", metavar="DIR", help="a tools/gpu_bundle.py bundle to install and import from")
    parser.add_argument("--model", metavar="DIR", help="e2e on these weights instead of random ones")
    parser.add_argument("--report", default="gpu_check_report.json", help="JSON report path")
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: a smoke run of executor/e2e
    args = parser.parse_args(argv)
    # The shipped drafters' widths with the fewest layers the shipped head can read (it fuses
    # target layers 2, 15 and 27: a 2-layer target failed its mtp and eagle rows here).
    args.cpu_shapes = dict(SMOL_SHAPES, num_layers=28)
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    sections = [s for s in args.sections.split(",") if s]
    unknown = [s for s in sections if s not in SECTIONS] + [d for d in args.dtypes if d not in DTYPES]
    if unknown:
        parser.error(f"unknown section or dtype: {', '.join(unknown)}")
    report: dict = {"started": time.strftime("%Y-%m-%d %H:%M:%S"), "python": sys.version.split()[0],
                    "torch": torch.__version__, "steps": []}

    def write(status: str) -> None:
        report["status"] = status
        Path(args.report).write_text(json.dumps(report, indent=2))

    if args.bundle:
        t0 = time.perf_counter()
        try:
            report["bundle"] = use_bundle(Path(args.bundle).resolve())
        except Exception as exc:
            print(f"FAIL bundle: {type(exc).__name__}: {exc}")
            report["bundle"] = {"error": f"{type(exc).__name__}: {exc}"}
            write("bundle failed")
            return 2
        print(f"[bundle] installed into {report['bundle']['install_dir']}, imports OK "
              f"({time.perf_counter() - t0:.1f}s)", flush=True)
    DEVICE = args.device
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("SKIP: no CUDA device: stopping here (nothing to check on this machine)")
        write("no CUDA device")
        return 0
    if DEVICE == "cuda":
        report["device"] = torch.cuda.get_device_name()
        from overlap.attention import flashinfer_problem

        problem = flashinfer_problem()
        report["flashinfer"] = problem or "ok"
        print(f"device: {report['device']}  torch {torch.__version__}  flashinfer: {problem or 'ok'}", flush=True)
    else:
        problem = "no CUDA device"
        sections = [s for s in sections if s in ("executor", "e2e")]

    rows: list[Row] = []
    for name in sections:
        t0 = time.perf_counter()
        if name in NEEDS_FLASHINFER and problem is not None:
            got = [Row(name, "needs flashinfer", False if DEVICE == "cuda" else None, {"why": problem[:200]})]
        else:
            try:
                got = SECTIONS[name](args)
            except Exception as exc:  # one broken section must not hide the others' results
                traceback.print_exc()
                got = [Row(name, "section crashed", False, {"error": f"{type(exc).__name__}: {exc}"[:200]})]
        seconds = time.perf_counter() - t0
        rows += got
        status = "FAIL" if any(r.ok is False for r in got) else "PASS"
        print(f"[{name}] {status} in {seconds:.1f}s: " + "; ".join(f"{r.name} {r.status}" for r in got), flush=True)
        report["steps"].append({"step": name, "status": status, "seconds": round(seconds, 2),
                                "rows": [{"name": r.name, "status": r.status, **r.cols} for r in got]})
        write("running")
    print_table(rows)
    failed = [r for r in rows if r.ok is False]
    print(f"{len(rows) - len(failed)}/{len(rows)} checks passed or skipped; "
          f"{len(failed)} failed" if failed else "ALL PASS")
    write("failed" if failed else "pass")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
