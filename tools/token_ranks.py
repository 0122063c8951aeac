"""Rank the target's vocabulary by frequency in a head's training text (FR-Spec's trimmed
draft vocabulary): a head scores only the N most frequent tokens at inference.

    python tools/token_ranks.py --out overlap/assets/smollm2-135m-mtp   # ~1 min on 2 cores

Counts tokens of the training split of the Python standard library (tools/corpus.py: the
held-out files, and pip / site-packages, are never read) and of the chat instructions the
head's self-distillation uses, in SmolLM2's chat template. Writes token_ranks.safetensors
(`ranked_ids` [V] i32: every token id, most frequent first, ties by id) into --out; load_head
reads it when SpecConfig.draft_vocab > 0, and --default N records N in the head's
config.json as the size it drafts with unless told otherwise. Verification stays over the
full vocabulary, so the choice of N changes speed and acceptance, never the output.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from corpus import chat_instructions, read_text, split_files  # noqa: E402
from overlap.models.loading import load_tokenizer, resolve_model_dir  # noqa: E402


def count_tokens(tokenizer, texts, vocab: int, desc: str) -> torch.Tensor:
    counts = torch.zeros(vocab, dtype=torch.long)
    for text in tqdm(texts, desc=desc, disable=None):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        counts += torch.bincount(torch.tensor(ids, dtype=torch.long), minlength=vocab)[:vocab]
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the head's directory")
    ap.add_argument("--model", default=None, help="target (default: the shipped SmolLM2-135M-Instruct)")
    ap.add_argument("--default", type=int, default=4096, metavar="N",
                    help="the draft vocabulary the head uses when a run names none (its config.json's "
                         "draft_vocab; 4096 measured best for the shipped head, docs/mtp_eagle.md, 'Session 23'; 0: full)")
    args = ap.parse_args(argv)
    model_dir = resolve_model_dir(args.model, progress=True)
    tokenizer = load_tokenizer(model_dir)
    vocab = len(tokenizer)
    train_files, _ = split_files()
    counts = count_tokens(tokenizer, (read_text(f) for f in train_files), vocab, "stdlib (train split)")
    chats = [tokenizer.apply_chat_template([{"role": "user", "content": c}], tokenize=False,
                                           add_generation_prompt=True) for c in chat_instructions()]
    counts += count_tokens(tokenizer, chats, vocab, "chat instructions")
    # Most frequent first; ties (mostly zero counts) by id, so the ranking is deterministic.
    order = sorted(range(vocab), key=lambda i: (-int(counts[i]), i))
    from safetensors.torch import save_file

    out = Path(args.out) / "token_ranks.safetensors"
    save_file({"ranked_ids": torch.tensor(order, dtype=torch.int32)}, str(out))
    config = Path(args.out) / "config.json"
    if config.exists():
        raw = json.loads(config.read_text())
        raw["draft_vocab"] = args.default
        config.write_text(json.dumps(raw, indent=2))
    covered = {n: float(counts[torch.tensor(order[:n])].sum() / counts.sum()) for n in (2048, 4096, 8192, 16384)}
    print(f"wrote {out}: {int(counts.sum())} tokens counted; share of them in the top N: "
          + ", ".join(f"{n}: {c:.3f}" for n, c in covered.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
