"""`generate_replies` (recipes/generation.py): replies under the streamed base, exact against resident `generate`."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import torch
from torch import Tensor
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.compat.bitsandbytes import disable_cpu_repack
from lightning_blockwise.recipes.chat import chat_format
from lightning_blockwise.recipes.finetune import CausalLMFineTune
from lightning_blockwise.recipes.generation import (
    MAX_NEW_TOKENS_LIMIT,
    RESET_COMMAND,
    ChatSession,
    GeneratingFineTune,
    PromptFormat,
    Reply,
    Sampling,
    eos_ids,
    generate_replies,
    left_padded,
    until_eos,
)
from lightning_blockwise.residency.streamer import BlockStreamer
from tests.helpers.chat import save_adapter, save_chat_checkpoint

#: Two prompts of different lengths: the batch is left-padded.
PROMPTS = ["hi", "name a color"]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny chat checkpoint and two different adapters for it."""
    root = tmp_path_factory.mktemp("chat")
    checkpoint = save_chat_checkpoint(root / "base")
    return {
        "base": checkpoint,
        "adapter": save_adapter(checkpoint, root / "adapter", seed=1),
        "other": save_adapter(checkpoint, root / "other", seed=2),
    }


def _format(checkpoint: Path) -> PromptFormat:
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    return PromptFormat(tokenizer, chat_format(tokenizer))


def _streamed(paths: dict[str, Path], adapter: str = "adapter", **sampling: Any) -> list[Reply]:
    session = ChatSession(_format(paths["base"]), [PROMPTS], Sampling(**{"max_new_tokens": 8, **sampling}))
    module = GeneratingFineTune(str(paths["base"]), compute_dtype="float32", adapter_path=str(paths[adapter]))
    return generate_replies(module, session, strategy=BlockwiseStrategy(block_size=2), accelerator="cpu")


def _resident(paths: dict[str, Path], adapter: str, max_new_tokens: int = 8) -> list[Tensor]:
    """``model.generate`` of the recipe's resident model (no Trainer), greedy, each row cut after its EOS."""
    module = CausalLMFineTune(str(paths["base"]), compute_dtype="float32", adapter_path=str(paths[adapter]))
    module.configure_model()
    # As the strategy does for its layers: NOTE [ bitsandbytes CPU inference kernel ].
    disable_cpu_repack(module.model)
    module.model.eval()
    prompt_format = _format(paths["base"])
    rows = [prompt_format.ids([{"role": "user", "content": text}]) for text in PROMPTS]
    input_ids, attention_mask = left_padded(rows, prompt_format.tokenizer.pad_token_id)
    eos = eos_ids(module.model, prompt_format.tokenizer)
    with torch.no_grad():
        output = module.model.generate(
            input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=max_new_tokens, do_sample=False,
            pad_token_id=prompt_format.tokenizer.pad_token_id, eos_token_id=eos,
        )  # fmt: skip
    return [until_eos(row, eos)[0] for row in output[:, input_ids.shape[1] :]]


def test_greedy_replies_under_the_streamed_base_equal_resident_generate(chat_model: dict[str, Path]) -> None:
    with mock.patch.object(BlockStreamer, "acquire", autospec=True, side_effect=BlockStreamer.acquire) as acquired:
        streamed = _streamed(chat_model)
    # The layers ran from streamed blocks: 4 layers per forward pass, 8 passes (prompt, then 7 new tokens).
    assert acquired.call_count == 4 * 8
    resident = _resident(chat_model, "adapter")
    assert [len(reply.tokens) for reply in streamed] == [8, 8]
    assert all(torch.equal(reply.tokens, row) for reply, row in zip(streamed, resident, strict=True))
    assert [reply.prompt for reply in streamed] == PROMPTS
    # The control: another adapter answers with other tokens, so the comparison sees the adapter.
    other = _resident(chat_model, "other")
    assert not all(torch.equal(reply.tokens, row) for reply, row in zip(streamed, other, strict=True))


def test_a_reply_stops_at_eos(chat_model: dict[str, Path]) -> None:
    free = _streamed(chat_model)
    assert not any(reply.stopped for reply in free)
    # The first prompt's third token becomes the tokenizer's end-of-sequence token: its reply ends there.
    stop = int(free[0].tokens[2])
    prompt_format = _format(chat_model["base"])
    prompt_format.tokenizer.eos_token = prompt_format.tokenizer.convert_ids_to_tokens(stop)
    session = ChatSession(prompt_format, [PROMPTS], Sampling(max_new_tokens=8))
    module = GeneratingFineTune(
        str(chat_model["base"]), compute_dtype="float32", adapter_path=str(chat_model["adapter"])
    )
    stopped = generate_replies(module, session, strategy=BlockwiseStrategy(), accelerator="cpu")
    first_stop = int((free[0].tokens == stop).nonzero()[0])
    assert stopped[0].stopped and torch.equal(stopped[0].tokens, free[0].tokens[: first_stop + 1])
    # The other row runs on to its own end, unchanged up to its first `stop`, if any.
    row = free[1].tokens
    cut = int((row == stop).nonzero()[0]) + 1 if (row == stop).any() else len(row)
    assert torch.equal(stopped[1].tokens, row[:cut])


def test_sampling_is_reproducible_with_a_seed(chat_model: dict[str, Path]) -> None:
    def tokens(seed: int) -> list[Tensor]:
        return [reply.tokens for reply in _streamed(chat_model, temperature=2.0, top_k=50, top_p=0.95, seed=seed)]

    first, again, other = tokens(3), tokens(3), tokens(4)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    # The control: another seed draws other tokens, and sampling is not greedy.
    assert not all(torch.equal(a, b) for a, b in zip(first, other, strict=True))
    greedy = [reply.tokens for reply in _streamed(chat_model)]
    assert not all(torch.equal(a, b) for a, b in zip(first, greedy, strict=True))


def test_a_conversation_keeps_its_turns_until_reset(chat_model: dict[str, Path]) -> None:
    prompt_format = _format(chat_model["base"])
    session = ChatSession(
        prompt_format, [["hi"], ["and then?"], [RESET_COMMAND], ["and then?"]], Sampling(max_new_tokens=4), history=True
    )
    module = GeneratingFineTune(
        str(chat_model["base"]), compute_dtype="float32", adapter_path=str(chat_model["adapter"])
    )
    with mock.patch.object(PromptFormat, "ids", autospec=True, side_effect=PromptFormat.ids) as rendered:
        replies = generate_replies(module, session, strategy=BlockwiseStrategy(), accelerator="cpu")
    assert [reply.prompt for reply in replies] == ["hi", "and then?", "and then?"]
    conversations = [call.args[1] for call in rendered.call_args_list]
    assert conversations == [
        [{"role": "user", "content": "hi"}],
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": replies[0].text},
         {"role": "user", "content": "and then?"}],
        [{"role": "user", "content": "and then?"}],
    ]  # fmt: skip


def test_the_prompt_is_rendered_as_training_renders_a_row(chat_model: dict[str, Path]) -> None:
    """The chat template's prompt (generation header included); Alpaca's after the BOS id; plain text as is."""
    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(chat_model["base"])
    messages = [{"role": "user", "content": "hi"}]
    assert (
        tokenizer.decode(PromptFormat(tokenizer, chat_format(tokenizer)).ids(messages)) == "<|user|>hi\n<|assistant|>"
    )
    alpaca = PromptFormat(tokenizer, chat_format(tokenizer, "alpaca")).ids(messages)
    assert alpaca[0] == tokenizer.bos_token_id
    assert tokenizer.decode(alpaca[1:]) == "### Instruction:\nhi\n\n### Response:\n"
    assert PromptFormat(tokenizer, None).ids(messages) == tokenizer("hi")["input_ids"]
    system = PromptFormat(tokenizer, chat_format(tokenizer), system="be brief").ids(messages)
    assert tokenizer.decode(system) == "<|system|>be brief\n<|user|>hi\n<|assistant|>"


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"max_new_tokens": 0}, f"from 1 to {MAX_NEW_TOKENS_LIMIT}"),
        ({"max_new_tokens": MAX_NEW_TOKENS_LIMIT + 1}, f"from 1 to {MAX_NEW_TOKENS_LIMIT}"),
        ({"temperature": -0.5}, "0 (greedy) or positive"),
        ({"temperature": 1.0, "top_p": 0.0}, "above 0 and at most 1"),
        ({"temperature": 1.0, "top_k": -1}, "0 (no cut) or positive"),
        ({"top_k": 5}, "Give a temperature above 0"),
    ],
)
def test_sampling_values_out_of_range_are_refused(options: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        Sampling(**options)
    # The control: the defaults are taken, and greedy.
    assert Sampling().greedy and Sampling().generate_options()["do_sample"] is False
