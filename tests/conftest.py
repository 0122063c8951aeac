import os
import sys
from pathlib import Path

import pytest

import overlap  # noqa: E402,F401  (before torch loads: its OpenMP wait policy, see overlap/__init__.py)

# Never reach for a model hub, in any test.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

from helpers import hf_model, save_hf_dir, tiny_hf_config  # noqa: E402


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    """The shipped SmolLM2-135M-Instruct, converted once into the cache."""
    from overlap.models.loading import resolve_model_dir

    return resolve_model_dir(None, progress=False)


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory, smol_dir) -> dict[str, Path]:
    """Tiny random models that share SmolLM2's tokenizer (vocab 49152):
    target (2 layers), draft (1 layer, other weights), vocab8 target/draft for statistics."""
    root = tmp_path_factory.mktemp("tiny")
    out = {}
    specs = {
        "target": dict(vocab=49152, layers=2, seed=0),
        "draft": dict(vocab=49152, layers=1, seed=1),
        "target_v6": dict(vocab=6, layers=2, seed=2),
        "draft_v6": dict(vocab=6, layers=1, seed=3),
    }
    for name, s in specs.items():
        cfg = tiny_hf_config(vocab=s["vocab"], layers=s["layers"], hidden=64, heads=4, kv_heads=2)
        out[name] = save_hf_dir(hf_model(cfg, seed=s["seed"]), cfg, root / name, tokenizer_dir=smol_dir)
    return out
