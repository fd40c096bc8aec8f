"""The adapter an export merges: read from a PEFT adapter directory or a ``CausalLMFineTune`` checkpoint.

Both are opened lazily (the safetensors file memory-mapped, the checkpoint ``torch.load``-ed
with ``mmap=True``), checked for what a merge supports, and presented as one
:class:`TrainedAdapter`: LoRA ``A`` and ``B`` per module and each module's scaling, read the way
PEFT reads them.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from peft import LoraConfig
from peft.utils.other import get_pattern_key
from safetensors import safe_open
from torch import Tensor

from lightning_blockwise.export.trained_adapter import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    UNSUPPORTED_SETTINGS,
    LoraModule,
    TrainedAdapter,
)
from lightning_blockwise.export.training_record import CHECKPOINT_RECORD_KEY, TrainingRecord, read_training_record

# A key of PEFT's saved adapter (`base_model.model.<module>.lora_A.weight`) and of a LightningModule's
# state dict around a PeftModel (`model.base_model.model.<module>.lora_A.default.weight`).
_SAVED_KEY = re.compile(r"base_model\.model\.(?P<module>.+)\.(?P<part>lora_[A-Za-z_]+)(?P<rest>(\.[^.]+)*)$")
_CKPT_KEY = re.compile(
    r"(.+\.)?base_model\.model\.(?P<module>.+)\.(?P<part>lora_[A-Za-z_]+)\.(?P<adapter>[^.]+)(?P<rest>(\.[^.]+)*)$"
)
# A base tensor PEFT saves with the adapter (`save_embedding_layers`: the embedding and the LM head when they are
# adapted or resized), which PEFT loads over the base's own.
_SAVED_BASE_KEY = re.compile(r"base_model\.model\.(?P<key>.+)$")
# Hyperparameters of `CausalLMFineTune` a checkpoint must hold to say how its adapters scale.
_HPARAMS = ("lora_r", "lora_alpha", "use_dora", "compute_dtype")


@contextmanager
def open_adapter(path: str | Path) -> Iterator[TrainedAdapter]:
    """Open a PEFT adapter directory or a ``CausalLMFineTune`` checkpoint (``.ckpt``) for the span of the block.

    Args:
        path: The adapter directory (``adapter_config.json`` and ``adapter_model.safetensors``) or the checkpoint.

    Raises:
        MisconfigurationException: If the path does not exist, lacks a file, is not a LoRA (or DoRA) adapter of
            linears, or is a checkpoint without ``CausalLMFineTune``'s hyperparameters. Settings a merge does not
            support are refused by :meth:`TrainedAdapter.check_mergeable`.
    """
    path = Path(path)
    if not path.exists():
        raise MisconfigurationException(
            f"lightning-blockwise export: the adapter {path} does not exist. Give a PEFT adapter directory or a"
            " `.ckpt` a `CausalLMFineTune` run saved."
        )
    if path.is_dir():
        with _open_directory(path) as adapter:
            yield adapter
    else:
        yield _open_checkpoint(path)


@contextmanager
def _open_directory(path: Path) -> Iterator[TrainedAdapter]:
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        if not (path / name).is_file():
            raise MisconfigurationException(
                f"lightning-blockwise export: {path} has no {name}; a PEFT adapter directory holds"
                f" {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS} (`PeftModel.save_pretrained`)."
            )
    settings = json.loads((path / ADAPTER_CONFIG).read_text())
    if settings.get("peft_type") != "LORA":
        raise MisconfigurationException(
            f"lightning-blockwise export: {path} is a {settings.get('peft_type')!r} adapter; only LoRA adapters can be"
            " exported or merged."
        )
    config = LoraConfig.from_pretrained(str(path))
    with safe_open(str(path / ADAPTER_WEIGHTS), framework="pt", device="cpu") as handle:
        names = list(handle.keys())
        lora = [key for key in names if _SAVED_KEY.fullmatch(key)]
        keys = {key: _parse(_SAVED_KEY.fullmatch(key), key, path) for key in lora}
        replacements = {}
        for key in sorted(set(names) - set(lora)):
            match = _SAVED_BASE_KEY.fullmatch(key)
            if match is None:
                raise MisconfigurationException(
                    f"lightning-blockwise export: {path} holds `{key}`, which is neither a LoRA weight nor a tensor of"
                    " the base; the file was not written by PEFT."
                )
            replacements[match["key"].replace(".base_layer.", ".")] = key
        # NOTE [ The training record of an adapter ] in export/training_record.py.
        record = read_training_record(path)
        yield _adapter(
            path,
            config,
            keys,
            replacements,
            record=record,
            trained_on=config.base_model_name_or_path,
            read=handle.get_tensor,
            shape=lambda key: tuple(handle.get_slice(key).get_shape()),
        )


def _open_checkpoint(path: Path) -> TrainedAdapter:
    try:
        # Memory-mapped: a checkpoint saved with its frozen base is as large as the model, and only the
        # adapters are read.
        checkpoint = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as error:
        raise MisconfigurationException(
            f"lightning-blockwise export: cannot read {path} as a Lightning checkpoint ({error}). Give a `.ckpt` a"
            " `CausalLMFineTune` run saved, or a PEFT adapter directory."
        ) from None
    hparams = checkpoint.get("hyper_parameters") or {}
    missing = [name for name in _HPARAMS if name not in hparams]
    if missing:
        raise MisconfigurationException(
            f"lightning-blockwise export: {path} lacks the hyperparameters {', '.join(missing)} that say how its"
            " adapters were built; only checkpoints of `CausalLMFineTune` are read. Save the adapter with"
            " `PeftModel.save_pretrained` and give that directory."
        )
    if hparams.get("random_init"):
        raise MisconfigurationException(
            f"lightning-blockwise export: {path} was trained over a random-init base (`random_init=True`); there is"
            " no checkpoint its adapters belong to."
        )
    state = checkpoint["state_dict"]
    keys = {key: _parse(match, key, path) for key in state if (match := _CKPT_KEY.fullmatch(key)) is not None}
    adapters = {match["adapter"] for match in (_CKPT_KEY.fullmatch(key) for key in keys) if match}
    if len(adapters) > 1:
        raise MisconfigurationException(
            f"lightning-blockwise export: {path} holds several adapters ({', '.join(sorted(adapters))}); export"
            " one at a time with PEFT."
        )
    modules = sorted({name for name, _ in keys.values()})
    config = LoraConfig(
        r=hparams["lora_r"],
        lora_alpha=hparams["lora_alpha"],
        lora_dropout=hparams.get("lora_dropout", 0.0),
        use_dora=hparams["use_dora"],
        # The exact linears that were adapted: PEFT matches a name that equals a target.
        target_modules=modules,
        task_type="CAUSAL_LM",
    )
    saved = checkpoint.get(CHECKPOINT_RECORD_KEY)
    try:
        # A checkpoint of an older version has no record: its hyperparameters say how the base was loaded.
        record = TrainingRecord.from_dict(saved) if saved is not None else None
    except ValueError as error:
        raise MisconfigurationException(
            f"lightning-blockwise export: {path}'s `{CHECKPOINT_RECORD_KEY}` is not a training record ({error})."
        ) from None
    quantize = hparams.get("quantize")
    record = TrainingRecord(
        getattr(torch, hparams["compute_dtype"]),
        quantize if isinstance(quantize, bool) else None,
        None if record is None else record.base,
    )
    return _adapter(
        path,
        config,
        keys,
        {},  # the frozen base a checkpoint may carry is the base's own
        record=record,
        trained_on=hparams.get("checkpoint"),
        read=state.__getitem__,
        shape=lambda key: tuple(state[key].shape),
    )


def _parse(match: re.Match[str] | None, key: str, source: Path) -> tuple[str, str]:
    """``(module, part)`` of a source key (``lora_A``, ``lora_B``, ``lora_magnitude_vector``); refuses the rest."""
    if match is None:
        raise MisconfigurationException(
            f"lightning-blockwise export: {source} holds `{key}`, which is not a LoRA weight; only LoRA adapters"
            " (lora_A and lora_B of linears) can be exported or merged."
        )
    part, rest = match["part"], match["rest"]
    if (part in ("lora_A", "lora_B") and rest == ".weight") or (
        part == "lora_magnitude_vector" and rest in ("", ".weight")
    ):
        return match["module"], part
    if part.startswith("lora_embedding"):
        why = "the adapter adapts an embedding, which the merge does not fold in"
    elif rest == ".bias":
        why = UNSUPPORTED_SETTINGS["lora_bias"]
    else:
        why = "it is not a LoRA linear's weight"
    raise MisconfigurationException(f"lightning-blockwise export: {source} holds `{key}`: {why}.")


def _adapter(
    source: Path,
    config: LoraConfig,
    keys: dict[str, tuple[str, str]],
    replacements: dict[str, str],
    record: TrainingRecord | None,
    trained_on: str | None,
    read: Callable[[str], Tensor],
    shape: Callable[[str], tuple[int, ...]],
) -> TrainedAdapter:
    parts: dict[str, dict[str, str]] = {}
    for key, (module, part) in keys.items():
        parts.setdefault(module, {})[part] = key
    if not parts:
        raise MisconfigurationException(f"lightning-blockwise export: {source} holds no LoRA weights.")
    modules = {}
    for name, found in sorted(parts.items()):
        if not {"lora_A", "lora_B"} <= set(found):
            raise MisconfigurationException(
                f"lightning-blockwise export: {source} holds only {', '.join(found)} of `{name}`; the file is"
                " incomplete."
            )
        rank = shape(found["lora_A"])[0]
        scaling = _scaling(config, name, rank, source)
        modules[name] = LoraModule(name, found["lora_A"], found["lora_B"], found.get("lora_magnitude_vector"), scaling)
    return TrainedAdapter(
        source,
        config,
        modules,
        replacements,
        compute_dtype=None if record is None else record.compute_dtype,
        trained_on=trained_on,
        quantize=None if record is None else record.quantize,
        base_identity=None if record is None else record.base,
        read=read,
        shape=shape,
    )


def _scaling(config: LoraConfig, name: str, rank: int, source: Path) -> float:
    """The scaling PEFT gives the linear ``name`` (``LoraModel._create_and_replace``, ``update_layer``)."""
    rank_pattern, alpha_pattern = config.rank_pattern or {}, config.alpha_pattern or {}
    r = rank_pattern.get(get_pattern_key(rank_pattern.keys(), name), config.r)
    alpha = alpha_pattern.get(get_pattern_key(alpha_pattern.keys(), name), config.lora_alpha)
    if r != rank:
        raise MisconfigurationException(
            f"lightning-blockwise export: {source} says `{name}` has rank {r}, but its lora_A has {rank} rows; the"
            " config and the weights do not belong together."
        )
    return alpha / math.sqrt(r) if config.use_rslora else alpha / r


__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "LoraModule", "TrainedAdapter", "open_adapter"]
