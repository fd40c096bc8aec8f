"""What an adapter directory records about its training besides PEFT's config: how its base was loaded, and which.

Example::

    write_training_record("runs/adapter", TrainingRecord(torch.float32, quantize=False, base=base_identity(path)))
    read_training_record("runs/adapter").compute_dtype  # torch.float32
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

from lightning_blockwise.loading.base_identity import BaseIdentity

#: The file beside ``adapter_config.json`` that holds the record (NOTE [ The training record of an adapter ]).
TRAINING_RECORD = "lightning_blockwise.json"
#: The compute dtypes a base can be loaded in (``CausalLMFineTune(compute_dtype=...)``).
COMPUTE_DTYPES = ("bfloat16", "float16", "float32")

# NOTE [ The training record of an adapter ]
# A merge quantizes the base exactly as training did, and the NF4 bytes depend on the compute dtype
# the base was loaded in: merging an fp32-trained adapter over a bf16-quantized base changes most
# merged weights (28 of 51 tensors in the run) without any error. A `.ckpt` holds the dtype
# in its hyperparameters; PEFT's `adapter_config.json` has no field for it, and a key of our own in
# it makes `LoraConfig.from_pretrained` warn "Unexpected keyword arguments" on every load. So the
# record is a file of its own beside it, `lightning_blockwise.json` (`{"compute_dtype": "float32"}`),
# which PEFT never opens: `PeftModel.from_pretrained` loads the directory as before. Every adapter
# this package writes carries it (`export_adapter`, an export from a `.ckpt`); `export --merge`
# uses it when `--compute-dtype` is not given, and warns where it is missing (an adapter written by
# PEFT alone or by an older version) or contradicted by the flag (export/merge_plan.py).
#
# The record also says whether the base was quantized (`quantize`: a dense-trained adapter merged into the NF4 base
# is another function, logits off by whole units) and which base it was (NOTE [ The identity of a base ] in
# loading/base_identity.py). `export`, `generate` and `CausalLMFineTune(adapter_path=...)` follow it: what they
# are not told is taken from it, what they are told and differs from it is done with a warning that names both,
# and another base is refused unless allowed. An older record has no `quantize` or `base` (`None`): NF4 is assumed,
# as before. A `.ckpt` of `CausalLMFineTune` holds the same record under `CHECKPOINT_RECORD_KEY`.

#: The key of a ``CausalLMFineTune`` checkpoint under which it holds its :class:`TrainingRecord` (as a dict).
CHECKPOINT_RECORD_KEY = "lightning_blockwise_training"


@dataclass(frozen=True)
class TrainingRecord:
    """How an adapter's base was loaded for training, and which base it was.

    Attributes:
        compute_dtype: The dtype the base was loaded (and its NF4 bytes quantized) in.
        quantize: Whether the base was NF4 (``True``) or dense (``False``); ``None``: not recorded (older records).
        base: The base's identity; ``None``: not recorded.
    """

    compute_dtype: torch.dtype
    quantize: bool | None = None
    base: BaseIdentity | None = None

    def to_dict(self) -> dict[str, Any]:
        """The record as plain JSON values (the file's content, and a checkpoint's entry)."""
        saved: dict[str, Any] = {"compute_dtype": dtype_name(self.compute_dtype)}
        if self.quantize is not None:
            saved["quantize"] = self.quantize
        if self.base is not None:
            saved["base"] = self.base.to_dict()
        return saved

    @classmethod
    def from_dict(cls, saved: Any) -> TrainingRecord:
        """The record :meth:`to_dict` wrote.

        Raises:
            ValueError: If ``saved`` is not one.
        """
        name = saved.get("compute_dtype") if isinstance(saved, dict) else None
        if name not in COMPUTE_DTYPES:
            raise ValueError(f"it does not record a compute dtype (one of {', '.join(COMPUTE_DTYPES)})")
        quantize = saved.get("quantize")
        if not isinstance(quantize, (bool, type(None))):
            raise ValueError(f"its `quantize` is {quantize!r}, not true or false")
        base = saved.get("base")
        return cls(getattr(torch, name), quantize, None if base is None else BaseIdentity.from_dict(base))

    @property
    def base_format(self) -> str:
        """``"NF4"`` or ``"dense"``: how the base was loaded, in words (NF4 where the record does not say)."""
        return "dense" if self.quantize is False else "NF4"


def write_training_record(directory: str | Path, record: TrainingRecord | str | torch.dtype) -> None:
    """Record, in ``directory``, how the adapter there was trained.

    Args:
        directory: The adapter directory (or its staging directory).
        record: The record, or only the compute dtype the base was loaded in (``"float32"`` or ``torch.float32``).

    Raises:
        ValueError: If the compute dtype is not one of :data:`COMPUTE_DTYPES`.
    """
    if not isinstance(record, TrainingRecord):
        name = record if isinstance(record, str) else dtype_name(record)
        if name not in COMPUTE_DTYPES:
            raise ValueError(f"compute dtype {record!r} is not one of {', '.join(COMPUTE_DTYPES)}")
        record = TrainingRecord(getattr(torch, name))
    (Path(directory) / TRAINING_RECORD).write_text(json.dumps(record.to_dict(), indent=2) + "\n")


def read_training_record(directory: str | Path) -> TrainingRecord | None:
    """The record in the adapter ``directory``, or ``None`` if it has none.

    Raises:
        MisconfigurationException: If the record exists but is not one this package writes.
    """
    path = Path(directory) / TRAINING_RECORD
    if not path.is_file():
        return None
    try:
        return TrainingRecord.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError) as error:
        raise MisconfigurationException(
            f"lightning-blockwise: {path} is not a training record as `lightning-blockwise` writes it ({error})."
            " Fix or delete the file, and give --compute-dtype."
        ) from None


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``: a dtype as records, flags and messages name it."""
    return str(dtype).removeprefix("torch.")


__all__ = [
    "CHECKPOINT_RECORD_KEY",
    "COMPUTE_DTYPES",
    "TRAINING_RECORD",
    "TrainingRecord",
    "dtype_name",
    "read_training_record",
    "write_training_record",
]
