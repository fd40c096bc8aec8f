"""Instruction and synthetic data modules (lightning_blockwise/recipes/: records, encoding, sampling, data)."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from transformers import PreTrainedTokenizerFast

from lightning_blockwise.recipes.chat import ALPACA, ChatFormat, chat_format
from lightning_blockwise.recipes.data import (
    IGNORE_INDEX,
    InstructionDataModule,
    SyntheticTokensDataModule,
    byte_tokenizer,
    encode,
    load_records,
    real_targets,
)
from lightning_blockwise.recipes.encoding import _runs
from lightning_blockwise.recipes.records import is_conversation

ROOT = Path(__file__).resolve().parents[2]
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


def _encoded_whole(record: dict, tokenizer: Any, max_length: int, chat: ChatFormat) -> dict[str, list[int]]:
    """The row as `encode` made it before NOTE [ Tokenizing a prefix ]: every run tokenized whole, then cut."""
    messages = (
        record["messages"]
        if is_conversation(record)
        else chat.instruction_messages(record["instruction"], record.get("input") or "", record["output"])
    )
    ids, labels = chat.leading_ids(tokenizer), []
    labels = [IGNORE_INDEX] * len(ids)
    for text, trained in _runs(chat.segments(messages)):
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        ids, labels = ids + piece, labels + (piece if trained else [IGNORE_INDEX] * len(piece))
    return {"input_ids": ids[:max_length], "labels": labels[:max_length]}


def _merging_bpe() -> PreTrainedTokenizerFast:
    """A byte-level BPE with GPT-2's split whose merges make long tokens (runs of `=` and spaces, whole words)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    corpus = ["Hello there, add 2 and 3.\n\n" + "=" * 64 + "\n" + " " * 32 + "lorem ipsum dolor\n"] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=500, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(corpus, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")


def _word_level() -> PreTrainedTokenizerFast:
    """Whole words, anything unknown one token: a token may span thousands of characters."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, "hi": 3}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


def _long_records() -> list[dict]:
    """Records long enough that `encode` tokenizes prefixes of them, with cuts inside runs, words and characters."""
    gen = torch.Generator().manual_seed(0)
    pieces = ["lorem ", "ipsum", " dolor\n", "=" * 40, " " * 33, "\n\n", "é", "😀", "add 2 and 3. ", "hi "]
    texts = ["".join(pieces[i] for i in torch.randint(len(pieces), (n,), generator=gen)) for n in (3000, 9000)]
    texts.append(("x" * 6000 + " ") * 12)  # word-level: 12 tokens in 72,000 characters
    return [
        *({"instruction": "Go on.", "output": text} for text in texts),
        {"instruction": texts[0], "input": texts[1], "output": "5"},  # the row is full before the output
        {"messages": [{"role": "system", "content": texts[2]}, {"role": "user", "content": "hi"},
                      {"role": "assistant", "content": texts[1]}]},
    ]  # fmt: skip


@pytest.mark.parametrize("make", [byte_tokenizer, _merging_bpe, _word_level], ids=["bytes", "bpe", "words"])
@pytest.mark.parametrize("template", [ALPACA, CHAT_TEMPLATE], ids=["alpaca", "template"])
def test_tokens_are_those_of_the_whole_text(make: Any, template: str) -> None:
    """NOTE [ Tokenizing a prefix ]: the shipped records, and long ones cut after a prefix, encode as before."""
    tokenizer = make()
    chat = chat_format(tokenizer, template)
    shipped = load_records(ROOT / "data" / "instructions.jsonl")[:60]
    for max_length in (8, 64, 600):
        for record in [*shipped, *_long_records()]:
            assert encode(record, tokenizer, max_length, chat) == _encoded_whole(record, tokenizer, max_length, chat)


class _Counting:
    """A tokenizer that records the length of every text it is given."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast) -> None:
        self.tokenizer = tokenizer
        self.lengths: list[int] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tokenizer, name)

    def __call__(self, text: str, **kwargs: Any) -> Any:
        self.lengths.append(len(text))
        return self.tokenizer(text, **kwargs)


def test_a_huge_record_costs_what_a_row_of_max_length_does(tmp_path: Path) -> None:
    """Tokenized whole, the issue's 50 MB record took 114 s and 9 GB at max_length=64; now a few thousand characters."""
    huge = {"instruction": "Summarize.", "output": ("lorem ipsum dolor sit amet " * 800_000)[:20_000_000]}
    path = _write(tmp_path / "huge.jsonl", [RECORDS[0], huge], jsonl=True)
    started = time.perf_counter()
    data = InstructionDataModule(str(path), max_length=64, val_fraction=0.0)
    counting = _Counting(data.tokenizer)
    data.tokenizer = counting
    data.setup("fit")
    assert time.perf_counter() - started < 10
    assert max(counting.lengths) < 20_000  # two prefixes of 8 x 64 + 4096 characters
    rows = sorted((row["input_ids"] for row in data.train_set), key=len)
    assert len(rows[-1]) == 64 and byte_tokenizer().decode(rows[-1]).endswith("Response:\nlorem ipsum dolor si")
    # Control: an ordinary record is tokenized whole, one text per run.
    counting.lengths.clear()
    encode(RECORDS[0], counting, 512, data.chat)
    assert sum(counting.lengths) == sum(len(text) for text, _ in _runs(data.chat.segments(
        data.chat.instruction_messages(RECORDS[0]["instruction"], RECORDS[0]["input"], RECORDS[0]["output"])
    )))  # fmt: skip


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


# Data errors: the file, the line (or record) and the field are named.


def test_bad_jsonl_line_is_named_by_its_line_in_the_file(tmp_path: Path) -> None:
    bad = tmp_path / "broken.jsonl"
    # Line 1 holds a raw U+2028 inside a string: a line break for `str.splitlines`, not for JSONL. Line 2 is blank.
    lines = [json.dumps({"instruction": "a\u2028b", "output": "ok"}, ensure_ascii=False), "", '{"instruction": "x",']
    bad.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(MisconfigurationException, match=r"broken\.jsonl as JSONL: line 3, column"):
        load_records(bad)
    bad.write_text("\n".join(lines[:2]) + "\n", encoding="utf-8")
    assert load_records(bad) == [{"instruction": "a\u2028b", "output": "ok"}]


def test_bad_json_names_the_line_and_column(tmp_path: Path) -> None:
    bad = tmp_path / "broken.json"
    bad.write_text('[\n {"instruction": "x", "output": "y"}\n {"instruction": "z"}\n]\n', encoding="utf-8")
    with pytest.raises(MisconfigurationException, match=r"broken\.json as JSON: line 3, column 2: Expecting ','"):
        load_records(bad)


def test_non_utf8_file_is_refused_naming_it(tmp_path: Path) -> None:
    bad = tmp_path / "latin1.jsonl"
    bad.write_bytes(json.dumps({"instruction": "café", "output": "x"}, ensure_ascii=False).encode("latin-1"))
    with pytest.raises(MisconfigurationException, match=r"latin1\.jsonl is not UTF-8"):
        load_records(bad)


@pytest.mark.parametrize("jsonl", [True, False])
def test_byte_order_mark_is_accepted(tmp_path: Path, jsonl: bool) -> None:
    path = _write(tmp_path / ("d.jsonl" if jsonl else "d.json"), RECORDS, jsonl)
    path.write_bytes(b"\xef\xbb\xbf" + path.read_bytes())
    assert load_records(path) == RECORDS


@pytest.mark.parametrize(
    ("jsonl", "record", "where"),
    [
        (True, {"instruction": "x", "output": None}, r"line 3 of .*d\.jsonl has `output` = null, which must be a str"),
        (True, {"instruction": 7, "output": "y"}, r"line 3 of .*d\.jsonl has `instruction` = 7"),
        (True, {"instruction": "x", "input": ["a"], "output": "y"}, r"line 3 .* `input` = \[\"a\"\].*string, null"),
        (False, {"instruction": "x", "output": None}, r"record 1 \(counting from 0\) of .*d\.json has `output`"),
    ],
)
def test_non_string_fields_are_refused(tmp_path: Path, jsonl: bool, record: dict, where: str) -> None:
    path = _write(tmp_path / ("d.jsonl" if jsonl else "d.json"), [RECORDS[0], record], jsonl)
    if jsonl:  # a blank line 2 puts the bad record on line 3
        path.write_text(path.read_text(encoding="utf-8").replace("\n", "\n\n", 1), encoding="utf-8")
    with pytest.raises(MisconfigurationException, match=where):
        load_records(path)


def test_null_input_is_accepted(tmp_path: Path) -> None:
    path = _write(tmp_path / "d.jsonl", [{"instruction": "Say hi.", "input": None, "output": "hi"}], jsonl=True)
    (record,) = load_records(path)
    text = byte_tokenizer().decode(encode(record, byte_tokenizer(), max_length=512)["input_ids"])
    assert text == "<s>### Instruction:\nSay hi.\n\n### Response:\nhi</s>"


def test_jsonl_record_that_is_not_an_object_names_its_line(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(RECORDS[0]) + "\n[1, 2]\n", encoding="utf-8")
    with pytest.raises(MisconfigurationException, match=r"line 2 of .*d\.jsonl needs string fields"):
        load_records(path)


CHAT = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}


@pytest.mark.parametrize(
    ("record", "where"),
    [
        ({"messages": "Hi"}, r"line 2 of .*d\.jsonl has `messages` = \"Hi\", which must be a non-empty list"),
        ({"messages": []}, r"line 2 of .*d\.jsonl has `messages` = \[\], which must be a non-empty list"),
        ({"messages": [{"role": "user"}]}, r"line 2 of .*: message 0 \(counting from 0\) is .* string `role` and"),
        ({"messages": CHAT["messages"][:1]}, r"line 2 of .* has no `assistant` message \(roles: \['user'\]\)"),
        ({**CHAT, "output": "x"}, r"line 2 of .* has `messages` and also `output`: a record is either"),
        ({"text": "Hi"}, r"line 2 of .* needs string fields `instruction` and `output` .*, or `messages`"),
    ],
)
def test_bad_conversation_records_are_refused(tmp_path: Path, record: dict, where: str) -> None:
    path = _write(tmp_path / "d.jsonl", [CHAT, record], jsonl=True)
    with pytest.raises(MisconfigurationException, match=where):
        load_records(path)


def test_conversation_and_instruction_records_mix(tmp_path: Path) -> None:
    path = _write(tmp_path / "d.jsonl", [CHAT, RECORDS[0]], jsonl=True)
    chat, instruction = load_records(path)
    assert chat == CHAT and is_conversation(chat) and not is_conversation(instruction)


# Resumable data order: see NOTE [ Resumable data order ] in lightning_blockwise/recipes/sampling.py.


def _numbered(path: Path, count: int = 22) -> Path:
    return _write(path, [{"instruction": f"n{i}", "output": f"{i:03d}"} for i in range(count)], jsonl=True)


#: With packing, two examples (of 40-41 tokens) a row and two rows a batch: as many batches as 4 examples a batch.
PACKED = {"packing": True, "max_length": 90, "batch_size": 2}


def _instruction_data(path: Path, packing: bool = False) -> InstructionDataModule:
    options = PACKED if packing else {"batch_size": 4}
    data = InstructionDataModule(str(path), val_fraction=0.0, seed=5, **options)
    data.setup("fit")
    return data


def _stream(loader: object, count: int) -> list[dict[str, torch.Tensor]]:
    """The next ``count`` batches, epoch after epoch."""
    batches: list[dict[str, torch.Tensor]] = []
    while len(batches) < count:
        batches += list(loader)[: count - len(batches)]
    return batches


def _equal(a: object, b: object) -> bool:
    """Tensors elementwise, anything else (a packed batch's `use_cache`) by value."""
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def _same(left: list[dict[str, torch.Tensor]], right: list[dict[str, torch.Tensor]]) -> bool:
    return len(left) == len(right) and all(
        a.keys() == b.keys() and all(_equal(a[key], b[key]) for key in a) for a, b in zip(left, right, strict=True)
    )


@pytest.mark.parametrize("packing", [False, True], ids=["examples", "packed"])
@pytest.mark.parametrize("k", [0, 2, 6])
def test_train_loader_state_resumes_the_order_across_epochs(tmp_path: Path, k: int, packing: bool) -> None:
    path = _numbered(tmp_path / "d.jsonl")
    per_epoch = len(_instruction_data(path, packing).train_dataloader())
    assert per_epoch == 6
    reference = _stream(_instruction_data(path, packing).train_dataloader(), 4 * per_epoch)
    epoch0, epoch1 = reference[:per_epoch], reference[per_epoch : 2 * per_epoch]
    assert not _same(epoch0, epoch1), "every epoch has an order of its own"

    # One whole epoch, then k batches of the next (k = 6: all of it, without the final StopIteration).
    interrupted = _instruction_data(path, packing).train_dataloader()
    list(interrupted)
    batches = iter(interrupted)
    for _ in range(k):
        next(batches)
    buffer = io.BytesIO()
    torch.save(interrupted.state_dict(), buffer)  # as in a checkpoint, loaded back as Lightning does
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)

    resumed = _instruction_data(path, packing).train_dataloader()
    resumed.load_state_dict(state)
    cut = per_epoch + k
    assert _same(_stream(resumed, 2 * per_epoch), reference[cut : cut + 2 * per_epoch])
    # Control: without the state, a fresh loader starts over at epoch 0.
    fresh = _stream(_instruction_data(path, packing).train_dataloader(), 2 * per_epoch)
    assert _same(fresh, reference[: 2 * per_epoch]) and not _same(fresh, reference[cut : cut + 2 * per_epoch])


def test_synthetic_train_loader_resumes_mid_epoch() -> None:
    def loader() -> object:
        return SyntheticTokensDataModule(seq_len=4, vocab_size=50, num_samples=10, batch_size=3).train_dataloader()

    reference = _stream(loader(), 8)
    interrupted = loader()
    batches = iter(interrupted)
    next(batches), next(batches)
    resumed = loader()
    resumed.load_state_dict(interrupted.state_dict())
    assert _same(_stream(resumed, 6), reference[2:8])
    assert not _same(_stream(loader(), 6), reference[2:8])  # control: a fresh loader starts over


def test_loaders_leave_the_global_rng_alone(tmp_path: Path) -> None:
    data = InstructionDataModule(str(_numbered(tmp_path / "d.jsonl")), batch_size=4, val_fraction=0.25)
    data.setup("fit")
    synthetic = SyntheticTokensDataModule(seq_len=4, vocab_size=50, num_samples=20, batch_size=2)
    makers = [
        data.train_dataloader,
        data.val_dataloader,
        data.test_dataloader,
        data.predict_dataloader,
        synthetic.train_dataloader,
        synthetic.val_dataloader,
    ]
    for make in makers:
        before = torch.get_rng_state()
        loader = make()
        for _ in range(2):  # two epochs: each `iter()` draws a base seed
            next(iter(loader))
        assert torch.equal(torch.get_rng_state(), before), make.__qualname__
    # Control: a loader without a generator of its own draws its base seed from the global RNG.
    before = torch.get_rng_state()
    next(iter(torch.utils.data.DataLoader(range(4))))
    assert not torch.equal(torch.get_rng_state(), before)


class _Recorder(pl.LightningModule):
    """Records the batches it trains on, with their epoch."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(()))
        self.seen: list[tuple[int, list[list[int]]]] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.seen.append((self.current_epoch, batch["input_ids"].tolist()))
        return self.weight.square()

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        pass

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _fit(
    path: Path,
    root: Path,
    checkpoint: dict | None = None,
    ckpt_path: str | None = None,
    packing: bool = False,
    **trainer: object,
) -> list:
    module = _Recorder()
    fitter = pl.Trainer(
        max_epochs=3,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[] if checkpoint is None else [ModelCheckpoint(root, "{step}", save_top_k=-1, **checkpoint)],
        enable_checkpointing=checkpoint is not None,
        default_root_dir=root,
        **trainer,
    )
    options = PACKED if packing else {"batch_size": 4}
    data = InstructionDataModule(str(path), val_fraction=0.1, seed=5, **options)
    fitter.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return module.seen


@pytest.mark.filterwarnings("ignore:Be aware that when using `ckpt_path`")
@pytest.mark.parametrize(
    ("checkpoint", "step", "per_epoch", "packing"),
    [
        ({"every_n_train_steps": 4}, 8, 6, False),  # mid-epoch 1: Lightning hands the loader its state
        ({"every_n_train_steps": 6}, 6, 6, False),  # after the last batch of epoch 0: the state has every row yielded
        ({"every_n_train_steps": 4}, 4, 4, False),  # after the last batch of epoch 0 cut short by `limit_train_batches`
        ({}, 6, 6, False),  # at the end of epoch 0, after validation: Lightning does not restore the loader's state
        ({"every_n_train_steps": 4}, 8, 6, True),  # the same with packed rows: mid-epoch 1
        ({}, 6, 6, True),  # and at the end of epoch 0
    ],
)
def test_fit_resumed_from_a_checkpoint_trains_on_the_same_batches(
    tmp_path: Path, checkpoint: dict, step: int, per_epoch: int, packing: bool
) -> None:
    path = _numbered(tmp_path / "d.jsonl", count=23)  # 21 training examples: 6 batches an epoch (packed: 11 rows)
    reference = _fit(path, tmp_path / "run", checkpoint, packing=packing, limit_train_batches=per_epoch)
    assert [epoch for epoch, _ in reference] == [0] * per_epoch + [1] * per_epoch + [2] * per_epoch
    ckpt_path = str(tmp_path / "run" / f"step={step}.ckpt")
    resumed = _fit(path, tmp_path / "resumed", ckpt_path=ckpt_path, packing=packing, limit_train_batches=per_epoch)
    assert resumed == reference[step:]
    # Control: the epochs differ, so a resume that replayed epoch 0 would have been caught.
    assert [batch for _, batch in reference[:per_epoch]] != [batch for _, batch in reference[per_epoch : 2 * per_epoch]]


def test_a_split_without_training_examples_is_refused_when_fitting(tmp_path: Path) -> None:
    """Two examples kept and `val_fraction=0.9` hold both out: a fit trained 0 steps and exported its adapter."""
    path = _write(tmp_path / "d.jsonl", RECORDS, jsonl=True)
    message = (
        r"^InstructionDataModule\(val_fraction=0\.9\): the split leaves 0 training examples: all 2 examples kept from"
        r" .*d\.jsonl go to validation \(2 records dropped\)\. .*Lower `val_fraction`"
    )
    with pytest.raises(MisconfigurationException, match=message):
        InstructionDataModule(str(path), max_length=47, val_fraction=0.9).setup("fit")
    # Control: validating needs no training example (the split is what the fit had: nothing to train on), and a
    # data module set up that way is refused when it is then fitted.
    data = InstructionDataModule(str(path), max_length=47, val_fraction=0.9)
    data.setup("validate")
    assert len(data.train_set) == 0 and len(data.val_set) == 2
    with pytest.raises(MisconfigurationException, match=message):
        data.setup("fit")


def test_a_missing_tokenizer_path_is_named(tmp_path: Path) -> None:
    """Hugging Face took the missing path for a hub repo id: "Repo id must be in the form ..."."""
    missing = tmp_path / "no-tokenizer-here"
    with pytest.raises(MisconfigurationException, match=rf"tokenizer='{missing}'\): {missing} does not exist\. Give"):
        InstructionDataModule(str(tmp_path / "d.jsonl"), tokenizer=str(missing))
    # Control: a directory that exists but holds no tokenizer is another error, which names it too.
    with pytest.raises(MisconfigurationException, match=rf"no tokenizer could be loaded from {tmp_path}"):
        InstructionDataModule(str(tmp_path / "d.jsonl"), tokenizer=str(tmp_path))


@pytest.mark.parametrize("name", ["assistant_only_loss", "packing"])
def test_a_flag_that_is_not_a_bool_is_refused(tmp_path: Path, name: str) -> None:
    """NOTE [ A string is not a flag ] in compat/flags.py: `packing="no"` packed."""
    with pytest.raises(MisconfigurationException, match=rf"^`InstructionDataModule\({name}='no'\)` must be True or"):
        InstructionDataModule(str(tmp_path / "d.jsonl"), **{name: "no"})
    # Control: the bools are taken.
    for ok in (True, False):
        assert InstructionDataModule(str(tmp_path / "d.jsonl"), **{name: ok}).hparams[name] is ok
