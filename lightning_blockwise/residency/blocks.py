"""The run-time block index: which decoder layers form which block.

Rematerialization works one layer at a time (each layer keeps its own call arguments),
while weights move one block of ``block_size`` consecutive layers at a time.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class BlockPlan:
    """Consecutive decoder layers grouped into blocks of ``block_size`` (the last may be shorter).

    Args:
        num_layers: Decoder layers in the model.
        block_size: Layers per block.

    Raises:
        ValueError: If ``block_size`` is below 1 or above ``num_layers``.
    """

    num_layers: int
    block_size: int

    def __post_init__(self) -> None:
        if not 1 <= self.block_size <= self.num_layers:
            raise ValueError(
                f"block_size={self.block_size} must be between 1 and the model's {self.num_layers} decoder layers."
                " Pick a block size in that range."
            )

    @property
    def num_blocks(self) -> int:
        """Number of blocks."""
        return -(-self.num_layers // self.block_size)

    @property
    def layers_per_block(self) -> list[int]:
        """How many decoder layers each block holds (the last may hold fewer)."""
        return [len(self.layers_of(block)) for block in range(self.num_blocks)]

    def block_of(self, layer: int) -> int:
        """The block that holds decoder layer ``layer``."""
        return layer // self.block_size

    def layers_of(self, block: int) -> range:
        """The decoder layers of block ``block``."""
        start = block * self.block_size
        return range(start, min(start + self.block_size, self.num_layers))


__all__ = ["BlockPlan"]
