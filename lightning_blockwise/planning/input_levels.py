"""Where a step's saved layer inputs go: how many on the card, how many in host memory, and one kept in how many.

Pure sizing for the planner and the ``plan`` command: the strategy options it answers are
``offload_activations`` (an integer: NOTE [ Split layer inputs ] in residency/activations.py) and
``input_checkpoint_every`` (NOTE [ Input checkpoints ] in replay/segments.py).
"""

from __future__ import annotations

from typing import NamedTuple

#: Offloaded inputs on the card at a time besides the kept ones: the one in use, the next one coming back and
#: one being copied out (NOTE [ Layer-input offload ] in residency/activations.py).
INPUTS_IN_FLIGHT = 3


class InputLevels(NamedTuple):
    """Where the saved layer inputs of a step wait for the backward.

    Attributes:
        device_count: Inputs kept on the card.
        host_count: Inputs in host memory (the lowest layers' ones).
        k: One layer input kept in ``k``, the others replayed in the backward; ``None``: every input kept.
    """

    device_count: int
    host_count: int
    k: int | None

    def offload_activations(self) -> bool | int:
        """The strategy's ``offload_activations`` for these levels: how many layers, the first ones, offload."""
        if self.host_count == 0:
            return False
        if self.device_count == 0:
            return True
        return self.host_count * (self.k or 1)


def card_inputs(layers: int, host_count: int, k: int | None) -> int:
    """Layer inputs on the card at a step's peak: those kept there, a segment's replayed ones, those in flight.

    One count for :func:`input_levels` and the strategy's memory model (``StepShape.activation_peak``).

    Args:
        layers: Decoder layers.
        host_count: Kept inputs in host memory.
        k: One layer input kept in ``k``; ``None``: every input kept.
    """
    kept = layers if k is None else -(-layers // k)
    in_flight = min(host_count, INPUTS_IN_FLIGHT)
    if k is None:
        replayed = 0
    elif host_count < kept:
        # A segment's backward holds the k inputs its replay made (NOTE [ Input checkpoints ] in
        # replay/segments.py): with its checkpoint on the card one of them is a kept one, so this is one over.
        replayed = k
    else:
        # Every checkpoint in host memory: a segment's top layer's backward holds the segment's k inputs (the
        # checkpoint back from the host, the k - 1 replayed ones, the top one in use) and the next segment's
        # checkpoint coming back, k + 1 in all, of which those in flight are counted already (the one in use, the
        # next coming back, and one copied out, which in the backward none is). Measured on the H100: 72B at 64k
        # and 96k tokens with k=2 peaked under the plan without checkpoints (results/h100_long_context_72b_*.jsonl).
        replayed = max(0, k + 1 - in_flight)
    return kept - host_count + replayed + in_flight


def input_levels(
    layers: int, tokens: int, hidden: int, device_bytes: int, host_bytes: int, element_bytes: int = 2
) -> InputLevels:
    """The cheapest way to hold a step's saved layer inputs in ``device_bytes`` of card and ``host_bytes`` of host.

    Cheapest first: every input on the card; then the fewest inputs in host memory (copies cost link time
    and pinned memory); then input checkpoints with the smallest ``k`` (each replayed layer costs a forward
    and a third pass of weight copies), again with the fewest in host memory. With checkpoints the card also
    holds a segment's ``k`` replayed inputs during its backward, and with any in host memory
    :data:`INPUTS_IN_FLIGHT` more.

    Args:
        layers: Decoder layers.
        tokens: Tokens per micro-batch.
        hidden: Hidden size.
        device_bytes: Card bytes free for saved inputs.
        host_bytes: Host bytes free for saved inputs.
        element_bytes: Bytes per element of an input (2 under bf16).

    Returns:
        The levels, e.g. ``InputLevels(device_count=8, host_count=0, k=None)``.

    Raises:
        ValueError: If no split and no ``k`` fits, saying the least card memory that would.
    """
    for name, value in (("layers", layers), ("tokens", tokens), ("hidden", hidden), ("element_bytes", element_bytes)):
        if value < 1:
            raise ValueError(f"{name}={value} must be at least 1.")
    one = tokens * hidden * element_bytes
    device, host = device_bytes // one, host_bytes // one
    least = None
    for k in [None, *range(2, layers + 1)]:
        kept = layers if k is None else -(-layers // k)
        for host_count in range(min(kept, host) + 1):
            card = card_inputs(layers, host_count, k)
            if card <= device:
                return InputLevels(kept - host_count, host_count, k)
            least = card if least is None else min(least, card)
    raise ValueError(
        f"the saved inputs of {layers} layers at {tokens} tokens ({one / 2**20:.1f} MiB each) do not fit"
        f" {device_bytes / 2**30:.2f} GiB of card and {host_bytes / 2**30:.2f} GiB of host memory in any split or"
        f" checkpoint spacing: the least card memory with this host memory is {least * one / 2**30:.2f} GiB."
    )


def fewest_on_card(layers: int, host_count: int) -> InputLevels:
    """The levels with the fewest inputs on the card at a step's peak, at most ``host_count`` in host memory.

    What a step that no card budget holds falls back to where host memory cannot take every input (NOTE [ Where
    layer inputs wait ] in planning/input_choice.py); of equal counts the cheaper one (no ``k``, then the smallest,
    and the fewest in host memory).

    Args:
        layers: Decoder layers.
        host_count: Inputs the host memory free for them holds.
    """
    choices = []
    for k in [None, *range(2, layers + 1)]:
        kept = layers if k is None else -(-layers // k)
        for host in range(min(kept, max(0, host_count)) + 1):
            choices.append((card_inputs(layers, host, k), InputLevels(kept - host, host, k)))
    # `min` keeps the first of equal counts: the cheapest.
    return min(choices, key=lambda choice: choice[0])[1]


__all__ = ["INPUTS_IN_FLIGHT", "InputLevels", "card_inputs", "fewest_on_card", "input_levels"]
