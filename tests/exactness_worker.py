"""Greedy outputs of every drafter on the real model, in one process, as JSON on stdout.

Run by tests/models/test_isa_exactness.py under ONEDNN_MAX_CPU_ISA caps (which must be set
before the process starts, hence a process of its own):

    python tests/exactness_worker.py --prompts 12 --tokens 64 --alone 12 --batch 8
"""

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from overlap.config import (EngineConfig, SchedulerConfig, SpecConfig, default_draft_dir,  # noqa: E402
                            default_head_dir, torch_dtype)
from overlap.kernels import kernels_name  # noqa: E402
from overlap.models.llama import load_llama  # noqa: E402
from overlap.models.loading import load_tokenizer, resolve_model_dir  # noqa: E402
from runtime.engine import Engine  # noqa: E402
from runtime.messages import SamplingParams  # noqa: E402

MODES = {
    "none": SpecConfig(),
    "draft": SpecConfig(method="draft", num_spec_tokens=4, draft_model=str(default_draft_dir())),
    "ngram": SpecConfig(method="ngram", num_spec_tokens=4),
    "mtp:1": SpecConfig(method="mtp", num_spec_tokens=1, head=str(default_head_dir())),
    "mtp:3": SpecConfig(method="mtp", num_spec_tokens=3, head=str(default_head_dir())),
    "eagle": SpecConfig(method="eagle", head=str(default_head_dir())),
    "eagle:dynamic": SpecConfig(method="eagle", head=str(default_head_dir()), tree="dynamic"),
}


def benchmark_prompts(n: int) -> list[str]:
    """n prompts, code and chat alternating, from the shipped benchmark sets."""
    sets = [[json.loads(line)["prompt"] for line in (ROOT / "benchmarks" / "prompts" / f"{kind}.jsonl").open()]
            for kind in ("code", "chat")]
    return [sets[i % 2][i // 2] for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--alone", type=int, default=0, help="also run the first N prompts one at a time")
    ap.add_argument("--batch", type=int, default=8, help="max sequences per batch for the batched run")
    ap.add_argument("--modes", nargs="+", default=list(MODES))
    args = ap.parse_args()
    model_dir = resolve_model_dir(None, progress=False)
    model, tokenizer = load_llama(model_dir, torch_dtype(EngineConfig().dtype)), load_tokenizer(model_dir)
    prompts = benchmark_prompts(args.prompts)
    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
    out = {"variant": kernels_name(), "modes": {}}
    for mode in args.modes:
        config = EngineConfig(spec=MODES[mode], scheduler=SchedulerConfig(max_num_seqs=args.batch))
        engine = Engine.from_model(config, model, tokenizer)
        batched = [r.token_ids for r in engine.generate(prompts, params)]
        alone = [engine.generate([p], params)[0].token_ids for p in prompts[: args.alone]]
        out["modes"][mode] = {"batched": batched, "alone": alone}
        engine.close()
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
