"""Talking to a trained adapter: replies generated with the frozen base streamed as in training.

:func:`generate_replies` builds a :class:`~lightning_blockwise.recipes.finetune.CausalLMFineTune` (from an
exported adapter, or a ``.ckpt`` of one) and runs a :class:`ChatSession` as the one step of
``Trainer.predict``, so that every forward pass of ``model.generate`` runs under the strategy's
residency and precision, exactly as validation does (NOTE [ A session is one predict step ]). How tokens
are chosen is in generation_options.py, the token ids around ``model.generate`` in prompt_tokens.py.

Example::

    session = ChatSession(PromptFormat(tokenizer), [["Name a primary color."]], Sampling(max_new_tokens=64))
    module = GeneratingFineTune("/models/Qwen2.5-72B", adapter_path="runs/adapter")
    replies = generate_replies(module, session, strategy=BlockwiseStrategy(vram_budget="20GiB"))
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import Strategy
from torch import Tensor
from torch.utils.data import DataLoader
from transformers import PreTrainedModel

from lightning_blockwise.compat.bitsandbytes import disable_cpu_repack
from lightning_blockwise.compat.quiet_logs import is_verbose
from lightning_blockwise.planning import format_gb
from lightning_blockwise.recipes.finetune import CausalLMFineTune
from lightning_blockwise.recipes.generation_options import DEFAULT_MAX_NEW_TOKENS, MAX_NEW_TOKENS_LIMIT, Sampling
from lightning_blockwise.recipes.prompt_tokens import PromptFormat, eos_ids, left_padded, until_eos
from lightning_blockwise.residency.stream_observer import StreamObserver
from lightning_blockwise.strategy.blockwise import BlockwiseStrategy
from lightning_blockwise.strategy.step_timing import link_rate

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
                streamed = f", {format_gb(counter.nbytes / max(new, 1))} streamed per token" if blockwise else ""
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
    verbose: bool = False,
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
        verbose: Show the messages left out by default (as ``LIGHTNING_BLOCKWISE_VERBOSE=1`` does): Lightning's
            warning that the ``.ckpt``'s training callbacks are not given back.
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
        if not (verbose or is_verbose()):
            # A training run's `.ckpt` records its callbacks (ParityCheck, the profiler, ModelCheckpoint): Lightning
            # asks for them back on every load, but generation restores the adapters only and needs none of them.
            warnings.filterwarnings("ignore", message="Be aware that when using `ckpt_path`, callbacks used")
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
        f"Each new token streams {format_gb(streamed)} of the base ({resident}) at {rate / 1e9:.1f} GB/s:"
        f" about {streamed / rate:.2f} s per token, shared by the prompts of a batch. `--vram-budget` keeps more"
        " blocks resident."
    )


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
