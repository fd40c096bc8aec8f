"""The adapter an export merges, as one :class:`TrainedAdapter` whatever it was read from (see export/sources.py)."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from bitsandbytes.nn import Linear4bit
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from peft import LoraConfig
from safetensors.torch import save_file
from torch import Tensor, nn

from lightning_blockwise.export.training_record import TrainingRecord, write_training_record
from lightning_blockwise.loading.base_identity import BaseIdentity

#: The files of a PEFT adapter directory, as ``PeftModel.save_pretrained`` writes them.
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

# Adapter settings a merge does not fold in, with why, checked on the config.
UNSUPPORTED_SETTINGS = {
    "use_dora": "DoRA rescales every row by its magnitude vector over the weight's norm; merging it is not supported"
    " yet. Export the adapter (`--merge none`) and load it with PEFT over the NF4 base",
    "lora_bias": "the adapter trains a bias on lora_B (`lora_bias=True`), which the merge does not fold in",
    "fan_in_fan_out": "the adapter is for transposed (Conv1D, GPT-2 style) weights, which decoder-only checkpoints"
    " loaded as NF4 do not have",
    "modules_to_save": "the adapter replaces whole modules (`modules_to_save`), which the merge does not write",
    "trainable_token_indices": "the adapter trains token embeddings (`trainable_token_indices`), which the merge"
    " does not write",
    "alora_invocation_tokens": "activated LoRA (aLoRA) applies only after its invocation tokens and cannot be merged",
    "layer_replication": "the adapter replicates layers (`layer_replication`), which the merge does not write",
}


@dataclass(frozen=True)
class LoraModule:
    """One adapted linear: where its ``A`` and ``B`` are in the source, its rank and scaling.

    Attributes:
        name: The linear's name in the Hugging Face model (``model.layers.0.self_attn.q_proj``).
        lora_a: The source key of ``lora_A``'s weight, ``(rank, in_features)``.
        lora_b: The source key of ``lora_B``'s weight, ``(out_features, rank)``.
        magnitude: The source key of DoRA's magnitude vector, ``None`` for LoRA.
        scaling: ``lora_alpha / rank``, or ``lora_alpha / sqrt(rank)`` with rsLoRA (PEFT's ``update_layer``).
    """

    name: str
    lora_a: str
    lora_b: str
    magnitude: str | None
    scaling: float


@dataclass(frozen=True)
class TrainedAdapter:
    """A LoRA adapter to export or merge, open for reading.

    Attributes:
        source: The adapter directory or checkpoint file.
        config: The adapter's PEFT config.
        modules: Adapted linear name -> its :class:`LoraModule`.
        replacements: Base checkpoint key -> the source key of the tensor saved with the adapter that PEFT loads
            in its place (``save_embedding_layers``).
        compute_dtype: The compute dtype training loaded the base in, if the source says (a checkpoint does, and
            an adapter directory with its training record: NOTE [ The training record of an adapter ]).
        trained_on: The base checkpoint training used, if the source says.
        quantize: Whether training loaded the base as NF4 (``True``) or dense (``False``), if the source says.
        base_identity: The identity of the base training used, if the source records it (NOTE [ The identity of a
            base ] in loading/base_identity.py).
        read: Source key -> the tensor (memory-mapped where the source allows).
        shape: Source key -> the tensor's shape, without reading it.
    """

    source: Path
    config: LoraConfig
    modules: dict[str, LoraModule]
    replacements: dict[str, str]
    compute_dtype: torch.dtype | None
    trained_on: str | None
    quantize: bool | None
    base_identity: BaseIdentity | None
    read: Callable[[str], Tensor]
    shape: Callable[[str], tuple[int, ...]]

    def weights(self, name: str, device: torch.device) -> tuple[Tensor, Tensor]:
        """``lora_A`` and ``lora_B``'s weights of the linear ``name``, on ``device``."""
        module = self.modules[name]
        return self.read(module.lora_a).to(device), self.read(module.lora_b).to(device)

    def check_mergeable(self) -> None:
        """Refuse an adapter with a setting the merge does not fold in (DoRA, ``lora_bias``, ``modules_to_save``, ...).

        Raises:
            MisconfigurationException: Naming the setting and what to do instead.
        """
        for name, why in UNSUPPORTED_SETTINGS.items():
            if getattr(self.config, name, None):
                raise MisconfigurationException(f"lightning-blockwise export: {self.source}: {why}.")
        dora = next((m.name for m in self.modules.values() if m.magnitude is not None), None)
        if dora is not None:
            raise MisconfigurationException(
                f"lightning-blockwise export: {self.source} has a DoRA magnitude vector on `{dora}`:"
                f" {UNSUPPORTED_SETTINGS['use_dora']}."
            )

    def check_against(self, model: nn.Module, checkpoint_keys: set[str], base: Path, merging: bool) -> None:
        """Refuse an adapter whose linears the base lacks or shapes differently, before any weight is read.

        Args:
            model: The base's model (on the meta device), its linears converted to 4-bit.
            checkpoint_keys: The keys of the base checkpoint.
            base: The base checkpoint directory, for the messages.
            merging: Whether the adapter will be merged (then a tied weight cannot be adapted).

        Raises:
            MisconfigurationException: If an adapted linear is missing, not a linear, of other shapes, or (when
                merging) has no weight of its own in the checkpoint (tied to the embedding); or a base tensor saved
                with the adapter is not the base's, has another shape, or would replace a 4-bit weight.
        """
        for name, module in self.modules.items():
            try:
                linear = model.get_submodule(name)
            except AttributeError:
                linear = None
            if not isinstance(linear, (nn.Linear, Linear4bit)):
                raise MisconfigurationException(
                    f"lightning-blockwise export: the adapter {self.source} adapts `{name}`, which the base {base}"
                    " does not have as a linear. The adapter was trained on another architecture or size; give the"
                    " base it was trained on."
                )
            a, b = self.shape(module.lora_a), self.shape(module.lora_b)
            wanted = ((a[0], linear.in_features), (linear.out_features, a[0]))
            if (tuple(a), tuple(b)) != wanted:
                raise MisconfigurationException(
                    f"lightning-blockwise export: the adapter of `{name}` has lora_A {tuple(a)} and lora_B {tuple(b)},"
                    f" but the base {base} has it as {linear.out_features} x {linear.in_features}, which needs"
                    f" lora_A {wanted[0]} and lora_B {wanted[1]}. Give the base the adapter was trained on."
                )
            if merging and f"{name}.weight" not in checkpoint_keys:
                raise MisconfigurationException(
                    f"lightning-blockwise export: the adapter adapts `{name}`, whose weight the base {base} does not"
                    " store (it is tied to another one, e.g. the LM head to the embedding); merging would change"
                    " both. Export the adapter (`--merge none`) instead."
                )
        self._check_replacements(model, checkpoint_keys, base)

    def _check_replacements(self, model: nn.Module, checkpoint_keys: set[str], base: Path) -> None:
        shapes = {key: tuple(tensor.shape) for key, tensor in model.state_dict().items()}
        quantized = {f"{name}.weight" for name, module in model.named_modules() if isinstance(module, Linear4bit)}
        for key, source in self.replacements.items():
            if key not in checkpoint_keys or key in quantized or shapes.get(key) != self.shape(source):
                raise MisconfigurationException(
                    f"lightning-blockwise export: the adapter {self.source} carries `{source}` {self.shape(source)},"
                    f" which PEFT loads over the base's `{key}`, but the base {base} has"
                    f" {'no such tensor' if key not in shapes else shapes[key]}"
                    f"{' quantized to 4 bits' if key in quantized else ''}. Give the base the adapter was trained"
                    " on (with its vocabulary, if the embeddings were resized)."
                )

    def write_peft(self, directory: Path, base: Path) -> None:
        """Write the adapter as a PEFT directory (``adapter_config.json``, ``adapter_model.safetensors``).

        The compute dtype, where known, goes beside them (NOTE [ The training record of an adapter ] in
        export/training_record.py), so that a merge from the written directory needs no ``--compute-dtype``.
        """
        if self.compute_dtype is not None:
            write_training_record(directory, TrainingRecord(self.compute_dtype, self.quantize, self.base_identity))
        if self.source.is_dir():
            # An adapter directory is copied as it is: nothing to gain from rewriting it.
            for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
                shutil.copyfile(self.source / name, directory / name)
            return
        self.config.base_model_name_or_path = str(base.resolve())
        self.config.save_pretrained(str(directory))
        tensors = {}
        for module in self.modules.values():
            prefix = f"base_model.model.{module.name}"
            tensors[f"{prefix}.lora_A.weight"] = self.read(module.lora_a).contiguous()
            tensors[f"{prefix}.lora_B.weight"] = self.read(module.lora_b).contiguous()
            if module.magnitude is not None:
                # PEFT saves the magnitude without the `.weight` of its parameter.
                tensors[f"{prefix}.lora_magnitude_vector"] = self.read(module.magnitude).contiguous()
        save_file(tensors, str(directory / ADAPTER_WEIGHTS), metadata={"format": "pt"})


__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "UNSUPPORTED_SETTINGS", "LoraModule", "TrainedAdapter"]
