"""Hugging Face transformers as the reference: same weights, same prompt ids, batch 1, greedy.

`overlap bench --compare-hf` uses it to check that our greedy outputs match token for token
and to put our speed next to transformers' on the same machine. transformers is imported
lazily: loading it costs seconds and nothing else in the runtime needs it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

from overlap.config import torch_dtype


class HFReference:
    """AutoModelForCausalLM over a model directory (the one our engine loaded)."""

    def __init__(self, model_dir: str | Path, dtype: str):
        import transformers

        dt = torch_dtype(dtype)
        # transformers 5 renamed torch_dtype to dtype (the old name still works, with a warning).
        kw = {"dtype": dt} if int(transformers.__version__.split(".")[0]) >= 5 else {"torch_dtype": dt}
        self.model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), **kw).eval()
        self.dtype = dtype

    @torch.inference_mode()
    def generate(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        """Greedy continuation of one prompt (stops at EOS, which it includes, like our engine)."""
        ids = torch.tensor([prompt_ids])
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=max_new_tokens,
                                  pad_token_id=self.model.generation_config.eos_token_id)
        return out[0, len(prompt_ids):].tolist()


def run_reference(model_dir: str | Path, dtype: str, prompt_ids: list[list[int]], max_new_tokens: int,
                  progress: bool = True) -> dict:
    """Generate every prompt one at a time; returns token ids, wall time and tokens/s."""
    from tqdm import tqdm

    ref = HFReference(model_dir, dtype)
    ref.generate(prompt_ids[0], 4)  # warm-up, as for our engine
    outputs, total = [], 0.0
    for ids in tqdm(prompt_ids, desc="hf c=1", unit="req", file=sys.stderr,
                    disable=None if progress else True, leave=False):  # None: off when not a terminal
        t0 = time.perf_counter()
        outputs.append(ref.generate(ids, max_new_tokens))
        total += time.perf_counter() - t0
    tokens = sum(len(o) for o in outputs)
    return {"dtype": dtype, "output_tokens": tokens, "wall_s": total, "tokens_per_s": tokens / total,
            "token_ids": outputs}
