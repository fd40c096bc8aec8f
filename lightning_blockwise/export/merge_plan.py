"""What a merge will write, decided before the first weight is read: the base checked, every output tensor planned.

:func:`plan_merge` reads the base's ``config.json`` and safetensors headers (never a weight), checks
them and the adapter against each other, and lists every tensor the merged model will hold with
its bytes, so that the shards' headers can be reserved, the disk checked and the work measured
before any of it is done.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from bitsandbytes.nn import Linear4bit
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor
from transformers import BitsAndBytesConfig

from lightning_blockwise.compat.bitsandbytes import SAVED_STATE_JSON, Nf4Format, is_4bit_weight
from lightning_blockwise.export.merge_settings import merge_settings, warn_settings
from lightning_blockwise.export.shards import PlannedTensor
from lightning_blockwise.export.trained_adapter import TrainedAdapter
from lightning_blockwise.export.training_record import COMPUTE_DTYPES
from lightning_blockwise.loading.files import checkpoint_files, load_config, open_checkpoint
from lightning_blockwise.loading.meta_model import build_meta_model, check_keys
from lightning_blockwise.loading.policy import resolve_quantization, saved_dtype

#: The dense exports and their dtypes.
DENSE_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# Bytes planned for a quant state's JSON entry, whose length depends on its values (about 200).
_QUANT_STATE_JSON_BOUND = 1024
# The NF4 code tables `save_pretrained` writes with each weight (NOTE [ NF4 bytes ]).
_QUANT_MAP_BYTES = 16 * 4
_NESTED_QUANT_MAP_BYTES = 256 * 4
_OWNER = "lightning-blockwise export"


@dataclass(frozen=True)
class MergePlan:
    """A merge, decided: its inputs, settings, the base's open shards and every tensor it will write.

    Attributes:
        adapter: The adapter to merge.
        base: The base checkpoint directory.
        mode: ``"bf16"``, ``"fp32"`` or ``"nf4"``.
        into_original: Whether the delta goes into the checkpoint's own weights, not dequant(NF4).
        device: Where weights are quantized, dequantized and summed.
        compute_dtype: The dtype the base was loaded in for training.
        compute_dtype_origin: Where ``compute_dtype`` comes from, in words (``"recorded with the adapter"``, ...).
        dense_base: Whether training loaded the base dense (``quantize=False``): the trained weights are the
            checkpoint's cast to ``compute_dtype``, not dequant(NF4) (NOTE [ What a merge adds ] in export/weights.py).
        base_format_origin: Where ``dense_base`` comes from, in words.
        bnb_config: The base's NF4 settings.
        pre_quantized: Whether the checkpoint is saved in NF4 already.
        config: The base's config (the export's ``config.json`` starts from it).
        keys: Checkpoint key -> the open shard that holds it.
        order: The checkpoint keys to write, in the model's order.
        four_bit: Checkpoint key of each 4-bit weight -> its meta ``Linear4bit`` (the quantization settings).
        planned: Every tensor to write, in order, with its bytes.
    """

    adapter: TrainedAdapter
    base: Path
    mode: str
    into_original: bool
    device: torch.device
    compute_dtype: torch.dtype
    compute_dtype_origin: str
    dense_base: bool
    base_format_origin: str
    bnb_config: BitsAndBytesConfig
    pre_quantized: bool
    config: Any
    keys: dict[str, Any]
    order: list[str]
    four_bit: dict[str, Linear4bit]
    planned: list[PlannedTensor]

    def output_dtype(self, tensor: Tensor) -> torch.dtype:
        """The dtype an unquantized checkpoint tensor is written in."""
        return _output_dtype(self.mode, self.compute_dtype, tensor)

    @property
    def nbytes(self) -> int:
        """The bytes of every tensor to write (the quant-state JSON entries at their bound)."""
        return sum(tensor.nbytes for tensor in self.planned)


@contextmanager
def plan_merge(
    adapter: TrainedAdapter,
    base: Path,
    mode: str,
    into_original: bool,
    device: torch.device,
    compute_dtype: str | None,
    quantize: bool | None = None,
) -> Iterator[MergePlan]:
    """Check the base against the adapter and plan the merge; the base's shards stay open for the block.

    Args:
        adapter: The adapter (:meth:`~TrainedAdapter.check_mergeable` already passed).
        base: The base checkpoint directory.
        mode: ``"bf16"``, ``"fp32"`` or ``"nf4"``.
        into_original: Merge into the checkpoint's own weights.
        device: Where to compute.
        compute_dtype: The dtype training loaded the base in; ``None``: the adapter's record, else bfloat16
            (NOTE [ The training record of an adapter ] in export/training_record.py).
        quantize: Whether training loaded the base as NF4 (``False``: dense); ``None``: the adapter's record, else NF4.

    Warns:
        UserWarning: When a merge loads the base in a compute dtype the adapter does not record (it records none and
            ``--compute-dtype`` is not given, or another), or in another format than the record's.

    Raises:
        MisconfigurationException: If the base is missing, incomplete, corrupt or of another architecture than
            the adapter, ``into_original`` is asked of a base saved in NF4, or a dense-trained adapter is to be
            merged into a base saved in NF4 (without ``quantize=True``).
    """
    settings = merge_settings(adapter, compute_dtype, quantize)
    dtype, origin = settings.compute_dtype, settings.compute_dtype_origin
    with ExitStack() as stack:
        try:
            config = load_config(base)
            bnb_config, pre_quantized = resolve_quantization(config, None, dtype)
            if pre_quantized:
                # As `from_pretrained` and `load_blockwise` do: a quantized checkpoint loads in its own dtype.
                dtype, origin = saved_dtype(config, bnb_config), "the NF4 checkpoint's own"
            model, _, prefixes = build_meta_model(config, bnb_config, dtype)
            keys = stack.enter_context(open_checkpoint(checkpoint_files(base)))
            check_keys(model, keys, prefixes, pre_quantized)
        except (ValueError, MisconfigurationException) as error:
            # The loaders' checks (a missing file, an unexpected or missing tensor, a corrupt shard) speak for
            # `load_blockwise`, and raise ValueError where the checkpoint is broken: for an export, all are
            # mistakes in its input.
            reason = str(error).removeprefix("load_blockwise: ")
            raise MisconfigurationException(f"{_OWNER}: the base checkpoint: {reason}") from None
        if pre_quantized and into_original:
            raise MisconfigurationException(
                f"{_OWNER}: --merge-into-original needs the original weights, but {base} is saved in NF4. Give the"
                " unquantized checkpoint, or leave the flag out."
            )
        adapter.check_against(model, set(keys), base, merging=mode != "none")
        if mode != "none":
            warn_settings(adapter, compute_dtype, quantize, settings, pre_quantized, base)
        formats = (not settings.quantize, settings.quantize_origin)
        yield _plan(adapter, base, mode, into_original, device, (dtype, origin), formats, bnb_config, pre_quantized,
                    model, keys)  # fmt: skip


def check_disk(target: Path, plan: MergePlan) -> None:
    """Refuse a merge whose output does not fit the free space where it is written.

    Raises:
        MisconfigurationException: With the bytes needed and free.
    """
    parent = next(p for p in (target, *target.parents) if p.exists())
    free = shutil.disk_usage(parent).free
    if plan.nbytes > free:
        raise MisconfigurationException(
            f"{_OWNER}: the merged model needs about {plan.nbytes / 1e9:.2f} GB, but {parent} has {free / 1e9:.2f} GB"
            " free. Free space there or write the export elsewhere."
        )


def _plan(
    adapter: TrainedAdapter,
    base: Path,
    mode: str,
    into_original: bool,
    device: torch.device,
    dtypes: tuple[torch.dtype, str],
    formats: tuple[bool, str],
    bnb_config: BitsAndBytesConfig,
    pre_quantized: bool,
    model: torch.nn.Module,
    keys: dict[str, Any],
) -> MergePlan:
    dtype = dtypes[0]
    four_bit = {
        f"{name}.weight": module
        for name, module in model.named_modules()
        if is_4bit_weight(module, "weight") and f"{name}.weight" in keys
    }
    # The meta model's state dict has every tensor's unquantized shape, in the model's order; keys it lacks (a
    # tied LM head) are not written, and the statistics of a pre-quantized weight go with the weight.
    shapes = model.state_dict()
    order = [key for key in shapes if key in keys]
    planned = []
    for key in order:
        if key in four_bit and mode == "nf4":
            planned += _planned_nf4(key, four_bit[key])
        else:
            meta = shapes[key]
            itemsize = _output_dtype(mode, dtype, meta).itemsize
            planned.append(PlannedTensor(key, meta.dim(), meta.numel() * itemsize))
    return MergePlan(
        adapter, base, mode, into_original, device, *dtypes, *formats, bnb_config, pre_quantized, model.config,
        keys, order, four_bit, planned,
    )  # fmt: skip


def _output_dtype(mode: str, compute_dtype: torch.dtype, tensor: Tensor) -> torch.dtype:
    """The export's dtype for floating tensors; in an NF4 model the compute dtype, as ``from_pretrained`` loads."""
    if not tensor.is_floating_point():
        return tensor.dtype
    return DENSE_DTYPES.get(mode, compute_dtype)


def _planned_nf4(key: str, module: Linear4bit) -> list[PlannedTensor]:
    """The entries ``save_pretrained`` writes for a 4-bit weight, with their bytes (NOTE [ NF4 bytes ])."""
    weight = module.weight
    nf4 = Nf4Format(weight.blocksize, weight.compress_statistics)
    specs = {
        suffix: (dtype, shape) for suffix, dtype, shape in nf4.tensor_specs(module.in_features * module.out_features)
    }

    def nbytes(suffix: str) -> int:
        dtype, shape = specs[suffix]
        return dtype.itemsize * int(torch.Size(shape).numel())

    planned = [
        PlannedTensor(key, 2, nbytes("")),
        PlannedTensor(f"{key}.absmax", 1, nbytes("quant_state.absmax")),
        PlannedTensor(f"{key}.quant_map", 1, _QUANT_MAP_BYTES),
    ]
    if nf4.double_quant:
        planned += [
            PlannedTensor(f"{key}.nested_absmax", 1, nbytes("quant_state.state2.absmax")),
            PlannedTensor(f"{key}.nested_quant_map", 1, _NESTED_QUANT_MAP_BYTES),
        ]
    return [*planned, PlannedTensor(f"{key}.{SAVED_STATE_JSON}", 1, _QUANT_STATE_JSON_BOUND)]


__all__ = ["COMPUTE_DTYPES", "DENSE_DTYPES", "MergePlan", "check_disk", "plan_merge"]
