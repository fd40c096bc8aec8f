"""A model's bytes as a blockwise run places them: the footprint ``plan`` and the strategy's planner share.

:class:`ModelSizes` is what :func:`~lightning_blockwise.planning.sizing.model_sizes` computes from a config
alone; :func:`slab_bytes` lays tensors out in a slab as the host arena does.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from transformers import PretrainedConfig

from lightning_blockwise.planning import ResidencyPlan, StepShape
from lightning_blockwise.planning.memory import HOPPER_BLAS_WORKSPACE
from lightning_blockwise.planning.step_budget import StepBudget, blas_threads
from lightning_blockwise.planning.step_kernels import PLAIN_KERNELS, StepKernels
from lightning_blockwise.residency.arena import slab_offsets
from lightning_blockwise.residency.blocks import BlockPlan
from lightning_blockwise.residency.layout import ALIGNMENT, tensor_offsets


def slab_bytes(tensor_bytes: Iterable[int], alignment: int = ALIGNMENT) -> int:
    """The size of a slab holding tensors of these sizes in this order, each offset aligned, as ``layout_block``.

    Args:
        tensor_bytes: Each tensor's own bytes, in slab order.
        alignment: The alignment of every offset (:data:`~lightning_blockwise.residency.layout.ALIGNMENT`).
    """
    return tensor_offsets(tensor_bytes, alignment)[-1]


@dataclass(frozen=True)
class ModelSizes:
    """A model's bytes as a blockwise run places them, computed from its config.

    Attributes:
        model_type: ``config.model_type``.
        layer_tensors: Per decoder layer, the bytes of each frozen tensor in slab order.
        device_bytes: Frozen bytes on the compute device for the whole run: LM head, final norm,
            rotary buffers, the embedding when it is tied (or not a plain frozen table), the
            4-bit code tables, and anything else outside the decoder layers.
        host_embedding_bytes: The input embedding table kept in host memory (0 when tied).
        trainable_bytes: The adapters' bytes (fp32).
        config: The model's config.
        activation_bytes: Bytes per activation element (the LM head's dtype, as the strategy reads it).
    """

    model_type: str
    layer_tensors: tuple[tuple[int, ...], ...]
    device_bytes: int
    host_embedding_bytes: int
    trainable_bytes: int
    config: PretrainedConfig
    activation_bytes: int

    @property
    def num_layers(self) -> int:
        """Decoder layers."""
        return len(self.layer_tensors)

    def per_rank(self, ranks: int) -> ModelSizes:
        """The sizes one rank of a ``ranks``-process data-parallel run places on its device.

        With several ranks, PyTorch DDP keeps its gradient buckets: a flat copy of the trainable gradients
        (``gradient_as_bucket_view=False``, its default and the strategy's), counted with the device's fixed bytes.
        Host bytes are a machine's, not a rank's: see ``plan``'s report.
        """
        if ranks <= 1:
            return self
        return replace(self, device_bytes=self.device_bytes + self.trainable_bytes)

    def block_bytes(self, block_size: int) -> list[int]:
        """Each block's slab size for ``block_size`` layers per block (the strategy's ``layout.nbytes``)."""
        return [
            slab_bytes(nbytes for layer in self.layer_tensors[start : start + block_size] for nbytes in layer)
            for start in range(0, self.num_layers, block_size)
        ]

    def host_bytes(self, block_size: int) -> int:
        """The pinned host arena for ``block_size``: every block's slab, each starting aligned (``arena.nbytes``)."""
        return slab_offsets(self.block_bytes(block_size))[-1]

    def shape(
        self,
        tokens: int,
        offload_inputs: bool = False,
        kernels: StepKernels = PLAIN_KERNELS,
        masked_row: int | None = None,
    ) -> StepShape:
        """The step shape of this model at ``tokens`` tokens per micro-batch (what its activations depend on).

        Args:
            tokens: Tokens per micro-batch (batch size x sequence length).
            offload_inputs: Layer inputs wait for the backward in host memory.
            kernels: How the module computes the step, as ``CausalLMFineTune`` installs it
                (:meth:`~lightning_blockwise.planning.step_kernels.StepKernels.as_installed`).
            masked_row: Tokens per row where attention runs with a mask (``StepShape.masked_row``); ``None``: causal.
        """
        return StepShape.for_config(
            self.config,
            tokens,
            self.num_layers,
            self.activation_bytes,
            offload_inputs=offload_inputs,
            kernels=kernels.as_installed(),
            masked_row=masked_row,
        )

    def step_budget(
        self,
        block_size: int = 1,
        prefetch_depth: int = 2,
        budget: int | None = None,
        offload: bool | None = None,
        kernels: StepKernels = PLAIN_KERNELS,
        device_limit: int | None = None,
        keep_activations: bool = True,
        window: int = 1,
        masked_row: int | None = None,
    ) -> StepBudget:
        """The strategy's step budget for this model: the same planner with the same inputs as at setup.

        The device bytes the strategy counts there are the frozen ones here plus the adapters.

        Args:
            block_size: Decoder layers per block.
            prefetch_depth: Blocks copied ahead of the one in use.
            budget: The ``vram_budget`` in bytes, or ``None`` to stream every block.
            offload: ``offload_activations``: force layer-input offload on or off; ``None`` turns it on
                when the step does not fit (the budget, else ``device_limit``) without it.
            kernels: How the module computes the step, as ``CausalLMFineTune`` installs it
                (:meth:`~lightning_blockwise.planning.step_kernels.StepKernels.as_installed`; the strategy's
                ``strategy.module_budget.module_budget`` reads what a module runs instead).
            device_limit: Without a budget, the device bytes beyond which automatic offload turns on.
            keep_activations: The strategy's ``keep_activations`` (NOTE [ Kept activations ] in memory.py).
            window: ``accumulate_grad_batches`` with block-major accumulation (its workers' cuBLAS workspaces and
                micro-batches' saved inputs count), else 1.
            masked_row: Tokens per row where attention runs with a mask (``StepBudget.masked_row``); ``None``: causal.

        Raises:
            ValueError: If ``block_size`` is out of range.
        """
        blocks = BlockPlan(num_layers=self.num_layers, block_size=block_size)  # refuses a block size out of range
        return StepBudget(
            config=self.config,
            num_layers=self.num_layers,
            activation_bytes=self.activation_bytes,
            block_bytes=self.block_bytes(block_size),
            prefetch_depth=prefetch_depth,
            # The cuBLAS workspaces as on Hopper (plan does not know the card).
            fixed_bytes=self.device_bytes + self.trainable_bytes + blas_threads(window) * HOPPER_BLAS_WORKSPACE,
            trainable_bytes=self.trainable_bytes,
            budget=budget,
            offload=offload,
            device_limit=device_limit,
            block_layers=blocks.layers_per_block,
            keep_activations=keep_activations,
            window=window,
            masked_row=masked_row,
            kernels=kernels.as_installed(),
        )

    def residency(
        self,
        tokens: int,
        block_size: int = 1,
        prefetch_depth: int = 2,
        budget: int | None = None,
        offload_inputs: bool = False,
        kernels: StepKernels = PLAIN_KERNELS,
        keep_activations: bool = True,
        masked_row: int | None = None,
    ) -> ResidencyPlan:
        """The strategy's residency plan and predicted training-step peak for this model, offload forced on or off.

        Args:
            tokens: Tokens per micro-batch (batch size x sequence length; the strategy's ``budget_tokens``).
            block_size: Decoder layers per block.
            prefetch_depth: Blocks copied ahead of the one in use.
            budget: The ``vram_budget`` in bytes, or ``None`` to stream every block.
            offload_inputs: Layer inputs wait for the backward in host memory (``offload_activations=True``).
            kernels: How the module computes the step, as ``CausalLMFineTune`` installs it (:meth:`step_budget`).
            keep_activations: The strategy's ``keep_activations``.
            masked_row: Tokens per row where attention runs with a mask; ``None``: causal.

        Raises:
            ValueError: If ``block_size`` is out of range or ``budget`` is below the minimum.
        """
        budgeted = self.step_budget(
            block_size,
            prefetch_depth,
            budget,
            offload_inputs,
            kernels,
            keep_activations=keep_activations,
            masked_row=masked_row,
        )
        return budgeted.plan(tokens).residency


__all__ = ["ModelSizes", "slab_bytes"]
