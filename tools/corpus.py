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
# target's own replies). Built from templates, unrelated to the benchmark prompts (a test
# checks the two sets are disjoint). `chat_instructions()` is the original small set the
# shipped tools default to; `many_chat_instructions()` the larger one tools/head_data.py uses.
_TASKS = ["Explain", "Give three facts about", "Write a short paragraph about",
          "What are the main uses of", "Describe the history of", "Summarize what you know about",
          "List some pros and cons of", "How would you teach a child about"]
_TOPICS = ["photosynthesis", "the water cycle", "volcanoes", "the Roman Empire", "prime numbers",
           "recursion in programming", "healthy sleep", "electric cars", "the Moon", "honey bees",
           "binary search", "climate and weather", "the printing press", "vaccines", "coral reefs",
           "sorting algorithms", "the Internet", "gravity", "chess openings", "bread baking",
           "rainbows", "hash tables", "renewable energy", "the human heart", "jazz music",
           "version control", "the Pythagorean theorem", "deserts", "supply and demand", "owls"]

_MORE_TASKS = ["Write a short essay about", "Give a beginner-friendly overview of",
               "What are common misconceptions about", "Compare two different views on",
               "Write five quiz questions with answers about", "Explain step by step how to learn about",
               "Write a blog post introduction about", "What should a student remember about"]
_MORE_TOPICS = ["black holes", "the French Revolution", "machine learning", "linked lists", "tea",
                "the stock market", "earthquakes", "the immune system", "public speaking", "bicycles",
                "the Silk Road", "database indexes", "tides", "origami", "the Renaissance", "penguins",
                "compilers", "coffee", "time management", "the speed of light", "ancient Egypt",
                "regular expressions", "rain forests", "the piano", "budgeting", "DNA", "glaciers",
                "object-oriented programming", "the Olympic Games", "mushrooms", "solar panels",
                "the periodic table", "memory in computers", "mountain climbing", "bees and flowers",
                "the Great Wall of China", "operating systems", "volunteering", "magnets", "whales",
                "unit testing", "gardening", "satellites", "the Cold War", "caching", "friendship",
                "dinosaurs", "encryption", "camping", "the Amazon river", "graph algorithms",
                "nutrition", "airplanes", "poetry", "concurrency", "museums", "the ocean floor",
                "dynamic programming", "recycling", "the brain", "trains", "probability"]
_FUNCTIONS = ["reverses a string", "checks whether a number is prime", "counts the vowels in a text",
              "returns the n-th Fibonacci number", "flattens a nested list", "removes duplicates from a list "
              "while keeping the order", "computes the factorial of n", "checks whether a string is a "
              "palindrome", "returns the most common word in a text", "converts Celsius to Fahrenheit",
              "parses a date string in ISO format", "computes the average of a list of numbers",
              "finds the longest word in a sentence", "groups a list of words by their first letter",
              "transposes a matrix given as a list of lists", "rotates a list by k positions",
              "counts the lines of a file", "checks whether two strings are anagrams",
              "returns the greatest common divisor of two integers", "splits a list into chunks of size n",
              "validates an email address with a regular expression", "computes the median of a list",
              "reads a CSV file into a list of dictionaries", "returns all permutations of a string",
              "converts a Roman numeral to an integer", "computes the power set of a list",
              "finds the second largest number in a list", "capitalizes every word in a sentence",
              "checks whether brackets in a string are balanced", "counts word frequencies in a text",
              "performs a linear search", "implements bubble sort", "implements quicksort",
              "implements insertion sort", "computes the dot product of two vectors",
              "returns the intersection of two lists", "converts a binary string to an integer",
              "generates the first n prime numbers", "finds the missing number in a range",
              "sums the digits of an integer", "returns the running total of a list",
              "merges two dictionaries", "checks whether a year is a leap year",
              "encodes a string with a Caesar cipher", "computes the edit distance of two strings",
              "finds all files with a given extension in a directory", "memoizes another function",
              "retries a function call up to three times", "computes the area of a circle",
              "returns the keys of a dictionary sorted by value"]
_CLASSES = ["a queue", "a bank account", "a linked list", "a binary tree", "a to-do list", "a timer",
            "a 2D point", "a rectangle", "an LRU cache", "a library book catalog", "a deck of cards",
            "a temperature sensor reading", "a shopping cart", "a simple counter", "a matrix",
            "a priority queue", "a student with grades", "a graph with adjacency lists",
            "a rate limiter", "a bounded buffer"]
_CODE_ASKS = ["Write a Python function that {}.", "Write a short Python function that {}, with a docstring.",
              "Show how to write a Python function that {}, and explain it."]


def chat_instructions() -> list[str]:
    return [f"{task} {topic}." for topic in _TOPICS for task in _TASKS]


def many_chat_instructions() -> list[str]:
    """~2,300 instructions: the original set, more topics and tasks, and programming requests
    (the dev set's chat prompts ask for code as often as for prose)."""
    prose = [f"{task} {topic}." for topic in _TOPICS + _MORE_TOPICS for task in _TASKS + _MORE_TASKS]
    code = [ask.format(f) for f in _FUNCTIONS for ask in _CODE_ASKS]
    classes = [f"Write a Python class for {c}, with a short example of its use." for c in _CLASSES]
    classes += [f"Implement {c} in Python and explain each method." for c in _CLASSES]
    return prose + code + classes


def function_headers(files, count: int, per_file: int = 3, top_level_only: bool = False) -> list[str]:
    """The `def` line(s) plus docstring of documented functions (prompts shaped like a user's
    code prompts), dedented, ending in a newline: at most `per_file` from each file (variety),
    only module-level functions with `top_level_only`, `count` in all."""
    import ast

    out = []
    for f in files:
        try:
            source = read_text(f)
            tree = ast.parse(source)
        except (SyntaxError, ValueError):
            continue
        lines, taken = source.splitlines(keepends=True), 0
        for node in ast.walk(tree):
            doc = isinstance(node, ast.FunctionDef) and ast.get_docstring(node)
            if not doc or len(doc) <= 40 or taken >= per_file or (top_level_only and node.col_offset):
                continue
            indent = node.col_offset
            text = "".join(line[indent:] for line in lines[node.lineno - 1: node.body[0].end_lineno])
            out.append(text if text.endswith("\n") else text + "\n")
            taken += 1
        if len(out) >= count:
            break
    return out[:count]
