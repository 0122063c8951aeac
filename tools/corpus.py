"""Offline training corpora for drafters and heads.

Code: the Python standard library's own sources (present on every machine with Python;
site-packages, and so pip, excluded: the team's dev prompts come from pip's sources, so
they are never trained on). Files are split into train / held-out by a hash of their
relative path, so the split is stable across machines and runs. The shipped benchmark
prompts (benchmarks/prompts/, tools/make_prompts.py) are cut from held-out files only.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

HELD_OUT_EVERY = 20  # ~5% of files are held out for evaluation


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in sorted(root.rglob("*.py"))
             if "site-packages" not in p.parts and "pip" not in p.parts]
    return files


def is_held_out(path: Path) -> bool:
    rel = path.relative_to(sysconfig.get_paths()["stdlib"]).as_posix()
    return int(hashlib.sha1(rel.encode()).hexdigest(), 16) % HELD_OUT_EVERY == 0


def split_files() -> tuple[list[Path], list[Path]]:
    files = stdlib_files()
    return [f for f in files if not is_held_out(f)], [f for f in files if is_held_out(f)]


def read_text(path: Path) -> str:
    return path.read_text(encoding="utf-8", errors="replace")


# Chat instructions for self-distillation (the target answers them; the drafter learns the
# target's own replies). Built from templates, unrelated to the benchmark prompts.
_TASKS = ["Explain", "Give three facts about", "Write a short paragraph about",
          "What are the main uses of", "Describe the history of", "Summarize what you know about",
          "List some pros and cons of", "How would you teach a child about"]
_TOPICS = ["photosynthesis", "the water cycle", "volcanoes", "the Roman Empire", "prime numbers",
           "recursion in programming", "healthy sleep", "electric cars", "the Moon", "honey bees",
           "binary search", "climate and weather", "the printing press", "vaccines", "coral reefs",
           "sorting algorithms", "the Internet", "gravity", "chess openings", "bread baking",
           "rainbows", "hash tables", "renewable energy", "the human heart", "jazz music",
           "version control", "the Pythagorean theorem", "deserts", "supply and demand", "owls"]


def chat_instructions() -> list[str]:
    return [f"{task} {topic}." for topic in _TOPICS for task in _TASKS]
