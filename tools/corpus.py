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


# A second, disjoint set (tools/head_data.py's `chat_more` part): other kinds of request than
# "<task> <topic>" (comparisons, poems and stories, plans and advice, translations, one-line
# questions, code with tests), so the head sees the target answer in more shapes.
_NEW_TASKS = ["Explain to a beginner", "Give two examples of", "Write a dialogue between two friends about",
              "What questions do people often ask about", "Explain why people care about",
              "Write a short news report about", "Give a one-paragraph summary of", "Write a FAQ about"]
_PAIRS = [("a list", "a tuple"), ("a hill", "a mountain"), ("a pond", "a river"), ("RAM", "a hard disk"),
          ("HTTP", "HTTPS"), ("a compiler", "an interpreter"), ("speed", "velocity"), ("a lake", "a sea"),
          ("stocks", "bonds"), ("a process", "a thread"), ("a crocodile", "an alligator"), ("mass", "weight"),
          ("a comet", "an asteroid"), ("SQL", "NoSQL databases"), ("a class", "an object"), ("baking", "roasting"),
          ("git merge", "git rebase"), ("a democracy", "a monarchy"), ("an app", "a website"),
          ("a stack", "a queue"), ("AC", "DC current"), ("a recession", "a depression"), ("a frog", "a toad"),
          ("a library", "a framework"), ("a moth", "a butterfly"), ("latitude", "longitude"),
          ("an array", "a linked list"), ("a hurricane", "a tornado"), ("static typing", "dynamic typing"),
          ("a symphony", "a concerto"), ("IPv4", "IPv6"), ("fission", "fusion"), ("a loan", "a grant"),
          ("unit tests", "integration tests"), ("a meteor", "a meteorite"), ("a poem", "a song"),
          ("mitosis", "meiosis"), ("a router", "a switch"), ("an acid", "a base"), ("a CPU", "a GPU"),
          ("a simile", "a metaphor"), ("JSON", "XML"), ("a fruit", "a vegetable"), ("a bug", "a feature"),
          ("breadth-first search", "depth-first search"), ("a savings account", "a checking account")]
_SUBJECTS = ["the first snow of winter", "a lighthouse keeper", "a lost umbrella", "the night sky",
             "a busy train station", "an old library", "morning coffee", "a robot learning to paint",
             "a cat on a windowsill", "the sea at dawn", "a small bakery", "a thunderstorm",
             "a friendly dragon", "a city at night", "a forgotten key", "spring flowers",
             "a long bus ride", "a programmer fixing a bug", "a garden in summer", "the last day of school",
             "a mountain village", "an astronaut far from home", "a rainy Sunday", "a street musician",
             "a mysterious letter", "a fox in the snow", "a broken clock", "a kite festival",
             "a quiet forest", "a ship in a storm"]
_WRITING = ["Write a short poem about {}.", "Write a limerick about {}.", "Tell a very short story about {}.",
            "Write the opening paragraph of a novel about {}.", "Describe {} in four sentences."]
_GOALS = ["learning to cook", "saving money each month", "learning a new language", "running a first 5k",
          "keeping a houseplant alive", "preparing for a job interview", "studying for an exam",
          "starting a vegetable garden", "reading more books", "organizing a small office",
          "learning to play the guitar", "getting better sleep", "planning a birthday party",
          "moving to a new city", "learning to draw", "writing a first novel", "reducing screen time",
          "training a puppy", "planning a road trip", "learning to swim", "starting to code",
          "keeping a journal", "eating more vegetables", "making new friends", "packing for a week of travel"]
_ADVICE = ["Suggest a four-week plan for {}.", "Give five practical tips for {}.",
           "What mistakes should I avoid when {}?", "Write a checklist for {}."]
_SENTENCES = ["I would like a cup of tea", "Where is the train station", "The library opens at nine",
              "My brother likes to play football", "We are going to the beach tomorrow",
              "This book is very interesting", "Can you help me, please", "The cat is sleeping on the sofa",
              "I have two sisters and one brother", "It is cold in the morning", "The shop is closed on Sundays",
              "She is learning to play the violin", "Thank you for the delicious dinner",
              "How much does this cost", "The children are playing in the park"]
_LANGUAGES = ["French", "Spanish", "German", "Italian"]
_QUESTIONS = ["Why is the sky blue?", "How do airplanes stay in the air?", "Why do cats purr?",
              "How does a refrigerator keep food cold?", "What causes the seasons?", "How do vaccines work?",
              "Why do leaves change color in autumn?", "How does a search engine rank pages?",
              "What is an API?", "What is a neural network?", "How does public-key encryption work?",
              "Why does bread rise?", "What is inflation?", "How do bees make honey?",
              "What is the difference between a virus and malware?", "How does GPS find your location?",
              "What is a black hole made of?", "Why do we dream?", "How does a battery store energy?",
              "What is a recursive function?", "Why is the ocean salty?", "How does a microwave heat food?",
              "What is cloud computing?", "How do noise-cancelling headphones work?", "What is a blockchain?",
              "Why do onions make you cry?", "How is glass made?", "What does a database index do?",
              "How do plants know which way is up?", "What is the Big O notation?",
              "What is a memory leak?", "How does a thermostat work?", "What is garbage collection?",
              "Why do cats sleep so much?", "How do tides work?", "What is a race condition?",
              "How does a kettle switch itself off?", "What is an operating system kernel?", "Why do stars twinkle?",
              "What is a load balancer?"]
_MORE_FUNCTIONS = ["returns the n-th triangular number", "checks whether a list is sorted",
                   "counts the words in a sentence", "returns the indices of a value in a list",
                   "converts a string to snake_case", "converts a number to its binary string",
                   "finds the longest increasing subsequence of a list", "shuffles a list in place",
                   "returns the k largest numbers of a list", "checks whether a number is a perfect square",
                   "returns the unique characters of a string", "pads a string to a given length",
                   "computes the standard deviation of a list", "zips two lists into a dictionary",
                   "returns the first non-repeating character of a string", "parses a simple INI file",
                   "converts a dictionary to a query string", "wraps text to a given width",
                   "finds the common elements of three lists", "checks whether a graph has a cycle",
                   "computes compound interest", "generates a random password", "validates a phone number",
                   "returns the day of the week for a date", "counts the uppercase letters in a string",
                   "removes the vowels from a string", "finds pairs in a list that sum to a target",
                   "computes the Hamming distance of two strings", "merges overlapping intervals",
                   "implements binary search on a sorted list", "implements merge sort",
                   "converts an integer to a Roman numeral", "computes the least common multiple",
                   "returns the prime factors of a number", "checks whether a string is a valid identifier",
                   "deep-copies a nested dictionary", "returns the size of a directory in bytes",
                   "reverses the words of a sentence", "finds the maximum subarray sum",
                   "times how long another function takes"]
_MORE_CODE_ASKS = ["Write a Python function that {}, and a few tests for it.",
                   "How would you write a Python function that {}? Show the code.",
                   "Write a Python function that {}. Keep it short."]
_CONCEPTS = ["a REST endpoint", "a Python decorator", "a context manager", "a generator", "a hash function",
             "a closure", "a lambda function", "list comprehensions", "exceptions", "type hints",
             "a virtual environment", "a unit test", "a regular expression", "recursion", "a dictionary",
             "a set", "an iterator", "a mutex", "a cache", "a queue", "an enum", "a dataclass",
             "string formatting", "a module", "a package", "inheritance", "an abstract class",
             "a binary heap", "a trie", "a bloom filter"]
_CLAIMS = ["reading every day is a good habit", "code reviews are useful", "people should drink more water",
           "cities need more parks", "learning history matters", "backups are important",
           "sleep matters for students", "teamwork helps projects succeed", "walking is good exercise",
           "comments in code should explain why", "learning math is worth it", "bees are important",
           "small commits make code easier to review", "music helps people relax", "trees matter in cities",
           "writing things down helps memory", "breakfast can matter", "public libraries are valuable",
           "version control helps teams", "simple code is easier to maintain"]


def more_chat_instructions() -> list[str]:
    """1,678 instructions none of which is in many_chat_instructions(), in other shapes. Some are
    close to prompts we measure on: tools/head_data.py skips those (too_close_to_evaluation) but
    keeps them here, so that every other one keeps its index (its seed, its chunk)."""
    topics = _TOPICS + _MORE_TOPICS
    out = [f"{task} {topic}." for topic in topics for task in _NEW_TASKS]
    out += [f"What is the difference between {a} and {b}?" for a, b in _PAIRS]
    out += [f"Compare {a} and {b} in a short table." for a, b in _PAIRS]
    out += [ask.format(s) for s in _SUBJECTS for ask in _WRITING]
    out += [ask.format(g) for g in _GOALS for ask in _ADVICE]
    out += [f"Translate the sentence '{s}.' into {lang}." for s in _SENTENCES for lang in _LANGUAGES]
    out += _QUESTIONS + [f"{q} Answer in two sentences." for q in _QUESTIONS]
    out += [ask.format(f) for f in _MORE_FUNCTIONS for ask in _CODE_ASKS + _MORE_CODE_ASKS]
    out += [ask.format(f) for f in _FUNCTIONS for ask in _MORE_CODE_ASKS]
    out += [f"Explain what {c} is in Python, with one example." if i % 2 == 0 else
            f"Explain {c} to a beginner, with a short code example." for i, c in enumerate(_CONCEPTS)]
    out += [f"Give three reasons why {c}, each in one sentence." for c in _CLAIMS]
    out += [f"Write a short persuasive paragraph arguing that {c}." for c in _CLAIMS]
    return out


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
