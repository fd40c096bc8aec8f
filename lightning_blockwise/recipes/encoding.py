"""Instruction records as token ids and labels, loss on the response only; padded batches of them.

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
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

#: The ignore index of the Hugging Face causal-LM loss: no loss where a label is -100.
IGNORE_INDEX = -100

#: The prompt format for tokenizers without a chat template (Alpaca's).
_ALPACA_PROMPT = "### Instruction:\n{instruction}\n\n### Response:\n"
_ALPACA_PROMPT_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"


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


def encode(record: dict[str, Any], tokenizer: PreTrainedTokenizerBase, max_length: int) -> dict[str, list[int]]:
    """Token ids and labels of one instruction record: loss on the response only.

    With a chat template the instruction (and input) form the user turn and the output the
    assistant turn; without one the Alpaca prompt is used, the response closed by the EOS
    token. Prompt tokens are labelled -100; the row is cut at ``max_length`` tokens.

    Args:
        record: ``instruction``, optional ``input``, ``output``.
        tokenizer: The tokenizer.
        max_length: Longest row in tokens.

    Raises:
        MisconfigurationException: If the chat template does not render the prompt as a prefix of the whole turn.
    """
    instruction, extra, output = record["instruction"], record.get("input") or "", record["output"]
    if tokenizer.chat_template:
        user = {"role": "user", "content": f"{instruction}\n\n{extra}" if extra else instruction}
        prompt = tokenizer.apply_chat_template([user], tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template([user, {"role": "assistant", "content": output}], tokenize=False)
        if not full.startswith(prompt):
            raise MisconfigurationException(
                "InstructionDataModule: the tokenizer's chat template does not render the prompt (with the generation"
                " prompt) as a prefix of the full conversation, so the response cannot be told apart for masking."
                " Use a tokenizer whose template does, or remove its `chat_template` to use the Alpaca format."
            )
        response = full[len(prompt) :]
        prefix: list[int] = []
    else:
        template = _ALPACA_PROMPT_WITH_INPUT if extra else _ALPACA_PROMPT
        prompt = template.format(instruction=instruction, input=extra)
        response = output + (tokenizer.eos_token or "")
        prefix = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else []
    # Prompt and response are tokenized apart so that no token straddles the boundary of the mask.
    prompt_ids = prefix + tokenizer(prompt, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
    input_ids = (prompt_ids + response_ids)[:max_length]
    labels = ([IGNORE_INDEX] * len(prompt_ids) + response_ids)[:max_length]
    return {"input_ids": input_ids, "labels": labels}


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
