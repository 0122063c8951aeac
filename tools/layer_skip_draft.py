"""A layer-skipping copy of the target as its draft model (self-speculation, no training):
choose which target layers to keep, greedily on held-out text, and export the copy for
`--spec draft --draft-model DIR`.

    python tools/layer_skip_draft.py --keep 2 4 8 --out runs/drafts/skip

Steps (seconds to minutes on 2 cores; nothing is trained):
  1. text     held-out windows only: stdlib files of the held-out split (tools/corpus.py) and
              the target's own greedy replies to chat instructions tools/head_data.py holds out
              (so the drafts trained on its corpus are scored on text they never saw). Two
              disjoint sets: one chooses the layers, the other reports their agreement.
  2. labels   the full target's argmax at every position (our inference path, bf16).
  3. search   from all L layers, drop the layer whose loss keeps top-1 agreement highest
              (draft argmax over its vocabulary == the target's argmax), until the smallest
              --keep remains; every layer count's agreement on both sets is reported. One
              round over n layers reruns only the layers after each candidate (~n^2/2 layer
              passes): ~10 min for a 30-layer target and the default ~1.5k search tokens.
  4. export   for each --keep N, DIR/N/: config.json + model.safetensors holding the kept
              layers, the target's final norm and the draft vocabulary (`vocab_ids`, by
              default the shipped draft's); embeddings and lm_head stay the target's.
              DIR/curve.json and DIR/curve.png: agreement against layers kept.

The shipped 2-layer draft started as such a copy (layers 0 and 29) and was then distilled
(tools/distill_draft.py); this tool answers whether a deeper copy with no training accepts
better per unit of step cost (docs/mtp_eagle.md, "layer-skipping draft").
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from corpus import many_chat_instructions, read_text, split_files  # noqa: E402
from distill_draft import code_windows, self_distilled  # noqa: E402
from head_data import EVAL_EVERY  # noqa: E402
from overlap.attention import ReferenceBackend, SeqAttention  # noqa: E402
from overlap.models.llama import LlamaModel, load_llama, logits_linear  # noqa: E402
from overlap.models.loading import load_tokenizer, read_model_config, resolve_model_dir  # noqa: E402
from overlap.speculative.draft_target import load_draft  # noqa: E402

SHIPPED_DRAFT = Path(__file__).resolve().parent.parent / "overlap" / "assets" / "smollm2-135m-draft"
PAGE = 16


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="target: GGUF or HF dir (default: shipped SmolLM2)")
    ap.add_argument("--out", required=True, help="directory for the exported drafts (one folder per --keep)")
    ap.add_argument("--keep", type=int, nargs="+", default=[2, 4, 8], help="layer counts to export")
    ap.add_argument("--tokens", type=int, default=1024,
                    help="held-out code tokens (and about twice as many of the target's chat tokens, 2 x "
                         "--tokens / --window replies), halved into the search and report sets")
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--vocab-from", default=str(SHIPPED_DRAFT),
                    help="a draft directory whose vocab_ids the copy scores (default: the shipped draft's)")
    ap.add_argument("--compare", nargs="*", default=[str(SHIPPED_DRAFT)], metavar="DRAFT_DIR",
                    help="trained drafts scored on the same report set, for the plot and the summary "
                         "(default: the shipped distilled draft)")
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


# ---------------------------------------------------------------------------- 1. text

def held_out_windows(target: LlamaModel, tokenizer, args) -> tuple[list[list[int]], list[list[int]]]:
    """(search windows, report windows), each half of the code windows (`args.tokens` in all)
    and half of the target's chat replies (2 x tokens / window of them), drawn from held-out
    files and held-out instructions only."""
    _, eval_files = split_files()
    random.Random(args.seed).shuffle(eval_files)
    code = code_windows((read_text(f) for f in eval_files), tokenizer, args.window, args.tokens)
    asks = [x for i, x in enumerate(many_chat_instructions()) if i % EVAL_EVERY == 0]  # head_data's eval split
    random.Random(args.seed).shuffle(asks)
    chat = self_distilled(target, tokenizer, asks[: 2 * args.tokens // args.window], args.window, args.window, chat=True)
    half_code, half_chat = len(code) // 2, len(chat) // 2
    return code[:half_code] + chat[:half_chat], code[half_code:] + chat[half_chat:]


# ---------------------------------------------------------------------------- 2.-3. agreement

class Window:
    """One window's inputs, KV pages and target labels, for reruns over any layer subset."""

    def __init__(self, target: LlamaModel, ids: list[int], backend: ReferenceBackend):
        self.ids = torch.tensor(ids)
        positions = torch.arange(len(ids))
        self.pages = -(-len(ids) // PAGE)
        self.kv = target.new_kv_pool(self.pages, PAGE)
        self.meta = backend.plan([SeqAttention(len(ids), len(ids), list(range(self.pages)))], PAGE)
        self.rope = target.rope.lookup(positions)
        self.embedded = target.embed(self.ids)
        hidden, _ = target.forward_states(self.ids, positions, backend, self.kv, self.meta)
        self.labels = target.compute_logits(hidden).argmax(-1)


class Agreement:
    """Top-1 agreement of the target with a copy that runs only some of its layers."""

    def __init__(self, target: LlamaModel, vocab_ids: torch.Tensor):
        self.target, self.backend = target, ReferenceBackend()
        self.vocab_ids = vocab_ids
        self.head = target.lm_head[vocab_ids].contiguous()

    def run(self, w: Window, x: torch.Tensor, layers: list[int]) -> torch.Tensor:
        for i in layers:  # a layer writes and reads its own KV slot: skipped ones are never read
            x = self.target.layers[i](x, w.rope, self.backend, w.kv, w.meta)
        return x

    def hits(self, w: Window, x: torch.Tensor) -> int:
        logits = logits_linear(self.target.norm(x), self.head, self.target.linear)  # as the engine's draft scores
        return int((self.vocab_ids[logits.argmax(-1)] == w.labels).sum())

    @torch.inference_mode()
    def of(self, windows: list[Window], layers: list[int]) -> float:
        hits = sum(self.hits(w, self.run(w, w.embedded, layers)) for w in windows)
        return hits / sum(len(w.ids) for w in windows)

    @torch.inference_mode()
    def without_each(self, windows: list[Window], layers: list[int]) -> list[float]:
        """Agreement with each layer of `layers` dropped in turn. The layers before the dropped
        one are run once and shared by all later candidates (n^2/2 layer passes, not n^2)."""
        hits = [0] * len(layers)
        for w in windows:
            prefix = w.embedded
            for p, layer in enumerate(layers):
                hits[p] += self.hits(w, self.run(w, prefix, layers[p + 1:]))
                if p + 1 < len(layers):  # the last layer's output is no candidate's prefix
                    prefix = self.run(w, prefix, [layer])
        total = sum(len(w.ids) for w in windows)
        return [h / total for h in hits]


def draft_agreement(target: LlamaModel, draft_dir: str, windows: list[Window]) -> float:
    """Top-1 agreement of a trained draft model (draft_target.load_draft) on the same windows."""
    # Loaded outside inference mode: the kernels' packed weights follow the weights' version counters.
    draft, backend = load_draft(draft_dir, target), ReferenceBackend()
    hits = 0
    with torch.inference_mode():
        for w in windows:
            hidden, _ = draft.model.forward_states(w.ids, torch.arange(len(w.ids)), backend,
                                                   draft.model.new_kv_pool(w.pages, PAGE), w.meta)
            hits += int((draft.logits(hidden).argmax(-1) == w.labels).sum())
    return hits / sum(len(w.ids) for w in windows)


def greedy_removal(agree: Agreement, search: list[Window], report: list[Window], down_to: int) -> list[dict]:
    """[{layers, search, report}] from all layers down to `down_to`, one layer dropped a round."""
    layers = list(range(agree.target.cfg.num_layers))
    curve = [{"layers": layers, "search": agree.of(search, layers), "report": agree.of(report, layers)}]
    bar = tqdm(total=len(layers) - down_to, desc="dropping layers")
    while len(layers) > down_to:
        scores = agree.without_each(search, layers)
        best = max(range(len(layers)), key=scores.__getitem__)
        layers = layers[:best] + layers[best + 1:]
        curve.append({"layers": layers, "search": scores[best], "report": agree.of(report, layers)})
        bar.update(1)
        bar.set_postfix(kept=len(layers), agreement=f"{scores[best]:.3f}")
    bar.close()
    return curve


def plot_curve(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kept = [len(p["layers"]) for p in summary["curve"]]
    fig, ax = plt.subplots(figsize=(6.4, 4))
    ax.plot(kept, [p["search"] for p in summary["curve"]], "o-", ms=3, label="search set (chooses the layers)")
    ax.plot(kept, [p["report"] for p in summary["curve"]], "s-", ms=3, label="report set (held out)")
    for draft_dir, (layers, top1) in summary.get("reference", {}).items():
        ax.plot([layers], [top1], "k*", ms=10)
        ax.annotate(f"{Path(draft_dir).name} (trained)", (layers, top1), textcoords="offset points", xytext=(6, -4), fontsize=8)
    ax.set(xlabel="target layers kept (of %d)" % max(kept), ylabel="top-1 agreement with the target",
           ylim=(0, 1), title="Layer-skipping copy of the target as a draft (no training)")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------- 4. export

def export(target: LlamaModel, target_hf: dict, layers: list[int], vocab_ids: torch.Tensor,
           out: Path, report: dict) -> None:
    """The kept layers under transformers' Llama names (what draft_target.load_draft reads)."""
    q, kv = target.cfg.num_heads * target.cfg.head_dim, target.cfg.num_kv_heads * target.cfg.head_dim
    inter = target.cfg.intermediate_size
    sd = {"model.norm.weight": target.norm.weight, "vocab_ids": vocab_ids.to(torch.int32)}
    for j, i in enumerate(layers):
        src, p = target.layers[i], f"model.layers.{j}."
        for name, w in zip("qkv", src.qkv_proj.split([q, kv, kv])):
            sd[p + f"self_attn.{name}_proj.weight"] = w
        if src.qkv_bias is not None:  # Qwen2's q/k/v biases
            for name, b in zip("qkv", src.qkv_bias.split([q, kv, kv])):
                sd[p + f"self_attn.{name}_proj.bias"] = b
        sd[p + "self_attn.o_proj.weight"] = src.o_proj
        sd[p + "mlp.gate_proj.weight"], sd[p + "mlp.up_proj.weight"] = src.gate_up_proj.split([inter, inter])
        sd[p + "mlp.down_proj.weight"] = src.down_proj
        sd[p + "input_layernorm.weight"] = src.input_layernorm.weight
        sd[p + "post_attention_layernorm.weight"] = src.post_attention_layernorm.weight
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().to(torch.bfloat16).contiguous() if k != "vocab_ids" else v for k, v in sd.items()},
              str(out / "model.safetensors"))
    cfg = {**target_hf, "num_hidden_layers": len(layers), "tie_word_embeddings": True, "torch_dtype": "bfloat16"}
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    (out / "layer_skip_report.json").write_text(json.dumps(report, indent=2))


def main(argv=None) -> int:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    model_dir = resolve_model_dir(args.model)
    tokenizer = load_tokenizer(model_dir)
    target = load_llama(model_dir, torch.bfloat16)
    if max(args.keep) > target.cfg.num_layers or min(args.keep) < 1:
        raise SystemExit(f"--keep: layer counts must be 1..{target.cfg.num_layers}, got {args.keep}")
    vocab_ids = load_file(str(Path(args.vocab_from) / "model.safetensors"))["vocab_ids"].long()
    settings = {"target": str(model_dir), "tokens": args.tokens, "window": args.window, "seed": args.seed,
                "vocab_from": args.vocab_from, "draft_vocab": len(vocab_ids)}
    out = Path(args.out)
    # 1.-3. the search (or a finished one with the same settings), then the trained drafts beside it
    summary, report = _earlier_search(out / "curve.json", settings, min(args.keep)), None
    if summary is None:
        summary, report = search(target, tokenizer, vocab_ids, settings, args)
    else:
        print(f"reusing the search in {out / 'curve.json'} (same settings)")
    if args.compare and set(args.compare) != set(summary.get("reference", {})):
        # Rebuilt when reused, not stored: the windows are deterministic (seeded files, greedy replies).
        report = report or _labelled(target, held_out_windows(target, tokenizer, args)[1])
        summary["reference"] = {d: (read_model_config(d)["num_hidden_layers"], draft_agreement(target, d, report))
                                for d in args.compare}
    out.mkdir(parents=True, exist_ok=True)
    (out / "curve.json").write_text(json.dumps(summary, indent=2))
    print_curve(summary)
    plot_curve(summary, out / "curve.png")
    # 4. the copies asked for
    for n in args.keep:
        point = next(p for p in summary["curve"] if len(p["layers"]) == n)
        export(target, read_model_config(model_dir), point["layers"], vocab_ids, out / str(n),
               {**summary, "kept": point["layers"], "top1_agreement": point["report"]})
        print(f"wrote {out / str(n)}: layers {point['layers']}, held-out top-1 {point['report']:.3f}")
    return 0


def search(target: LlamaModel, tokenizer, vocab_ids: torch.Tensor, settings: dict, args):
    """Steps 1-3: (the summary with its curve, the labelled report windows)."""
    started = time.time()
    search_ids, report_ids = held_out_windows(target, tokenizer, args)
    search_set, report = _labelled(target, search_ids, "search"), _labelled(target, report_ids, "report")
    curve = greedy_removal(Agreement(target, vocab_ids), search_set, report, min(args.keep))
    return {**settings, "search_tokens": sum(map(len, search_ids)), "report_tokens": sum(map(len, report_ids)),
            "curve": curve, "seconds": round(time.time() - started)}, report


def _labelled(target: LlamaModel, windows: list[list[int]], name: str = "report") -> list[Window]:
    backend = ReferenceBackend()
    with torch.inference_mode():
        return [Window(target, w, backend) for w in tqdm(windows, desc=f"target labels ({name})")]


def print_curve(summary: dict) -> None:
    for d, (layers, top1) in summary.get("reference", {}).items():
        print(f"trained draft {d}: {layers} layers, top-1 {top1:.3f} on the report set")
    print(f"{'kept':>4}  {'search':>6}  {'report':>6}  layers")
    for point in summary["curve"]:
        print(f"{len(point['layers']):>4}  {point['search']:.3f}  {point['report']:.3f}  {point['layers']}")


def _earlier_search(path: Path, settings: dict, down_to: int) -> dict | None:
    """A finished search with the same settings that went down to `down_to` layers or fewer:
    exporting other layer counts from it costs seconds, not a new search."""
    if not path.exists():
        return None
    summary = json.loads(path.read_text())
    same = all(summary.get(k) == v for k, v in settings.items())
    return summary if same and len(summary["curve"][-1]["layers"]) <= down_to else None


if __name__ == "__main__":
    sys.exit(main())
