"""Instruction and synthetic data modules (lightning_blockwise/data.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_blockwise.data import (
    IGNORE_INDEX,
    InstructionDataModule,
    SyntheticTokensDataModule,
    byte_tokenizer,
    encode,
    load_records,
    real_targets,
)

ROOT = Path(__file__).resolve().parents[1]
#: A minimal chat template: each turn is <|role|>content</s>, and the generation prompt opens the assistant turn.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
RECORDS = [
    {"instruction": "Add the two numbers.", "input": "2 3", "output": "5"},
    {"instruction": "Say hi.", "output": "hi"},  # no `input` key at all
    {"instruction": "Say nothing.", "input": "", "output": ""},  # empty output: only EOS to learn, dropped
    {"instruction": "Reverse it.", "input": "", "output": "olleh"},
]


def _write(path: Path, records: list[dict], jsonl: bool) -> Path:
    text = "\n".join(json.dumps(r) for r in records) + "\n" if jsonl else json.dumps(records, indent=1)
    path.write_text(text, encoding="utf-8")
    return path


def _decode_targets(row: dict[str, list[int]]) -> str:
    tokenizer = byte_tokenizer()
    return tokenizer.decode([t for t in row["labels"] if t != IGNORE_INDEX])


def test_byte_tokenizer_round_trips_any_text() -> None:
    tokenizer = byte_tokenizer()
    text = "Ünïcode, tabs\tand 12 + 30 = 42"
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text
    assert len(tokenizer) == 259 and tokenizer.pad_token_id == 0 and tokenizer.chat_template is None


def test_without_chat_template_only_the_response_and_eos_are_targets() -> None:
    tokenizer = byte_tokenizer()
    row = encode(RECORDS[0], tokenizer, max_length=512)
    assert tokenizer.decode(row["input_ids"]) == (
        "<s>### Instruction:\nAdd the two numbers.\n\n### Input:\n2 3\n\n### Response:\n5</s>"
    )
    assert _decode_targets(row) == "5</s>" and real_targets(row["labels"]) == 2


def test_empty_input_leaves_out_the_input_section() -> None:
    tokenizer = byte_tokenizer()
    for record in (RECORDS[1], {**RECORDS[1], "input": ""}):
        text = tokenizer.decode(encode(record, tokenizer, max_length=512)["input_ids"])
        assert text == "<s>### Instruction:\nSay hi.\n\n### Response:\nhi</s>"


def test_chat_template_masks_the_user_turn() -> None:
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    row = encode(RECORDS[0], tokenizer, max_length=512)
    assert tokenizer.decode(row["input_ids"]) == "<|user|>Add the two numbers.\n\n2 3</s><|assistant|>5</s>"
    assert _decode_targets(row) == "5</s>"


def test_chat_template_that_does_not_extend_its_prompt_is_refused() -> None:
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}>{% endif %}"
    )
    with pytest.raises(MisconfigurationException, match="prefix of the full conversation"):
        encode(RECORDS[0], tokenizer, max_length=512)


def test_over_long_rows_are_truncated() -> None:
    tokenizer = byte_tokenizer()
    full = encode(RECORDS[3], tokenizer, max_length=512)
    cut = encode(RECORDS[3], tokenizer, max_length=len(full["input_ids"]) - 3)
    assert cut["input_ids"] == full["input_ids"][:-3] and cut["labels"] == full["labels"][:-3]
    assert _decode_targets(cut) == "oll"


@pytest.mark.parametrize("jsonl", [True, False])
def test_module_drops_rows_with_fewer_than_two_targets_and_splits(tmp_path: Path, jsonl: bool) -> None:
    path = _write(tmp_path / ("d.jsonl" if jsonl else "d.json"), RECORDS, jsonl)
    # Prompts: "Say hi." 41 tokens, "Reverse it." 45, "Add ..." 70; at 47, "Reverse it." keeps "ol" of its response.
    data = InstructionDataModule(str(path), max_length=47, batch_size=4, val_fraction=0.25, seed=1)
    data.setup("fit")
    # Dropped: the empty output (EOS only) and "Add ..." whose prompt alone fills 47 tokens.
    assert data.dropped == 2
    assert len(data.train_set) + len(data.val_set) == 2 and len(data.val_set) == 1
    batch = next(iter(data.train_dataloader()))
    assert set(batch) == {"input_ids", "attention_mask", "labels"}
    assert all(real_targets(row.tolist()) >= 2 for row in batch["labels"])


def test_padding_is_masked_in_labels_and_attention(tmp_path: Path) -> None:
    path = _write(tmp_path / "d.jsonl", [RECORDS[1], RECORDS[3]], jsonl=True)
    data = InstructionDataModule(str(path), batch_size=2, val_fraction=0.0)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    pad = batch["attention_mask"] == 0
    assert pad.any(), "the two rows differ in length, so one is padded"
    assert (batch["labels"][pad] == IGNORE_INDEX).all() and (batch["input_ids"][pad] == 0).all()
    # Right padding: every row is real tokens, then padding.
    assert torch.equal(batch["attention_mask"], batch["attention_mask"].sort(dim=1, descending=True).values)


def test_split_depends_on_the_seed_only(tmp_path: Path) -> None:
    path = _write(tmp_path / "d.jsonl", [{"instruction": f"n{i}", "output": f"{i:03d}"} for i in range(20)], True)

    def split(seed: int) -> list[list[int]]:
        data = InstructionDataModule(str(path), val_fraction=0.2, seed=seed)
        data.setup("fit")
        return [row["input_ids"] for row in data.val_set.rows]

    assert split(0) == split(0) != split(1)
    assert len(split(0)) == 4


def test_bad_files_are_refused(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "x"}\n', encoding="utf-8")
    with pytest.raises(MisconfigurationException, match="needs string fields"):
        load_records(bad)
    bad.write_text("{not json", encoding="utf-8")
    with pytest.raises(MisconfigurationException, match="cannot read"):
        load_records(bad)
    empty = _write(tmp_path / "empty.json", [RECORDS[2]], jsonl=False)
    with pytest.raises(MisconfigurationException, match="none of the 1 records"):
        InstructionDataModule(str(empty)).setup("fit")


def test_shipped_instructions_are_generated_by_the_script() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_instructions", ROOT / "data" / "make_instructions.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    shipped = load_records(ROOT / "data" / "instructions.jsonl")
    assert shipped == module.make(len(shipped)) and len(shipped) >= 300


def test_synthetic_tokens() -> None:
    data = SyntheticTokensDataModule(seq_len=16, vocab_size=50, num_samples=8, batch_size=4, seed=3)
    batch = next(iter(data.train_dataloader()))
    assert batch["input_ids"].shape == (4, 16) and int(batch["input_ids"].max()) < 50
    assert torch.equal(batch["labels"], batch["input_ids"]) and bool(batch["attention_mask"].all())
    again = next(
        iter(
            SyntheticTokensDataModule(seq_len=16, vocab_size=50, num_samples=8, batch_size=4, seed=3).train_dataloader()
        )
    )
    assert torch.equal(again["input_ids"], batch["input_ids"])
    with pytest.raises(MisconfigurationException, match="seq_len >= 2"):
        SyntheticTokensDataModule(seq_len=1)
