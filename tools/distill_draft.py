"""Distil a small draft model for a target (default: the shipped SmolLM2-135M-Instruct).

    python tools/distill_draft.py --out drafts/smollm2-135m-draft [--workdir runs/distill]

The draft is a Llama decoder with a few layers of the target's width. It shares the target's
tokenizer, embeddings and lm_head (frozen, not stored again) and scores only the target's
most frequent tokens (`vocab_ids`, FR-Spec style), so a draft step costs a fraction of a
target step. Its layers start as copies of evenly spaced target layers.

Steps (each resumable: outputs land in --workdir and are reused):
  1. corpus    Python stdlib sources (train / held-out split by file) plus the target's own
               answers to templated chat instructions (self-distillation).
  2. labels    OUR inference path runs the target over every training window and keeps its
               top-k next-token distribution (the KL target).
  3. train     KL(target || draft) over the draft vocabulary, AdamW, cosine schedule,
               checkpoints every --ckpt-every steps; --resume is automatic.
  4. evaluate  held-out top-1 agreement of draft and target argmax.
  5. export    config.json + model.safetensors (decoder layers, final norm, vocab_ids).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from corpus import chat_instructions, function_headers, read_text, split_files  # noqa: E402
from overlap.attention import ReferenceBackend, SeqAttention  # noqa: E402
from overlap.models.llama import LlamaModel, load_llama  # noqa: E402
from overlap.models.loading import load_tokenizer, read_model_config, resolve_model_dir  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="target: GGUF or HF dir (default: shipped SmolLM2)")
    ap.add_argument("--out", required=True, help="directory for the exported draft")
    ap.add_argument("--workdir", default="runs/distill")
    ap.add_argument("--layers", type=int, default=2, help="draft decoder layers")
    ap.add_argument("--draft-vocab", type=int, default=8192, help="tokens the draft scores")
    ap.add_argument("--window", type=int, default=256, help="tokens per training window")
    ap.add_argument("--max-train-tokens", type=int, default=400_000)
    ap.add_argument("--max-eval-tokens", type=int, default=20_000)
    ap.add_argument("--chat-answers", type=int, default=160, help="self-distilled chat replies (0: none)")
    ap.add_argument("--chat-tokens", type=int, default=160, help="tokens per self-distilled reply")
    ap.add_argument("--code-answers", type=int, default=192,
                    help="self-distilled continuations of stdlib function headers (0: none)")
    ap.add_argument("--self-weight", type=int, default=4, help="oversampling of self-distilled parts")
    ap.add_argument("--top-k", type=int, default=32, help="target probabilities kept per position")
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--batch", type=int, default=8, help="windows per step")
    ap.add_argument("--lr", type=float, default=5e-4)
    ap.add_argument("--ckpt-every", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    return ap.parse_args(argv)


# ---------------------------------------------------------------------------- 1. corpus
# The corpus is built in parts, each cached with its labels in --workdir, so a later run
# that adds a part reuses the others. Self-generated parts hold the target's own greedy
# continuations: what the draft must predict at inference time.

PARTS = ("code", "chat", "gen_code")


def build_part(name: str, split: str, args, tokenizer, target: LlamaModel) -> list[list[int]]:
    train_files, eval_files = split_files()
    files = train_files if split == "train" else eval_files
    random.Random(args.seed).shuffle(files)
    if name == "code":
        budget = args.max_train_tokens if split == "train" else args.max_eval_tokens
        return code_windows((read_text(f) for f in files), tokenizer, args.window, budget)
    if name == "chat":
        instructions = chat_instructions()
        chosen = [x for i, x in enumerate(instructions) if (i % 10 == 0) == (split == "eval")]
        count = args.chat_answers if split == "train" else max(4, args.chat_answers // 10)
        return self_distilled(target, tokenizer, chosen[:count], args.chat_tokens, args.window, chat=True)
    if name == "gen_code":
        count = args.code_answers if split == "train" else max(4, args.code_answers // 10)
        headers = function_headers(files, count, per_file=1, top_level_only=True)
        return self_distilled(target, tokenizer, headers, args.chat_tokens, args.window, chat=False)
    raise ValueError(name)


def code_windows(texts, tokenizer, window: int, budget: int) -> list[list[int]]:
    out, total = [], 0
    for text in texts:
        ids = tokenizer.encode(text)
        for i in range(0, len(ids) - 32, window):
            if total >= budget:
                return out
            out.append(ids[i: i + window])
            total += len(out[-1])
    return out


def self_distilled(target, tokenizer, prompts, max_tokens: int, window: int, chat: bool) -> list[list[int]]:
    """The target's own greedy continuations of the prompts (prompt + reply ids)."""
    if not prompts:
        return []
    from overlap.config import CacheConfig, EngineConfig
    from runtime.engine import Engine
    from runtime.messages import SamplingParams

    engine = Engine.from_model(EngineConfig(cache=CacheConfig(num_pages=4096)), target, tokenizer)
    ids = [engine.add_request(q, SamplingParams(max_tokens=max_tokens), chat=chat) for q in prompts]
    bar = tqdm(total=len(ids), desc=f"self-distilled {'chat' if chat else 'code'}")
    while engine.has_work():
        for delta in engine.step():
            bar.update(delta.finish_reason is not None)
    bar.close()
    return [(engine.encode(q, chat=chat) + engine.pop_result(rid).token_ids)[:window]
            for rid, q in zip(ids, prompts)]


def load_parts(args, tokenizer, target: LlamaModel, work: Path) -> dict:
    """{(name, split): (windows, (probs, ids))} for every part, built or read from the cache."""
    parts = {}
    for name in PARTS:
        for split in ("train", "eval"):
            path = work / f"part_{name}_{split}_top{args.top_k}.pt"
            if not path.exists():
                windows = build_part(name, split, args, tokenizer, target)
                labels = target_labels(target, windows, args.top_k, f"target labels ({name}/{split})")
                torch.save({"windows": windows, "labels": labels}, path)
            data = torch.load(path)
            parts[name, split] = (data["windows"], data["labels"])
    return parts


# ---------------------------------------------------------------------------- 2. labels

@torch.inference_mode()
def target_labels(target: LlamaModel, windows: list[list[int]], top_k: int, desc: str):
    """Top-k target probabilities for every next-token position of every window."""
    backend = ReferenceBackend()
    page = 16
    probs, ids = [], []
    for w in tqdm(windows, desc=desc):
        pages = -(-len(w) // page)
        kv = target.new_kv_pool(pages, page)
        meta = backend.plan([SeqAttention(len(w), len(w), list(range(pages)))], page)
        _, logits = target(torch.tensor(w), torch.arange(len(w)), backend, kv, meta, torch.arange(len(w)))
        top = torch.softmax(logits, -1).topk(top_k, dim=-1)
        probs.append(top.values.half())
        ids.append(top.indices.int())
    return probs, ids


# ---------------------------------------------------------------------------- 3. the draft

def draft_config(target_hf: dict, layers: int) -> dict:
    cfg = dict(target_hf)
    cfg.update(num_hidden_layers=layers, tie_word_embeddings=True, torch_dtype="float32")
    return cfg


def init_draft(target: LlamaModel, cfg: dict, layers: int):
    """An HF LlamaForCausalLM (trainable) whose layers copy evenly spaced target layers."""
    import transformers

    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg))
    picks = [round(i * (target.cfg.num_layers - 1) / max(layers - 1, 1)) for i in range(layers)]
    q, kv = target.cfg.num_heads * target.cfg.head_dim, target.cfg.num_kv_heads * target.cfg.head_dim
    inter = target.cfg.intermediate_size
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(target.embed_tokens.float())
        model.model.norm.weight.copy_(target.norm.weight.float())
        for dst, src_i in zip(model.model.layers, picks):
            src = target.layers[src_i]
            wq, wk, wv = src.qkv_proj.float().split([q, kv, kv])
            dst.self_attn.q_proj.weight.copy_(wq)
            dst.self_attn.k_proj.weight.copy_(wk)
            dst.self_attn.v_proj.weight.copy_(wv)
            dst.self_attn.o_proj.weight.copy_(src.o_proj.float())
            gate, up = src.gate_up_proj.float().split([inter, inter])
            dst.mlp.gate_proj.weight.copy_(gate)
            dst.mlp.up_proj.weight.copy_(up)
            dst.mlp.down_proj.weight.copy_(src.down_proj.float())
            dst.input_layernorm.weight.copy_(src.input_layernorm.weight.float())
            dst.post_attention_layernorm.weight.copy_(src.post_attention_layernorm.weight.float())
    model.model.embed_tokens.weight.requires_grad_(False)  # shared with the target: frozen
    return model, picks


def draft_logits(model, ids: torch.Tensor, vocab_ids: torch.Tensor) -> torch.Tensor:
    """ids [B, L] → logits over the draft vocabulary [B, L, Vd]."""
    hidden = model.model(input_ids=ids).last_hidden_state
    return hidden @ model.model.embed_tokens.weight[vocab_ids].T


def kl_loss(logits: torch.Tensor, t_probs: torch.Tensor, t_ids: torch.Tensor, to_draft: torch.Tensor):
    """Soft cross-entropy to the target's top-k mass that lies in the draft vocabulary.
    logits [N, Vd]; t_probs, t_ids [N, k]; to_draft [V] i64 (-1: not in the draft vocab)."""
    idx = to_draft[t_ids.long()]
    keep = (idx >= 0).float()
    p = t_probs.float() * keep
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-8)
    logq = torch.log_softmax(logits.float(), -1).gather(1, idx.clamp_min(0))
    return -(p * logq).sum(-1).mean()


def batches(windows, probs, ids, size, rng):
    order = list(range(len(windows)))
    while True:
        rng.shuffle(order)
        for i in range(0, len(order) - size + 1, size):
            chosen = order[i: i + size]
            length = min(len(windows[j]) for j in chosen)
            yield (torch.tensor([windows[j][:length] for j in chosen]),
                   torch.stack([probs[j][:length] for j in chosen]),
                   torch.stack([ids[j][:length] for j in chosen]))


def train(args, model, corpus, labels, vocab_ids, work: Path):
    vocab = model.config.vocab_size
    to_draft = torch.full((vocab,), -1, dtype=torch.long)
    to_draft[vocab_ids] = torch.arange(len(vocab_ids))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * min(s, args.steps) / args.steps)))
    ckpt = work / "ckpt.pt"
    step, history = 0, []
    if ckpt.exists():
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        sched.load_state_dict(state["sched"])
        step, history = state["step"], state["history"]
        print(f"resumed from step {step}")
    rng = random.Random(args.seed + step)
    data = batches(corpus["train"], *labels, args.batch, rng)
    bar = tqdm(total=args.steps, initial=step, desc="train")
    model.train()
    while step < args.steps:
        ids, t_probs, t_ids = next(data)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = draft_logits(model, ids, vocab_ids)
        loss = kl_loss(logits.reshape(-1, logits.shape[-1]), t_probs.reshape(-1, args.top_k),
                       t_ids.reshape(-1, args.top_k), to_draft)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        step += 1
        history.append(float(loss))
        bar.update(1)
        bar.set_postfix(loss=f"{sum(history[-20:]) / len(history[-20:]):.3f}")
        if step % args.ckpt_every == 0 or step == args.steps:
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "sched": sched.state_dict(),
                        "step": step, "history": history}, tmp)
            tmp.replace(ckpt)  # atomic: a kill mid-save never corrupts the checkpoint
    bar.close()
    return history


# ---------------------------------------------------------------------------- 4. evaluate

@torch.no_grad()
def evaluate(model, corpus, eval_labels, vocab_ids) -> dict:
    """Held-out top-1 agreement: the draft's argmax equals the target's argmax."""
    model.eval()
    agree = {kind: [0, 0] for kind in set(corpus["eval_kinds"])}
    for w, p, i, kind in zip(corpus["eval"], *eval_labels, corpus["eval_kinds"]):
        logits = draft_logits(model, torch.tensor([w]), vocab_ids)[0]
        draft_top = vocab_ids[logits.argmax(-1)]
        target_top = i[:, 0].long()  # topk is sorted: column 0 is the argmax
        agree[kind][0] += int((draft_top == target_top).sum())
        agree[kind][1] += len(w)
    out = {k: a / n for k, (a, n) in agree.items() if n}
    total = sum(a for a, _ in agree.values()) / max(1, sum(n for _, n in agree.values()))
    return {"top1_agreement": total, **{f"top1_agreement_{k}": v for k, v in out.items()},
            "eval_tokens": sum(n for _, n in agree.values())}


# ---------------------------------------------------------------------------- 5. export

def export(model, vocab_ids, cfg: dict, out: Path, report: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    sd = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()
          if "embed_tokens" not in k and "lm_head" not in k}  # shared with the target
    sd["vocab_ids"] = vocab_ids.to(torch.int32)
    save_file(sd, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({**cfg, "torch_dtype": "bfloat16"}, indent=2))
    (out / "distill_report.json").write_text(json.dumps(report, indent=2))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    started = time.time()
    model_dir = resolve_model_dir(args.model)
    tokenizer = load_tokenizer(model_dir)
    target = load_llama(model_dir, torch.bfloat16)
    # 1. corpus and 2. labels, per part
    parts = load_parts(args, tokenizer, target, work)
    train_windows, train_probs, train_ids = [], [], []
    for name in PARTS:
        windows, (probs, ids) = parts[name, "train"]
        # The target's own continuations are what the draft meets at inference: oversample them.
        repeat = args.self_weight if name != "code" else 1
        train_windows += windows * repeat
        train_probs += probs * repeat
        train_ids += ids * repeat
    corpus = {"train": train_windows,
              "eval": [w for n in PARTS for w in parts[n, "eval"][0]],
              "eval_kinds": [n for n in PARTS for _ in parts[n, "eval"][0]]}
    labels = {"train": (train_probs, train_ids),
              "eval": tuple(sum((list(parts[n, "eval"][1][i]) for n in PARTS), []) for i in range(2))}
    # 3. the draft and its vocabulary: the most frequent tokens of the training text.
    counts = torch.bincount(torch.tensor([t for w in corpus["train"] for t in w]), minlength=target.cfg.vocab_size)
    vocab_ids = counts.topk(min(args.draft_vocab, target.cfg.vocab_size)).indices.sort().values
    cfg = draft_config(read_model_config(model_dir), args.layers)
    model, picks = init_draft(target, cfg, args.layers)
    print(f"draft: {args.layers} layers initialised from target layers {picks}; vocab {len(vocab_ids)}; "
          f"{len(corpus['train'])} train windows, {len(corpus['eval'])} held-out windows")
    before = evaluate(model, corpus, labels["eval"], vocab_ids)
    history = train(args, model, corpus, labels["train"], vocab_ids, work)
    # 4. evaluate
    after = evaluate(model, corpus, labels["eval"], vocab_ids)
    report = {"before_training": before, "after_training": after, "layers_from_target": picks,
              "draft_vocab": len(vocab_ids), "train_windows": len(corpus["train"]),
              "train_tokens": sum(map(len, corpus["train"])), "steps": args.steps, "batch": args.batch,
              "lr": args.lr, "seed": args.seed, "final_loss": sum(history[-50:]) / max(1, len(history[-50:])),
              "corpus": "Python stdlib sources (held out by file hash), the target's greedy continuations "
                        "of stdlib function headers, and its replies to templated chat instructions",
              "wall_s": time.time() - started}
    print(json.dumps(report, indent=2))
    # 5. export
    export(model, vocab_ids, cfg, Path(args.out), report)
    print(f"draft written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
