"""Pure planning: which layers form which block.

Rematerialization works one layer at a time (each layer keeps its own call arguments),
while weights move one block of ``block_size`` consecutive layers at a time.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from lightning.pytorch.utilities.exceptions import MisconfigurationException


@dataclass(frozen=True)
class BlockPlan:
    """Consecutive decoder layers grouped into blocks of ``block_size`` (the last may be shorter).

    Args:
        num_layers: Decoder layers in the model.
        block_size: Layers per block.

    Raises:
        MisconfigurationException: If ``block_size`` is below 1 or above ``num_layers``.
    """

    num_layers: int
    block_size: int

    def __post_init__(self) -> None:
        if not 1 <= self.block_size <= self.num_layers:
            raise MisconfigurationException(
                f"`BlockwiseStrategy(block_size={self.block_size})` must be between 1 and the model's"
                f" {self.num_layers} decoder layers. Pick a block size in that range."
            )

    @property
    def num_blocks(self) -> int:
        """Number of blocks."""
        return -(-self.num_layers // self.block_size)

    def block_of(self, layer: int) -> int:
        """The block that holds decoder layer ``layer``."""
        return layer // self.block_size

    def layers_of(self, block: int) -> range:
        """The decoder layers of block ``block``."""
        start = block * self.block_size
        return range(start, min(start + self.block_size, self.num_layers))


#: Bytes per token per vocabulary entry in the loss: bf16 logits, their fp32 upcast and its gradient.
_LOGIT_BYTES_PER_ENTRY = 2 + 4 + 4


@dataclass(frozen=True)
class StepShape:
    """What a training step's activation memory depends on.

    Args:
        tokens: Tokens per micro-batch (batch size x sequence length), at most.
        hidden_size: The model's hidden size.
        intermediate_size: The MLP's inner size.
        vocab_size: The vocabulary size.
        num_layers: Decoder layers.
        activation_bytes: Bytes per activation element (2 under bf16 autocast).
    """

    tokens: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_layers: int
    activation_bytes: int = 2

    @classmethod
    def for_config(cls, config: Any, tokens: int, num_layers: int, activation_bytes: int = 2) -> StepShape:
        """The step shape of a Hugging Face model config (its ``text_config`` for a multimodal one).

        Args:
            config: The model's ``PretrainedConfig``.
            tokens: Tokens per micro-batch.
            num_layers: Decoder layers.
            activation_bytes: Bytes per activation element (the LM head's element size).
        """
        config = getattr(config, "text_config", None) or config
        return cls(
            tokens=tokens,
            hidden_size=config.hidden_size,
            intermediate_size=getattr(config, "intermediate_size", 4 * config.hidden_size),
            vocab_size=config.vocab_size,
            num_layers=num_layers,
            activation_bytes=activation_bytes,
        )

    def activation_peak(self) -> int:
        """Predicted activation bytes at the step's peak.

        Saved layer inputs (one tensor per layer between forward and backward), the loss's
        logits and their gradient, and one layer's recompute graph with the dequantized
        weight of its largest projection (the working set while a layer's backward runs).
        """
        saved_inputs = self.num_layers * self.tokens * self.hidden_size * self.activation_bytes
        logits = self.tokens * self.vocab_size * _LOGIT_BYTES_PER_ENTRY
        dequantized = 2 * self.hidden_size * self.intermediate_size * self.activation_bytes
        return saved_inputs + logits + self.layer_graph() + dequantized

    def layer_graph(self) -> int:
        """Predicted bytes of one decoder layer's autograd graph (what a resident layer keeps until its backward)."""
        return self.tokens * (6 * self.hidden_size + 4 * self.intermediate_size) * self.activation_bytes


@dataclass(frozen=True)
class ResidencyPlan:
    """Which blocks stay on the device for the whole run, and the memory that is predicted to take.

    Attributes:
        resident: Blocks copied to the device once and kept there.
        num_slots: Device slots for the streamed blocks.
        slot_bytes: Bytes of one slot (the largest streamed block).
        predicted_peak: Predicted peak allocated device memory of a training step, in bytes.
        minimum: The smallest budget that streams every block.
    """

    resident: tuple[int, ...]
    num_slots: int
    slot_bytes: int
    predicted_peak: int
    minimum: int


def plan_residency(
    block_bytes: list[int], prefetch_depth: int, fixed_bytes: int, trainable_bytes: int, activation_bytes: int,
    budget: int | None,
) -> ResidencyPlan:  # fmt: skip
    """Keep as many blocks resident as ``budget`` allows; stream the rest (all of them without a budget).

    The prediction adds what is on the device for the whole run (``fixed_bytes``: head,
    norms, adapters), the adapters' gradients and AdamW state (3 x ``trainable_bytes``), the
    activations, the slots and the resident blocks. Blocks are kept resident from the first
    one on: every block but those around the forward/backward turn is loaded twice per step,
    so any resident block saves the same traffic.

    Args:
        block_bytes: Each block's slab size.
        prefetch_depth: Blocks copied ahead of the one in use.
        fixed_bytes: Device bytes that do not depend on the plan.
        trainable_bytes: Bytes of the trainable parameters.
        activation_bytes: Predicted activation peak (:meth:`StepShape.activation_peak`).
        budget: The cap on the predicted peak, in bytes, or ``None`` to stream every block.

    Raises:
        MisconfigurationException: If ``budget`` is below the minimum (every block streamed).
    """
    base = fixed_bytes + 3 * trainable_bytes + activation_bytes

    def peak(resident: int) -> tuple[int, int, int]:
        streamed = block_bytes[resident:]
        slots = min(prefetch_depth + 1, len(streamed))
        slot_bytes = max(streamed, default=0)
        return base + slots * slot_bytes + sum(block_bytes[:resident]), slots, slot_bytes

    minimum, slots, slot_bytes = peak(0)
    if budget is None:
        return ResidencyPlan((), slots, slot_bytes, minimum, minimum)
    if budget < minimum:
        raise MisconfigurationException(
            f"`BlockwiseStrategy(vram_budget={budget / 2**30:.2f} GiB)` is below the {minimum / 2**30:.2f} GiB this run"
            f" needs with every block streamed ({len(block_bytes)} blocks, {slots} slots of {slot_bytes / 2**20:.0f}"
            f" MiB). Raise the budget to at least {minimum / 2**30:.2f} GiB, or lower `prefetch_depth`, `block_size`"
            " or the tokens per micro-batch."
        )
    resident = 0
    while resident < len(block_bytes) and peak(resident + 1)[0] <= budget:
        resident += 1
    predicted, slots, slot_bytes = peak(resident)
    return ResidencyPlan(tuple(range(resident)), slots, slot_bytes, predicted, minimum)


def parse_bytes(value: int | str) -> int:
    """Bytes from a positive int or a string like ``"16GiB"``, ``"24GB"``, ``"512MiB"``.

    Raises:
        MisconfigurationException: If ``value`` is not an int or a string (a bool or a float is
            refused: a size is a count of bytes), the string is not a finite number with a known
            unit, or the size is not positive.
    """
    hint = "Give an integer number of bytes or a number with a unit, e.g. '16GiB' or '24GB'."
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise MisconfigurationException(f"Cannot read {value!r} ({type(value).__name__}) as a memory size. {hint}")
    if isinstance(value, int):
        nbytes = value
    else:
        units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
        units |= {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
        text = value.strip().upper().replace(" ", "")
        number = text.rstrip("KMGTIB")
        unit = text[len(number) :]
        try:
            amount = float(number) * units[unit]
        except (KeyError, ValueError):
            raise MisconfigurationException(f"Cannot read {value!r} as a memory size. {hint}") from None
        if not math.isfinite(amount):
            raise MisconfigurationException(f"Cannot read {value!r} as a memory size: it is not finite. {hint}")
        nbytes = int(amount)
    if nbytes <= 0:
        raise MisconfigurationException(f"The memory size {value!r} must be positive. {hint}")
    return nbytes
