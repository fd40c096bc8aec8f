"""The caching allocator under a ``vram_budget``: expandable segments on, and the budget as its cap."""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lightning_blockwise.planning.memory import BLAS_THREADS, HOPPER_BLAS_WORKSPACE
from lightning_blockwise.planning.units import format_gib

# NOTE [ Expandable segments ]
# The headroom a budget leaves over the predicted peak (NOTE [ A budget is a cap on the card ]
# in planning/memory.py) was measured with the allocator's expandable segments on; without them
# the allocator keeps whole segments that a cap cannot hand out again, and 1.10x ran out of memory.
# So the strategy turns them on for a CUDA run, unless PYTORCH_CUDA_ALLOC_CONF names
# `expandable_segments` (the user's choice stands; a budget with them off is refused, since it
# could not keep its promise). Torch reads PYTORCH_CUDA_ALLOC_CONF once, when it is imported, so
# setting the variable later changes nothing: the setting goes through
# `torch.cuda.memory._set_allocator_settings` (torch 2.11; torch 2.13 deprecates it for
# `torch._C._accelerator_setAllocatorSettings`, used where it exists), the only way after import:
# there is no public one. It applies to the segments mapped from then on, and stays on for the
# rest of the process: turned off again at teardown, a second `fit` in the same process ran out of
# memory under its cap with 2.6 GiB reserved and free (H100, 7B, 16k tokens, an 8.5 GiB budget;
# the same run passed in a fresh process). Whether they are on is known from the variable alone
# (off unless it names them), so no getter is needed (torch 2.11 has none).

_CONF_VARIABLE = "PYTORCH_CUDA_ALLOC_CONF"

# NOTE [ Segments the base left behind ]
# A module built or loaded on the device (a 4-bit model from `from_pretrained(device_map="cuda")`, or built layer
# by layer with bf16 temporaries) leaves its small long-lived tensors, the adapters and the head, scattered through
# the segments its frozen weights and temporaries were mapped in. When the frozen layers leave for the host arena,
# `empty_cache` returns only the segments left wholly free: the rest stay reserved, mostly free, mapped before
# expandable segments were on. Measured (H100, Qwen2.5-32B shape built NF4 on the card, 512 tokens): 9.64 GB
# reserved in 32 segments holding 2.98 GB, so a 7 GB budget's cap was below what the allocator held before the
# first step, and a 270 MiB dequantization ran out of memory with 2.96 GiB allocated. So, once expandable segments
# are on, where more than `STRANDED_RELOCATE_BYTES` is reserved and free the module's device tensors move to the
# host and back (the same `nn.Parameter` objects; seconds at most, once per setup), and the segments are returned.
# What stays stranded (tensors held outside the module) is counted like the memory the process holds outside the
# run: on top of the budget's cap, which bounds what the allocator reserves, so the budget is still the run's.

#: Reserved-but-free bytes after `empty_cache` from which the module's device tensors are moved out and back
#: (NOTE [ Segments the base left behind ]); below it the cap counts them and no copy is made.
STRANDED_RELOCATE_BYTES = 256 * 2**20


@dataclass
class DeviceMemoryCap:
    """What :func:`apply_cap` changed on a CUDA device; :meth:`restore` puts back the cap.

    Attributes:
        device: The CUDA device.
        fraction: The per-process memory fraction found (``None``: left unchanged).
        segments_turned_on: Whether expandable segments were turned on (they stay on).
    """

    device: torch.device
    fraction: float | None
    segments_turned_on: bool

    def restore(self) -> None:
        """Put back the per-process fraction found; expandable segments stay on (NOTE [ Expandable segments ])."""
        if self.fraction is not None:
            torch.cuda.set_per_process_memory_fraction(self.fraction, self.device)


def expandable_segments_choice() -> bool | None:
    """The user's ``expandable_segments``, or ``None`` when neither allocator variable names it.

    torch reads ``PYTORCH_ALLOC_CONF`` first and ``PYTORCH_CUDA_ALLOC_CONF`` when that is unset.
    """
    conf = os.environ.get("PYTORCH_ALLOC_CONF")
    for entry in (os.environ.get(_CONF_VARIABLE, "") if conf is None else conf).split(","):
        key, _, value = entry.partition(":")
        if key.strip() == "expandable_segments":
            return value.strip().lower() == "true"
    return None


def check_cap(device: torch.device, budget: int | None) -> None:
    """Refuse a ``budget`` that cannot be kept on a CUDA ``device``, before anything is changed or built.

    Raises:
        ValueError: If ``budget`` is given while ``PYTORCH_CUDA_ALLOC_CONF`` turns expandable
            segments off, or exceeds the card or a per-process cap already set; says the fix.
    """
    if budget is None:
        return
    if expandable_segments_choice() is False:
        raise ValueError(
            f"{_CONF_VARIABLE} turns expandable segments off, and without them the caching allocator cannot be held"
            f" to the budget of {format_gib(budget)} (it ran out of memory under a cap of 1.10x its allocated peak)."
            f" Remove `expandable_segments:False` from {_CONF_VARIABLE}, or pass `vram_budget=None` (every block"
            " streamed, no cap)."
        )
    fraction = torch.cuda.get_per_process_memory_fraction(device)
    limit = int(fraction * torch.cuda.get_device_properties(device).total_memory)
    if budget > limit:
        cap = "the card's memory" if fraction >= 1.0 else "the cap set with `set_per_process_memory_fraction`"
        raise ValueError(
            f"the budget of {format_gib(budget)} is more than {cap}, {format_gib(limit)}. Lower it to at most"
            f" {format_gib(limit)}."
        )


def stranded_bytes(device: torch.device) -> int:
    """Bytes the caching allocator keeps reserved but unallocated on ``device`` once it has returned what it can."""
    torch.cuda.empty_cache()
    return max(0, torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def apply_cap(
    device: torch.device,
    budget: int | None,
    held_outside: int = 0,
    relocate: Callable[[torch.device], None] | None = None,
) -> tuple[DeviceMemoryCap, list[str]]:
    """Turn on expandable segments and cap the allocator at ``budget`` on a CUDA ``device``.

    NOTE [ Expandable segments ], NOTE [ Segments the base left behind ], NOTE [ A budget is a cap on the card ] in
    planning/memory.py.

    Args:
        device: A CUDA device.
        budget: The ``vram_budget`` in bytes, or ``None`` (segments only, no cap).
        held_outside: Device bytes the process holds outside the run (the cap is the process's), allowed on
            top of the budget as far as the card or an existing cap allows.
        relocate: Moves the module's device tensors to the device it is given (the host, then back), so that
            the segments they kept mapped are returned; ``None``: nothing is moved.

    Returns:
        What to restore at teardown, and one line per change for the log.

    Raises:
        ValueError: As :func:`check_cap`.
    """
    check_cap(device, budget)
    changes = []
    turned_on = expandable_segments_choice() is None
    if turned_on:
        _set_allocator_settings("expandable_segments:True")
        # Segments mapped before stay as they were; those the packed base left free are returned now, so
        # that the run's memory comes from expandable ones.
        torch.cuda.empty_cache()
        changes.append(f"expandable segments turned on ({_CONF_VARIABLE}=expandable_segments:False keeps them off)")
    stranded = stranded_bytes(device)
    if relocate is not None and stranded >= STRANDED_RELOCATE_BYTES:
        relocate(torch.device("cpu"))
        torch.cuda.empty_cache()
        relocate(device)
        left = stranded_bytes(device)
        changes.append(
            f"{format_gib(stranded - left)} the allocator held free in segments mapped before the run returned (the"
            " module's device tensors moved to the host and back)"
        )
        stranded = left
    if budget is None:
        return DeviceMemoryCap(device, None, turned_on), changes
    found = torch.cuda.get_per_process_memory_fraction(device)
    total = torch.cuda.get_device_properties(device).total_memory
    cap = min(budget + held_outside + stranded, int(found * total))
    torch.cuda.set_per_process_memory_fraction(cap / total, device)
    outside = ""
    if cap > budget:
        kept = f", {format_gib(stranded)} of it reserved and free" if stranded else ""
        outside = f" ({format_gib(budget)} and {format_gib(cap - budget)} the process held before{kept})"
    changes.append(f"the caching allocator capped at {format_gib(cap)}{outside}")
    return DeviceMemoryCap(device, found, turned_on), changes


# NOTE [ The card as the default budget ]
# Without a ``vram_budget`` the run plans for the card: what this process may use at setup, which is
# the free memory plus what its caching allocator holds already (its reserved bytes are free to the
# run once the packed base has left the device), bounded by a per-process cap already set (another
# job or a peer on the card is respected through both), less what the process holds outside the
# module and a margin for memory that appears outside the caching allocator during the run (NCCL's
# buffers under DDP, kernels loaded at the first step, the CUDA context's growth): 1 GiB, or 3% of
# what the process may use where that is over 33 GiB. Blocks that fit it stay resident and keep their activations,
# the rest streams, and layer inputs go to host memory only when the step needs it, as with a set
# budget (the same planner, the same 10% allocator headroom). Unlike a set budget it does not cap the
# allocator: the card is the cap already, and a run that outgrows its plan would run out of memory
# either way. With expandable segments turned off by the user the headroom the plan keeps was never
# measured (NOTE [ Expandable segments ]), so there is no card budget and every block streams.

#: The least margin the card's budget keeps below what the process may use (NOTE [ The card as the default budget ]).
CARD_MARGIN = 2**30
#: The margin as a share of the process's limit on large cards, in percent.
CARD_MARGIN_PERCENT = 3


@dataclass(frozen=True)
class CardBudget:
    """The budget a run without ``vram_budget`` plans for on a CUDA device (NOTE [ The card as the default budget ]).

    Attributes:
        budget: Bytes the run may take, or ``None`` where expandable segments are off (every block streams).
        usable: Bytes this process may use on the device now (free plus reserved, under any per-process cap).
        held_outside: Bytes the process holds on the device outside the module.
        margin: Bytes kept back for memory outside the caching allocator.
        why: One clause for the setup line: what was decided and why.
    """

    budget: int | None
    usable: int
    held_outside: int
    margin: int
    why: str


def card_budget(device: torch.device, held_outside: int = 0) -> CardBudget:
    """What a run without ``vram_budget`` may take of the CUDA ``device`` (NOTE [ The card as the default budget ]).

    Args:
        device: A CUDA device, with the module's rest already moved to it and the packed base off it.
        held_outside: Device bytes the process holds outside the module (another model, a reference run).
    """
    free, total = torch.cuda.mem_get_info(device)
    cap = int(torch.cuda.get_per_process_memory_fraction(device) * total)
    usable = min(free + torch.cuda.memory_reserved(device), cap)
    margin = max(CARD_MARGIN, usable * CARD_MARGIN_PERCENT // 100)
    capped = f" under the per-process cap of {format_gib(cap)}" if cap < total else ""
    if expandable_segments_choice() is False:
        why = (
            f"no budget from the card: {_CONF_VARIABLE} turns expandable segments off, under which the plan's allocator"
            " headroom does not hold, so every block streams (set `vram_budget` to keep blocks on the card)"
        )
        return CardBudget(None, usable, held_outside, margin, why)
    budget = max(0, usable - held_outside - margin)
    outside = f", less {format_gib(held_outside)} the process holds outside the module" if held_outside else ""
    why = (
        f"the card's budget {format_gib(budget)}: {format_gib(usable)} this process may use{capped}{outside}, less a"
        f" {format_gib(margin)} margin (`vram_budget` overrides)"
    )
    return CardBudget(budget, usable, held_outside, margin, why)


def blas_workspace_bytes(device: torch.device, threads: int = BLAS_THREADS) -> int:
    """Bytes of the cuBLAS workspaces a training step on ``device`` allocates through the caching allocator.

    One per matmul thread (``threads``: ``BLAS_THREADS``, more with block-major accumulation's workers), each
    sized by ``CUBLAS_WORKSPACE_CONFIG``
    (``:SIZE_KIB:COUNT`` pairs) or torch's default: 32 MiB from Hopper on, 8 MiB + 128 KiB before.
    0 off CUDA.
    """
    if device.type != "cuda":
        return 0
    config = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    pairs = re.findall(r":(\d+):(\d+)", config or "")
    if pairs:
        workspace = sum(int(kib) * 2**10 * int(count) for kib, count in pairs)
    elif torch.cuda.get_device_capability(device)[0] >= 9:
        workspace = HOPPER_BLAS_WORKSPACE
    else:
        workspace = 4096 * 2**10 * 2 + 16 * 2**10 * 8
    return threads * workspace


def _set_allocator_settings(setting: str) -> None:
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is None:
        setter = torch.cuda.memory._set_allocator_settings
    setter(setting)


__all__ = [
    "CARD_MARGIN",
    "CARD_MARGIN_PERCENT",
    "STRANDED_RELOCATE_BYTES",
    "CardBudget",
    "DeviceMemoryCap",
    "apply_cap",
    "blas_workspace_bytes",
    "card_budget",
    "check_cap",
    "expandable_segments_choice",
    "stranded_bytes",
]
