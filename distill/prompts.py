"""Training prompts that exist offline: composed task templates and snippets of local text.

The snippets come from files the user names (`--corpus`) or, by default, from the Python standard
library installed on this machine: its docstrings are English prose and its functions are code, so the
prompts cover the assistant's usual jobs (explain, summarize, rewrite, list, JSON, code) without a network.
The benchmark prompts in edgespec/data are never used: they are the held-out set.
"""
from __future__ import annotations

import ast
import json
import random
import sysconfig
import textwrap
from importlib import resources
from pathlib import Path

from edgespec.distill.chat_prompts import chat_prompt

TOPICS = (
    "photosynthesis", "the water cycle", "black holes", "compound interest", "the French Revolution",
    "machine learning", "recursion", "public key cryptography", "climate change", "the immune system",
    "volcanoes", "supply and demand", "the Roman Empire", "plate tectonics", "vaccines", "sleep",
    "the internet", "electric cars", "honey bees", "the moon landing", "inflation", "DNA",
    "renewable energy", "the printing press", "gravity", "rainforests", "sorting algorithms",
    "databases", "time management", "healthy eating", "meditation", "the stock market", "coral reefs",
    "the human heart", "solar panels", "earthquakes", "the Renaissance", "bread baking", "chess",
    "version control", "unit testing", "recycling", "the speed of light", "bicycles", "tea",
    "the Great Wall of China", "neural networks", "operating systems", "friendship", "running",
    "the periodic table", "antibiotics", "the Industrial Revolution", "wind turbines", "jazz", "origami",
    "the Pythagorean theorem", "the phases of the Moon", "the Silk Road", "glaciers", "caffeine",
    "public speaking", "budgeting", "remote work", "composting", "the theory of evolution", "tides",
    "3D printing", "blockchains", "the Olympic Games", "migratory birds", "the metric system", "allergies",
    "hiking safety", "password managers", "central banks", "nuclear power", "desert ecosystems",
    "the human brain", "probability", "the Cold War", "email etiquette", "job interviews", "gardening",
    "the scientific method", "compilers", "cloud computing", "open source software", "coffee brewing",
    "first aid", "negotiation", "the Amazon river", "comets", "electric circuits", "magnetism",
    "photography", "learning a language", "sleep hygiene", "urban planning", "data privacy",
)
TASKS = (
    "Explain {topic} to a beginner.", "Explain {topic} in simple terms.", "What is {topic}?",
    "Give me three facts about {topic}.", "List five key points about {topic}.",
    "Write a short paragraph about {topic}.", "Why does {topic} matter?", "Write a haiku about {topic}.",
    "What are the pros and cons of {topic}?", "Write a short story that involves {topic}.",
    "Give a one-sentence definition of {topic}.", "Write a quiz question about {topic} with its answer.",
    "Return a JSON object with the fields name, summary and keywords describing {topic}.",
    "Write an outline for a presentation on {topic}.", "Compare {topic} and {other}.",
    "How would you teach {topic} to a ten-year-old?", "Write a tweet about {topic}.",
    "What are common misconceptions about {topic}?", "Give me a step-by-step guide related to {topic}.",
    "Write an email to a friend recommending they learn about {topic}.",
    "What is a surprising fact about {topic}?", "How has {topic} changed over time?",
    "What should everyone know about {topic}?", "Write a limerick about {topic}.",
    "Create a short FAQ about {topic}.", "Describe {topic} using an analogy.",
)
# how a composed request asks to be answered: each template reads with any of them, which multiplies the
# distinct prompts a large run (a GPU's tens of thousands) needs without repeating one
STYLES = (
    "", " Answer in one sentence.", " Keep it short.", " Use bullet points.", " Explain step by step.",
    " Answer in under 100 words.", " Give an example.", " Write it for a busy reader.",
)
CODE_TASKS = (
    "Write a Python function that {job}.", "Write a JavaScript function that {job}.",
    "Write a Python class that {job}.", "Show how to {job} in Python, with a short explanation.",
    "Write a unit test for a function that {job}.", "Write a SQL query that {job2}.",
)
CODE_JOBS = (
    "reverses a string", "checks whether a number is prime", "returns the n-th Fibonacci number",
    "counts the words in a text", "merges two sorted lists", "removes duplicates from a list",
    "reads a CSV file and sums a column", "computes the average of a list", "finds the largest element",
    "validates an email address", "converts Celsius to Fahrenheit", "flattens a nested list",
    "sorts a list of dictionaries by a key", "implements binary search", "parses a date string",
    "computes the factorial of n", "checks whether a string is a palindrome", "groups words by length",
    "implements a stack", "returns the most common element", "implements a simple cache",
)
SQL_JOBS = (
    "finds the ten most recent orders", "counts users per country", "returns the average salary per department",
    "finds customers with no orders", "lists products whose price is above the average",
)
TEXT_TASKS = (
    "Summarize this:\n{text}", "Explain this in plain words:\n{text}", "Rewrite this more simply:\n{text}",
    "Give three bullet points that capture this:\n{text}", "What is the main idea of this text?\n{text}",
    "Turn this into a JSON object with the keys topic and summary:\n{text}",
)
CODE_TEXT_TASKS = (
    "Explain what this code does:\n{text}", "Add a docstring to this function:\n{text}",
    "Suggest improvements to this code:\n{text}", "Rewrite this function with clearer names:\n{text}",
    "Write a test for this function:\n{text}",
)


def default_corpus() -> list[Path]:
    return [Path(sysconfig.get_paths()["stdlib"])]


# installed third-party packages nested under a corpus folder (the standard library's own site-packages
# holds whatever this machine installed): their licences vary and they differ from machine to machine
INSTALLED_PACKAGES = ("site-packages", "dist-packages")


def python_files(roots: list[Path]) -> list[Path]:
    """The .py files under each folder (a file root is taken as it is), leaving out installed packages
    nested in a folder."""
    files = []
    for root in roots:
        if not root.is_dir():
            files.append(root)
            continue
        files.extend(f for f in sorted(root.rglob("*.py"))
                     if not set(f.relative_to(root).parts) & set(INSTALLED_PACKAGES))
    return files


def corpus_snippets(roots: list[Path], rng: random.Random, limit: int) -> tuple[list[str], list[str]]:
    """(prose, code): docstrings and short functions from Python files; text files give prose paragraphs."""
    prose, code = [], []
    files = python_files(roots)
    rng.shuffle(files)
    for path in files:
        if len(prose) >= limit and len(code) >= limit:
            break
        try:
            source = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue  # unreadable or non-UTF-8 files carry no usable text
        if path.suffix != ".py":
            prose.extend(p.strip() for p in source.split("\n\n") if 200 < len(p.strip()) < 900)
            continue
        try:
            tree = ast.parse(source)
        except (SyntaxError, ValueError):
            continue  # test fixtures in the standard library are deliberately broken Python
        lines = source.splitlines(keepends=True)  # once per file: ast.get_source_segment splits it per call
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module)):
                doc = ast.get_docstring(node)
                if doc and 200 < len(doc) < 900:
                    prose.append(doc)
            if isinstance(node, ast.FunctionDef) and 5 <= node.end_lineno - node.lineno <= 25:
                code.append(textwrap.dedent("".join(lines[node.lineno - 1:node.end_lineno])).rstrip())
    return [p for p in prose if p], [c for c in code if c]


def training_prompts(count: int, seed: int, corpus: list[Path]) -> list[str]:
    """`count` distinct user messages, half composed from templates and half quoting local text."""
    rng = random.Random(seed)
    # snippets in proportion to the prompts asked for: a few hundred cap a run at ~16 k distinct prompts
    prose, code = corpus_snippets(corpus, rng, limit=max(400, count // 8))
    makers = [
        lambda: rng.choice(TASKS).format(topic=rng.choice(TOPICS), other=rng.choice(TOPICS)) + rng.choice(STYLES),
        lambda: rng.choice(CODE_TASKS).format(job=rng.choice(CODE_JOBS), job2=rng.choice(SQL_JOBS)) + rng.choice(STYLES),
    ]
    if prose:
        makers.append(lambda: rng.choice(TEXT_TASKS).format(text=rng.choice(prose)))
    if code:
        makers.append(lambda: rng.choice(CODE_TEXT_TASKS).format(text=rng.choice(code)))
    makers.insert(2, lambda: chat_prompt(rng))
    # short chat requests weigh most: they are what the built-in chat prompts ask (history.md §66)
    weights = [3, 2, 4, 3, 2][:len(makers)]
    prompts, seen = [], set(held_out_prompts())
    for _ in range(count * 20):
        if len(prompts) == count:
            break
        prompt = rng.choices(makers, weights)[0]()
        if prompt not in seen:
            seen.add(prompt)
            prompts.append(prompt)
    return prompts


def held_out_prompts() -> set[str]:
    """The built-in benchmark prompts' messages: held out, so never made as training prompts."""
    return {message["content"] for line in resources.files("edgespec").joinpath("data/prompts.jsonl")
                                                           .read_text(encoding="utf-8").splitlines() if line.strip()
            for message in json.loads(line).get("messages", [])}
