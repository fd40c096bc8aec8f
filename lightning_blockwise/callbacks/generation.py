"""``SampleGenerations``: a few greedy generations of the model at the end of each validation.

Off unless added to the Trainer's callbacks. It runs the Hugging Face model's own ``generate``,
under whatever strategy trains the module, and leaves the training run as it found it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch import Callback
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from typing_extensions import override

from lightning_blockwise.architectures import pretrained_models
from lightning_blockwise.compat.lightning_namespaces import FollowsTrainer, follow
from lightning_blockwise.replay.rng import GlobalRngState

#: The most tokens :class:`SampleGenerations` generates per prompt (NOTE [ A generated token streams every block ]).
MAX_NEW_TOKENS_LIMIT = 256

# NOTE [ A generated token streams every block ]
# Under BlockwiseStrategy a forward pass streams every block of the frozen base through the
# device, and greedy decoding runs one forward pass per generated token (with the KV cache, a
# pass over one new token per prompt; without it, over the whole sequence again). The pass
# costs about what streaming the base costs: ~0.7 s at the 72B shape on an H100 (36 GB of NF4
# blocks over a ~55 GB/s host link), whatever the number of prompts. So a validation with
# `max_new_tokens=32` adds ~20 s at 72B: the prompts go in one left-padded batch, and
# `max_new_tokens` is bounded. The decoder layers run as in validation (no graph, each layer
# acquiring its block from the streamer in order), so the KV cache works as it does resident
# (tests/callbacks/test_generation.py counts the positions each streamed layer sees):
# the cache holds keys and values, not weights, and lives on the device, outside the
# residency plan (`prompts x (prompt + max_new_tokens)` tokens' keys and values per layer).
#
# NOTE [ Generations leave no trace ]
# Greedy decoding draws no random numbers, reads no data loader and builds no graph, with the
# model in eval mode, so it leaves the training run's state as it was. Still, the generators
# (Python, NumPy, torch CPU and CUDA) are put back after it, so that a model whose forward
# draws in eval mode leaves the run's dropout masks where they were, and every module's
# training flag is put back.


@dataclass(frozen=True)
class Sample:
    """One prompt's generation.

    Attributes:
        step: ``trainer.global_step`` when it was generated.
        prompt: The prompt as given: text, or token ids.
        tokens: The generated token ids: ``max_new_tokens`` of them, fewer when every prompt's generation ended
            at an end-of-sequence token; padding after a prompt's end.
        text: ``tokens`` decoded without special tokens, or ``None`` without a tokenizer.
    """

    step: int
    prompt: str | tuple[int, ...]
    tokens: Tensor
    text: str | None


class SampleGenerations(FollowsTrainer, Callback):
    r"""Greedy-decode a few prompts at the end of each validation, print them and log them as text.

    Gives a look at what the adapters learn, next to the validation loss. The prompts go
    through the Hugging Face model's ``generate`` in one left-padded batch, greedily
    (``do_sample=False``), under the Trainer's precision (as ``validation_step`` runs); the
    result is printed on rank zero, kept in :attr:`samples`, and written with ``add_text`` to
    every logger whose experiment has it (TensorBoard's ``SummaryWriter``, tag ``samples/<i>``).
    Generation stops at ``max_new_tokens`` or, with a tokenizer, its end-of-sequence token when the
    model's generation config names none. Nothing runs during the sanity check.

    Under :class:`~lightning_blockwise.BlockwiseStrategy` each generated token streams every block
    of the frozen base (about 0.7 s per token at 72B on an H100, NOTE [ A generated token streams
    every block ]), so ``max_new_tokens`` is bounded; the greedy tokens are those of resident
    training's model (``torch.equal``). The training run is unchanged by it (NOTE [ Generations
    leave no trace ]).

    Args:
        prompts: Text prompts, tokenized by the ``tokenizer`` attribute of the LightningModule or, without
            one, of the data module (e.g. ``InstructionDataModule``); or prompts as lists of token ids. Write
            them as the training data renders a prompt (for the Alpaca format,
            ``"### Instruction:\n...\n\n### Response:\n"``).
        max_new_tokens: Tokens to generate per prompt, 1 to :data:`MAX_NEW_TOKENS_LIMIT`.
        use_cache: Reuse the keys and values of earlier positions (the KV cache); ``False`` recomputes
            the whole sequence for every token.

    Raises:
        MisconfigurationException: If ``prompts`` is empty or mixes text and token ids, ``max_new_tokens`` is
            out of range, text prompts find no tokenizer (at setup), or the module holds no single Hugging Face
            model that can generate, or the token ids exceed its vocabulary (at fit or validation start).

    Example::

        from lightning_blockwise import SampleGenerations

        prompts = ["### Instruction:\nName a primary color.\n\n### Response:\n"]
        trainer = Trainer(strategy="blockwise", callbacks=[SampleGenerations(prompts, max_new_tokens=32)])
    """

    def __init__(
        self, prompts: Sequence[str] | Sequence[Sequence[int]], max_new_tokens: int = 32, use_cache: bool = True
    ) -> None:
        self.prompts = _checked_prompts(prompts)
        if (
            isinstance(max_new_tokens, bool)
            or not isinstance(max_new_tokens, int)
            or not (1 <= max_new_tokens <= MAX_NEW_TOKENS_LIMIT)
        ):
            raise MisconfigurationException(
                f"`SampleGenerations(max_new_tokens={max_new_tokens!r})` must be an integer from 1 to"
                f" {MAX_NEW_TOKENS_LIMIT}: under BlockwiseStrategy every generated token streams every block of the"
                " frozen base (about 0.7 s per token at 72B on an H100), at every validation."
            )
        self.max_new_tokens = max_new_tokens
        self.use_cache = use_cache
        self.samples: list[Sample] = []
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._leading_ids: list[int] | None = None

    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if follow(self, trainer):  # NOTE [ Two Lightning namespaces ]: now the twin, whose own setup runs
            return self.setup(trainer, pl_module, stage)
        # Before the model is built: a text prompt with nothing to tokenize it is refused first.
        self._tokenizer = _find_tokenizer(pl_module, trainer.datamodule)
        # A data module that renders its rows with a chat format (InstructionDataModule's `chat`) says what the
        # training rows start with: the prompts start the same way (recipes/encoding.py).
        chat = getattr(trainer.datamodule, "chat", None)
        leading = getattr(chat, "leading_ids", None)
        self._leading_ids = list(leading(self._tokenizer)) if callable(leading) and self._tokenizer else None
        if self._tokenizer is None and isinstance(self.prompts[0], str):
            raise MisconfigurationException(
                "`SampleGenerations` was given text prompts but found no tokenizer: neither"
                f" `{type(pl_module).__name__}` nor the data module has a `tokenizer` attribute (a Hugging Face"
                " tokenizer). Give the prompts as lists of token ids, or set `tokenizer` on the module."
            )

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._model(pl_module)

    @override
    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._model(pl_module)

    @override
    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        model = self._model(pl_module)
        tokens = self._generate(model, trainer, pl_module.device)
        samples = [
            Sample(trainer.global_step, prompt, row, self._decode(row))
            for prompt, row in zip(self.prompts, tokens, strict=True)
        ]
        self.samples.extend(samples)
        lines = [f"SampleGenerations at step {trainer.global_step} (greedy, {self.max_new_tokens} new tokens at most):"]
        lines += [f"  [{i}] {_shown(s.prompt)!r} -> {_shown(s.text, s.tokens)!r}" for i, s in enumerate(samples)]
        rank_zero_info("\n".join(lines))
        for logger in trainer.loggers:
            # TensorBoard's `SummaryWriter` (torch's or tensorboardX's) has it; a CSV file has no place for text.
            add_text = getattr(logger.experiment, "add_text", None)
            if add_text is None:
                continue
            for index, s in enumerate(samples):
                text = f"```\n{_shown(s.prompt)}\n```\n\n```\n{_shown(s.text, s.tokens)}\n```"
                add_text(f"samples/{index}", text, trainer.global_step)

    def _generate(self, model: PreTrainedModel, trainer: pl.Trainer, device: torch.device) -> Tensor:
        """The greedy new tokens of every prompt, one row each, on the CPU (NOTE [ Generations leave no trace ])."""
        ids = [self._encode(prompt) for prompt in self.prompts]
        pad = self._pad_id(model)
        length = max(len(row) for row in ids)
        # Left padding: every row's next token is then at the same position, the last.
        input_ids = torch.full((len(ids), length), pad, dtype=torch.long)
        attention_mask = torch.zeros((len(ids), length), dtype=torch.long)
        for i, row in enumerate(ids):
            input_ids[i, length - len(row) :] = torch.tensor(row)
            attention_mask[i, length - len(row) :] = 1
        options: dict[str, Any] = {"pad_token_id": pad}
        if model.generation_config.eos_token_id is None and self._tokenizer is not None:
            options["eos_token_id"] = self._tokenizer.eos_token_id
        rng = GlobalRngState.capture()
        modes = {module: module.training for module in model.modules()}
        model.eval()
        try:
            with torch.no_grad(), trainer.strategy.precision_plugin.forward_context():
                output = model.generate(
                    input_ids=input_ids.to(device),
                    attention_mask=attention_mask.to(device),
                    max_new_tokens=self.max_new_tokens,
                    do_sample=False,
                    num_beams=1,
                    use_cache=self.use_cache,
                    **options,
                )
        finally:
            for module, training in modes.items():
                module.training = training
            rng.restore()
        return output[:, length:].cpu()

    def _encode(self, prompt: str | tuple[int, ...]) -> list[int]:
        if not isinstance(prompt, str):
            return list(prompt)
        assert self._tokenizer is not None  # refused at setup otherwise
        if self._leading_ids is None:
            return list(self._tokenizer(prompt)["input_ids"])
        # As the training rows: the format's leading ids (Alpaca's BOS), then the text without the tokenizer's own
        # special tokens (a rendered chat template writes its own BOS as text).
        return self._leading_ids + list(self._tokenizer(prompt, add_special_tokens=False)["input_ids"])

    def _decode(self, tokens: Tensor) -> str | None:
        return None if self._tokenizer is None else self._tokenizer.decode(tokens, skip_special_tokens=True)

    def _pad_id(self, model: PreTrainedModel) -> int:
        """The id left padding uses: the tokenizer's, else the model's; any id will do under a zero attention mask."""
        for pad in (
            getattr(self._tokenizer, "pad_token_id", None),
            model.generation_config.pad_token_id,
            model.config.pad_token_id,
        ):
            if isinstance(pad, int):
                return pad
        return 0

    def _model(self, pl_module: pl.LightningModule) -> PreTrainedModel:
        """The module's one Hugging Face model, checked to generate and to embed every prompt's ids."""
        models = pretrained_models(pl_module)
        if len(models) != 1:
            found = ", ".join(f"`{name}` ({type(m).__name__})" for name, m in models) or "none"
            raise MisconfigurationException(
                f"`SampleGenerations` generates with the one Hugging Face model of `{type(pl_module).__name__}`, but"
                f" found {len(models)}: {found}. Keep one `PreTrainedModel` in the module, or drop the callback."
            )
        name, model = models[0]
        if not model.can_generate():
            raise MisconfigurationException(
                f"`SampleGenerations` needs a model that can `generate`, but `{name}` ({type(model).__name__}) cannot."
                " Use a causal LM (`AutoModelForCausalLM`), or drop the callback."
            )
        vocab = model.get_input_embeddings().num_embeddings
        too_large = [i for prompt in self.prompts if not isinstance(prompt, str) for i in prompt if i >= vocab]
        if too_large:
            raise MisconfigurationException(
                f"`SampleGenerations` was given token ids the model cannot embed: {sorted(set(too_large))[:5]} (its"
                f" vocabulary has {vocab} ids). Give ids from 0 to {vocab - 1}."
            )
        return model


def _checked_prompts(prompts: Sequence[str] | Sequence[Sequence[int]]) -> list[str | tuple[int, ...]]:
    """The prompts as strings or tuples of ids, all of one kind."""
    if isinstance(prompts, str) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise MisconfigurationException(
            f"`SampleGenerations(prompts={prompts!r})` must be a non-empty list of text prompts or of token id lists,"
            ' e.g. `["### Instruction:\\nName a color.\\n\\n### Response:\\n"]` or `[[1, 2, 3]]`.'
        )
    if all(isinstance(p, str) and p for p in prompts):
        return list(prompts)
    if all(
        isinstance(p, Sequence)
        and not isinstance(p, str)
        and len(p) > 0
        and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in p)
        for p in prompts
    ):
        return [tuple(p) for p in prompts]
    raise MisconfigurationException(
        f"`SampleGenerations(prompts={prompts!r})` must be all non-empty text prompts or all non-empty lists of"
        " token ids (integers of at least 0), not a mix."
    )


def _shown(value: str | tuple[int, ...] | None, tokens: Tensor | None = None) -> str | list[int]:
    """A prompt or generation as printed: the text, else its token ids as a list."""
    if isinstance(value, str):
        return value
    return list(value) if value is not None else tokens.tolist()


def _find_tokenizer(pl_module: pl.LightningModule, datamodule: Any) -> PreTrainedTokenizerBase | None:
    """The module's ``tokenizer``, else the data module's; ``None`` when neither holds a Hugging Face tokenizer."""
    for owner in (pl_module, datamodule):
        tokenizer = getattr(owner, "tokenizer", None)
        if isinstance(tokenizer, PreTrainedTokenizerBase):
            return tokenizer
    return None


__all__ = ["MAX_NEW_TOKENS_LIMIT", "Sample", "SampleGenerations"]
