"""Train an MTP head (overlap/models/heads.py) for a target (default: the shipped SmolLM2-135M-Instruct).

    python tools/train_mtp.py --out overlap/assets/smollm2-135m-mtp [--workdir runs/mtp] [--no-norms]

The head is one decoder layer that reads a token and the target's hidden state; it shares the
target's embeddings and lm_head (frozen, not stored). Head row j pairs x_{j+1} with H_j (the
target's hidden at position j, after its final norm) and predicts x_{j+2}.

Steps (each cached in --workdir and reused; training resumes with --resume):
  1. corpus    as tools/distill_draft.py: Python stdlib sources (train / held-out split by file
               hash), the target's greedy continuations of stdlib function headers and its
               replies to templated chat instructions. --windows FILE replaces it with token
               windows of your own ({"train": [[ids]], "eval": [[ids]]}).
  2. hidden    OUR inference path (LlamaModel, ReferenceBackend, paged KV, several windows per
               forward) runs the target over every window; its hidden states H (after the final
               norm) are stored in bf16 next to the token ids, one file per part and split. The
               target's logits are NOT stored: lm_head(H) recomputes them (the lm_head is frozen
               and shared), 2 * hidden bytes per position instead of 4 * vocab.
  3. train     inputs (x_{j+1}, H_j), targets H_{j+1} (smooth-L1 on the head hidden) and the
               target's next-token distribution softmax(lm_head(H_{j+1})) (KL through the same
               frozen lm_head), as EAGLE does. AdamW, warmup + cosine, clipping, bf16 autocast,
               checkpoints every --ckpt-every steps. Batches depend only on (seed, step), so a
               resumed run continues exactly as an uninterrupted one.
  4. evaluate  held out: top-1 agreement with the target's greedy token (k=1), and chains of
               --eval-k drafts that feed back the head's own hidden: per-position accuracy and
               the expected acceptance length of greedy chains.
  5. export    config.json + model.safetensors (head weights only, bf16) + train_report.json.

--no-norms trains the original-EAGLE layout (no norms around the fuse) on the same data, steps
and seed, for the ablation.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from corpus import chat_instructions  # noqa: E402
from overlap.attention import ReferenceBackend, SeqAttention  # noqa: E402
from overlap.models.heads import MTPHead, save_head  # noqa: E402
from overlap.models.llama import LlamaModel, default_feature_layers, load_llama  # noqa: E402
from overlap.models.loading import load_tokenizer, resolve_model_dir  # noqa: E402

PARTS = ("code", "chat", "gen_code")  # tools/distill_draft.py's parts
PAGE = 16


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", "--tiny-target", dest="model", default=None,
                    help="target: GGUF or HF dir (default: shipped SmolLM2)")
    ap.add_argument("--out", required=True, help="directory for the exported head")
    ap.add_argument("--workdir", default="runs/mtp", help="cached hidden states and checkpoints")
    ap.add_argument("--no-norms", dest="norms", action="store_false",
                    help="original-EAGLE layout: no norms on the fuse inputs, no final norm")
    ap.add_argument("--data", default=None, help="a data directory from tools/head_data.py (the full "
                    "corpus with the target's states, memory-mapped) instead of the small built-in one")
    ap.add_argument("--windows", default=None, help='JSON {"train": [[ids]], "eval": [[ids]]}: '
                    "your own token windows instead of the built-in corpus")
    ap.add_argument("--features", choices=("multi", "last"), default="multi",
                    help="head input: the target's low/middle/high layer outputs (EAGLE-3, fused by a "
                         "learned reduce) or its last hidden state (EAGLE-1/2, the ablation)")
    ap.add_argument("--ttt-depth", type=int, default=3,
                    help="training-time test: unroll the head this many steps on its own predicted "
                         "features, a loss at every depth (1: teacher forcing only, the ablation)")
    ap.add_argument("--depth-decay", type=float, default=0.8, help="loss weight of depth d: decay^(d-1)")
    # corpus (names as in distill_draft, whose builders are reused)
    ap.add_argument("--seq-len", type=int, default=256, help="head rows per training window")
    ap.add_argument("--max-train-tokens", type=int, default=150_000, help="stdlib code tokens")
    ap.add_argument("--max-eval-tokens", type=int, default=12_000)
    ap.add_argument("--chat-answers", type=int, default=160, help="self-distilled chat replies (0: none)")
    ap.add_argument("--chat-tokens", type=int, default=192, help="tokens per self-distilled reply")
    ap.add_argument("--code-answers", type=int, default=32,
                    help="self-distilled continuations of stdlib function headers (0: none)")
    ap.add_argument("--self-weight", type=int, default=3, help="oversampling of self-distilled parts")
    ap.add_argument("--precompute-batch", type=int, default=8, help="windows per target forward")
    ap.add_argument("--precompute-only", action="store_true", help="stop after caching the hidden states")
    # training
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch-size", type=int, default=4, help="windows per step")
    ap.add_argument("--crop", type=int, default=128,
                    help="head rows per window in a step: a random crop (0: all --seq-len)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--reg-weight", type=float, default=1.0,
                    help="smooth-L1(head hidden, H_{j+d}); last-layer heads only (EAGLE-3 drops it)")
    ap.add_argument("--kl-weight", type=float, default=1.0, help="KL(target || head) next-token")
    ap.add_argument("--loss-vocab", type=int, default=8192,
                    help="the KL runs over this many most frequent training tokens (0: all); "
                         "evaluation always uses the full vocabulary")
    ap.add_argument("--init-layer", type=int, default=None,
                    help="start the layer as a copy of this target layer and the fuse as the mean of "
                         "its inputs (default: random, EAGLE's start; it trained faster in a pilot)")
    ap.add_argument("--fp32", action="store_true", help="no bf16 autocast")
    ap.add_argument("--ckpt-every", type=int, default=100)
    ap.add_argument("--resume", action="store_true", help="continue from the variant's checkpoint")
    ap.add_argument("--stop-after", type=int, default=None,
                    help="leave after this step with only the checkpoint written (an interruption)")
    ap.add_argument("--eval-k", type=int, default=3, help="chain length of the held-out evaluation")
    ap.add_argument("--engine-validate", type=int, default=0,
                    help="after export, run this many held-out chat prompts through the engine "
                         "(needs overlap.speculative.mtp)")
    ap.add_argument("--device", default="cpu", metavar="cpu|cuda[:N]",
                    help="where the --engine-validate engine runs (training itself runs on the CPU)")
    ap.add_argument("--attention-backend", default="auto", choices=("auto", "reference", "flashinfer"),
                    help="attention kernels of the --engine-validate engine (auto: flashinfer on cuda)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    return ap.parse_args(argv)


# ---------------------------------------------------------------------------- 1. corpus

def corpus_windows(name: str, split: str, args, tokenizer, target: LlamaModel) -> list[list[int]]:
    """distill_draft's part builders, with windows of seq_len + 1 tokens (seq_len head rows)."""
    from distill_draft import build_part

    opts = SimpleNamespace(window=args.seq_len + 1, max_train_tokens=args.max_train_tokens,
                           max_eval_tokens=args.max_eval_tokens, chat_answers=args.chat_answers,
                           chat_tokens=args.chat_tokens, code_answers=args.code_answers, seed=args.seed)
    return [w for w in build_part(name, split, opts, tokenizer, target) if len(w) >= 2]


def part_settings(name: str, args, model_dir) -> dict:
    """What a cached part depends on; a cache made with other settings is rebuilt."""
    common = {"model": str(model_dir), "window": args.seq_len + 1, "seed": args.seed}
    if args.windows:
        digest = hashlib.sha1(Path(args.windows).read_bytes()).hexdigest()
        return {**common, "windows": str(Path(args.windows).resolve()), "sha1": digest}
    return {**common, **{"code": {"train": args.max_train_tokens, "eval": args.max_eval_tokens},
                         "chat": {"n": args.chat_answers, "tokens": args.chat_tokens},
                         "gen_code": {"n": args.code_answers, "tokens": args.chat_tokens}}[name]}


def load_parts(args, model_dir, target: LlamaModel, work: Path) -> dict:
    """{(name, split): a part (ids, offsets, rows(start, n) -> (hidden, features))}: from a
    tools/head_data.py directory (--data), or built here from the small built-in corpus or
    --windows and cached in --workdir."""
    if args.data:
        from head_data import PARTS as DATA_PARTS, HeadData

        parts = {(n, s): HeadData(args.data, n, s) for n in DATA_PARTS for s in ("train", "eval")}
        return {key: part for key, part in parts.items() if len(part)}
    names = ("windows",) if args.windows else PARTS
    given = json.loads(Path(args.windows).read_text()) if args.windows else None
    layers = default_feature_layers(target.cfg.num_layers)
    parts = {}
    for name in names:
        settings = {**part_settings(name, args, model_dir), "feature_layers": list(layers)}
        for split in ("train", "eval"):
            path = work / f"states_{name}_{split}.pt"
            data = torch.load(path) if path.exists() else None
            if data is None or data["settings"] != settings:
                started = time.time()
                windows = ([w[: args.seq_len + 1] for w in given[split]] if given
                           else corpus_windows(name, split, args, load_tokenizer(model_dir), target))
                hidden, features = target_states(target, windows, args.precompute_batch, layers,
                                                 f"target states ({name}/{split})")
                lengths = torch.tensor([0] + [len(w) for w in windows])
                data = {"settings": settings, "ids": torch.tensor([t for w in windows for t in w], dtype=torch.int32),
                        "offsets": lengths.cumsum(0), "hidden": hidden, "features": features,
                        "seconds": time.time() - started}
                tmp = path.with_suffix(".tmp")
                torch.save(data, tmp)
                tmp.replace(path)
            parts[name, split] = MemoryPart(data)
    return parts


class MemoryPart:
    """A part held in memory (the built-in corpus and --windows): HeadData's interface."""

    def __init__(self, data: dict):
        self.ids, self.offsets = data["ids"].long(), data["offsets"]
        self.hidden, self.features = data["hidden"], data["features"]
        self.seconds = data.get("seconds", 0.0)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def rows(self, start: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.hidden[start: start + length], self.features[start: start + length]


# ---------------------------------------------------------------------------- 2. states

@torch.inference_mode()
def target_states(target: LlamaModel, windows: list[list[int]], batch: int, layers: tuple[int, ...],
                  desc: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(H [sum of lengths, hidden], features [sum of lengths, len(layers) * hidden]) bf16: the
    target's hidden after its final norm and the outputs of `layers`, every position of every
    window (each its own sequence from position 0), `batch` windows a forward."""
    backend = ReferenceBackend()
    hidden, features = [], []
    for i in tqdm(range(0, len(windows), batch), desc=desc):
        chunk = windows[i: i + batch]
        seqs, pages = [], 0
        for w in chunk:
            n = -(-len(w) // PAGE)
            seqs.append(SeqAttention(len(w), len(w), list(range(pages, pages + n))))
            pages += n
        kv = target.new_kv_pool(pages, PAGE)
        meta = backend.plan(seqs, PAGE)
        ids = torch.tensor([t for w in chunk for t in w])
        positions = torch.cat([torch.arange(len(w)) for w in chunk])
        h, taps = target.forward_states(ids, positions, backend, kv, meta, layers)
        hidden.append(h.to(torch.bfloat16))
        features.append(torch.cat(taps, -1).to(torch.bfloat16))
    width = target.cfg.hidden_size
    if not hidden:
        return torch.zeros(0, width, dtype=torch.bfloat16), torch.zeros(0, len(layers) * width, dtype=torch.bfloat16)
    return torch.cat(hidden), torch.cat(features)


# ---------------------------------------------------------------------------- 3. train

class Windows:
    """The windows of several parts; `picks` lists window indices, repeated for oversampling
    (the data itself is stored once, memory-mapped for --data)."""

    def __init__(self, parts: list, weights: list[int], kinds: list[str], multi: bool):
        self.parts, self.multi = parts, multi
        self.spans, self.kinds, self.picks = [], [], []  # (part, start, length) per window
        for p, (part, weight, kind) in enumerate(zip(parts, weights, kinds)):
            off = part.offsets.tolist()
            for a, b in zip(off[:-1], off[1:]):
                self.picks += [len(self.spans)] * weight
                self.spans.append((p, a, b - a))
                self.kinds.append(kind)

    @property
    def num_tokens(self) -> int:
        return sum(len(p.ids) for p in self.parts)

    def token_counts(self, vocab: int) -> torch.Tensor:
        return sum(torch.bincount(p.ids, minlength=vocab) for p in self.parts)

    def window(self, w: int, start: int = 0, length: int | None = None):
        """(ids [n] i64, hidden [n, H], head input states [n, W]) of window w, rows start.."""
        p, a, n = self.spans[w]
        length = n - start if length is None else length
        part = self.parts[p]
        hidden, features = part.rows(a + start, length)
        return part.ids[a + start: a + start + length], hidden, (features if self.multi else hidden)

    def batch(self, step: int, size: int, rows: int, depth: int, seed: int):
        """Step `step`'s batch, a function of (seed, step) only: crops of rows + depth tokens,
        tokens [B, L] i64 (x_i), states [B, L, W] (the head's input for row i), hidden [B, L, H]
        (H_i: lm_head(H_i) is the target's distribution of x_{i+1}), positions [B, L] i64 and
        valid [B, L] f32 (0 past the end of a short window); L = rows + depth."""
        gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
        length = rows + depth
        crops = []
        for i in torch.randint(len(self.picks), (size,), generator=gen).tolist():
            w = self.picks[i]
            n = min(self.spans[w][2], length)
            a = int(torch.randint(self.spans[w][2] - n + 1, (1,), generator=gen))  # crop offset
            crops.append((w, a, n))
        ids0, hid0, st0 = self.window(crops[0][0], crops[0][1], 1)
        tokens = torch.zeros(size, length, dtype=torch.long)
        positions = torch.zeros(size, length, dtype=torch.long)
        hidden = torch.zeros(size, length, hid0.shape[1], dtype=hid0.dtype)
        states = torch.zeros(size, length, st0.shape[1], dtype=st0.dtype)
        valid = torch.zeros(size, length)
        for b, (w, a, n) in enumerate(crops):
            ids, hid, st = self.window(w, a, n)
            tokens[b, :n], hidden[b, :n], states[b, :n] = ids, hid, st
            positions[b] = torch.arange(a, a + length)
            valid[b, :n] = 1
        return tokens, states, hidden, positions, valid


def init_head(head: MTPHead, target: LlamaModel, layer: int | None, seed: int) -> None:
    """The layer starts as a copy of target layer `layer` and the fuse as the mean of its two
    inputs (plus noise); layer=None: both random (std 0.02). Norms start as ones."""
    gen = torch.Generator().manual_seed(seed)
    h = head.cfg.hidden_size
    with torch.no_grad():
        if layer is None:
            for name, p in head.named_parameters():
                if "norm" not in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
            return
        eye = torch.eye(h)
        head.fuse.copy_(0.5 * torch.cat([eye, eye], 1) + 0.01 * torch.randn(h, 2 * h, generator=gen))
        if head.feature_layers:  # start from the highest layer's features
            parts = [torch.zeros(h, h)] * (len(head.feature_layers) - 1) + [eye]
            head.reduce.copy_(torch.cat(parts, 1) + 0.01 * torch.randn(head.reduce.shape, generator=gen))
        src = target.layers[layer]
        for name, p in head.layer.named_parameters():
            p.copy_(src.get_parameter(name).float())


def loss_terms(head: MTPHead, lm_rows: torch.Tensor, batch, args):
    """(loss, {reg, kl, acc, kl_d, acc_d}) of one batch, unrolled `--ttt-depth` steps
    (EAGLE-3 / HASS training-time test).

    Depth 1 is teacher forcing: row j reads (x_{j+1}, the target's states at j) at position j
    and predicts x_{j+2}, whose target distribution is softmax(lm_head(H_{j+1})). Depth d > 1
    reads (x_{j+d}, the head's OWN hidden from depth d-1) at position j+d-1, attending to
    depth 1's keys of rows 0..j and its own chain's keys (forward_dense's `past`): exactly
    what the runtime feeds a chain's d-th draft, so the head learns on the features it will
    see, not only on the target's. Each depth adds KL(target || head) over the loss
    vocabulary (lm_rows [Vs, hidden]) and, for a last-layer head, smooth-L1(g, H_{j+d}),
    weighted decay^(d-1)."""
    tokens, states, hidden, positions, valid = batch
    depth = args.ttt_depth
    rows = tokens.shape[1] - depth
    h, past = states[:, :rows].float(), []
    total, terms = 0.0, {}
    for d in range(1, depth + 1):
        tok, pos = tokens[:, d: d + rows], positions[:, d - 1: d - 1 + rows]
        target_h, mask = hidden[:, d: d + rows].float(), valid[:, d: d + rows]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not args.fp32):
            g, kv = head.forward_dense(tok, h, pos, past or None)
            logits = F.linear(g, lm_rows)
            with torch.no_grad():
                t_logits = F.linear(target_h, lm_rows)
        logq = torch.log_softmax(logits.float(), -1)
        with torch.no_grad():
            logp = torch.log_softmax(t_logits.float(), -1)
        kl = (logp.exp() * (logp - logq)).sum(-1)  # [B, R]
        n = mask.sum().clamp_min(1)
        loss_d = args.kl_weight * kl
        if not head.feature_layers:
            reg = F.smooth_l1_loss(g.float(), target_h, reduction="none").mean(-1)
            loss_d = loss_d + args.reg_weight * reg
            if d == 1:
                terms["reg"] = float((reg * mask).sum() / n)
        total = total + args.depth_decay ** (d - 1) * (loss_d * mask).sum() / n
        with torch.no_grad():
            acc = float(((logits.argmax(-1) == t_logits.argmax(-1)).float() * mask).sum() / n)
        terms.update({f"kl{d}": float((kl * mask).sum() / n), f"acc{d}": acc})
        past.append(kv)
        h = g
    terms.setdefault("reg", 0.0)
    terms["kl"], terms["acc"] = terms["kl1"], terms["acc1"]
    return total, terms


def variant_name(args) -> str:
    """norms | no_norms, + _last (last-layer input) and _ttt1 (no training-time test)."""
    name = "norms" if args.norms else "no_norms"
    return name + ("_last" if args.features == "last" else "") + ("" if args.ttt_depth > 1 else "_ttt1")


def rows_per_window(args) -> int:
    return min(args.crop or args.seq_len, args.seq_len)


def train_signature(args) -> dict:
    keys = ("norms", "seq_len", "crop", "batch_size", "lr", "warmup", "steps", "reg_weight", "kl_weight",
            "init_layer", "fp32", "seed", "self_weight", "loss_vocab", "features", "ttt_depth", "depth_decay", "data")
    return {k: getattr(args, k) for k in keys}


def loss_vocab(data: "Windows", vocab: int, size: int) -> torch.Tensor:
    """[Vs] i64 sorted ids of the `size` most frequent training tokens (all when size is 0)."""
    if not size or size >= vocab:
        return torch.arange(vocab)
    return data.token_counts(vocab).topk(size).indices.sort().values


def train(args, head: MTPHead, data: Windows, vocab_ids: torch.Tensor, ckpt: Path) -> list[dict]:
    # Frozen, so gathered once (in f32 without autocast, else the matmul would run in bf16).
    lm_rows = head.lm_head[vocab_ids].to(torch.float32 if args.fp32 else head.lm_head.dtype)
    params = [p for p in head.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / args.warmup)
                                              * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    step, history = 0, []
    if args.resume and ckpt.exists():
        state = torch.load(ckpt)
        if state["signature"] != train_signature(args):
            diff = {k: (v, state["signature"].get(k)) for k, v in train_signature(args).items()
                    if state["signature"].get(k) != v}
            raise SystemExit(f"--resume: {ckpt} was made with other settings (now, then): {diff}")
        head.load_state_dict(state["head"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        step, history = state["step"], state["history"]
        print(f"resumed from step {step}")
    elif ckpt.exists():
        print(f"{ckpt} exists; starting over (pass --resume to continue it)")
    stop = min(args.steps, args.stop_after or args.steps)
    bar = tqdm(total=args.steps, initial=step, desc=f"train ({variant_name(args)})")
    head.train()
    while step < stop:
        batch = data.batch(step, args.batch_size, rows_per_window(args), args.ttt_depth, args.seed)
        loss, terms = loss_terms(head, lm_rows, batch, args)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        step += 1
        history.append({"loss": float(loss.detach()), **terms})
        bar.update(1)
        recent = history[-20:]
        bar.set_postfix(loss=f"{sum(h['loss'] for h in recent) / len(recent):.3f}",
                        acc="/".join(f"{sum(h[f'acc{d}'] for h in recent) / len(recent):.2f}"
                                     for d in range(1, args.ttt_depth + 1)))
        if step % args.ckpt_every == 0 or step == stop:
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"head": head.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "step": step, "history": history, "signature": train_signature(args)}, tmp)
            tmp.replace(ckpt)  # atomic: a kill mid-save never corrupts the checkpoint
    bar.close()
    return history


def curve_summary(history: list[dict], points: int = 20) -> list[dict]:
    """Mean loss terms over `points` equal stretches of training."""
    out, size = [], max(1, len(history) // points)
    for i in range(0, len(history), size):
        part = history[i: i + size]
        out.append({"steps": [i + 1, i + len(part)],
                    **{k: round(sum(h[k] for h in part) / len(part), 4) for k in part[0]}})
    return out


# ---------------------------------------------------------------------------- 4. evaluate

@torch.no_grad()
def evaluate(head: MTPHead, data: Windows, k: int, fp32: bool, vocab_ids: torch.Tensor) -> dict:
    """Held-out agreement with the target's greedy tokens t_i = argmax lm_head(H_i) (the token
    the target puts after position i).

    top1: draft 1 of row j (x_{j+1}, H_j) equals t_{j+1}, over every row.
    chain: row j drafts d_1..d_k, step i feeding (d_{i-1}, head hidden of step i-1) at position
    j+i-1 (what the runtime does for k > 1). d_i is compared with t_{j+i}. The target's tokens
    after a draft are only known where the data took the same token, so chains are scored at
    the starts where x_{j+i+1} = t_{j+i} for i < k (the target's own greedy continuation: all
    of a self-distilled reply, where greedy decoding spends its time).
    prefix_match[i]: fraction of those starts whose drafts 1..i all match (what the engine
    reports as acceptance per position); expected acceptance length = 1 + sum of prefix_match.
    """
    head.eval()
    stats: dict[str, dict] = {}
    for w, (_, _, length) in enumerate(data.spans):
        if length < k + 2:
            continue
        ids, hidden, states = data.window(w)
        n = length - 1  # head rows
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not fp32):
            t = head.dense_logits(hidden[None].float()).argmax(-1)[0]  # [length]
            tokens, h, past, drafts = ids[None, 1:], states[None, :-1].float(), [], []
            for i in range(k):
                g, kv = head.forward_dense(tokens, h, torch.arange(i, n + i), past or None)
                tokens, h = head.dense_logits(g).argmax(-1), g
                past.append(kv)
                drafts.append(tokens[0])
        s = stats.setdefault(data.kinds[w], {"rows": 0, "top1": 0, "starts": 0,
                                             "match": [0] * k, "prefix": [0] * k, "greedy": []})
        s["rows"] += n
        s["top1"] += int((drafts[0] == t[1:]).sum())
        s["greedy"].append(t[1:])
        # Chain starts j = 0 .. n-k: on the target's greedy path for the tokens drafted before.
        starts = n - k + 1
        on_path = torch.ones(starts, dtype=torch.bool)
        for i in range(1, k):
            on_path &= ids[i + 1: i + 1 + starts] == t[i: i + starts]
        ok = torch.ones(starts, dtype=torch.bool)
        s["starts"] += int(on_path.sum())
        for i in range(k):
            hit = (drafts[i][:starts] == t[i + 1: i + 1 + starts]) & on_path
            ok &= hit
            s["match"][i] += int(hit.sum())
            s["prefix"][i] += int(ok.sum())
    out = _metrics(stats, k)
    # How much of what the target says next the training loss saw (the rest: regression only).
    greedy = torch.cat([g for s in stats.values() for g in s["greedy"]])
    inside = torch.zeros(head.cfg.vocab_size, dtype=torch.bool)
    inside[vocab_ids] = True
    return {**out, "loss_vocab_coverage": float(inside[greedy].float().mean())}


def _metrics(stats: dict, k: int) -> dict:
    def summarise(s):
        greedy = torch.cat(s["greedy"])
        prefix = [p / max(1, s["starts"]) for p in s["prefix"]]
        return {"top1": s["top1"] / max(1, s["rows"]), "rows": s["rows"],
                # Always guessing the most common target token: the floor top1 must clear.
                "majority_baseline": float(torch.bincount(greedy).max()) / max(1, len(greedy)),
                "chain_starts": s["starts"],
                "chain_accuracy": [m / max(1, s["starts"]) for m in s["match"]],
                "chain_prefix_match": prefix,
                "chain_conditional_accuracy": [p / q if q else 0.0 for p, q in zip(prefix, [1.0] + prefix)],
                "expected_acceptance_length": 1 + sum(prefix)}

    total = {"rows": 0, "top1": 0, "starts": 0, "match": [0] * k, "prefix": [0] * k, "greedy": []}
    for s in stats.values():
        for key in ("rows", "top1", "starts"):
            total[key] += s[key]
        for key in ("match", "prefix"):
            total[key] = [a + b for a, b in zip(total[key], s[key])]
        total["greedy"] += s["greedy"]
    out = {"k": k, **summarise(total)}
    if len(stats) > 1:
        out["by_kind"] = {kind: summarise(s) for kind, s in sorted(stats.items())}
    return out


def validate_with_engine(head_dir, prompts: list[str], k: int = 3, model: str | None = None,
                         max_tokens: int = 128, chat: bool = True, device: str = "cpu",
                         attention_backend: str = "auto") -> dict:
    """Greedy generation through the real engine with the MTP proposer: acceptance length and
    per-position acceptance from the requests' stats (runtime.bench.acceptance)."""
    try:
        import overlap.speculative.mtp  # noqa: F401
    except ImportError as exc:
        raise NotImplementedError("engine validation needs the MTP proposer (overlap.speculative.mtp)") from exc
    from overlap.config import EngineConfig, SpecConfig
    from runtime.bench import acceptance
    from runtime.engine import Engine
    from runtime.messages import SamplingParams

    spec = SpecConfig(method="mtp", num_spec_tokens=k, head=str(head_dir))
    engine = Engine(EngineConfig(model=model, spec=spec, device=device, attention_backend=attention_backend),
                    progress=False)
    try:
        results = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0), chat=chat)
    finally:
        engine.close()
    return {"prompts": len(prompts), "k": k, **acceptance([r.stats for r in results])}


# ---------------------------------------------------------------------------- main

def main(argv=None) -> int:
    args = parse_args(argv)
    if args.engine_validate:
        from overlap.config import check_device

        check_device(args.device, args.attention_backend)  # now, not after the training
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    model_dir = resolve_model_dir(args.model)
    target = load_llama(model_dir, torch.bfloat16)
    # 1. corpus and 2. hidden states, per part
    parts = load_parts(args, model_dir, target, work)
    names = [n for n in PARTS + ("windows",) if (n, "train") in parts]
    # The target's own continuations are what the head meets at inference: oversample them.
    weights = [1 if n in ("code", "windows") else args.self_weight for n in names]
    multi = args.features == "multi"
    train_data = Windows([parts[n, "train"] for n in names], weights, list(names), multi)
    eval_names = [n for n in names if (n, "eval") in parts]
    eval_data = Windows([parts[n, "eval"] for n in eval_names], [1] * len(eval_names), eval_names, multi)
    data_s = time.time() - started
    sizes = {"train_windows": len(train_data.spans), "train_tokens": train_data.num_tokens,
             "train_tokens_oversampled": sum(train_data.spans[i][2] for i in train_data.picks),
             "eval_windows": len(eval_data.spans), "eval_tokens": eval_data.num_tokens,
             "by_part": {n: {s: len(parts[n, s].ids) for s in ("train", "eval") if (n, s) in parts} for n in names},
             # Building the parts (self-distillation + target forwards), when they were built here.
             "precompute_s": round(sum(getattr(p, "seconds", 0.0) for p in parts.values()), 1)}
    print(f"data: {json.dumps(sizes)}")
    if args.precompute_only:
        return 0
    # 3. the head, trained in f32 (bf16 autocast) against the frozen bf16 target
    layers = (tuple(parts[names[0], "train"].feature_layers) if args.data
              else default_feature_layers(target.cfg.num_layers)) if multi else ()
    head = MTPHead(target.cfg, target, norms=args.norms, dtype=torch.float32, feature_layers=layers)
    init_head(head, target, args.init_layer, args.seed)
    variant = variant_name(args)
    t0 = time.time()
    vocab_ids = loss_vocab(train_data, target.cfg.vocab_size, args.loss_vocab)
    before = evaluate(head, eval_data, args.eval_k, args.fp32, vocab_ids)
    history = train(args, head, train_data, vocab_ids, work / f"ckpt_{variant}.pt")
    train_s = time.time() - t0
    if len(history) < args.steps:
        print(f"stopped after step {len(history)} (--stop-after); resume with --resume")
        return 0
    # 4. evaluate
    t0 = time.time()
    after = evaluate(head, eval_data, args.eval_k, args.fp32, vocab_ids)
    eval_s = time.time() - t0
    tail = history[-50:]
    report = {
        "variant": variant, "norms": args.norms, "target": str(model_dir),
        "features": {"kind": args.features, "target_layers": list(layers)},
        "training_time_test": {"depth": args.ttt_depth, "depth_decay": args.depth_decay},
        "alignment": "head row j: token x_{j+1} + the target's states at j (its hidden H_j after the "
                     "final norm, or its feature layers' outputs), position j → predicts x_{j+2}",
        "data": sizes,
        "corpus": (f"tools/head_data.py data in {args.data} (manifest.json there)" if args.data else
                   f"token windows from {args.windows}" if args.windows else
                   "Python stdlib sources (held out by file hash), the target's greedy continuations of "
                   "stdlib function headers, and its replies to templated chat instructions"),
        "train": {"steps": args.steps, "batch_size": args.batch_size, "seq_len": args.seq_len,
                  "crop": rows_per_window(args), "lr": args.lr,
                  "warmup": args.warmup, "loss_vocab": len(vocab_ids), "reg_weight": args.reg_weight, "kl_weight": args.kl_weight,
                  "init": "random" if args.init_layer is None else f"target layer {args.init_layer}", "autocast": "off (f32)" if args.fp32 else "bf16",
                  "seed": args.seed, "threads": torch.get_num_threads(),
                  "final": {k: round(sum(h[k] for h in tail) / len(tail), 4) for k in tail[0]},
                  "curve": curve_summary(history)},
        "before_training": before,
        "held_out": after,
        "seconds": {"data": round(data_s, 1), "train": round(train_s, 1), "eval": round(eval_s, 1),
                    "total": round(time.time() - started, 1)},
    }
    # 5. export
    out = Path(args.out)
    save_head(head, out, {"target": Path(str(model_dir)).name, "trained_steps": args.steps})
    if args.engine_validate:
        held_out = [x for i, x in enumerate(chat_instructions()) if i % 10 == 0][: args.engine_validate]
        try:
            report["engine"] = validate_with_engine(out, held_out, args.eval_k, args.model,
                                                    device=args.device, attention_backend=args.attention_backend)
        except NotImplementedError as exc:
            report["engine"] = f"skipped: {exc}"
    (out / "train_report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps({k: report[k] for k in ("variant", "data", "held_out", "seconds")}, indent=2))
    print(f"head written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
