"""Chat formats and assistant-only masks (lightning_blockwise/recipes/chat.py, through encoding.encode)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from transformers import PreTrainedTokenizerFast

from lightning_blockwise.recipes import data as data_module
from lightning_blockwise.recipes.chat import AlpacaFormat, TemplateFormat, chat_format
from lightning_blockwise.recipes.data import IGNORE_INDEX, InstructionDataModule, byte_tokenizer, encode

# Qwen2.5-like ChatML (its default system prompt included) and a Llama-3-like template, both without
# `{% generation %}` markers, as the real ones are.
CHATML = (
    "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}{%- if message.role != 'system' or not loop.first %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
LLAMA3 = (
    "{% for message in messages %}{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
    " + message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}"
    "{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
#: CHATML with `{% generation %}` markers around each assistant reply: what Hugging Face's own mask needs.
CHATML_MARKED = CHATML.replace(
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}",
    "{%- if message.role == 'assistant' %}{{- '<|im_start|>assistant\\n' }}{% generation %}"
    "{{- message.content + '<|im_end|>\\n' }}{% endgeneration %}{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{%- endif %}",
)
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Hello!"},
    {"role": "user", "content": "Add 2 and 3."},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "Thanks"},  # after the last assistant turn: nothing to learn, left out
]


CHAT_RECORD = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}


def _tokenizer(template: str | None = None) -> PreTrainedTokenizerFast:
    tokenizer = byte_tokenizer()
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIALS})
    tokenizer.chat_template = template
    return tokenizer


#: The pre-tokenizer split of Llama-3 (Qwen2's differs only in splitting digits one by one): newlines are one piece.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


def _bpe(llama3_split: bool) -> PreTrainedTokenizerFast:
    """A byte-level BPE with merges, trained here: Llama-3's pre-tokenizer split, or GPT-2's."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=not llama3_split)
    split = pre_tokenizers.Split(Regex(LLAMA3_SPLIT), behavior="isolated")
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level]) if llama3_split else byte_level
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>", *SPECIALS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(["Hello there!\n\nHi there, add 2 and 3.\n\nBe brief.\nThanks\n\n"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")


def _trained_spans(tokenizer: PreTrainedTokenizerFast, row: dict[str, list[int]]) -> list[str]:
    """The runs of trained tokens, decoded."""
    spans: list[list[int]] = []
    for index, label in enumerate(row["labels"]):
        if label == IGNORE_INDEX:
            continue
        if spans and row["labels"][index - 1] != IGNORE_INDEX:
            spans[-1].append(label)
        else:
            spans.append([label])
    return [tokenizer.decode(span) for span in spans]


@pytest.mark.parametrize(
    ("template", "replies"),
    [(CHATML, ["Hello!<|im_end|>\n", "5<|im_end|>\n"]), (LLAMA3, ["Hello!<|eot_id|>", "5<|eot_id|>"])],
    ids=["chatml", "llama3"],
)
def test_assistant_turns_are_the_only_targets_without_generation_markers(template: str, replies: list[str]) -> None:
    tokenizer = _tokenizer(template)
    row = encode({"messages": CONVERSATION}, tokenizer, max_length=4096)
    # The text is the template's rendering, up to the last reply.
    assert tokenizer.decode(row["input_ids"]) == tokenizer.apply_chat_template(CONVERSATION[:5], tokenize=False)
    assert _trained_spans(tokenizer, row) == replies
    everything = encode({"messages": CONVERSATION}, tokenizer, max_length=4096, assistant_only_loss=False)
    assert everything["labels"] == everything["input_ids"] == row["input_ids"]


@pytest.mark.parametrize("template", [CHATML, LLAMA3], ids=["chatml", "llama3"])
def test_pieces_tokenize_as_the_whole_conversation_with_a_real_bpe(template: str) -> None:
    """NOTE [ Assistant masks from rendered prefixes ]: with Llama-3's (and Qwen2's) pre-tokenizer split."""
    tokenizer = _bpe(llama3_split=True)
    tokenizer.chat_template = template
    row = encode({"messages": CONVERSATION}, tokenizer, max_length=4096)
    whole = tokenizer(tokenizer.apply_chat_template(CONVERSATION[:5], tokenize=False), add_special_tokens=False)
    assert row["input_ids"] == whole["input_ids"] and len(row["input_ids"]) < len(tokenizer.decode(row["input_ids"]))
    # Control: GPT-2's split cuts "\n\n" before a word in two, but keeps it whole at the end of a prompt.
    gpt2 = _bpe(llama3_split=False)
    gpt2.chat_template = LLAMA3
    whole = gpt2(gpt2.apply_chat_template(CONVERSATION[:5], tokenize=False), add_special_tokens=False)
    assert encode({"messages": CONVERSATION}, gpt2, max_length=4096)["input_ids"] != whole["input_ids"]


def test_masks_equal_hugging_faces_from_generation_markers() -> None:
    tokenizer = _tokenizer(CHATML)
    row = encode({"messages": CONVERSATION[:5]}, tokenizer, max_length=4096)

    def hf_mask(template: str) -> tuple[list[int], list[int]]:
        out = tokenizer.apply_chat_template(
            CONVERSATION[:5], chat_template=template, return_dict=True, return_assistant_tokens_mask=True
        )
        return list(out["input_ids"]), list(out["assistant_masks"])

    ids, mask = hf_mask(CHATML_MARKED)
    assert ids == row["input_ids"]
    assert mask == [int(label != IGNORE_INDEX) for label in row["labels"]] and 0 < sum(mask) < len(mask)
    # Control: without the markers Hugging Face's mask is all zeros, which is why the masks are derived here.
    assert sum(hf_mask(CHATML)[1]) == 0


def test_template_that_rewrites_earlier_turns_is_refused() -> None:
    # Like Qwen3's: the reasoning of every assistant turn but the last is dropped.
    template = CHATML.replace(
        "message.content + '<|im_end|>\\n' }}",
        "(message.content.split('</think>')[-1] if message.role == 'assistant' and not loop.last"
        " else message.content) + '<|im_end|>\\n' }}",
    )
    tokenizer = _tokenizer(template)
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>greet</think>Hello"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "<think>part</think>Bye"},
    ]
    with pytest.raises(MisconfigurationException, match=r"up to message 3 .* rewrites earlier turns"):
        encode({"messages": messages}, tokenizer, max_length=4096)
    # Control: one turn renders consistently, and so does the conversation with a template that keeps every turn.
    assert _trained_spans(tokenizer, encode({"messages": messages[:2]}, tokenizer, 4096)) == [
        "<think>greet</think>Hello<|im_end|>\n"
    ]
    assert len(_trained_spans(_tokenizer(CHATML), encode({"messages": messages}, _tokenizer(CHATML), 4096))) == 2


def test_alpaca_renders_conversations_turn_by_turn() -> None:
    tokenizer = _tokenizer(CHATML)  # has a template, but "alpaca" is asked for
    chat = chat_format(tokenizer, "alpaca")
    assert isinstance(chat, AlpacaFormat)
    row = encode({"messages": CONVERSATION}, tokenizer, max_length=4096, chat=chat)
    assert tokenizer.decode(row["input_ids"]) == (
        "<s>Be brief.\n\n### Instruction:\nHi there\n\n### Response:\nHello!</s>"
        "### Instruction:\nAdd 2 and 3.\n\n### Response:\n5</s>"
    )
    assert _trained_spans(tokenizer, row) == ["Hello!</s>", "5</s>"]
    # An instruction record and the same exchange as a conversation encode alike (the Alpaca fallback of old).
    record = {"instruction": "Hi there", "output": "Hello!"}
    conversation = {"messages": [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]}
    assert encode(record, tokenizer, 4096, chat) == encode(conversation, tokenizer, 4096, chat)


@pytest.mark.parametrize(
    ("template", "match"),
    [
        ("{% for m in messages %}{{ m.content }", r"is not a valid Jinja template: line 1: unexpected '}'\. Fix the"),
        ("{% for m in messages %}{{ m.content | nosuch }}{% endfor %}", r"not a valid Jinja template.*'nosuch'"),
        ("{{ foo.bar }}{% for m in messages %}{{ m.content }}{% endfor %}", r"failed while rendering.*'foo' is undef"),
    ],
    ids=["syntax", "filter", "undefined"],
)
def test_a_broken_template_is_blamed_not_the_records_roles(template: str, match: str) -> None:
    with pytest.raises(MisconfigurationException, match=match) as refused:
        encode(CHAT_RECORD, _tokenizer(), 64, chat_format(_tokenizer(), template))
    assert "roles" not in str(refused.value)


@pytest.mark.parametrize("said", ["Begin with a system turn.", "This template does not support tools."])
def test_a_template_that_raises_is_reported_in_its_own_words(said: str) -> None:
    """Control of the test above: the template's own `raise_exception` is quoted as the template's message.

    It was reported as a roles error ("refused the conversation prefix with roles ...: Fix the record's roles") for
    whatever the template checked.
    """
    template = f"{{% if messages[0].role != 'system' %}}{{{{ raise_exception({said!r}) }}}}{{% endif %}}"
    with pytest.raises(MisconfigurationException) as refused:
        encode(CHAT_RECORD, _tokenizer(), 64, chat_format(_tokenizer(), template))
    message = str(refused.value)
    assert message.startswith(f"InstructionDataModule: the chat template given inline raised its own error: {said!r}")
    assert "the first 1 messages of a conversation, with the generation prompt, roles ['user']" in message
    assert "That message is the template's (its `raise_exception`)" in message and "Fix the record" not in message


def test_chat_template_choices(tmp_path: Path) -> None:
    with_template, without = _tokenizer(CHATML), _tokenizer()
    assert isinstance(chat_format(without, "auto"), AlpacaFormat)
    own = chat_format(with_template, "auto")
    assert isinstance(own, TemplateFormat) and own.template == CHATML and own.name == "the tokenizer's chat template"
    assert chat_format(without, LLAMA3).template == LLAMA3
    path = tmp_path / "llama3.jinja"
    path.write_text(LLAMA3, encoding="utf-8")
    from_file = chat_format(without, str(path))
    assert from_file.template == LLAMA3 and str(path) in from_file.name
    with pytest.raises(MisconfigurationException, match=r"chat_template='chatml'\) is neither 'auto', 'alpaca'"):
        chat_format(without, "chatml")


def test_data_module_trains_conversations_with_the_template_it_logs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "chats.jsonl"
    records = [{"messages": CONVERSATION}, {"instruction": "Say hi.", "output": "hi"}]  # kinds mixed in one file
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n", encoding="utf-8")
    with pytest.raises(MisconfigurationException, match="is neither"):
        InstructionDataModule(str(path), chat_template="chatml")  # refused before the data are read
    data = InstructionDataModule(str(path), val_fraction=0.0, chat_template=LLAMA3, batch_size=2)
    logged: list[str] = []
    monkeypatch.setattr(data_module, "rank_zero_info", logged.append)
    data.setup("fit")
    assert "InstructionDataModule: rendering the records with the chat template given inline." in logged
    batch = next(iter(data.train_dataloader()))
    targets = sorted("".join(_trained_spans(data.tokenizer, {"labels": labels.tolist()})) for labels in batch["labels"])
    assert targets == ["Hello!<|eot_id|>5<|eot_id|>", "hi<|eot_id|>"]
