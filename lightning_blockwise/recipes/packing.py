"""Sample packing: several examples per row, each attending only to itself, through transformers' packed batches.

Example::

    bins = pack([len(row["input_ids"]) for row in rows], capacity=1024)
    batch = PackCollator(tokenizer.pad_token_id)([[rows[i] for i in b] for b in bins[:8]])
    model(**batch).loss  # input_ids, labels, position_ids, use_cache=False; no attention_mask
"""

from __future__ import annotations

import bisect
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lightning_blockwise.recipes.encoding import IGNORE_INDEX

# NOTE [ Packed rows ]
#
# A packed row holds several examples back to back. transformers 5 trains on it as on the examples apart when the
# batch has `position_ids` that restart at 0 with each example and no attention mask: its mask builders
# (`masking_utils.find_packed_sequence_indices`, called from `create_causal_mask` and
# `create_sliding_window_causal_mask`) cut the row where the positions do not go up by one, and let each token attend
# only within its own example (sliding windows measured from the example's start). The rotary embeddings read the
# same positions, so each example sees the positions it has alone. What else it takes:
#
# - `use_cache=False` in the batch. transformers looks for packing only when no cache is passed, and a model whose
#   config says `use_cache=True` (the default of most) builds an empty `DynamicCache` in every forward, training
#   included: the packed positions are then ignored and every token attends to the whole row, silently.
# - The label at each example's first token is -100: the causal-LM loss shifts labels by one, so that label would
#   be predicted from the previous example's last token. (Alone, an example's first token is never predicted.)
# - Padding (rows of a batch differ in length) is a sequence of its own, positions from 0, labels -100: the
#   examples never attend to it, nor it to them.
# - An attention implementation whose mask follows the packed positions: "sdpa" and "eager" (checked in
#   tests/recipes/test_packing.py). transformers' flash-attention path finds packing only in a batch of one row
#   (`modeling_flash_attention_utils._is_packed_sequence`), and the others are not checked here; they are refused by
#   `check_packed_attention`.
#
# Packed training is not bit-identical to unpacked training: a packed row's matmuls have other shapes, its attention
# runs with an explicit mask instead of a causal kernel, and the loss sums its tokens in another order. Each example
# gets its alone loss within rounding (the tolerance is in tests/recipes/test_packing.py). Blockwise training of
# packed rows is still exactly resident training of them: the mask and positions are call arguments of each decoder
# layer, captured and replayed like any other (NOTE [ Per-layer call replay ] in replay/capture.py).

#: Attention implementations whose masks keep packed examples apart (NOTE [ Packed rows ]).
PACKED_ATTENTION = ("sdpa", "eager")


def pack(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Bins of example indices whose lengths add up to at most ``capacity``: best-fit decreasing, deterministic.

    Examples go longest first (ties in the order given) into the fullest bin they fit, a new one when none does;
    within a bin they keep the order given. Best-fit decreasing needs at most 11/9 of the fewest bins possible,
    plus one, and leaves at most one bin half full or less: few rows, little padding.

    Args:
        lengths: Each example's length in tokens.
        capacity: Most tokens in a bin (the row length).

    Raises:
        ValueError: If an example is longer than ``capacity`` or shorter than 1 token.
    """
    bad = next((i for i, n in enumerate(lengths) if not 1 <= n <= capacity), None)
    if bad is not None:
        raise ValueError(f"example {bad} has {lengths[bad]} tokens; a packed row holds 1 to {capacity}.")
    bins: list[list[int]] = []
    # (space left, bin index), sorted: the first entry with room enough is the fullest bin the example fits.
    space: list[tuple[int, int]] = []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        at = bisect.bisect_left(space, (lengths[index], -1))
        if at == len(space):
            bins.append([])
            left, target = capacity, len(bins) - 1
        else:
            left, target = space.pop(at)
        bins[target].append(index)
        bisect.insort(space, (left - lengths[index], target))
    return [sorted(b) for b in bins]


class PackCollator:
    """Builds a batch of packed rows: ids, labels and restarting ``position_ids``, no attention mask.

    Each row is the concatenation of its examples, the first label of each -100, and is
    right-padded to the longest row of the batch with ``pad_id`` (labels -100, positions a
    sequence of their own). The batch carries ``use_cache=False``, which transformers needs to
    see the packing (NOTE [ Packed rows ]), so pass it to the model whole: ``model(**batch)``.

    Args:
        pad_id: The tokenizer's padding id.
    """

    def __init__(self, pad_id: int) -> None:
        self.pad_id = pad_id

    def __call__(self, rows: list[list[dict[str, list[int]]]]) -> dict[str, Any]:
        """Stack ``rows`` (each a list of examples) into a packed batch."""
        length = max(sum(len(example["input_ids"]) for example in row) for row in rows)
        ids = torch.full((len(rows), length), self.pad_id, dtype=torch.long)
        labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
        positions = torch.empty((len(rows), length), dtype=torch.long)
        for i, row in enumerate(rows):
            start = 0
            for example in row:
                n = len(example["input_ids"])
                ids[i, start : start + n] = torch.tensor(example["input_ids"])
                labels[i, start : start + n] = torch.tensor(example["labels"])
                # Not predicted from the previous example's last token (NOTE [ Packed rows ]).
                labels[i, start] = IGNORE_INDEX
                positions[i, start : start + n] = torch.arange(n)
                start += n
            positions[i, start:] = torch.arange(length - start)
        return {"input_ids": ids, "labels": labels, "position_ids": positions, "use_cache": False}


def is_packed(batch: Any) -> bool:
    """Whether ``batch`` is a packed batch (a mapping with ``position_ids`` and no attention mask)."""
    return isinstance(batch, Mapping) and "position_ids" in batch and batch.get("attention_mask") is None


def check_packed_attention(model: torch.nn.Module) -> None:
    """Refuse a model whose attention would let packed examples see each other.

    Args:
        model: A Hugging Face model (PEFT-wrapped or not).

    Raises:
        ValueError: If its ``config._attn_implementation`` is not one of :data:`PACKED_ATTENTION`.
    """
    config = model.config
    implementation = getattr(config.get_text_config(), "_attn_implementation", None) or config._attn_implementation
    if implementation not in PACKED_ATTENTION:
        raise ValueError(
            f"packed batches need an attention implementation whose mask follows the packed positions"
            f" ({', '.join(PACKED_ATTENTION)}); this model uses {implementation!r}, with which the examples of a row"
            " could attend to each other (NOTE [ Packed rows ] in recipes/packing.py)."
        )


__all__ = ["PACKED_ATTENTION", "PackCollator", "check_packed_attention", "is_packed", "pack"]
