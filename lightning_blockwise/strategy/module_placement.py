"""Where a blockwise run puts the module outside the host arena, and what teardown puts back."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from lightning_blockwise.architectures import DecoderStack
from lightning_blockwise.compat.bitsandbytes import disable_cpu_repack, restore_cpu_repack
from lightning_blockwise.loading.sharing import run_scope, scoped
from lightning_blockwise.residency import embedding
from lightning_blockwise.residency.layout import BlockLayout
from lightning_blockwise.residency.placement import move_rest_to_device
from lightning_blockwise.strategy.checkpointing import base_fingerprint
from lightning_blockwise.strategy.device_memory import DeviceMemoryCap, apply_cap
from lightning_blockwise.strategy.module_budget import device_bytes
from lightning_blockwise.strategy.step_planner import budget_errors


class ModulePlacement:
    """The module's changes for a run, once its decoder layers' frozen tensors are bound to the host arena.

    :meth:`place` keeps the input embedding on the host where it can
    (:func:`~lightning_blockwise.residency.embedding.can_stay_on_host`), moves the rest to the device,
    and then, on the CPU, keeps bitsandbytes from repacking the decoder layers' 4-bit weights (NOTE
    [ bitsandbytes CPU inference kernel ] in compat/bitsandbytes/cpu_kernel.py) or, elsewhere, caps the
    allocator at the budget (NOTE [ A budget is a cap on the card ] in planning/memory.py).
    :meth:`restore` undoes all but the move.
    """

    def __init__(self) -> None:
        self._on_host: list[nn.Module] = []
        self._repack_flags: dict[nn.Module, bool] = {}
        self._memory_cap: DeviceMemoryCap | None = None
        #: Device bytes the process held outside the module when it was placed (another model, a reference run's
        #: results): on top of a budget's cap, and out of the card's budget (NOTE [ The card as the default budget ]).
        self.held_outside = 0

    def place(
        self, module: nn.Module, stack: DecoderStack, device: torch.device, budget: int | None, owner: str
    ) -> list[str]:
        """Place ``module`` on ``device`` for the run; return what the allocator cap changed, for the log.

        Args:
            module: The LightningModule.
            stack: Its decoder stack, whose frozen tensors are bound to the host arena already.
            device: The compute device.
            budget: The ``vram_budget`` in bytes, or ``None``.
            owner: How errors name the option they are about, e.g. ```BlockwiseStrategy(vram_budget=...)```.

        Raises:
            MisconfigurationException: If the allocator cannot be capped at ``budget``.
        """
        self.held_outside = 0
        embedding_module = stack.model.get_input_embeddings()
        on_host = []
        if embedding_module is not None and embedding.can_stay_on_host(embedding_module, module):
            embedding.install(embedding_module, device, stack.model)
            on_host.append(embedding_module)
        move_rest_to_device(module, stack, device, skip=on_host)
        self._on_host = on_host
        if device.type == "cpu":
            self._repack_flags = disable_cpu_repack(stack.layers)
            return []
        # Once the base has left the device, so the cap is not below what it holds (NOTE [ A budget is a
        # cap on the card ] in planning/memory.py). The cap is the process's: what the process holds on the
        # device outside the module (another model, a reference run's results) comes on top of the budget.
        self.held_outside = max(0, torch.cuda.memory_allocated(device) - device_bytes(module, device))

        def relocate(target: torch.device) -> None:  # NOTE [ Segments the base left behind ] in device_memory.py
            move_rest_to_device(module, stack, target, skip=on_host)

        with budget_errors(owner):
            self._memory_cap, changes = apply_cap(device, budget, held_outside=self.held_outside, relocate=relocate)
        return changes

    def restore(self) -> None:
        """Put the embedding's own forward, bitsandbytes' repacking and the allocator's cap back as they were."""
        for module in self._on_host:
            embedding.uninstall(module)
        self._on_host = []
        restore_cpu_repack(self._repack_flags)
        self._repack_flags = {}
        if self._memory_cap is not None:
            self._memory_cap.restore()
            self._memory_cap = None


def shared_copy_key(
    config: Any, share_host_copy: bool | None, distributed: bool
) -> Callable[[Sequence[BlockLayout]], str | None]:
    """What names a packed base for sharing its host copy (``BlockwiseStrategy(share_host_copy=...)``).

    The base's fingerprint (NOTE [ Lean checkpoints ] in checkpointing.py: it covers random-init bases and a
    checkpoint replaced at the same path), and, without the opt-in, this run's rendezvous address, so that
    only the ranks of one run share; ``None`` where nothing is shared (one process, or ``False``). The
    bytes are compared block by block anyway (:func:`~lightning_blockwise.residency.binding.bind_checked`).
    """

    def key(layouts: Sequence[BlockLayout]) -> str | None:
        if share_host_copy is False or (share_host_copy is None and not distributed):
            return None
        tensors = [entry.bindings[0].current() for layout in layouts for entry in layout.entries]
        fingerprint = base_fingerprint(config, tensors)
        if share_host_copy:
            return fingerprint
        return scoped(fingerprint, run_scope())

    return key


__all__ = ["ModulePlacement", "shared_copy_key"]
