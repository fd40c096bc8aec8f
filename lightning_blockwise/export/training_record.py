"""What an adapter directory records about its training besides PEFT's config: the compute dtype of its base.

Example::

    write_training_record("runs/adapter", "float32")
    read_training_record("runs/adapter")  # torch.float32
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

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


def write_training_record(directory: str | Path, compute_dtype: str | torch.dtype) -> None:
    """Record, in ``directory``, the compute dtype the adapter there was trained with.

    Args:
        directory: The adapter directory (or its staging directory).
        compute_dtype: The dtype the base was loaded in, as ``"float32"`` or ``torch.float32``.

    Raises:
        ValueError: If ``compute_dtype`` is not one of :data:`COMPUTE_DTYPES`.
    """
    name = compute_dtype if isinstance(compute_dtype, str) else dtype_name(compute_dtype)
    if name not in COMPUTE_DTYPES:
        raise ValueError(f"compute dtype {compute_dtype!r} is not one of {', '.join(COMPUTE_DTYPES)}")
    (Path(directory) / TRAINING_RECORD).write_text(json.dumps({"compute_dtype": name}, indent=2) + "\n")


def read_training_record(directory: str | Path) -> torch.dtype | None:
    """The compute dtype recorded in the adapter ``directory``, or ``None`` if it has no record.

    Raises:
        MisconfigurationException: If the record exists but is not one this package writes.
    """
    path = Path(directory) / TRAINING_RECORD
    if not path.is_file():
        return None
    try:
        name = json.loads(path.read_text())["compute_dtype"]
    except (OSError, ValueError, KeyError, TypeError):
        name = None
    if name not in COMPUTE_DTYPES:
        raise MisconfigurationException(
            f"lightning-blockwise export: {path} does not record a compute dtype (one of {', '.join(COMPUTE_DTYPES)})"
            " as `lightning-blockwise` writes it. Fix or delete the file, and give --compute-dtype."
        )
    return getattr(torch, name)


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``: a dtype as records, flags and messages name it."""
    return str(dtype).removeprefix("torch.")


__all__ = ["COMPUTE_DTYPES", "TRAINING_RECORD", "dtype_name", "read_training_record", "write_training_record"]
