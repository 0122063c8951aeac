"""One-call GPU acceptance check: `python tools/gpu_check.py` on a machine with CUDA.

Sections (each a function returning table rows; later work adds CUDA graphs, TP, ...):
  kernels  FlashInfer vs the reference backend on random paged batches: max abs error,
           PASS/FAIL, plan time (ms, host) and run time (ms, CUDA events) per case;
  model    the shipped SmolLM2 in bf16 on CUDA: one prefill (and one decode step after it)
           with the reference backend vs FlashInfer: top-1 agreement and max abs logit diff.

Exits 1 if any check fails, 2 if flashinfer cannot be imported on a CUDA machine, and 0
with "SKIP: no CUDA device" where there is no GPU, so it runs anywhere.
The first run on a machine JIT-compiles FlashInfer's kernels (minutes; one module per dtype
and wrapper kind): `--dtypes bf16` halves that.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

import torch

# Run from a checkout without installing the package.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from overlap.attention.testing import (DeviceReferenceBackend, max_abs_error,  # noqa: E402
                                       random_paged_batch, random_specs)

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

    fi, ref = FlashInferBackend(DEVICE), DeviceReferenceBackend(DEVICE)
    rows = []
    for dtype_name in args.dtypes:
        for case in KERNEL_CASES:
            rows.append(_kernel_row(case, DTYPES[dtype_name], dtype_name, fi, ref, args.seed))
    return rows


def _kernel_row(case: KernelCase, dtype, dtype_name: str, fi, ref, seed: int) -> Row:
    specs = random_specs(case.kind, random.Random(seed), batch=case.batch, max_cached=case.max_cached)
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
    ref = _prefill_then_decode(model, DeviceReferenceBackend(DEVICE), prompts)
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


# -- driver -----------------------------------------------------------------------------------

SECTIONS = {"kernels": check_kernels, "model": check_model}


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
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated, from: {', '.join(SECTIONS)}")
    parser.add_argument("--dtypes", default="bf16,fp16", help="comma-separated: bf16, fp16")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    sections = [s for s in args.sections.split(",") if s]
    unknown = [s for s in sections if s not in SECTIONS] + [d for d in args.dtypes if d not in DTYPES]
    if unknown:
        parser.error(f"unknown section or dtype: {', '.join(unknown)}")

    if not torch.cuda.is_available():
        print("SKIP: no CUDA device")
        return 0
    try:
        import flashinfer
    except ImportError as exc:
        print(f"FAIL: flashinfer is not importable ({exc}); install flashinfer-python")
        return 2
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  "
          f"flashinfer {flashinfer.__version__}")

    rows: list[Row] = []
    for name in sections:
        t0 = time.perf_counter()
        try:
            rows += SECTIONS[name](args)
        except Exception as exc:  # one broken section must not hide the others' results
            traceback.print_exc()
            rows.append(Row(name, "section crashed", False, {"error": f"{type(exc).__name__}: {exc}"[:200]}))
        print(f"[{name}] done in {time.perf_counter() - t0:.1f}s", flush=True)
    print_table(rows)
    failed = [r for r in rows if r.ok is False]
    print(f"{len(rows) - len(failed)}/{len(rows)} checks passed or skipped; "
          f"{len(failed)} failed" if failed else "ALL PASS")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
