"""Talking to a trained adapter: replies generated with the frozen base streamed as in training.

:func:`generate_replies` builds a :class:`~lightning_blockwise.recipes.finetune.CausalLMFineTune` (from an
exported adapter, or a ``.ckpt`` of one) and runs a :class:`ChatSession` as the one step of
``Trainer.predict``, so that every forward pass of ``model.generate`` runs under the strategy's
residency and precision, exactly as validation does (NOTE [ A session is one predict step ]).

Example::

    session = ChatSession(PromptFormat(tokenizer), [["Name a primary color."]], Sampling(max_new_tokens=64))
    module = GeneratingFineTune("/models/Qwen2.5-72B", adapter_path="runs/adapter")
    replies = generate_replies(module, session, strategy=BlockwiseStrategy(vram_budget="20GiB"))
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import Strategy
from torch import Tensor
from torch.utils.data import DataLoader
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from lightning_blockwise.compat.bitsandbytes import disable_cpu_repack
from lightning_blockwise.recipes.chat import ChatFormat
from lightning_blockwise.recipes.finetune import CausalLMFineTune
from lightning_blockwise.residency.streamer import StreamObserver
from lightning_blockwise.strategy.blockwise import BlockwiseStrategy
from lightning_blockwise.strategy.step_timing import link_rate

#: Tokens generated per prompt unless asked otherwise: a paragraph, about 3 minutes at 72B streamed on an H100.
DEFAULT_MAX_NEW_TOKENS = 256
#: The most tokens one reply may have (NOTE [ A generated token streams every block ] in callbacks/generation.py).
MAX_NEW_TOKENS_LIMIT = 4096
#: What an interactive session reads as "forget the conversation so far".
RESET_COMMAND = "/reset"

# NOTE [ A session is one predict step ]
# Generation must run each decoder layer with its block made resident by the strategy's streamer, under the
# precision's autocast, with no graph: exactly what BlockwiseStrategy does for validation and predict steps
# (the installed RematLayer acquires the block, runs the layer directly outside grad mode, releases it; the
# KV cache lives on the device outside the residency plan: NOTE [ A generated token streams every block ]).
# Building a StreamedStack by hand would repeat the strategy's setup (host copy, residency plan under a
# `vram_budget`, placement of the embedding and head, lean-checkpoint restore of a `.ckpt`) and drift from
# it. So the whole session is the single batch of `Trainer.predict`: one setup, one teardown, and the
# session's loop (prompts from the command line, or read from stdin as they come) inside `predict_step`. A
# loader of prompts would not do for the interactive loop: Lightning fetches the next batch before it runs
# the current one, so the prompt would be asked for before the reply was printed.
#
# The residency plan is the one for a training step of the strategy's `budget_tokens` (default 2048): a
# generation step builds no graph, so the headroom that plan keeps for activations holds the KV cache
# (`prompts x (prompt + max_new_tokens)` tokens' keys and values per layer) with room to spare.


@dataclass(frozen=True)
class Sampling:
    """How tokens are chosen: greedy at ``temperature=0`` (the default), else sampled.

    Attributes:
        max_new_tokens: Tokens per reply at most, 1 to :data:`MAX_NEW_TOKENS_LIMIT`; a reply ends sooner at EOS.
        temperature: ``0``: greedy (the most likely token, no randomness); above ``0``: sample from the
            softmax of the logits divided by it.
        top_p: Sample from the smallest set of tokens whose probabilities add up to ``top_p`` (``1``: all).
        top_k: Sample from the ``top_k`` most likely tokens (``0``: all).
        seed: Seeds torch's generators when the session starts: sampled replies are reproducible.

    Raises:
        ValueError: If a value is out of its range (the message names it and the range).
    """

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS_LIMIT:
            raise ValueError(
                f"max_new_tokens={self.max_new_tokens} must be from 1 to {MAX_NEW_TOKENS_LIMIT}: each token streams"
                " the whole streamed base once."
            )
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature={self.temperature} must be 0 (greedy) or positive, e.g. 0.7.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be above 0 and at most 1 (1: no nucleus cut), e.g. 0.9.")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be 0 (no cut) or positive, e.g. 50.")
        if self.greedy and (self.top_p != 1 or self.top_k != 0):
            raise ValueError(
                f"top_p={self.top_p} and top_k={self.top_k} apply to sampling, but temperature=0 is greedy. Give a"
                " temperature above 0 (e.g. 0.7) to sample."
            )

    @property
    def greedy(self) -> bool:
        """Whether tokens are chosen greedily (``temperature == 0``)."""
        return self.temperature == 0

    def generate_options(self) -> dict[str, Any]:
        """The keyword arguments of ``model.generate`` (no sampling knobs when greedy: it warns about them)."""
        options: dict[str, Any] = {"max_new_tokens": self.max_new_tokens, "num_beams": 1, "do_sample": not self.greedy}
        if not self.greedy:
            options.update(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)
        return options


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


@dataclass(frozen=True)
class Reply:
    """One prompt's reply.

    Attributes:
        prompt: The user message it answers.
        tokens: The generated ids, up to and including the end-of-sequence token where it stopped at one.
        text: ``tokens`` decoded without special tokens.
        stopped: Whether it ended at an end-of-sequence token (else at ``max_new_tokens``).
        seconds: Wall time of the batch it was generated in.
    """

    prompt: str
    tokens: Tensor
    text: str
    stopped: bool
    seconds: float


class _CopiedBytes(StreamObserver):
    """Counts the bytes the streamer copies from the host arena (what each generated token costs)."""

    def __init__(self) -> None:
        self.nbytes = 0

    def copy_finished(self, block: int, nbytes: int) -> None:
        self.nbytes += nbytes


class ChatSession:
    """Batches of prompts and how to answer them: the one batch of a ``Trainer.predict`` run.

    Args:
        prompts: Batches of user messages, each batch generated at once (left-padded); read lazily, so an
            iterator over stdin works. With ``history``, batches of one message.
        prompt_format: Renders a conversation as prompt ids.
        sampling: How tokens are chosen.
        on_reply: Called with each reply as soon as its batch is done (e.g. to print it).
        report: Called with lines about speed (the expected one at the start, the measured one per batch).
        history: Keep the conversation: each prompt continues the earlier turns (an interactive chat);
            :data:`RESET_COMMAND` starts over.
    """

    def __init__(
        self,
        prompt_format: PromptFormat,
        prompts: Iterable[list[str]],
        sampling: Sampling,
        on_reply: Callable[[Reply], None] = lambda reply: None,
        report: Callable[[str], None] = lambda line: None,
        history: bool = False,
    ) -> None:
        self.prompt_format = prompt_format
        self.prompts = prompts
        self.sampling = sampling
        self.on_reply = on_reply
        self.report = report
        self.history = history
        self.replies: list[Reply] = []
        self._turns: list[dict[str, str]] = []

    def run(self, model: PreTrainedModel, strategy: Strategy) -> list[Reply]:
        """Answer every batch of prompts with ``model`` under ``strategy`` (inside its predict step)."""
        torch.manual_seed(self.sampling.seed)
        counter = _CopiedBytes()
        blockwise = isinstance(strategy, BlockwiseStrategy)
        if blockwise:
            self.report(expected_speed(strategy))
            previous = strategy.observer
            strategy.set_observer(counter)
        try:
            for batch in self.prompts:
                if self.history and batch == [RESET_COMMAND]:
                    self._turns = []
                    self.report("(conversation reset)")
                    continue
                counter.nbytes = 0
                replies = self._answer(model, strategy.root_device, batch)
                new = max(len(reply.tokens) for reply in replies)
                rate = new * len(batch) / max(replies[0].seconds, 1e-9)
                streamed = f", {counter.nbytes / max(new, 1) / 1e9:.2f} GB streamed per token" if blockwise else ""
                self.report(f"({new} tokens x {len(batch)} prompts in {replies[0].seconds:.1f} s: {rate:.2f} tokens/s"
                            f"{streamed})")  # fmt: skip
        finally:
            if blockwise:
                strategy.set_observer(previous)
        return self.replies

    def _answer(self, model: PreTrainedModel, device: torch.device, batch: list[str]) -> list[Reply]:
        conversations = [[*self._turns, {"role": "user", "content": text}] for text in batch]
        rows = [self.prompt_format.ids(messages) for messages in conversations]
        eos = eos_ids(model, self.prompt_format.tokenizer)
        pad = self.prompt_format.tokenizer.pad_token_id
        pad = pad if pad is not None else (eos[0] if eos else 0)
        input_ids, attention_mask = left_padded(rows, pad)
        began = time.perf_counter()
        output = model.generate(
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            pad_token_id=pad,
            eos_token_id=eos or None,
            **self.sampling.generate_options(),
        )
        new = output[:, input_ids.shape[1] :].cpu()
        seconds = time.perf_counter() - began
        replies = []
        for text, row in zip(batch, new, strict=True):
            tokens, stopped = until_eos(row, eos)
            decoded = self.prompt_format.tokenizer.decode(tokens, skip_special_tokens=True)
            replies.append(Reply(text, tokens, decoded, stopped, seconds))
        if self.history:
            self._turns += [{"role": "user", "content": batch[0]}, {"role": "assistant", "content": replies[0].text}]
        for reply in replies:
            self.replies.append(reply)
            self.on_reply(reply)
        return replies


class GeneratingFineTune(CausalLMFineTune):
    """:class:`~lightning_blockwise.recipes.finetune.CausalLMFineTune` whose predict step runs a :class:`ChatSession`.

    Takes the same arguments (``adapter_path`` for an exported adapter); its state dict is the recipe's, so a
    ``.ckpt`` of a ``CausalLMFineTune`` run restores into it.
    """

    def configure_model(self) -> None:
        """The recipe's model, kept off bitsandbytes' CPU inference kernel under every strategy.

        NOTE [ bitsandbytes CPU inference kernel ] in compat/bitsandbytes/cpu_kernel.py: in eval mode without grad,
        a CPU ``Linear4bit`` repacks its weight for good (and fails outright on shapes that are not multiples of its
        block size); ``BlockwiseStrategy`` keeps its decoder layers off that kernel, a resident run needs the same.
        The flag is read on the CPU only.
        """
        super().configure_model()
        disable_cpu_repack(self.model)

    def predict_step(self, batch: ChatSession, batch_idx: int) -> list[Reply]:
        """Run the session (NOTE [ A session is one predict step ])."""
        return batch.run(self.model, self.trainer.strategy)


def generate_replies(
    module: GeneratingFineTune,
    session: ChatSession,
    strategy: Strategy | str = "blockwise",
    accelerator: str = "auto",
    precision: str | None = None,
    ckpt_path: str | Path | None = None,
) -> list[Reply]:
    """Load ``module``'s model under ``strategy`` and answer ``session``'s prompts; the replies, in order.

    Args:
        module: The model to talk to.
        session: The prompts and how to answer them.
        strategy: ``"blockwise"`` (or a :class:`~lightning_blockwise.BlockwiseStrategy`): the base streamed as in
            training; ``"auto"``: resident.
        accelerator: The Trainer's accelerator (``"cpu"``, ``"gpu"``, ``"auto"``).
        precision: The Trainer's precision; ``None``: ``"bf16-mixed"`` on a GPU (what the configs train in),
            ``"32-true"`` on the CPU.
        ckpt_path: A ``.ckpt`` of a ``CausalLMFineTune`` run whose adapters are restored over the model.
    """
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=1,
        strategy=strategy,
        precision=precision or ("bf16-mixed" if _uses_gpu(accelerator) else "32-true"),
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    with warnings.catch_warnings():
        # One batch that is the whole session: worker processes would have nothing to do.
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        trainer.predict(
            module, DataLoader([session], batch_size=None), ckpt_path=ckpt_path and str(ckpt_path),
            return_predictions=False,
        )  # fmt: skip
    return session.replies


def expected_speed(strategy: BlockwiseStrategy) -> str:
    """One line: the bytes of the base each generated token streams, and the time that takes on this link."""
    host_copy, plan = strategy.host_copy, strategy.residency_plan
    assert host_copy is not None and plan is not None  # set up (the session runs inside a predict step)
    sizes = [layout.nbytes for layout in host_copy.layouts]
    streamed = sum(size for block, size in enumerate(sizes) if block not in plan.resident)
    resident = f"{len(plan.resident)} of {len(sizes)} blocks resident"
    device = strategy.root_device
    if device.type != "cuda":
        return (
            f"BlockwiseStrategy on the {device.type.upper()}: the base is read from host memory ({resident});"
            " a token costs a forward pass of the model."
        )
    rate = link_rate(host_copy.arena.slabs[0], device)
    return (
        f"Each new token streams {streamed / 1e9:.2f} GB of the base ({resident}) at {rate / 1e9:.1f} GB/s:"
        f" about {streamed / rate:.2f} s per token, shared by the prompts of a batch. `--vram-budget` keeps more"
        " blocks resident."
    )


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


def _uses_gpu(accelerator: str) -> bool:
    return accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())


__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "MAX_NEW_TOKENS_LIMIT",
    "RESET_COMMAND",
    "ChatSession",
    "GeneratingFineTune",
    "PromptFormat",
    "Reply",
    "Sampling",
    "eos_ids",
    "expected_speed",
    "generate_replies",
    "left_padded",
    "until_eos",
]
