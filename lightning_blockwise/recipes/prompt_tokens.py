"""The token ids around ``model.generate``: prompts rendered as in training, left-padded; replies cut at EOS."""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lightning_blockwise.recipes.chat import ChatFormat


class PromptFormat:
    """Token ids of a conversation's next reply's prompt, rendered as training rendered its rows.

    Args:
        tokenizer: The checkpoint's tokenizer.
        chat: The chat format training used (:func:`~lightning_blockwise.recipes.chat.chat_format`: the
            tokenizer's template, else Alpaca); ``None``: the last user message as plain text, continued.
        system: A system message put first, or ``None``.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, chat: ChatFormat | None, system: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.chat = chat
        self.system = system

    def ids(self, messages: list[dict[str, str]]) -> list[int]:
        """The prompt ids of the reply to ``messages`` (user and assistant turns, the last a user's)."""
        if self.chat is None:
            return list(self.tokenizer(messages[-1]["content"])["input_ids"])
        head = [{"role": "system", "content": self.system}] if self.system else []
        # The reply as an empty assistant turn: everything before its (trained) segment is the prompt, the
        # generation header included, in the pieces training tokenized (NOTE [ Assistant masks from rendered
        # prefixes ] in chat.py).
        segments = self.chat.segments([*head, *messages, {"role": "assistant", "content": ""}])
        text = "".join(segment.text for segment in segments[:-1])
        return self.chat.leading_ids(self.tokenizer) + list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


def eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The ids a reply stops at: the model's generation config's (a chat model's end of turn) and the tokenizer's."""
    ids = model.generation_config.eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def left_padded(rows: list[list[int]], pad: int) -> tuple[Tensor, Tensor]:
    """``input_ids`` and ``attention_mask`` of ``rows`` padded on the left: every row's next token is the last."""
    length = max(len(row) for row in rows)
    input_ids = torch.full((len(rows), length), pad, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, row in enumerate(rows):
        input_ids[i, length - len(row) :] = torch.tensor(row, dtype=torch.long)
        attention_mask[i, length - len(row) :] = 1
    return input_ids, attention_mask


def until_eos(row: Tensor, eos: list[int]) -> tuple[Tensor, bool]:
    """``row`` up to and including its first end-of-sequence id, and whether it had one."""
    hits = torch.isin(row, torch.tensor(eos, dtype=row.dtype)).nonzero() if eos else torch.empty(0)
    if len(hits) == 0:
        return row, False
    return row[: int(hits[0]) + 1], True


__all__ = ["PromptFormat", "eos_ids", "left_padded", "until_eos"]
