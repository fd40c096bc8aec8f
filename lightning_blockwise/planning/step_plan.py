"""A training step's plan: where blocks and layer inputs go, and the peak it predicts."""

from __future__ import annotations

from dataclasses import dataclass

from lightning_blockwise.planning.input_levels import InputLevels
from lightning_blockwise.planning.memory import ResidencyPlan
from lightning_blockwise.planning.step_shape import StepShape
from lightning_blockwise.planning.units import format_gib


@dataclass(frozen=True)
class InputChoice:
    """Where a plan's layer inputs wait, as the planner chose it (NOTE [ Where layer inputs wait ]).

    Attributes:
        levels: Inputs on the card, in host memory, and one kept in ``k``.
        card_holds: The most inputs the budget holds on the card beside the rest of the step (those in flight and
            a segment's replayed ones counted).
        host_holds: The inputs the host memory free for them holds.
    """

    levels: InputLevels
    card_holds: int
    host_holds: int
    #: More inputs wait in host memory than the card needs, so that it keeps attention outputs and graphs instead.
    for_kept: bool = False

    def describe(self, num_layers: int, host_bytes: int) -> str:
        """What was chosen and why, for the log (``host_bytes``: what the inputs in host memory take)."""
        device, host, every = self.levels
        if every is None and not host:
            return f"layer inputs: all {num_layers} on the card (the budget holds them)"
        where = f"{device} on the card" + (f", {host} in host memory ({format_gib(host_bytes)} pinned)" if host else "")
        if every is not None:
            where = (
                f"one in {every} kept ({where}), the others replayed in the backward: no split of all {num_layers} fits"
            )
        holds = f"the budget holds {self.card_holds} at a time on the card, the host {self.host_holds}"
        if self.for_kept:
            holds += "; in host memory so that the card keeps attention outputs and graphs, which skip compute"
        return f"layer inputs: {where}; {holds}"


@dataclass(frozen=True)
class StepPlan:
    """The plan of a training step for micro-batches of up to ``tokens`` tokens.

    Attributes:
        tokens: Tokens per micro-batch planned for.
        residency: Which blocks stay resident, and the predicted peak.
        offload: Whether layer inputs wait for the backward in host memory.
        shape: The step shape the prediction was made from.
    """

    tokens: int
    residency: ResidencyPlan
    offload: bool
    shape: StepShape
    #: Why the card's budget gave way to streaming every block (NOTE [ The card as the default budget ]), else None.
    over_card: str | None = None
    #: Where the layer inputs wait, where the planner chose it (NOTE [ Where layer inputs wait ]), else None.
    inputs: InputChoice | None = None

    @property
    def offload_host_bytes(self) -> int:
        """Host bytes the offloaded layer inputs take (0 with offload off)."""
        return self.shape.offloaded_host_bytes()


__all__ = ["InputChoice", "StepPlan"]
