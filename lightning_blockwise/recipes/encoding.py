"""Records as token ids and labels, loss on the assistant turns only; padded batches of them.

Nothing here touches the network: the tokenizer is one the caller built, or the byte-level
tokenizer built in memory (:func:`byte_tokenizer`).

Example::

    tokenizer = byte_tokenizer()
    row = encode({"instruction": "Say hi.", "output": "hi"}, tokenizer, max_length=64)
    batch = PadCollator(tokenizer.pad_token_id)([row])
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from lightning_blockwise.recipes.chat import ChatFormat, Segment, chat_format
from lightning_blockwise.recipes.records import is_conversation

#: The ignore index of the Hugging Face causal-LM loss: no loss where a label is -100.
IGNORE_INDEX = -100


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer built in memory: 256 byte tokens plus ``<pad>`` (0), ``<s>`` and ``</s>``.

    Any text round-trips through it, so it needs neither training nor a download; its
    vocabulary (259) is fixed, so a model built for it fits any data.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    specials = ["<pad>", "<s>", "</s>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: index for index, token in enumerate([*specials, *alphabet])}
    # A BPE without merges over the byte alphabet: every byte is one token.
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>", padding_side="right"
    )


def encode(
    record: dict[str, Any],
    tokenizer: PreTrainedTokenizerBase,
    max_length: int,
    chat: ChatFormat | None = None,
    assistant_only_loss: bool = True,
) -> dict[str, list[int]]:
    """Token ids and labels of one record (instruction or conversation): by default, loss on assistant turns only.

    An instruction record is a user turn (the instruction, and the input) and an assistant
    turn (the output). The conversation is rendered by ``chat`` (see
    :mod:`~lightning_blockwise.recipes.chat`); each run of text that is trained on, or not, is
    tokenized apart, so that no token straddles the boundary of the mask. With
    ``assistant_only_loss`` the tokens outside assistant turns are labelled -100, else every
    token is a target. The row is cut at ``max_length`` tokens, and a long text is tokenized only
    as far as the row needs (NOTE [ Tokenizing a prefix ]): a huge record costs no more than a
    row of ``max_length``.

    Args:
        record: ``instruction``, optional ``input``, ``output``; or ``messages``.
        tokenizer: The tokenizer.
        max_length: Longest row in tokens.
        chat: The chat format; ``None``: ``chat_format(tokenizer, "auto")``, the tokenizer's template if it has one,
            else Alpaca.
        assistant_only_loss: Train on the assistant turns only (else on every token).

    Raises:
        MisconfigurationException: If the chat template's renderings of the conversation are not prefixes of each
            other, so the assistant turns cannot be told apart (NOTE [ Assistant masks from rendered prefixes ]).
    """
    chat = chat_format(tokenizer) if chat is None else chat
    if is_conversation(record):
        messages = record["messages"]
    else:
        messages = chat.instruction_messages(record["instruction"], record.get("input") or "", record["output"])
    input_ids = chat.leading_ids(tokenizer)
    labels = [IGNORE_INDEX] * len(input_ids)
    for text, trained in _runs(chat.segments(messages)):
        if len(input_ids) >= max_length:
            break  # the row is full: what follows would be cut
        ids = _first_ids(tokenizer, text, max_length - len(input_ids))
        input_ids += ids
        labels += ids if trained or not assistant_only_loss else [IGNORE_INDEX] * len(ids)
    return {"input_ids": input_ids[:max_length], "labels": labels[:max_length]}


# NOTE [ Tokenizing a prefix ]
#
# A row keeps its first `max_length` tokens, but tokenizing a text whole costs time and memory in its length: one
# 50 MB record took 114 s and 9 GB of RAM to keep 64 tokens. So a long text is tokenized from a prefix. The ids of a
# prefix are those of the whole text except near the cut (a pre-tokenizer piece or a merge that the cut splits),
# so the prefix is taken long enough to hold more than the tokens wanted, and its first tokens are checked against
# those of a prefix twice as long: where they agree, the cut did not reach them. Where they do not (a token spans
# more characters than allowed for, a model whose merges reach far), the prefix doubles, up to the whole text. A
# text no longer than the first prefix is tokenized whole, as before: the ids of ordinary records do not change.
#: Characters per wanted token in the first prefix, and characters added: a token rarely spans more than a few.
_CHARS_PER_TOKEN, _CHARS_SPARE = 8, 4096


def _first_ids(tokenizer: PreTrainedTokenizerBase, text: str, wanted: int) -> list[int]:
    """The ids of ``text`` (no special tokens added), at least its first ``wanted``: NOTE [ Tokenizing a prefix ]."""
    size = _CHARS_PER_TOKEN * wanted + _CHARS_SPARE
    while size < len(text):
        ids = tokenizer(text[:size], add_special_tokens=False)["input_ids"]
        longer = tokenizer(text[: 2 * size], add_special_tokens=False)["input_ids"]
        if len(ids) > wanted and ids[:wanted] == longer[:wanted]:
            return ids[:wanted]
        size *= 2
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _runs(segments: list[Segment]) -> list[tuple[str, bool]]:
    """Adjacent segments of the same kind joined, so that each is tokenized as one text (a prompt stays whole)."""
    runs: list[tuple[str, bool]] = []
    for segment in segments:
        if runs and runs[-1][1] == segment.trained:
            runs[-1] = (runs[-1][0] + segment.text, segment.trained)
        elif segment.text:
            runs.append((segment.text, segment.trained))
    return runs


def real_targets(labels: list[int]) -> int:
    """Label positions the shifted causal-LM loss trains on (the first position is never predicted)."""
    return sum(label != IGNORE_INDEX for label in labels[1:])


class PadCollator:
    """Right-pads rows to the longest in the batch: padding is ``pad_id`` in the ids, 0 in the mask, -100 in labels.

    Args:
        pad_id: The tokenizer's padding id.
    """

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, rows: list[dict[str, list[int]]]) -> dict[str, Tensor]:
        """Stack ``rows`` into a padded batch."""
        length = max(len(row["input_ids"]) for row in rows)
        ids = torch.full((len(rows), length), self.pad_id, dtype=torch.long)
        labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
        mask = torch.zeros((len(rows), length), dtype=torch.long)
        for i, row in enumerate(rows):
            n = len(row["input_ids"])
            ids[i, :n] = torch.tensor(row["input_ids"])
            labels[i, :n] = torch.tensor(row["labels"])
            mask[i, :n] = 1
        return {"input_ids": ids, "attention_mask": mask, "labels": labels}


__all__ = ["IGNORE_INDEX", "PadCollator", "byte_tokenizer", "encode", "real_targets"]
