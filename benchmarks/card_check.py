"""Do the 16 GB and 24 GB card settings in configs/ hold? Each model's real shape, trained under a capped allocator.

For every model of configs/ (its real shape, from `MODELS`; random-init weights, NF4 double
quant, LoRA r=16 with dropout 0.05 on every decoder linear, bf16-mixed, rows of 1024 tokens,
batch 1, AdamW) and every card size:

1. `lightning-blockwise plan`'s recommendation for that card (`recommend.recommend`, the numbers
   in the config's header): `vram_budget`, `block_size`, the predicted peak.
2. The caching allocator is capped with `torch.cuda.set_per_process_memory_fraction` to the
   card's memory less the CUDA context this process really holds (measured: `mem_get_info`
   used bytes minus `memory_reserved`), so that torch can reserve no more than it could on that
   card.
3. `Trainer.fit` with `BlockwiseStrategy(block_size, vram_budget)` for `--steps` steps; the peak
   allocated and reserved bytes after the first step, and whether it ran out of memory.

First, uncapped, the same fit with every block streamed (`vram_budget=None`): it moves the base
to the host arena (the whole NF4 model starts on the GPU) and is the config headers' "every
block streamed" line. GB = 1e9 bytes, GiB = 2**30.

    python benchmarks/card_check.py --models qwen2.5-7b llama-3.1-8b --cards 16GiB 24GiB [--steps 4] [--out F]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
import transformers
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.utils.data import DataLoader

from benchmarks.step_benchmark import SHAPES, TARGETS, BenchModule
from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.planning import parse_bytes
from lightning_blockwise.planning.recommend import recommend
from lightning_blockwise.planning.sizing import model_sizes
from lightning_blockwise.recipes.random_init import random_nf4_model

#: The models of configs/, at their published shapes (Gemma 3 27B: its language model; the
#: config's multimodal checkpoint adds the vision tower, which its header counts).
MODELS: dict[str, Callable[[], transformers.PretrainedConfig]] = {
    "qwen2.5-7b": SHAPES["7b"],
    "qwen2.5-32b": SHAPES["32b"],
    "qwen2.5-72b": SHAPES["72b"],
    "llama-3.1-8b": lambda: transformers.LlamaConfig(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False,
    ),
    "qwen3-32b": lambda: transformers.Qwen3Config(
        vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
        num_attention_heads=64, num_key_value_heads=8, head_dim=128, tie_word_embeddings=False,
    ),
    "gemma-3-27b-text": lambda: transformers.Gemma3TextConfig(
        vocab_size=262208, hidden_size=5376, intermediate_size=21504, num_hidden_layers=62,
        num_attention_heads=32, num_key_value_heads=16, head_dim=128, query_pre_attn_scalar=168,
        sliding_window=1024, tie_word_embeddings=True,
    ),
}  # fmt: skip
TOKENS = 1024


class PeakAfterFirstStep(pl.Callback):
    """Peak allocated and reserved bytes from the second step on, and the median step time."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, idx: int) -> None:
        torch.cuda.synchronize()
        if idx == 1:
            torch.cuda.reset_peak_memory_stats()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        torch.cuda.synchronize()
        if args[-1] >= 1:
            self.times.append(time.perf_counter() - self._start)


def fit(model: nn.Module, strategy: BlockwiseStrategy, steps: int, vocab: int) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(0)
    batches = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, vocab, (steps, 1, TOKENS), generator=gen)]
    peaks = PeakAfterFirstStep()
    trainer = pl.Trainer(
        accelerator="gpu", devices=1, strategy=strategy, precision="bf16-mixed", max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[peaks],
    )  # fmt: skip
    row: dict[str, Any] = {"oom": False}
    try:
        trainer.fit(BenchModule(model), DataLoader(batches, batch_size=None))
    except torch.OutOfMemoryError as error:
        row["oom"] = True
        row["error"] = str(error).splitlines()[0]
    row["peak_allocated_gb"] = torch.cuda.max_memory_allocated() / 1e9
    row["peak_reserved_gb"] = torch.cuda.max_memory_reserved() / 1e9
    row["s_per_step"] = sorted(peaks.times)[len(peaks.times) // 2] if peaks.times else None
    plan = strategy.residency_plan
    if plan is not None:
        row["predicted_peak_gb"] = plan.predicted_peak / 1e9
        row["resident_blocks"] = len(plan.resident)
    model.to("cpu")  # a failed fit may leave adapters or the head on the GPU
    torch.cuda.empty_cache()
    return row


def context_bytes() -> int:
    """Device memory this process holds outside torch's caching allocator (CUDA context, libraries)."""
    free, total = torch.cuda.mem_get_info()
    return total - free - torch.cuda.memory_reserved()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=sorted(MODELS), choices=sorted(MODELS))
    parser.add_argument("--cards", nargs="+", default=["16GiB", "24GiB"], help="card memory sizes")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", default=None, help="append the rows as JSON lines here")
    args = parser.parse_args()
    device = torch.device("cuda")
    torch.ones(1, device=device) @ torch.ones(1, 1, device=device)  # the context and cuBLAS, before measuring them
    total = torch.cuda.get_device_properties(device).total_memory
    for name in args.models:
        config = MODELS[name]()
        sizes = model_sizes(config, torch.bfloat16, lora_rank=16)
        advice = {card: recommend(sizes, parse_bytes(card), TOKENS) for card in args.cards}
        torch.manual_seed(0)
        model = random_nf4_model(config, device)
        lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.05, target_modules=TARGETS)
        model = get_peft_model(model, lora)
        # Streamed first with the block size most cards use, so that the host arena is packed once.
        block_sizes = [a.block_size for a in advice.values()]
        first = max(set(block_sizes), key=block_sizes.count)
        arms: list[tuple[str, int, int | None]] = [("every block streamed", first, None)]
        ordered = sorted(advice.items(), key=lambda item: item[1].block_size != first)
        arms += [(card, a.block_size, a.budget) for card, a in ordered if a.plan is not None]
        for card in (card for card, a in advice.items() if a.plan is None):
            print(json.dumps({"model": name, "arm": card, "fits": False, "minimum_gb": advice[card].minimum / 1e9}))
        for arm, block_size, budget in arms:
            torch.cuda.set_per_process_memory_fraction(1.0)
            torch.cuda.empty_cache()
            cap = None
            if arm in advice:
                context = context_bytes()
                cap = parse_bytes(arm) - context
                torch.cuda.set_per_process_memory_fraction(cap / total)
            torch.cuda.reset_peak_memory_stats()
            strategy = BlockwiseStrategy(block_size=block_size, vram_budget=budget, budget_tokens=TOKENS)
            row = {
                "model": name,
                "arm": arm,
                "block_size": block_size,
                "vram_budget": budget,
                "allocator_cap_gb": None if cap is None else cap / 1e9,
                "context_gb": None if cap is None else context / 1e9,
                "plan_peak_gb": None if budget is None else advice[arm].plan.predicted_peak / 1e9,
                **fit(model, strategy, args.steps, config.vocab_size),
                "device": torch.cuda.get_device_name(),
            }
            print(json.dumps(row), flush=True)
            if args.out:
                with open(args.out, "a") as out:
                    out.write(json.dumps(row) + "\n")
        torch.cuda.set_per_process_memory_fraction(1.0)
        del model, strategy
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
