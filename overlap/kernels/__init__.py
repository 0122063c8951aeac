"""Compiled CPU kernels, batch-invariant by construction: the bf16 linear (linear_bf16.cpp
says why), the drafters' weight-only int8 linear (linear_int8.cpp), paged attention
(attention.cpp), the small per-layer ops fused (layer_ops.cpp), the greedy tree walk
(tree_walk.cpp) and a drafting head's whole forward in one call (head_step.cpp).

Built once per ISA variant with the machine's C++ compiler through torch's extension
builder, cached on disk (TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions); later
processes load the cached library in milliseconds. The variant is the best the CPU has,
capped by ONEDNN_MAX_CPU_ISA when it is set, so the oneDNN caps the tests use to emulate
other CPUs reach this kernel's variants too.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import os
import sys
from pathlib import Path

import torch

SOURCES = [str(Path(__file__).with_name(n))
           for n in ("bindings.cpp", "linear_bf16.cpp", "linear_int8.cpp", "attention.cpp", "layer_ops.cpp",
                     "tree_walk.cpp", "model_step.cpp", "head_step.cpp")]

# variant id → (name, compiler flags, CPU flags it needs)
VARIANTS = {
    3: ("amx", ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16",
                "-mavx512vnni", "-mamx-tile", "-mamx-bf16"],
        {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni", "amx_tile", "amx_bf16"}),
    2: ("avx512bf16", ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                       "-mavx512bf16", "-mavx512vnni"],
        {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16", "avx512_vnni"}),
    1: ("avx512", ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"],
        {"avx512f", "avx512bw", "avx512vl", "avx512dq"}),
    0: ("avx2", ["-mavx2", "-mfma"], {"avx2", "fma"}),
    -1: ("generic", [], set()),
}

# The highest variant each oneDNN ISA cap allows (prefix match, longest first).
_CAPS = [("AVX10", 3), ("AVX512_CORE_AMX", 3), ("AVX512_CORE_FP16", 2), ("AVX512_CORE_BF16", 2),
         ("AVX512_CORE_VNNI", 1), ("AVX512_CORE", 1), ("AVX2", 0), ("", -1)]


@functools.cache
def _cpuinfo(field: str) -> str:
    """The first value of `field` in /proc/cpuinfo ("" where there is none): read once a
    field, though the loader asks for the flags and the vendor several times."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":", 1)[0].strip() == field:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_flags() -> set[str]:
    return set(_cpuinfo("flags").split())


def cpu_vendor() -> str:
    return _cpuinfo("vendor_id")


def cpu_model() -> str:
    return _cpuinfo("model name")


def choose_variant(flags: set[str], isa_cap: str | None) -> int:
    """The best variant the CPU supports, at most what ONEDNN_MAX_CPU_ISA allows."""
    best = max(v for v, (_, _, need) in VARIANTS.items() if need <= flags)
    if isa_cap:
        cap = next(v for prefix, v in _CAPS if isa_cap.upper().startswith(prefix))
        best = min(best, cap)
    return best


def machine_variant() -> int:
    """The ISA variant this machine's build runs (its CPU flags under any ONEDNN_MAX_CPU_ISA
    cap), known without building or loading the kernels."""
    return choose_variant(cpu_flags(), os.environ.get("ONEDNN_MAX_CPU_ISA"))


# The avx512bf16 build's two bf16 arithmetics (linear_bf16.cpp says why): "dot" (vdpbf16ps)
# or "fma" (f32 FMAs on widened weight pairs, variant 1's bits).
ARITHMETICS = ("dot", "fma")


def choose_arithmetic(variant: int, vendor: str, override: str | None) -> str | None:
    """Variant 2's bf16 arithmetic (None for the others, which have one): what
    OVERLAP_BF16_ARITHMETIC says, else fma on Intel CPUs (an avx512bf16 Intel is a Cooper Lake or
    a later Xeon whose AMX a hypervisor hides; its dot products run at half the FMAs' rate),
    dot elsewhere (AMD Zen 4/5 run them at the FMAs' rate, with twice the products each)."""
    if override and override not in ARITHMETICS:
        raise ValueError(f"OVERLAP_BF16_ARITHMETIC={override!r}: expected one of {', '.join(ARITHMETICS)}")
    if variant != 2:
        return None
    return override or ("fma" if vendor == "GenuineIntel" else "dot")


def machine_arithmetic() -> str | None:
    """The bf16 arithmetic this machine's build runs (None: the variant's only one)."""
    return choose_arithmetic(machine_variant(), cpu_vendor(), os.environ.get("OVERLAP_BF16_ARITHMETIC"))


# Where the linear kernels' tiles prefetch the next weight block (prefetch.h says why two).
PREFETCH_LEVELS = ("l1", "l2")


def choose_prefetch(vendor: str, override: str | None) -> str:
    """What OVERLAP_KERNEL_PREFETCH says, else L2 on Intel CPUs (whole forwards 0.86-0.97 of
    their time on an Emerald Rapids), L1 elsewhere (L2 was slower on a Zen 5)."""
    if override and override not in PREFETCH_LEVELS:
        raise ValueError(f"OVERLAP_KERNEL_PREFETCH={override!r}: expected one of {', '.join(PREFETCH_LEVELS)}")
    return override or ("l2" if vendor == "GenuineIntel" else "l1")


def machine_prefetch() -> str:
    return choose_prefetch(cpu_vendor(), os.environ.get("OVERLAP_KERNEL_PREFETCH"))


def _sources_digest() -> str:
    """The kernels' sources and this file (their flags and the build lock's protocol): a
    checkout that builds differently never shares a build folder with this one."""
    digest = hashlib.sha1()
    for path in sorted(Path(__file__).parent.glob("*.[ch]*")):  # .cpp, .h
        if path.suffix in (".cpp", ".h"):
            digest.update(path.name.encode() + path.read_bytes())
    digest.update(Path(__file__).read_bytes())
    return digest.hexdigest()[:10]


def _module_name() -> str:
    return f"overlap_kernels_{VARIANTS[machine_variant()][0]}_{_sources_digest()}"


def kernels_name() -> str:
    """The variant, its arithmetic where it has two, and where the tiles prefetch where that is
    not L1: "avx512bf16-fma-l2", "amx"."""
    arithmetic = machine_arithmetic()
    name = VARIANTS[machine_variant()][0] + (f"-{arithmetic}" if arithmetic else "")
    return name + ("-l2" if machine_prefetch() == "l2" else "")


def build_name() -> str:
    """This machine's kernels: the variant, its arithmetic and the sources' hash (what a cached
    measurement of step costs depends on, beside the machine)."""
    return f"{kernels_name()}_{_sources_digest()}"


@functools.cache
def _library():
    from torch.utils import cpp_extension

    variant = machine_variant()
    name, flags, _ = VARIANTS[variant]
    # The sources' hash in the module name: two checkouts with different kernels (a branch, a
    # worktree, an upgrade) each keep their own build instead of rebuilding over each other.
    module = _module_name()
    build_dir = Path(cpp_extension._get_build_directory(module, False))
    with _exclusive_build(build_dir):
        if not (build_dir / f"{module}.so").exists():
            print(f"overlap: compiling the CPU kernels ({name}; once per machine, about a minute)",
                  file=sys.stderr, flush=True)
        lib = cpp_extension.load(
            name=module, sources=SOURCES,
            extra_cflags=["-O3", "-ffp-contract=off", f"-DOVERLAP_VARIANT={variant}", *flags],
            extra_ldflags=["-lpthread"], verbose=False)
    assert lib.variant() == variant
    lib.set_fma_pairs(machine_arithmetic() == "fma")  # before any linear runs
    lib.set_prefetch_l2(machine_prefetch() == "l2")
    return lib


@contextlib.contextmanager
def _exclusive_build(build_dir: Path):
    """One builder or loader of this module at a time, through a kernel lock (flock) that dies
    with its process. torch's own build lock is a plain file that a process killed while
    building or loading (a test's timeout, Ctrl-C, a session ending) leaves behind, and every
    later load then waits on it forever. Every process that uses this build folder runs this
    file (the folder's name hashes it), so under our lock none of them is building and such a
    file is stale: it is removed. (A compiler orphaned by a killed parent could still be
    writing; the rebuild that follows overwrites its output.)"""
    with open(build_dir.parent / f"{build_dir.name}.flock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            stale = build_dir / "lock"
            if stale.exists():
                print(f"overlap: removing a build lock left by a process that died ({stale})",
                      file=sys.stderr, flush=True)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(held, fcntl.LOCK_UN)


def variant() -> int:
    """The ISA variant this process runs (VARIANTS' key)."""
    return _library().variant()


def variant_name() -> str:
    return VARIANTS[variant()][0]


@contextlib.contextmanager
def bf16_arithmetic(name: str):
    """Tests only: the avx512bf16 build's bf16 linear runs `name` ("dot" or "fma") inside the
    block. A process otherwise keeps the one its loader chose: cached results (packed graphs,
    step costs) assume it."""
    if name not in ARITHMETICS:
        raise ValueError(f"bf16 arithmetic {name!r}: expected one of {', '.join(ARITHMETICS)}")
    lib = _library()
    before = lib.fma_pairs()
    lib.set_fma_pairs(name == "fma")
    try:
        yield
    finally:
        lib.set_fma_pairs(before)


def _kept_on(weight: torch.Tensor, attr: str, make):
    """make(weight) on first use, kept on the weight tensor itself as `attr` and made again
    if the weight is changed in place (its version counter moves). Costs one extra copy of
    the CPU weight in memory."""
    cached = getattr(weight, attr, None)
    if cached is None or cached[0] != weight._version:
        with torch.no_grad():
            cached = (weight._version, make(weight.detach()))
        setattr(weight, attr, cached)
    return cached[1]


def packed(weight: torch.Tensor) -> torch.Tensor:
    """The kernel's packed copy of a weight [N, K] (column blocks, k-major inside), kept on
    the weight (_kept_on)."""
    return _kept_on(weight, "_overlap_packed", lambda w: _library().pack_weight(w))


def linear_bf16(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                out_float: bool = False) -> torch.Tensor:
    """x [M, K] bf16, weight [N, K] bf16 → [M, N] bf16 (f32 if out_float).
    Row m of the result depends only on row m of x: bit-identical for any M."""
    return _library().linear(x, packed(weight), weight.shape[0], bias, out_float)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] → (q [N, K] int8, scale [N] f32): symmetric, one scale per output row,
    q = round(w / scale) with scale = max |w| / 127 (a row of zeros keeps scale 0)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / 127
    q = torch.where(scale[:, None] > 0, w / scale.clamp_min(torch.finfo(torch.float32).tiny)[:, None], 0.0)
    return q.round().clamp(-127, 127).to(torch.int8), scale


def int8_packed(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The weight's int8 quantization in the int8 kernel's layout, (packed, scale), kept on
    the weight beside the bf16 packing (_kept_on)."""
    def make(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q, scale = quantize_int8(w)
        return _library().pack_int8(q), scale

    return _kept_on(weight, "_overlap_int8", make)


def linear_int8(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                out_float: bool = False) -> torch.Tensor:
    """x [M, K] bf16, weight [N, K] (any float dtype; quantized to int8 once) → [M, N] bf16
    (f32 if out_float): weight-only int8 for drafters, whose rounding never reaches the
    output (verification is the target's). Row m depends only on row m of x."""
    packed_q, scale = int8_packed(weight)
    return _library().linear_int8(x, packed_q, scale, weight.shape[0], bias, out_float)


def version_watch(tensors: list[torch.Tensor]):
    """An object whose sum() is the sum of these tensors' version counters, read in one call."""
    return _library().VersionWatch(tensors)


def packed_matmul(weight: torch.Tensor, int8: bool, bias: torch.Tensor | None = None):
    """One matmul of a fused call (model_step.cpp): the weight's packed copy, bf16 or int8
    (kept on the weight, as `linear_bf16` / `linear_int8` keep them: no second copy), and its
    bias."""
    if int8:
        packed_q, scale = int8_packed(weight)
        return _library().packed_matmul(packed_q, scale, weight.shape[0], bias)
    return _library().packed_matmul(packed(weight), None, weight.shape[0], bias)


def layer_step(layer, int8: bool):
    """A Llama decoder layer (overlap/models/llama.py, DecoderLayer) as the fused calls run it."""
    matmuls = [packed_matmul(w, int8, b) for w, b in (
        (layer.qkv_proj, layer.qkv_bias), (layer.o_proj, None), (layer.gate_up_proj, None), (layer.down_proj, None))]
    return _library().DecoderLayerStep(matmuls, layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                                       layer.num_heads, layer.num_kv_heads, layer.head_dim,
                                       layer.input_layernorm.eps)


def model_step(embed: torch.Tensor, layers: list, norm_final: torch.Tensor, lm_head, cos: torch.Tensor,
               sin: torch.Tensor, eps: float):
    """A decoder's whole forward as one call (model_step.cpp: the same kernels in the same
    order as LlamaModel.forward, with the GIL released): layers = layer_step of each decoder
    layer, lm_head = packed_matmul of the lm_head."""
    return _library().ModelStep(embed, layers, norm_final, lm_head, cos, sin, eps)


def head_step(embed: torch.Tensor, norm_embed: torch.Tensor | None, norm_hidden: torch.Tensor | None,
              fuse, layer, lm_head, norm_final: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor,
              vocab_ids: torch.Tensor | None, vocab: int, eps: float):
    """A head's forward as one call (head_step.cpp: the same kernels in the same order, with
    the GIL released): fuse and lm_head = packed_matmul of those (the lm_head's trimmed rows
    where vocab_ids is given), layer = layer_step of its decoder layer; a None norm:
    norms=False."""
    empty = torch.empty(0, dtype=embed.dtype)
    return _library().HeadStep(embed, empty if norm_embed is None else norm_embed,
                               empty if norm_hidden is None else norm_hidden, fuse, layer, lm_head,
                               empty if norm_final is None else norm_final, cos, sin,
                               torch.empty(0, dtype=torch.long) if vocab_ids is None else vocab_ids,
                               vocab, eps)


def tree_plan(levels: list[tuple], num_nodes: int, top_k: int):
    """An EAGLE tree's expansion levels as HeadStep.expand_tree reads them (head_step.h,
    TreePlan): levels as overlap/speculative/eagle.py's _Level tuples, (draws [(parent,
    children [c] i64, ranks [c] i64)], rows, row_index [q] i64, row_parents, mask [q, q] bool
    or None, depth_offsets)."""
    return _library().TreePlan(levels, num_nodes, top_k)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    q_start: torch.Tensor, q_len: torch.Tensor, kv_len: torch.Tensor,
                    page_table: torch.Tensor, page_size: int, tree: torch.Tensor | None,
                    scale: float, reference: bool = False, v_pairs: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D]; caches [slots, Hkv, D]; q_start/q_len/kv_len [B] i32; page_table [B, P] i32;
    tree [T, Qmax] bool or None (causal) → [T, H, D] in q's dtype (attention.cpp).
    reference: the plain loops that define the arithmetic instead of the vector path (the
    same bits: tests compare the two). v_pairs: v_cache in key pairs (KVPool.value_pairs),
    which the AMX variant's value tiles read instead of pairing the keys per call (the same
    bits either way)."""
    empty = torch.empty(0, dtype=torch.bool)
    return _library().paged_attention(q, k_cache, v_cache, q_start, q_len, kv_len, page_table,
                                      page_size, empty if tree is None else tree, scale, reference, v_pairs)


def value_pairs_wanted(dtype: torch.dtype, head_dim: int, page_size: int, device) -> bool:
    """Whether paged_attention sums values on AMX tiles for such a cache, and so a KVPool
    keeps its values in key pairs too: bf16 on an AMX CPU (variant 3), head_dim 32-256 a
    power of two, pages of a multiple of 16 tokens."""
    return (torch.device(device).type == "cpu" and dtype == torch.bfloat16 and head_dim in (32, 64, 128, 256)
            and page_size % 16 == 0 and variant() == 3)


def sync_value_pairs(v_all: torch.Tensor, pairs_all: torch.Tensor, slots: torch.Tensor, page_size: int,
                     layer: int = -1) -> None:
    """pairs_all [L, pages, Hkv, page_size / 2, D, 2] := v_all [L, pages, page_size, Hkv, D] in
    key pairs at these slots [N] i64, in one layer (or all: -1)."""
    layers, _, _, kv_heads, dim = v_all.shape
    _library().sync_value_pairs(v_all.view(layers, -1, kv_heads, dim), pairs_all, slots, page_size, layer)


def fusable(x: torch.Tensor) -> bool:
    """Whether the fused bf16 layer ops apply: bf16 rows on the CPU, no autograd wanted
    (the training tools run the same modules with gradients, through eager torch)."""
    return (x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.dim() == 2
            and not (torch.is_grad_enabled() and x.requires_grad))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, H] bf16, weight [H] bf16 → weight * bf16(x / rms(x)) [T, H] bf16."""
    return _library().rms_norm(x, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] bf16 → bf16(silu(gate)) * up [T, I] bf16."""
    return _library().silu_mul(gate_up)


def rotary_(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot_heads: int, head_dim: int) -> None:
    """Rotate the first rot_heads heads of each qkv row [T, W] bf16 in place; cos/sin [T, D] bf16."""
    _library().rotary_(qkv, cos, sin, rot_heads, head_dim)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [R, V] f32 on the CPU → [R] i64, the same indices as torch.argmax(x, -1) (first
    maximum; a NaN counts as the largest), 16 lanes at a time (layer_ops.cpp)."""
    return _library().argmax_rows(x)


def spread_columns(sub: torch.Tensor, ids: torch.Tensor, vocab: int) -> torch.Tensor:
    """sub [R, N] f32, ids [N] i64 ascending → [R, vocab] f32: sub's columns at ids, -inf
    elsewhere, in one pass on the calling thread (layer_ops.cpp)."""
    return _library().spread_columns(sub, ids, vocab)


def tree_walk_greedy(target_best: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor, order: torch.Tensor,
                     depth: int, max_children: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """speculative.tree.verify_tree_greedy's walk on CPU i64 tensors in one call, the same
    outputs (tree_walk.cpp): (tokens [B, D+1], num_accepted [B], path [B, D])."""
    out, accepted, path = _library().tree_walk_greedy(target_best, tokens, parents, order, depth, max_children)
    return out, accepted, path


def verify_trees_greedy(logits: torch.Tensor, rows_at: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor,
                        order: torch.Tensor, depth: int, max_children: int, top_nodes: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A greedy tree step's verification on CPU tensors in one call (tree_walk.cpp): the
    argmax of each logits row into its cell rows_at of the [B, N+1] table, the walk
    (tree_walk_greedy) and speculative.tree.top_path_accepted → (tokens [B, D+1],
    num_accepted [B], path [B, D], top_accepted [B])."""
    out = _library().verify_trees_greedy(logits, rows_at, tokens, parents, order, depth, max_children, top_nodes)
    return out[0], out[1], out[2], out[3]


def move_slots(k_all: torch.Tensor, v_all: torch.Tensor, pairs_all: torch.Tensor | None, src: torch.Tensor,
               dst: torch.Tensor, page_size: int) -> None:
    """KV slots moved in every layer in one call (tree_walk.cpp; KVPool.copy_slots on the CPU):
    slot dst[i] takes what src[i] held (every source read first), V's key-pair copy kept in
    step where pairs_all is given; k_all, v_all as KVPool.slot_arrays gives them."""
    _library().move_slots(k_all, v_all, pairs_all, src, dst, page_size)


def compact_paths(accepted: torch.Tensor, path: torch.Tensor, slots: torch.Tensor, starts: torch.Tensor,
                  moved_rows: torch.Tensor, hidden: torch.Tensor, k_all: torch.Tensor, v_all: torch.Tensor,
                  pairs_all: torch.Tensor, page_size: int) -> torch.Tensor:
    """The accepted paths' KV (every layer, in place; k_all, v_all, pairs_all as
    KVPool.slot_arrays gives them, an empty pairs_all for none) and hidden states moved into
    place in one call (tree_walk.cpp) → the moved hidden states."""
    return _library().compact_paths(accepted, path, slots, starts, moved_rows, hidden, k_all, v_all, pairs_all,
                                    page_size)
