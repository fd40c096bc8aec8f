"""Export a trained adapter, or a model with it merged in, streaming the base one tensor at a time.

:func:`export` writes the PEFT adapter (``merge="none"``) or a merged model that
``AutoModelForCausalLM.from_pretrained`` loads: dense (``"bf16"``, ``"fp32"``) or re-quantized NF4
(``"nf4"``). The base is read from its safetensors shards one tensor at a time and each 4-bit weight
is quantized as training quantized it, dequantized, given the adapter's delta and written
(NOTE [ What a merge adds ] in export/weights.py) into shards that are written as they fill
(NOTE [ Streamed safetensors shards ] in export/shards.py): host memory and device memory hold one
weight and its intermediates, whatever the size of the model. The output appears at once and
replaces nothing by accident (NOTE [ Atomic adapter export ] in export/adapter.py).

Example::

    export("runs/qwen/adapter", "/models/Qwen2.5-72B", "/models/Qwen2.5-72B-tuned", merge="bf16", device="cuda")
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor
from tqdm.auto import tqdm

from lightning_blockwise.export.adapter import check_export_target, staged_directory
from lightning_blockwise.export.merge_plan import COMPUTE_DTYPES, DENSE_DTYPES, MergePlan, check_disk, plan_merge
from lightning_blockwise.export.merge_settings import check_base
from lightning_blockwise.export.model_card import write_model_files
from lightning_blockwise.export.shards import ShardWriter
from lightning_blockwise.export.sources import open_adapter
from lightning_blockwise.export.training_record import dtype_name
from lightning_blockwise.export.weights import (
    dequantized,
    lora_delta,
    quantized_as_trained,
    requantized,
    saved_entries,
)
from lightning_blockwise.planning import parse_bytes

#: ``merge``'s choices: the PEFT adapter alone, a dense model in bf16 or fp32, a re-quantized NF4 model.
MERGE_CHOICES = ("none", *DENSE_DTYPES, "nf4")
#: ``save_pretrained``'s default shard cap.
DEFAULT_MAX_SHARD_SIZE = "5GB"
_OWNER = "lightning-blockwise export"


def export(
    adapter: str | Path,
    base: str | Path,
    target: str | Path,
    *,
    merge: str = "none",
    merge_into_original: bool = False,
    device: str | torch.device = "cpu",
    compute_dtype: str | None = None,
    quantize: bool | None = None,
    allow_other_base: bool = False,
    max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    overwrite: bool = False,
    progress: bool = True,
    report: Callable[[str], None] | None = None,
) -> Path:
    """Write ``adapter`` as a PEFT adapter, or merged into ``base`` as a model ``from_pretrained`` loads.

    Every check (arguments, target, adapter, base files and keys, shapes, disk space) runs before
    the first weight is read. The merge reads the base one tensor at a time; see the module
    docstring and NOTE [ What a merge adds ] in export/weights.py for what is computed.

    Args:
        adapter: A PEFT adapter directory, or a ``.ckpt`` of ``CausalLMFineTune``.
        base: The local checkpoint the adapter was trained on (safetensors; unquantized, or NF4 as saved
            by bitsandbytes).
        target: The directory to write; refused if it is, contains or lies inside ``adapter`` or ``base``, or
            holds files, unless ``overwrite`` and they are a previous export's.
        merge: ``"none"``: the PEFT adapter; ``"bf16"`` / ``"fp32"``: a dense model, dequant(NF4) + delta
            cast to that dtype; ``"nf4"``: dequant(NF4) + delta re-quantized to NF4 as PEFT's ``merge_and_unload``
            does, weights without an adapter kept as trained.
        merge_into_original: Add the delta to the checkpoint's own weights instead of to dequant(NF4): a
            model other than the one trained (its ``config.json`` and ``README.md`` say so).
        device: Where to quantize, dequantize and add (``"cpu"``, ``"cuda"``, ``"cuda:1"``). Use the device
            training loaded the base on: NF4 quantization on the CPU and on a GPU can differ.
        compute_dtype: The dtype training loaded the base in (``CausalLMFineTune(compute_dtype=...)``), which
            decides the NF4 bytes; ``None``: the one the adapter records (a checkpoint's hyperparameter, an adapter
            directory's ``lightning_blockwise.json``), else ``"bfloat16"`` with a warning. One other than the
            record is used, with a warning (NOTE [ The training record of an adapter ] in export/training_record.py).
        quantize: Whether training loaded the base as NF4 (``True``) or dense (``False``, ``quantize=False``: the
            merge adds the delta to the checkpoint's weights cast to the compute dtype); ``None``: what the adapter
            records, else NF4. One other than the record is used, with a warning.
        allow_other_base: Merge into a ``base`` whose config or weights differ from the base the adapter records
            (NOTE [ The identity of a base ] in loading/base_identity.py), with a warning; otherwise refused.
        max_shard_size: The cap on each output shard (``"5GB"``, ``"500MiB"``, or bytes).
        overwrite: Replace the previous export ``target`` holds (atomically); never anything else.
        progress: Show a progress bar over the bytes written.
        report: Called with a line that says what a merge does (the compute dtype, and where it comes from)
            before the first weight is read; ``None``: nothing is said.

    Returns:
        ``target``.

    Warns:
        UserWarning: If the adapter names another base than ``base`` (another path where it records no identity,
            another identity with ``allow_other_base``), or a merge loads the base in a compute dtype or a format the
            adapter does not record.

    Raises:
        MisconfigurationException: If an argument is out of range, ``target`` overlaps an input or holds files
            without ``overwrite`` or other than a previous export, the adapter or base is missing, incomplete or
            mismatched (another base than the recorded one, without ``allow_other_base``), the adapter uses a
            setting a merge does not support, or the disk lacks room for the output.
    """
    target = Path(target)
    mode = _check_arguments(merge, merge_into_original, compute_dtype)
    shard_cap = _shard_cap(max_shard_size)
    torch_device = _device(device)
    check_export_target(target, overwrite, _OWNER, overwrite_hint="`--overwrite`", inputs=(adapter, base))
    with open_adapter(adapter) as trained:
        if mode != "none":
            trained.check_mergeable()
        check_base(trained, Path(base), allow_other_base)
        # Planned for the adapter alone too: it checks the adapter against the base it names.
        planned = plan_merge(trained, Path(base), mode, merge_into_original, torch_device, compute_dtype, quantize)
        with planned as plan:
            if mode == "none":
                with staged_directory(target) as staging:
                    trained.write_peft(staging, plan.base)
                return target
            check_disk(target, plan)
            if report is not None:
                used = dtype_name(plan.compute_dtype)
                fmt = f"dense base ({plan.base_format_origin}), " if plan.dense_base else ""
                report(f"{_OWNER}: merging with {fmt}compute dtype {used} ({plan.compute_dtype_origin}).")
            with staged_directory(target) as staging:
                _write_weights(plan, staging, shard_cap, progress)
                dtype = DENSE_DTYPES.get(mode, plan.compute_dtype)
                quantization = plan.bnb_config if mode == "nf4" else None
                # The card names `target`, where the files will be, not `staging`, where they are written.
                write_model_files(
                    plan.base, staging, plan.config, dtype, quantization, _card_facts(plan), target=target
                )
    return target


def _check_arguments(merge: str, merge_into_original: bool, compute_dtype: str | None) -> str:
    if merge not in MERGE_CHOICES:
        raise MisconfigurationException(f"{_OWNER}: --merge {merge!r} is not one of {', '.join(MERGE_CHOICES)}.")
    if merge_into_original and merge == "none":
        raise MisconfigurationException(
            f"{_OWNER}: --merge-into-original needs a merge; give --merge bf16, fp32 or nf4 as well."
        )
    if compute_dtype is not None and compute_dtype not in COMPUTE_DTYPES:
        raise MisconfigurationException(
            f"{_OWNER}: --compute-dtype {compute_dtype!r} is not one of {', '.join(COMPUTE_DTYPES)}; give the"
            " `compute_dtype` training used."
        )
    return merge


def _shard_cap(max_shard_size: int | str) -> int:
    try:
        return parse_bytes(max_shard_size)
    except ValueError as error:
        raise MisconfigurationException(f"{_OWNER}: --max-shard-size: {error}") from None


def _device(device: str | torch.device) -> torch.device:
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise MisconfigurationException(f"{_OWNER}: --device {device!r} is not a device; give cpu or cuda.") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise MisconfigurationException(f"{_OWNER}: --device {device} needs CUDA, which torch does not find here.")
    if resolved.type not in ("cpu", "cuda"):
        raise MisconfigurationException(f"{_OWNER}: --device {device}: only cpu and cuda are supported.")
    return resolved


def _write_weights(plan: MergePlan, staging: Path, shard_cap: int, progress: bool) -> None:
    writer = ShardWriter(staging, shard_cap, plan.planned)
    bar = tqdm(total=plan.nbytes, unit="B", unit_scale=True, desc=_OWNER, disable=not progress)
    try:
        for key in plan.order:
            for name, tensor in _merged(plan, key).items():
                writer.write(name, tensor)
                bar.update(tensor.nbytes)
        writer.finish()
    finally:
        writer.close()
        bar.close()


def _merged(plan: MergePlan, key: str) -> dict[str, Tensor]:
    """The output tensors of one checkpoint key, on the CPU (NOTE [ What a merge adds ] in export/weights.py)."""
    name = key.removesuffix(".weight")
    lora = plan.adapter.modules.get(name) if key.endswith(".weight") else None
    delta = None
    if lora is not None:
        lora_a, lora_b = plan.adapter.weights(name, plan.device)
        delta = lora_delta(lora_a, lora_b, lora.scaling)
    module = plan.four_bit.get(key)
    if plan.dense_base:
        return _merged_dense(plan, key, module, delta)
    if module is None:
        replacement = plan.adapter.replacements.get(key)
        raw = plan.keys[key].get_tensor(key) if replacement is None else plan.adapter.read(replacement)
        if delta is None:
            return {key: raw.to(plan.output_dtype(raw))}
        # An unquantized linear with an adapter (e.g. a skipped module): its trained weight is the one loaded.
        base = raw.to(plan.device) if plan.into_original else raw.to(plan.device, plan.compute_dtype)
        return {key: (base + delta).to(plan.output_dtype(raw)).cpu()}
    if plan.into_original and (plan.mode != "nf4" or delta is not None):
        original = plan.keys[key].get_tensor(key).to(plan.device)
        value = original if delta is None else original + delta
        if plan.mode == "nf4":
            return saved_entries(key, requantized(module, value, plan.device))
        return {key: value.to(DENSE_DTYPES[plan.mode]).cpu()}
    with quantized_as_trained(module, key, plan.keys, plan.device, plan.compute_dtype, plan.pre_quantized) as weight:
        if plan.mode == "nf4" and delta is None:
            return saved_entries(key, weight)
        value = dequantized(weight)
        if delta is not None:
            value = value + delta
        if plan.mode == "nf4":
            return saved_entries(key, requantized(module, value, plan.device))
        return {key: value.to(DENSE_DTYPES[plan.mode]).cpu()}


def _merged_dense(plan: MergePlan, key: str, module: Any, delta: Tensor | None) -> dict[str, Tensor]:
    """One key of an adapter trained over the dense base: the checkpoint's tensor as training loaded it, plus delta.

    Training loaded every floating tensor in the compute dtype (`from_pretrained(dtype=...)`,
    `load_blockwise(quantize=False)`), so the trained weight is the checkpoint's cast to it; the sum with the
    float32 delta is taken in float32, as for the NF4 base (NOTE [ What a merge adds ] in export/weights.py).
    """
    replacement = plan.adapter.replacements.get(key)
    raw = plan.keys[key].get_tensor(key) if replacement is None else plan.adapter.read(replacement)
    value = raw.to(plan.device)
    if raw.is_floating_point() and not plan.into_original:
        value = value.to(plan.compute_dtype)
    if delta is not None:
        value = value + delta
    if plan.mode == "nf4" and module is not None:
        return saved_entries(key, requantized(module, value, plan.device))
    return {key: value.to(plan.output_dtype(raw)).cpu()}


def _card_facts(plan: MergePlan) -> dict[str, Any]:
    """What the written ``config.json`` and ``README.md`` record about the merge."""
    return {
        "merge": plan.mode,
        "merged_into": "original" if plan.into_original else "dense" if plan.dense_base else "dequantized_nf4",
        "compute_dtype": dtype_name(plan.compute_dtype),
        "compute_dtype_origin": plan.compute_dtype_origin,
        # NF4 or dense: what the delta was added to (NOTE [ The training record of an adapter ]).
        "base_format": "dense" if plan.dense_base else "nf4",
        "base_format_origin": plan.base_format_origin,
        "trained_base_format": {None: None, True: "nf4", False: "dense"}[plan.adapter.quantize],
        # What the adapter says training used, `None` if it does not say (NOTE [ The training record of an adapter ]).
        "trained_compute_dtype": None if plan.adapter.compute_dtype is None else dtype_name(plan.adapter.compute_dtype),
        "device": plan.device.type,
        "adapter": str(plan.adapter.source.resolve()),
        "base": str(plan.base.resolve()),
        "trained_on": plan.adapter.trained_on,
        "trained_on_identity": None if plan.adapter.base_identity is None else plan.adapter.base_identity.to_dict(),
        "pre_quantized_base": plan.pre_quantized,
        "adapted_linears": len(plan.adapter.modules),
        "tensors_saved_with_the_adapter": sorted(plan.adapter.replacements),
    }


__all__ = ["DEFAULT_MAX_SHARD_SIZE", "MERGE_CHOICES", "export"]
