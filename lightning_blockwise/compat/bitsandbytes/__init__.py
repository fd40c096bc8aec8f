"""Everything lightning_blockwise knows about bitsandbytes: on a bitsandbytes upgrade, this is the package to check.

- ``config``: the NF4 settings the package loads with (:func:`nf4_config`, :func:`is_supported_config`,
  :func:`nf4_linear`).
- ``formats``: what an NF4 weight is stored as, its tensors' dtypes, shapes and bytes predicted from the
  weight's size (:class:`Nf4Format`, :func:`nf4_tensor_bytes`, :func:`pending_nf4`, :func:`code_table_bytes`).
- ``quant_state``: the quant-state tensors packed with a weight (:func:`quant_state_tensors`), the code
  tables left on the compute device (:func:`move_code_tables`), moving a weight to the host
  (:func:`move_to_host`).
- ``linears``: converting a meta model's linears (:func:`replace_with_4bit_linears`), finding them
  (:func:`named_4bit_linears`, :func:`is_4bit_weight`; 8-bit ones, which do not stream:
  :func:`named_8bit_linears`), quantizing (:func:`quantize_like`).
- ``saved_state``: the state-dict entries ``save_pretrained`` writes next to a 4-bit weight
  (:data:`SAVED_WEIGHT_ENTRIES`), deserializing a saved weight (:func:`deserialize`,
  :func:`saved_quant_type`), and what checkpoints read from them (:func:`saved_nested_offsets`,
  :func:`is_saved_quantization_metadata`).
- ``cpu_kernel``: the CPU inference kernel (:func:`keep_4bit_trainable_on_cpu`, the public guard;
  :func:`disable_cpu_repack`, :func:`restore_cpu_repack`, :func:`is_repacked_for_cpu`).
- ``optimizers``: 8-bit AdamW, plain and paged (:func:`adamw_8bit`), and what its moments cost
  (:data:`MOMENT_BYTES_8BIT`, :data:`MOMENT_BYTES_FP32`, :data:`MIN_8BIT_SIZE`).

Every name is importable from here.

Example::

    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=nf4_config(torch.bfloat16)).train()
"""

from lightning_blockwise.compat.bitsandbytes.config import is_supported_config, nf4_config, nf4_linear
from lightning_blockwise.compat.bitsandbytes.cpu_kernel import (
    disable_cpu_repack,
    is_repacked_for_cpu,
    keep_4bit_trainable_on_cpu,
    restore_cpu_repack,
)
from lightning_blockwise.compat.bitsandbytes.formats import Nf4Format, code_table_bytes, nf4_tensor_bytes, pending_nf4
from lightning_blockwise.compat.bitsandbytes.linears import (
    is_4bit_weight,
    named_4bit_linears,
    named_8bit_linears,
    quantize_like,
    replace_with_4bit_linears,
)
from lightning_blockwise.compat.bitsandbytes.optimizers import (
    MIN_8BIT_SIZE,
    MOMENT_BYTES_8BIT,
    MOMENT_BYTES_FP32,
    adamw_8bit,
)
from lightning_blockwise.compat.bitsandbytes.quant_state import move_code_tables, move_to_host, quant_state_tensors
from lightning_blockwise.compat.bitsandbytes.saved_state import (
    SAVED_STATE_JSON,
    SAVED_STATE_JSON_PREFIX,
    SAVED_STATE_SUFFIXES,
    SAVED_WEIGHT_ENTRIES,
    deserialize,
    is_saved_quantization_metadata,
    saved_nested_offsets,
    saved_quant_type,
)

__all__ = [
    "MIN_8BIT_SIZE",
    "MOMENT_BYTES_8BIT",
    "MOMENT_BYTES_FP32",
    "SAVED_STATE_JSON",
    "SAVED_STATE_JSON_PREFIX",
    "SAVED_STATE_SUFFIXES",
    "SAVED_WEIGHT_ENTRIES",
    "Nf4Format",
    "adamw_8bit",
    "code_table_bytes",
    "deserialize",
    "disable_cpu_repack",
    "is_4bit_weight",
    "is_repacked_for_cpu",
    "is_saved_quantization_metadata",
    "is_supported_config",
    "keep_4bit_trainable_on_cpu",
    "move_code_tables",
    "move_to_host",
    "named_4bit_linears",
    "named_8bit_linears",
    "nf4_config",
    "nf4_linear",
    "nf4_tensor_bytes",
    "pending_nf4",
    "quant_state_tensors",
    "quantize_like",
    "replace_with_4bit_linears",
    "restore_cpu_repack",
    "saved_nested_offsets",
    "saved_quant_type",
]
