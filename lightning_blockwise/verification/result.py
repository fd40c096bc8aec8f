"""What a parity check compared and found: the result, its report and the metrics ``ParityCheck`` logs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from lightning_blockwise.planning import format_gb

#: How to make a CUDA stack deterministic, the fix both the check's warning and a report give.
DETERMINISM_FIX = (
    "Train with `Trainer(deterministic=True)` and set the environment variable `CUBLAS_WORKSPACE_CONFIG=:4096:8`"
)


class ParityError(RuntimeError):
    """The blockwise step differs from the resident one (raised by ``ParityCheck``)."""


@dataclass(frozen=True)
class TensorMismatch:
    """One tensor that differs between the arms.

    Attributes:
        name: ``"loss"`` or the adapter parameter's name (its gradient).
        max_abs_diff: Largest elementwise absolute difference (``inf`` when only one arm has a gradient).
        num_different: Elements that are not equal.
        numel: Elements in the tensor.
    """

    name: str
    max_abs_diff: float
    num_different: int
    numel: int


@dataclass
class ParityResult:
    """What a parity check compared and found.

    Attributes:
        passed: Whether the loss and every adapter gradient were ``torch.equal`` (``None``: nothing was checked).
        checked_blocks: Leading blocks that ran resident in the reference arm.
        checked_layers: Their decoder layers.
        num_blocks: Blocks in the plan.
        num_layers: Decoder layers in the model.
        num_tensors: Tensors compared (the loss and each adapter gradient).
        mismatches: The tensors that differ.
        nondeterministic: Whether the resident arm, run twice, disagreed with itself (checked on a mismatch).
        reference_bytes: Estimated device bytes the resident prefix needed beyond the run's plan.
        reference_limit: The bytes it was allowed (``None``: no limit).
        peak_vram_bytes: Peak allocated device memory during the check (``None`` off CUDA).
    """

    passed: bool | None
    checked_blocks: int
    checked_layers: int
    num_blocks: int
    num_layers: int
    num_tensors: int = 0
    mismatches: list[TensorMismatch] = field(default_factory=list)
    nondeterministic: bool = False
    reference_bytes: int = 0
    reference_limit: int | None = None
    peak_vram_bytes: int | None = None

    @property
    def full(self) -> bool:
        """Whether the whole decoder stack ran resident in the reference arm."""
        return self.checked_layers == self.num_layers

    def scope(self) -> str:
        """One sentence saying exactly what was compared."""
        if self.checked_layers == 0:
            return (
                f"Nothing was checked: not even the first block fits the reference's memory limit"
                f" ({self._limit_gb()} available, {format_gb(self.reference_bytes, digits=3)} needed)."
            )
        if self.full:
            return (
                f"Compared resident training of all {self.num_layers} decoder layers with blockwise training"
                f" ({self.num_tensors} tensors: the loss and every adapter gradient)."
            )
        return (
            f"Compared decoder layers 0..{self.checked_layers - 1} ({self.checked_blocks} of {self.num_blocks}"
            f" blocks) resident against blockwise; layers {self.checked_layers}..{self.num_layers - 1} ran blockwise"
            f" in both arms because the full reference does not fit ({self._limit_gb()} available)."
            f" {self.num_tensors} tensors compared: the loss and every adapter gradient."
        )

    def _limit_gb(self) -> str:
        """The reference's memory limit as the report prints it."""
        return "unlimited GB" if self.reference_limit is None else format_gb(self.reference_limit, digits=3)

    def report(self) -> str:
        """The scope, the verdict and one line per differing tensor."""
        lines = [f"ParityCheck: {self.scope()}"]
        if self.passed:
            lines.append("Every tensor is bit-identical.")
        elif self.passed is False:
            lines.append(f"{len(self.mismatches)} of {self.num_tensors} tensors differ:")
            lines += [
                f"  {m.name}: max |diff| {m.max_abs_diff:.3e}, {m.num_different} of {m.numel} elements differ"
                for m in self.mismatches
            ]
            if self.nondeterministic:
                lines.append(
                    "The resident step, run twice from the same state, disagrees with itself: the hardware/software"
                    " stack is nondeterministic, so blockwise == resident is undefined here (not a replay bug)."
                    f" {DETERMINISM_FIX}."
                )
            else:
                lines.append(
                    "The resident step reproduces itself, so the blockwise replay is broken. Please report this"
                    " with the model type, the strategy's options and this report."
                )
        if self.peak_vram_bytes is not None:
            lines.append(f"Peak allocated VRAM during the check: {format_gb(self.peak_vram_bytes, digits=3)}.")
        return "\n".join(lines)

    def metrics(self) -> dict[str, float]:
        """The metrics ``ParityCheck`` logs (its docstring lists them)."""
        metrics = {
            "parity/passed": float(bool(self.passed)),
            "parity/checked_layers": float(self.checked_layers),
            "parity/num_layers": float(self.num_layers),
            "parity/mismatches": float(len(self.mismatches)),
            "parity/nondeterministic": float(self.nondeterministic),
        }
        if self.peak_vram_bytes is not None:
            metrics["parity/peak_vram_bytes"] = float(self.peak_vram_bytes)
        return metrics

    @classmethod
    def from_dict(cls, state: Mapping[str, Any]) -> ParityResult:
        """The inverse of :func:`dataclasses.asdict`."""
        state = dict(state)
        state["mismatches"] = [TensorMismatch(**m) for m in state.get("mismatches", [])]
        return cls(**state)
