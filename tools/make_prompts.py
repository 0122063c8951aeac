"""Regenerate the benchmark prompt sets shipped in benchmarks/prompts/ (deterministically).

    python tools/make_prompts.py [--out benchmarks/prompts] [--check]

code.jsonl  function signatures and docstrings from the HELD-OUT files of the heads' and the
            draft's training corpus (tools/corpus.py: the Python standard library, split into
            train / held-out by a hash of each file's relative path). A prompt is kept only if
            its source text appears in no training-split file, so no benchmark code prompt is
            text a shipped drafter trained on. Ordered round-robin over the source files, so
            the first N prompts (`overlap bench --num-prompts N`) cover several modules.
chat.jsonl  instructions written for this set (below; not the templated instructions the
            training tools self-distil on), each with SmolLM2-Instruct's chat template applied
            and ending where the assistant's answer starts, exactly as `overlap generate --chat`
            builds its prompt.
sources.json  the Python version the code prompts were cut from, and each code prompt's
            source file and line (what tests/tools/test_make_prompts.py checks against the split).

Every line is {"prompt": ..., "kind": "code" | "chat"}, the format `overlap bench --prompts`
reads. The code prompts depend on the stdlib's text, so regenerate them with the Python
version named in sources.json to get the same bytes (--check compares instead of writing).
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
import sysconfig
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from corpus import HELD_OUT_EVERY, is_held_out, read_text, split_files  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "benchmarks" / "prompts"
PER_FILE = 20  # at most this many functions from one module: variety
MIN_DOC = 40  # characters of docstring: a prompt that says what the function should do
# Parts of the stdlib whose functions read nothing like user code (test suites, IDLE, 2to3).
SKIP_PARTS = {"test", "tests", "idlelib", "lib2to3"}

# Written for this set. Mixed on purpose (code, explanations, writing, reasoning, everyday
# tasks) so acceptance is measured on more than one kind of answer.
CHAT_INSTRUCTIONS = [
    # code
    "Write a Python function that returns the n-th row of Pascal's triangle as a list.",
    "Write a Python function that checks whether a string is a palindrome, ignoring spaces and case.",
    "Write a Python function that counts how often each word appears in a text and returns a dict.",
    "Write a Python function that flattens a nested list of arbitrary depth.",
    "Write a Python function that converts a Roman numeral such as 'MCMXCIV' to an integer.",
    "Write a Python generator that yields the Fibonacci numbers below a given limit.",
    "Write a Python function that removes duplicates from a list while keeping the original order.",
    "Write a Python function that returns the longest common prefix of a list of strings.",
    "Write a Python class Temperature that stores degrees Celsius and has a fahrenheit property.",
    "Write a Python function that rotates a square matrix by 90 degrees clockwise.",
    "Write a Python function that validates an IPv4 address given as a string.",
    "Write a Python script that reads a CSV file and prints the average of its second column.",
    "Write a Python function that groups a list of words into lists of anagrams.",
    "Write a Python decorator that prints how long the decorated function took to run.",
    "Write a Python function that computes the greatest common divisor of two integers without using math.gcd.",
    "Write a Python function that splits a list into chunks of a given size.",
    "Write a Python function that returns the k most common elements of a list.",
    "Write a Python context manager that temporarily changes the current working directory.",
    "Write a SQL query that returns the ten customers with the highest total order amount.",
    "Write a JavaScript function that debounces another function by 300 milliseconds.",
    "Write a bash one-liner that counts the lines of all .py files in a directory tree.",
    "Write a Python function that parses a query string like 'a=1&b=2' into a dictionary.",
    "Write a Python dataclass for a book with a title, an author and a publication year, and sort a list of books by year.",
    "Write a Python function that checks whether the brackets in a string are balanced.",
    "Implement insertion sort in Python and state its time complexity.",
    "Write a Python function that converts a number of seconds into a string like '2h 5m 7s'.",
    "Write unit tests with pytest for a function add(a, b) that adds two numbers.",
    "Write a Python function that merges two dictionaries, summing the values of shared keys.",
    "Write a recursive Python function that lists every subset of a set of numbers.",
    "Write a Python function that finds the first non-repeating character in a string.",
    # explain code / computing
    "What does the Python expression [x * x for x in range(5) if x % 2 == 0] evaluate to, and why?",
    "What is the difference between a list and a tuple in Python?",
    "Explain what a Python dictionary comprehension is, with a short example.",
    "Why is it a bad idea to use a mutable default argument in a Python function?",
    "What is the difference between 'is' and '==' in Python?",
    "Explain the difference between a process and a thread.",
    "What is a race condition, and how can a lock prevent it?",
    "Explain big-O notation in simple terms, with two examples.",
    "What is the difference between a stack and a queue? Give a real-world example of each.",
    "How does a hash function help a dictionary look up keys quickly?",
    "What does the git command 'rebase' do, and when would you use it instead of 'merge'?",
    "Explain what a memory leak is and how one can happen in a garbage-collected language.",
    "What is the purpose of an index in a database, and what does it cost?",
    "Explain the difference between HTTP GET and POST requests.",
    "What is a virtual environment in Python and why would you use one?",
    "What happens, step by step, when you type a web address into a browser and press Enter?",
    "Explain what caching is and give two places where it is used in computers.",
    "What is the difference between compiled and interpreted programming languages?",
    "Explain what recursion is to someone who has just started programming.",
    "What is floating-point rounding error? Why does 0.1 + 0.2 not print exactly 0.3 in Python?",
    # science and general knowledge
    "Why is the sky blue during the day and red at sunset?",
    "How do plants turn sunlight into food? Keep the answer short.",
    "What causes the seasons on Earth?",
    "Explain how a refrigerator keeps food cold.",
    "Why do we have leap years?",
    "What is the difference between weather and climate?",
    "How do vaccines train the immune system?",
    "Why does ice float on water?",
    "What is an eclipse, and how is a solar eclipse different from a lunar one?",
    "How does a compass work?",
    "Why do cats purr? Summarize what scientists think.",
    "What is the difference between a virus and a bacterium?",
    "How are rainbows formed?",
    "What is inflation in economics, in two or three sentences?",
    "Explain how a bicycle stays upright while it is moving.",
    "What are tides and what causes them?",
    "Why do leaves change colour in the autumn?",
    "How does GPS work out where you are?",
    "What is the greenhouse effect?",
    "Explain the difference between speed and velocity.",
    # writing
    "Write a short poem about a lighthouse at night.",
    "Write a limerick about a cat who learns to code.",
    "Write a two-paragraph story about a robot that finds a lost dog.",
    "Write a polite email asking a colleague to review a document by Friday.",
    "Write a short thank-you note to a neighbour who watered my plants while I was away.",
    "Write a product description for a reusable water bottle in three sentences.",
    "Write the opening paragraph of a mystery novel set in a small fishing village.",
    "Write a short speech to welcome new students on their first day at school.",
    "Write a tweet announcing the launch of a new open-source library.",
    "Write a four-line poem about the first snow of winter.",
    "Write a dialogue between a customer and a baker about a birthday cake.",
    "Write a short motivational message for someone starting to learn a new language.",
    "Write a cover letter opening for a junior software developer position.",
    "Describe a busy city market using all five senses.",
    "Write a fairy tale about a dragon who is afraid of the dark, in under 150 words.",
    # reasoning and math
    "A train leaves at 9:40 and arrives at 13:15. How long is the journey? Explain your steps.",
    "If a shirt costs 40 dollars after a 20 percent discount, what was the original price?",
    "What is the sum of the integers from 1 to 100, and how can you compute it quickly?",
    "Is 221 a prime number? Show how you check.",
    "A rectangle has a perimeter of 30 cm and a length of 9 cm. What is its area?",
    "Convert 72 degrees Fahrenheit to Celsius and show the formula.",
    "I have 3 red, 4 blue and 5 green marbles in a bag. What is the chance of drawing a blue one?",
    "Solve the equation 3x + 7 = 25 and explain each step.",
    "What is 15 percent of 240? Show a quick way to work it out in your head.",
    "Three friends share a 54-dollar bill, but one of them pays twice as much as each of the others. How much does each pay?",
    "What comes next in the sequence 2, 6, 12, 20, 30, and why?",
    "Explain why any number multiplied by zero is zero.",
    "A recipe for 4 people needs 300 g of flour. How much flour is needed for 10 people?",
    "How many seconds are there in a week? Show the calculation.",
    "Explain the Monty Hall problem and why switching doors is the better choice.",
    # everyday advice and planning
    "Give me five tips for staying focused while working from home.",
    "How can I make my morning routine less rushed?",
    "Plan a three-day trip to Rome for someone who likes history and food.",
    "What should I pack for a weekend camping trip in the mountains?",
    "Suggest a simple vegetarian dinner I can cook in 20 minutes.",
    "How do I politely decline an invitation to a party?",
    "Give me a checklist for moving to a new apartment.",
    "What are some good questions to ask at the end of a job interview?",
    "How can I save money on groceries each month?",
    "Suggest three board games for a family with young children and say why.",
    "How do I start learning to play the guitar as an adult?",
    "Give me a simple plan to read more books this year.",
    "What are good habits for keeping a houseplant alive?",
    "How should I prepare for a five-kilometre run in six weeks?",
    "Suggest names for a small coffee shop near a university.",
    # summarize, rewrite, compare
    "Summarize the main idea of the story of the tortoise and the hare in two sentences.",
    "Rewrite this sentence to sound more formal: 'Hey, can you send me that file asap?'",
    "Correct the grammar in this sentence: 'Me and him goes to the park every days.'",
    "Compare electric cars and petrol cars in a short table of pros and cons.",
    "List the planets of the solar system in order from the Sun, with one fact about each.",
    "Give an outline for a short presentation about recycling.",
    "Explain the difference between affect and effect, with an example sentence for each.",
    "Turn these notes into a clear paragraph: meeting moved to Tuesday, bring laptops, lunch provided.",
    "What are the main differences between a novel and a short story?",
    "Classify these animals as mammals, birds or reptiles: eagle, whale, lizard, bat, penguin, turtle.",
]


# ------------------------------------------------------------------------------------- code


def function_prompts(path: Path) -> list[tuple[int, str, str]]:
    """(line, prompt, source text) for each documented function or method in a file, in source
    order: the `def` through the end of its docstring, dedented (methods too)."""
    source = read_text(path)
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    lines = source.splitlines(keepends=True)
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node)
        if not doc or len(doc) < MIN_DOC:
            continue
        text = "".join(lines[node.lineno - 1: node.body[0].end_lineno])
        prompt = textwrap.dedent(text)
        out.append((node.lineno, prompt if prompt.endswith("\n") else prompt + "\n", text))
    return sorted(out)


def code_prompts() -> tuple[list[str], list[dict]]:
    """The code prompts and, for each, its source {file, line} (relative to the stdlib)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    train, held = split_files()
    # Text a training file also holds (a vendored copy, a duplicated helper) is training data too.
    training_text = "\n".join(read_text(f) for f in train)
    training_lines = {line.strip() for line in training_text.splitlines()}  # a fast first filter

    def in_training(text: str) -> bool:
        return text.splitlines()[0].strip() in training_lines and text in training_text

    per_file = []
    for path in held:
        assert is_held_out(path)
        rel = path.relative_to(stdlib)
        if SKIP_PARTS & set(rel.parts):
            continue
        kept, seen = [], set()
        for line, prompt, text in function_prompts(path):
            if prompt in seen or in_training(text) or in_training(prompt):
                continue
            seen.add(prompt)
            kept.append((prompt, {"file": rel.as_posix(), "line": line}))
        if kept:
            per_file.append(kept[:PER_FILE])
    # Round-robin over the files: the first N prompts of the set come from many modules.
    prompts, sources = [], []
    for i in range(max(map(len, per_file), default=0)):
        for kept in per_file:
            if i < len(kept):
                prompts.append(kept[i][0])
                sources.append(kept[i][1])
    return prompts, sources


# ------------------------------------------------------------------------------------- chat


def chat_prompts(instructions: list[str] = CHAT_INSTRUCTIONS) -> list[str]:
    """Each instruction as one user turn in the default model's chat template, ending where
    the assistant's answer starts (what `overlap generate --chat` sends)."""
    from overlap.models.loading import load_tokenizer, resolve_model_dir

    tokenizer = load_tokenizer(resolve_model_dir(None, progress=False))
    return [tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                          tokenize=False) for text in instructions]


# ------------------------------------------------------------------------------------- files


def jsonl(prompts: list[str], kind: str) -> str:
    return "".join(json.dumps({"prompt": p, "kind": kind}, ensure_ascii=False) + "\n" for p in prompts)


def render() -> dict[str, str]:
    """{file name: contents} of every generated file."""
    code, sources = code_prompts()
    meta = {"python": ".".join(map(str, sys.version_info[:3])), "held_out_every": HELD_OUT_EVERY,
            "code": sources}
    return {"code.jsonl": jsonl(code, "code"), "chat.jsonl": jsonl(chat_prompts(), "chat"),
            "sources.json": _sources_json(meta)}


def _sources_json(meta: dict) -> str:
    """Indented, one code prompt's source a line (diffs stay readable)."""
    rows = ",\n".join(f"  {json.dumps(s)}" for s in meta["code"])
    head = {k: v for k, v in meta.items() if k != "code"}
    return "{\n" + "".join(f" {json.dumps(k)}: {json.dumps(v)},\n" for k, v in head.items()) + \
        f' "code": [\n{rows}\n ]\n}}\n'



def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="directory for the files (default: %(default)s)")
    ap.add_argument("--check", action="store_true", help="compare with the files there instead of writing")
    args = ap.parse_args(argv)
    out = Path(args.out)
    files = render()
    if args.check:
        stale = [name for name, text in files.items()
                 if not (out / name).is_file() or (out / name).read_text(encoding="utf-8") != text]
        for name in stale:
            print(f"{out / name}: differs from what this Python ({sys.version.split()[0]}) generates")
        return 1 if stale else 0
    out.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (out / name).write_text(text, encoding="utf-8")
        print(f"wrote {out / name}" + (f" ({text.count(chr(10))} prompts)" if name.endswith(".jsonl") else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
