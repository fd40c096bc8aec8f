"""Generation speed (issue 44, lever 6): ``generate``'s tokens/s streamed, under a budget and resident.

Each arm loads the model as ``lightning-blockwise generate`` does (``GeneratingFineTune`` under a ``Trainer.predict``;
here ``random_init``: a Qwen2.5 shape's random NF4 base built straight into the host arena, fresh LoRA adapters,
``kernels=None``), then generates greedily for a batch of each ``--prompts`` size after one warm-up batch. A row per
arm and batch: new tokens, seconds, tokens/s, seconds per pass, the strategy's own expected-speed line (the bytes a
token streams at the link rate measured on the spot, docs/generate.md) and the bytes it measured per token. Every
arm's replies are compared token for token with the first arm's (``same_tokens``).

On the GPU host, from the repository root, with ``.whl`` installed::

    python -m benchmarks.generation_speed --shape 7b --arms streamed budget=20GiB resident --prompts 1 8 \
        --new-tokens 32 --out /tmp/generation_7b.jsonl
    python -m benchmarks.generation_speed --shape 72b --arms streamed budget=20GiB --prompts 1 8 --new-tokens 16

``--device cpu --shape tiny`` runs it on the CPU in seconds (tests/benchmarks/test_generation_speed.py).
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
from pathlib import Path
from typing import Any

import torch

from benchmarks.load_benchmark import SHAPES, qwen2_config
from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.recipes.encoding import byte_tokenizer
from lightning_blockwise.recipes.generation import ChatSession, GeneratingFineTune, Reply, generate_replies
from lightning_blockwise.recipes.generation_options import Sampling
from lightning_blockwise.recipes.prompt_tokens import PromptFormat

#: A Qwen2 shape for the CPU tests: two layers, a vocabulary above the byte tokenizer's 259 ids.
TINY = {**qwen2_config("7b"), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}  # fmt: skip
#: The arms: the base streamed (every block), under a ``vram_budget``, or resident (``strategy="auto"``).
ARM = re.compile(r"^(streamed|resident|budget=\S+)$")
PROMPT = "Write one sentence about the sea."
_MEASURED = re.compile(r"([\d.]+) GB streamed per token")


def write_config(shape: str, directory: Path) -> Path:
    """A checkpoint directory holding ``shape``'s ``config.json`` alone (``random_init`` needs no weights)."""
    directory.mkdir(parents=True, exist_ok=True)
    config = TINY if shape == "tiny" else {**qwen2_config(shape), "tie_word_embeddings": False}
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def strategy_of(arm: str) -> Any:
    """The arm's strategy: ``"auto"`` resident, or ``BlockwiseStrategy`` streamed or under its ``vram_budget``."""
    if ARM.match(arm) is None:
        raise ValueError(f"arm {arm!r}: expected streamed, resident or budget=SIZE (e.g. budget=20GiB)")
    if arm == "resident":
        return "auto"
    return BlockwiseStrategy(vram_budget=None if arm == "streamed" else arm.split("=", 1)[1])


def run_arm(checkpoint: Path, arm: str, prompts: list[int], new_tokens: int, device: str) -> list[dict[str, Any]]:
    """Generate a warm-up batch of one prompt, then a batch of each size in ``prompts``; a row per timed batch."""
    report: list[str] = []
    batches = [[PROMPT]] + [[PROMPT] * count for count in prompts]
    session = ChatSession(PromptFormat(byte_tokenizer(), None), batches, Sampling(new_tokens), report=report.append)
    module = GeneratingFineTune(checkpoint=str(checkpoint), random_init=True, lora_dropout=0.0, kernels=None)
    torch.manual_seed(0)  # random_init is seeded by the global generator: every arm builds the same base
    replies = generate_replies(module, session, strategy_of(arm), accelerator="gpu" if device == "cuda" else "cpu")
    expected = report[0] if report and "streams" in report[0] else None
    measured = [line for line in report if line.startswith("(")]
    rows = []
    position = 1  # after the warm-up batch's one reply
    for index, count in enumerate(prompts):
        batch: list[Reply] = replies[position : position + count]
        position += count
        tokens = max(len(reply.tokens) for reply in batch)
        seconds = batch[0].seconds
        match = _MEASURED.search(measured[index + 1]) if index + 1 < len(measured) else None
        rows.append({
            "arm": arm, "prompts": count, "new_tokens": tokens, "seconds": round(seconds, 4),
            "tokens_per_s": round(tokens * count / seconds, 3), "seconds_per_pass": round(seconds / tokens, 5),
            "expected": expected, "streamed_gb_per_token": float(match.group(1)) if match else None,
            "replies": [reply.tokens.tolist() for reply in batch],
        })  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="7b", choices=["tiny", *SHAPES], help="a Qwen2.5 shape, or tiny (CPU)")
    parser.add_argument("--arms", nargs="+", default=["streamed", "resident"], help="streamed, resident, budget=SIZE")
    parser.add_argument("--prompts", nargs="+", type=int, default=[1, 8], help="batch sizes, each one timed batch")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens generated per reply (greedy)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--work", type=Path, default=None, help="where the config-only checkpoint goes")
    parser.add_argument("--out", type=Path, default=None, help="append the rows here as JSON lines")
    args = parser.parse_args(argv)
    for arm in args.arms:
        strategy_of(arm)  # refuse a typo before any model is built
    work = args.work or Path(tempfile.mkdtemp(prefix="generation_speed_"))
    checkpoint = write_config(args.shape, work / args.shape)
    rows: list[dict[str, Any]] = []
    for arm in args.arms:
        for row in run_arm(checkpoint, arm, args.prompts, args.new_tokens, args.device):
            first = next((r for r in rows if r["prompts"] == row["prompts"]), row)
            row.update(shape=args.shape, device=args.device, same_tokens=row["replies"] == first["replies"])
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "replies"}), flush=True)
    if args.out is not None:
        with args.out.open("a") as out:
            out.writelines(json.dumps(row) + "\n" for row in rows)
    return rows


if __name__ == "__main__":
    main()
