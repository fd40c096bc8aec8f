"""Write ``data/instructions.jsonl``: deterministic arithmetic and string-manipulation instruction pairs.

Alpaca-style records (``instruction``, ``input``, ``output``) that a small model can learn
from, generated from a fixed seed so that every checkout has the same file::

    python data/make_instructions.py            # writes data/instructions.jsonl
    python data/make_instructions.py --count 50 --out /tmp/small.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from pathlib import Path

_WORDS = [
    "apple", "river", "stone", "cloud", "lamp", "forest", "window", "tiger", "garden", "pencil",
    "silver", "ocean", "bridge", "candle", "mirror", "rocket", "violet", "planet", "button", "harbor",
]  # fmt: skip


def _add(rng: random.Random) -> dict[str, str]:
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    return {"instruction": "Add the two numbers.", "input": f"{a} {b}", "output": str(a + b)}


def _subtract(rng: random.Random) -> dict[str, str]:
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    return {"instruction": f"What is {a} minus {b}?", "input": "", "output": str(a - b)}


def _multiply(rng: random.Random) -> dict[str, str]:
    a, b = rng.randint(2, 99), rng.randint(2, 12)
    return {"instruction": f"Multiply {a} by {b}.", "input": "", "output": str(a * b)}


def _reverse(rng: random.Random) -> dict[str, str]:
    word = rng.choice(_WORDS)
    return {"instruction": "Reverse the letters of the word.", "input": word, "output": word[::-1]}


def _upper(rng: random.Random) -> dict[str, str]:
    words = " ".join(rng.sample(_WORDS, 3))
    return {"instruction": "Write the text in capital letters.", "input": words, "output": words.upper()}


def _count(rng: random.Random) -> dict[str, str]:
    word = rng.choice(_WORDS)
    return {"instruction": f"How many letters does the word '{word}' have?", "input": "", "output": str(len(word))}


def _sort(rng: random.Random) -> dict[str, str]:
    words = rng.sample(_WORDS, 4)
    return {
        "instruction": "Sort the words alphabetically.",
        "input": " ".join(words),
        "output": " ".join(sorted(words)),
    }


_TASKS: list[Callable[[random.Random], dict[str, str]]] = [_add, _subtract, _multiply, _reverse, _upper, _count, _sort]


def make(count: int, seed: int = 0) -> list[dict[str, str]]:
    """``count`` records cycling through the tasks, drawn from ``seed``."""
    rng = random.Random(seed)
    return [_TASKS[i % len(_TASKS)](rng) for i in range(count)]


def main() -> None:
    """Write the records as JSON lines."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=420, help="Number of records (default: 420).")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the numbers and words (default: 0).")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("instructions.jsonl"))
    options = parser.parse_args()
    lines = [json.dumps(record) for record in make(options.count, options.seed)]
    options.out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {len(lines)} records to {options.out}")


if __name__ == "__main__":
    main()
