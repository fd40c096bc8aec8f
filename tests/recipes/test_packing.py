"""Sample packing (lightning_blockwise/recipes/packing.py): bins, packed batches, and what packed examples learn.

Tolerance of "each packed example gets its alone loss": 1e-5 absolute on losses near 4.6 (fp32, CPU), about
20 units in the last place. A packed row is not the examples apart bit for bit (NOTE [ Packed rows ]): its
attention runs with an explicit mask and its matmuls with other shapes, so sums round in another order; measured
deviations were 0 to 4.8e-7 (one unit in the last place) on llama, qwen2, qwen3, mistral, phi3, gemma2 and
gemma3_text, with sdpa and eager. The controls (positions not restarted, a cache built) deviate by 4e-3 to 6e-2.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn
from transformers.masking_utils import find_packed_sequence_indices

from benchmarks import packing_throughput
from lightning_blockwise.longcontext.loss import chunked_causal_lm_loss
from lightning_blockwise.recipes.data import IGNORE_INDEX, InstructionDataModule
from lightning_blockwise.recipes.finetune import CausalLMFineTune
from lightning_blockwise.recipes.packing import PackCollator, check_packed_attention, is_packed, pack
from tests.helpers.models import VOCAB, build_model

TOLERANCE = 1e-5
#: Longer than the tiny models' sliding windows (4), so that windows measured from the row's start would show.
LENGTHS = (9, 6, 11, 7)


def _examples(lengths: tuple[int, ...], seed: int = 0, prompt: int = 3) -> list[dict[str, list[int]]]:
    """Random examples whose first ``prompt`` tokens are not trained on."""
    gen = torch.Generator().manual_seed(seed)
    examples = []
    for n in lengths:
        ids = torch.randint(1, VOCAB, (n,), generator=gen).tolist()
        examples.append({"input_ids": ids, "labels": [IGNORE_INDEX] * prompt + ids[prompt:]})
    return examples


def _model(model_type: str, attention: str = "sdpa") -> nn.Module:
    model = build_model(model_type, peft=False, attention_dropout=0.0)
    model.config._attn_implementation = attention
    return model.eval()


def _alone_losses(model: nn.Module, examples: list[dict[str, list[int]]]) -> list[Tensor]:
    with torch.no_grad():
        return [
            model(input_ids=torch.tensor([e["input_ids"]]), labels=torch.tensor([e["labels"]])).loss for e in examples
        ]


def _packed_losses(model: nn.Module, examples: list[dict[str, list[int]]], batch: dict) -> list[Tensor]:
    """Each example's mean loss, read from the logits of one packed row (``batch`` without labels)."""
    with torch.no_grad():
        logits = model(**batch).logits[0]
    losses, start = [], 0
    for example in examples:
        n = len(example["input_ids"])
        targets = torch.tensor(example["labels"][1:])
        losses.append(F.cross_entropy(logits[start : start + n - 1], targets, ignore_index=IGNORE_INDEX))
        start += n
    return losses


def _deviation(left: list[Tensor], right: list[Tensor]) -> float:
    return max(abs(a - b).item() for a, b in zip(left, right, strict=True))


def test_pack_is_best_fit_decreasing() -> None:
    # Longest first: 8 -> bin 0, 7 -> bin 1, 5 -> bin 2 (fits neither), 3 -> bin 1 (the fullest it fits), 2 -> bin 0,
    # 1 -> bin 2 (the only one with room); within a bin, examples keep the order given.
    assert pack([5, 3, 8, 2, 7, 1], capacity=10) == [[2, 3], [1, 4], [0, 5]]
    lengths = [random.Random(0).randint(1, 100) for _ in range(500)]
    bins = pack(lengths, capacity=128)
    assert sorted(i for b in bins for i in b) == list(range(500))
    assert all(sum(lengths[i] for i in b) <= 128 for b in bins)
    assert sum(sum(lengths[i] for i in b) <= 64 for b in bins) <= 1, "at most one bin is half full or less"
    assert pack(lengths, capacity=128) == bins
    with pytest.raises(ValueError, match="example 1 has 11 tokens; a packed row holds 1 to 10"):
        pack([3, 11], capacity=10)


def test_pack_collator_restarts_positions_and_masks_boundaries() -> None:
    first, second, third = _examples((4, 3, 5), prompt=0)
    batch = PackCollator(pad_id=0)([[first, second], [third]])
    assert set(batch) == {"input_ids", "labels", "position_ids", "use_cache"} and batch["use_cache"] is False
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2], [0, 1, 2, 3, 4, 0, 1]]
    assert batch["input_ids"].tolist() == [first["input_ids"] + second["input_ids"], third["input_ids"] + [0, 0]]
    # The first label of each example is -100 (as is padding); the rest are the example's own.
    assert batch["labels"].tolist() == [
        [IGNORE_INDEX, *first["labels"][1:], IGNORE_INDEX, *second["labels"][1:]],
        [IGNORE_INDEX, *third["labels"][1:], IGNORE_INDEX, IGNORE_INDEX],
    ]
    # transformers cuts the rows where we meant it to: padding is a sequence of its own.
    assert find_packed_sequence_indices(batch["position_ids"]).tolist() == [[0] * 4 + [1] * 3, [0] * 5 + [1] * 2]
    assert is_packed(batch) and not is_packed({**batch, "attention_mask": torch.ones(2, 7)})


@pytest.mark.parametrize(
    ("model_type", "attention"),
    [("llama", "sdpa"), ("llama", "eager"), ("qwen2", "sdpa"), ("mistral", "eager"), ("gemma2", "eager")],
)
def test_packed_row_gives_each_example_its_alone_loss(model_type: str, attention: str) -> None:
    model, examples = _model(model_type, attention), _examples(LENGTHS)
    alone = _alone_losses(model, examples)
    batch = PackCollator(pad_id=0)([examples])
    del batch["labels"]
    assert _deviation(_packed_losses(model, examples, batch), alone) <= TOLERANCE
    # Controls: positions that run on through the row (no reset), or a cache that turns the packing detection off,
    # let the examples attend to each other and shift their positions.
    no_reset = {**batch, "position_ids": torch.arange(sum(LENGTHS))[None]}
    assert _deviation(_packed_losses(model, examples, no_reset), alone) > 100 * TOLERANCE
    with_cache = {key: value for key, value in batch.items() if key != "use_cache"}
    assert model.config.use_cache
    assert _deviation(_packed_losses(model, examples, with_cache), alone) > 100 * TOLERANCE


@pytest.mark.parametrize("loss", ["hugging_face", "chunked"])
def test_packed_batch_loss_is_the_token_weighted_mean_of_alone_losses(loss: str) -> None:
    # Every label a target, so that only the collator masks the boundaries.
    model, examples = _model("qwen2"), _examples(LENGTHS, prompt=0)
    counts = [sum(label != IGNORE_INDEX for label in e["labels"][1:]) for e in examples]
    expected = sum(a * n for a, n in zip(_alone_losses(model, examples), counts, strict=True)) / sum(counts)

    def batch_loss(batch: dict) -> Tensor:
        with torch.no_grad():
            if loss == "chunked":
                return chunked_causal_lm_loss(model, chunk_tokens=5, **batch).loss
            return model(**batch).loss

    # Two rows, the second padded: the boundary and padding labels are -100.
    batch = PackCollator(pad_id=0)([examples[:2], examples[2:]])
    assert abs(batch_loss(batch) - expected) <= TOLERANCE
    # Control: with the label at each boundary left in, a token is predicted from the previous example.
    unmasked = batch["labels"].clone()
    unmasked[0, LENGTHS[0]] = examples[1]["labels"][0]
    assert abs(batch_loss({**batch, "labels": unmasked}) - expected) > 100 * TOLERANCE


def test_only_attention_that_follows_the_packing_is_accepted() -> None:
    for attention in ("sdpa", "eager"):
        check_packed_attention(_model("llama", attention))
    model = build_model("llama", peft=True)
    model.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match="this model uses 'flash_attention_2'"):
        check_packed_attention(model)
    # CausalLMFineTune refuses packed batches for it before any forward, and trains unpacked ones as before.
    module = CausalLMFineTune("unused")
    module.model = model
    batch = PackCollator(pad_id=0)([_examples(LENGTHS)])
    with pytest.raises(MisconfigurationException, match=r"CausalLMFineTune: packed batches need .* turn off the"):
        module._loss(batch)
    model.config._attn_implementation = "sdpa"
    assert torch.isfinite(module._loss(batch))


def test_data_module_packs_every_example_once(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    records = [{"instruction": f"n{i}", "output": "x" * (i % 7 + 2)} for i in range(30)]
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8")

    def module(packing: bool) -> InstructionDataModule:
        data = InstructionDataModule(str(path), max_length=256, batch_size=2, val_fraction=0.2, packing=packing)
        data.setup("fit")
        return data

    packed, plain = module(True), module(False)
    for rows, examples in ((packed.train_set.rows, plain.train_set.rows), (packed.val_set.rows, plain.val_set.rows)):
        assert sorted(map(str, (e for row in rows for e in row))) == sorted(map(str, examples))
        assert all(sum(len(e["input_ids"]) for e in row) <= 256 for row in rows)
        assert len(rows) <= len(examples) / 3
    batches = list(packed.train_dataloader())
    assert len(batches) == len(packed.train_dataloader()) and all(is_packed(b) for b in batches)
    assert sum(int((b["position_ids"] == 0).sum()) for b in batches) >= len(plain.train_set)


def test_packing_benchmark_runs_tiny(tmp_path: Path) -> None:
    lengths = packing_throughput.example_lengths(500, median=512, sigma=0.9, low=64, high=4000, seed=0)
    assert lengths == packing_throughput.example_lengths(500, median=512, sigma=0.9, low=64, high=4000, seed=0)
    assert min(lengths) == 64 and max(lengths) <= 4000 and 350 < sorted(lengths)[250] < 700
    with pytest.raises(SystemExit) as exit_info:
        packing_throughput.parse(["--help"])
    assert exit_info.value.code == 0
    argv = ["--tiny", "--steps", "2", "--warmup", "1", "--examples", "60", "--workdir", str(tmp_path)]
    rows = packing_throughput.main([*argv, "--arms", "padded:2", "packed:1"])
    assert [row["arm"] for row in rows] == ["padded:2", "packed:1"] and all(row["steps"] == 2 for row in rows)
    assert rows[1]["padding_fraction"] == 0 and rows[1]["tokens_per_step"] > rows[0]["tokens_per_step"] / 2
