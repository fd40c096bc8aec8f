"""A run's step plan over its life: made at setup, made again before a longer batch, applied to the streamed stack."""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Literal

import torch
import torch.distributed
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_debug, rank_zero_info

from lightning_blockwise.compat.quiet_logs import VERBOSE_ENV, is_verbose
from lightning_blockwise.planning.step_budget import StepBudget, host_room
from lightning_blockwise.planning.step_plan import StepPlan
from lightning_blockwise.strategy.step_tokens import batch_tokens, masked_row
from lightning_blockwise.strategy.streamed_stack import StreamedStack


@contextmanager
def budget_errors(owner: str) -> Iterator[None]:
    """The planner's and the allocator cap's ``ValueError`` as the user's mistake, prefixed with ``owner``."""
    try:
        yield
    except ValueError as error:
        raise MisconfigurationException(f"{owner}: {error}") from None


def agreed(value: int, op: Literal["min", "max"], device: torch.device, group: Any = None) -> int:
    """``value`` reduced over the run's processes with ``op`` (one all-reduce); itself with one process.

    Every process must call it at the same point (NOTE [ Where layer inputs wait ] in planning/input_choice.py).
    With ``group`` (a gloo group: :func:`~.data_parallel.host_group`) the value is a CPU tensor, so an NCCL run does
    not wait for its GPU queue here before every step; without one it goes through the default group on ``device``.
    """
    return agreed_all([value], op, device, group)[0]


def agreed_all(values: list[int], op: Literal["min", "max"], device: torch.device, group: Any = None) -> list[int]:
    """Each of ``values`` reduced over the run's processes with ``op``, in one all-reduce (as :func:`agreed`)."""
    if not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return values
    if torch.distributed.get_world_size() == 1:
        return values
    on_cpu = group is not None or torch.distributed.get_backend() == "gloo"
    tensor = torch.tensor(values, dtype=torch.int64, device="cpu" if on_cpu else device)
    reduce = torch.distributed.ReduceOp.MIN if op == "min" else torch.distributed.ReduceOp.MAX
    torch.distributed.all_reduce(tensor, op=reduce, group=group)
    return [int(v) for v in tensor.tolist()]


class StepPlanner:
    """Holds the run's :class:`~lightning_blockwise.planning.step_plan.StepPlan`; keeps the streamed stack in step.

    The first plan is made for a declared token count (:meth:`first_plan`, before the stack exists:
    its resident blocks decide which blocks the stack keeps on the device); :meth:`attach` then applies
    it, and :meth:`see_batch` plans again, between steps, for a batch longer than any planned for
    (NOTE [ A budget that sees the batches ] in planning/step_budget.py).

    Args:
        budget: What a step's device memory depends on.
        owner: How errors name the option they are about, e.g. ```BlockwiseStrategy(vram_budget=...)```.
        device: Where the ranks' all-reduces run (the compute device: NCCL reduces CUDA tensors only).
    """

    def __init__(self, budget: StepBudget, owner: str, device: torch.device | None = None, group: Any = None) -> None:
        self.budget = budget
        self.owner = owner
        self.device = torch.device("cpu") if device is None else device
        #: The process group the ranks agree through (a gloo group under NCCL; ``None``: the default group).
        self.group = group
        self.plan: StepPlan | None = None
        self._layers: StreamedStack | None = None
        self._paused = 0
        #: The last training batch moved to the device, and its masked row read on the host (:meth:`note_host_batch`).
        self._noted: tuple[Any, int | None] | None = None
        #: Re-plans logged so far, and the last one where it was not shown (NOTE [ Re-plans in the log ]).
        self._replans = 0
        self._unsaid: str | None = None

    def first_plan(self, tokens: int, source: str = "", per_rank: bool = False) -> StepPlan:
        """The plan for micro-batches of up to ``tokens`` tokens, made the run's.

        Args:
            tokens: Tokens per micro-batch.
            source: Where the count came from and how to plan for another
                (:attr:`~.step_tokens.PlannedTokens.source`), said in a refusal.
            per_rank: The count is this rank's own (its first batch): the ranks plan for the most of theirs.

        Raises:
            MisconfigurationException: If the step does not fit the budget even with every block streamed.
        """
        if per_rank:
            # Every rank plans for the same count (NOTE [ Where layer inputs wait ] in planning/input_choice.py).
            most = agreed(tokens, "max", self.device, self.group)
            source += f" The most of any rank's: {most}." if most != tokens else ""
            tokens = most
        self.plan = self._plan_for(tokens, source)
        return self.plan

    def attach(self, layers: StreamedStack) -> None:
        """Apply the plan's offload to ``layers``, built with the plan's resident blocks, and follow it from now on."""
        assert self.plan is not None
        self._layers = layers
        layers.offload_inputs(self.plan.shape.input_bytes() if self.plan.offload else None)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Steps run inside are not the run's (``ParityCheck``'s arms): not planned for."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def before_step(self, batch: Any) -> str | None:
        """Before a training step: plan again for a longer ``batch``; a line for the log if so.

        Raises:
            MisconfigurationException: If the longer batch does not fit the budget.
        """
        return None if self._paused else self.see_batch(batch)

    def see_batch(self, batch: Any) -> str | None:
        """Plan again before a step whose ``batch`` holds more tokens than planned for; a line for the log if so.

        Raises:
            MisconfigurationException: If the longer batch does not fit the budget.
        """
        tokens = batch_tokens(batch)
        noted, self._noted = self._noted, None
        # Read on the host before the copy where the strategy saw it move (no device sync), else here.
        row = noted[1] if noted is not None and noted[0] is batch else self._longer_masked_row(batch)
        if tokens is not None and self.budget.places_inputs:
            # Every rank re-plans at the same step, for the longest batch and masked row of any (NOTE [ Where layer
            # inputs wait ]), in one all-reduce.
            tokens, longest_row = agreed_all([tokens, row or 0], "max", self.device, self.group)
            row = longest_row or None
        if tokens is None or self.plan is None:
            return None
        masked = row is not None and row > (self.budget.masked_row or 0)
        if not masked and tokens <= self.plan.tokens:
            return None
        if masked:  # NOTE [ Masked attention ] in planning/step_shape.py
            self.budget = replace(self.budget, masked_row=row)
        why = "longer batch" if tokens > self.plan.tokens else f"masked attention over rows of {row} tokens"
        self._adopt(self._plan_for(max(tokens, self.plan.tokens)))
        return f"{why}: {self.describe()}"

    # NOTE [ Re-plans in the log ]
    # Plans grow with the batches (NOTE [ A budget that sees the batches ]), and data padded to each batch's longest
    # row makes a new longest masked row every few steps at first: the demo printed a plan line per re-plan through
    # the progress bar. The first re-plan is shown (the plan the run trains with from its first step), the later ones
    # go to the DEBUG log, and at the end of training the largest (the last: plans only grow) is shown once, with the
    # count. `LIGHTNING_BLOCKWISE_VERBOSE=1` shows each as it happens.
    def announce(self, line: str) -> None:
        """Log the re-plan ``line`` (:meth:`see_batch`'s) as NOTE [ Re-plans in the log ] says."""
        self._replans += 1
        message = f"BlockwiseStrategy: {line}."
        if self._replans == 1 or is_verbose():
            rank_zero_info(message)
            self._unsaid = None
        else:
            rank_zero_debug(message)
            self._unsaid = line

    def announce_largest(self) -> None:
        """At the end of training: the largest plan, where its re-plan went to the DEBUG log only."""
        if self._unsaid is None:
            return
        rank_zero_info(
            f"BlockwiseStrategy: planned again {self._replans} times as longer or masked batches came"
            f" ({VERBOSE_ENV}=1 shows each); the largest plan: {self._unsaid}."
        )
        self._unsaid = None

    def note_host_batch(self, host_batch: Any, moved: Any) -> None:
        """Read a training batch's masked row on the host, for :meth:`see_batch` of its copy ``moved``.

        ``host_batch`` is the batch before its copy to the device (NOTE [ Masked attention ] in
        planning/step_shape.py): a mask's values read on the device would make the host wait for the device before
        every step.
        """
        self._noted = (moved, self._longer_masked_row(host_batch))

    def _longer_masked_row(self, batch: Any) -> int | None:
        """The batch's masked row length where it is longer than any planned for (its values read only then)."""
        ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
        if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[-1] <= (self.budget.masked_row or 0):
            return None
        return masked_row(batch, self.budget.config)

    def describe(self) -> str:
        """One line for the log: tokens, peak, offload, and where the layer inputs wait where the plan chose it."""
        assert self.plan is not None
        return self.budget.describe(self.plan)

    def resident_prefix_bytes(self, num_blocks: int) -> int:
        """Device bytes that running the first ``num_blocks`` blocks resident needs beyond the planned peak.

        See :meth:`~lightning_blockwise.strategy.blockwise.BlockwiseStrategy.resident_prefix_bytes`.
        """
        assert self._layers is not None and self.plan is not None
        return self._layers.prefix_bytes(num_blocks, self.budget.layer_graph(self.plan.tokens))

    def host_room(self) -> int:
        """Host bytes a plan may give the layer inputs now, the same on every rank (NOTE [ Where layer inputs wait ]).

        This rank's share of the host memory free, plus its current slabs (freed before a new plan's are allocated),
        the least of every rank's.
        """
        room = host_room(self.budget.host_ranks)
        if self._layers is not None and self._layers.offload is not None:
            room += self._layers.offload.host_bytes
        return agreed(room, "min", self.device, self.group)

    def _plan_for(self, tokens: int, source: str = "") -> StepPlan:
        """The plan at ``tokens`` tokens.

        A refusal adds ``source`` (where the count came from) and, off CUDA, that
        the budget caps nothing there.
        """
        host_bytes = self.host_room() if self.budget.places_inputs else None
        try:
            plan = self.budget.plan(tokens, host_bytes)
        except ValueError as error:
            more = f" {source}" if source else ""
            if self.device.type != "cuda" and self.budget.budget is not None:
                more += (
                    f" On the {self.device.type.upper()} the budget caps no memory (the frozen base already lives in"
                    " host memory): drop `vram_budget` to train without one."
                )
            raise MisconfigurationException(f"{self.owner}: {error}{more}") from None
        if plan.over_card is not None:
            # Every rank plans for its own card: each says so (not rank 0 alone).
            warnings.warn(f"BlockwiseStrategy: at {tokens} tokens per micro-batch, {plan.over_card}.", stacklevel=2)
        return plan

    def _adopt(self, plan: StepPlan) -> None:
        """Make ``plan`` the run's: where its layer inputs wait, its resident blocks and its offload (between steps)."""
        assert self._layers is not None and self.plan is not None
        self.plan = plan
        # NOTE [ Where layer inputs wait ] in planning/input_choice.py: a re-plan may move them, the old slabs freed
        # first (the plan counted them as room), the streamer rebuilt once for a new k and new resident blocks together.
        shape, residency = plan.shape, plan.residency
        self._layers.set_input_levels(
            shape.offloaded_layers, shape.checkpoint_every, residency.resident, residency.kept, residency.attention
        )
        self._layers.offload_inputs(shape.input_bytes() if plan.offload else None)


__all__ = ["StepPlanner", "budget_errors"]
