"""More requests for the target to answer, for the ``large`` draft recipe: the kinds of work the
per-task benchmark measures (open chat, code explained, edited and completed, passages
summarised, questioned and extracted from), written from templates over topics listed here and
over the Python standard library's own functions and docstrings, so they are many and varied and
need nothing downloaded.

None of them is a benchmark task (``tests/lm/models/test_transcript_prompts.py`` checks it against
``bench/workloads/tasks.jsonl`` and the shipped prompt sets), and the topics here avoid the
benchmark's: a draft trained on them is measured on requests it has not seen.
"""

from __future__ import annotations

import random
import re

_TOPICS = (
    "photosynthesis", "black holes", "the French Revolution", "compound interest", "volcanoes", "the human heart",
    "plate tectonics", "the printing press", "solar panels", "electric cars", "the immune system", "coral reefs",
    "the Roman Empire", "inflation", "supply and demand", "earthquakes", "the moon's phases", "honey bees",
    "the Industrial Revolution", "vaccination history", "tides", "glaciers", "democracy", "the stock market",
    "nuclear energy", "wind turbines", "the water table", "migration of birds", "the Renaissance", "chess openings",
    "learning a new language", "public speaking", "time management", "starting a vegetable garden", "composting",
    "meditation", "running a marathon", "saving money", "writing a cover letter", "job interviews", "remote work",
    "team meetings", "giving feedback", "cooking rice", "baking bread", "brewing coffee", "houseplants",
    "adopting a dog", "caring for a cat", "recycling", "climate change", "ocean currents", "the Great Wall of China",
    "the pyramids of Giza", "the Silk Road", "Ancient Greece", "the Moon landing", "the Internet's history",
    "password security", "phishing emails", "cloud computing", "open-source software", "version control",
    "databases", "spreadsheets", "machine translation", "3D printing", "robots in factories", "self-driving cars",
    "the periodic table", "gravity", "magnetism", "sound waves", "light and color", "electric circuits",
    "DNA", "evolution", "dinosaurs", "the solar system", "Mars exploration", "comets", "deserts", "rainforests",
)
_OPEN_FORMS = (
    "Explain {t} to a beginner.", "What are the most important facts about {t}?", "Write a short paragraph about {t}.",
    "Give me three interesting facts about {t}.", "What are common misconceptions about {t}?",
    "How would you explain {t} to a ten-year-old?", "Write a short poem about {t}.", "What is the history of {t}, briefly?",
)
_MODULE_FORMS = ("How do I use the `{m}` module in Python? Give an example.", "Explain the main functions of the Python module `{m}`.")
_FUNCTION_FORMS = (
    "Explain what this Python function does:\n\n{code}",
    "Add a docstring to this function and return the whole code:\n\n{code}",
    "Rename the function {name} to {name}_v2 everywhere and return the whole code:\n\n{code}",
    "Add type hints to this function and return the whole code:\n\n{code}",
    "Find possible bugs in this function:\n\n{code}",
)
_PASSAGE_FORMS = (
    "Summarize this passage in one sentence: {p}",
    "Context: {p}\n\nQuestion: What is this text about? Answer briefly.",
    "Extract the main terms of this text as a JSON list of strings: {p}",
    "Rewrite this text in simpler words: {p}",
)
_TASK_FORMS = ("How would I write code that {t}? Explain briefly.", "Show a short Python example that {t}.")


def _functions(text: str, limit: int, max_chars: int = 600) -> list[tuple[str, str]]:
    """Top-level functions of ``text`` that fit in ``max_chars``: (name, source) pairs."""
    out = []
    for match in re.finditer(r"^def (\w+)\(.*?(?=^\S|\Z)", text, re.M | re.S):
        code = match.group(0).rstrip()
        if 80 <= len(code) <= max_chars and not match.group(1).startswith("_"):
            out.append((match.group(1), code))
        if len(out) >= limit:
            break
    return out


def _passages(text: str, limit: int) -> list[str]:
    """Prose docstrings of ``text`` (200-600 characters, mostly words), whitespace collapsed."""
    out = []
    for match in re.finditer(r'"""(.*?)"""', text, re.S):
        prose = " ".join(match.group(1).split())
        letters = sum(c.isalpha() or c == " " for c in prose)
        if 200 <= len(prose) <= 600 and letters > 0.9 * len(prose) and ">>>" not in prose:
            out.append(prose)
        if len(out) >= limit:
            break
    return out


def large_chat_requests(seed: int, code_text: str, module_names: list[str], tasks: tuple[str, ...],
                        functions: int = 400, passages: int = 320) -> list[str]:
    """The ``large`` recipe's extra requests (deterministic in its arguments, no repeats):
    open chat over topics, questions about the modules in ``module_names``, functions and
    docstrings of ``code_text`` explained, edited, summarised and extracted from, and ``tasks``
    (what the default recipe's function requests ask for) asked another way."""
    rng = random.Random(seed)
    out = [form.format(t=t) for t in _TOPICS for form in _OPEN_FORMS]
    out += [form.format(m=m) for m in module_names for form in _MODULE_FORMS]
    found = _functions(code_text, functions * 4)
    for name, code in rng.sample(found, min(functions, len(found))):
        out.append(rng.choice(_FUNCTION_FORMS).format(name=name, code=code))
    found = _passages(code_text, passages * 4)
    for p in rng.sample(found, min(passages, len(found))):
        out.append(rng.choice(_PASSAGE_FORMS).format(p=p))
    out += [form.format(t=t) for t in tasks for form in _TASK_FORMS]
    out = list(dict.fromkeys(out))
    rng.shuffle(out)
    return out
