"""Checkpoint keys -> model tensors, through transformers' own conversion mapping (renamings, fused experts).

A checkpoint's keys are not always the model's: transformers 5 keeps the experts of an MoE such
as ``qwen3_moe`` as fused 3-D parameters (``mlp.experts.gate_up_proj``) while checkpoints, its own
``save_pretrained`` included, store one 2-D weight per expert (``mlp.experts.3.up_proj.weight``).
``from_pretrained`` maps them with the model's ``WeightConverter`` and ``WeightRenaming`` list
(``get_model_conversion_mapping``); :func:`map_checkpoint` applies the same list to the keys once,
before any tensor is read, and :meth:`TensorSource.read` runs the same operations per target when
its layer loads.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from transformers import PreTrainedModel
from transformers.conversion_mapping import get_model_conversion_mapping
from transformers.core_model_loading import WeightConverter, WeightRenaming, dot_natural_key, rename_source_key


@dataclass
class TensorSource:
    """The checkpoint tensors one group of model tensors is made of, and how.

    Attributes:
        targets: The model tensors (state-dict names) the group produces; one, except for a
            converter that splits (a fused ``qkv`` into ``q``, ``k``, ``v``).
        inputs: ``(checkpoint key, source pattern)`` per input, in the order ``from_pretrained``
            collects them (natural key order: expert 2 before expert 10).
        converter: The transformers converter that combines the inputs; ``None``: one input, renamed at most.
    """

    targets: list[str]
    inputs: list[tuple[str, str]] = field(default_factory=list)
    converter: WeightConverter | None = None

    def read(self, keys: dict[str, Any], device: torch.device | str, dtype: torch.dtype) -> dict[str, Tensor]:
        """Read, cast and combine the inputs: target name -> tensor.

        Each input is cast to ``dtype`` on ``device`` before the operations, as
        ``from_pretrained``'s ``_materialize_copy`` does (NOTE [ Same bytes as from_pretrained ] in nf4.py).

        Args:
            keys: Checkpoint key -> the open shard that holds it.
            device: Where to materialize the inputs.
            dtype: The dtype to cast every input to first.
        """
        if self.converter is None:
            (key, _), target = self.inputs[0], self.targets[0]
            return {target: keys[key].get_tensor(key).to(device=device, dtype=dtype)}
        converter = copy.deepcopy(self.converter)
        for key, pattern in self.inputs:
            # A callable is transformers' "sync loading" form of a collected tensor.
            converter.add_tensor(self.targets[0], key, pattern, _reader(keys, key, device, dtype))
        made = converter.convert(self.targets[0])
        return {name: value[0] if isinstance(value, list) else value for name, value in made.items()}


def _reader(keys: dict[str, Any], key: str, device: torch.device | str, dtype: torch.dtype) -> Any:
    return lambda: keys[key].get_tensor(key).to(device=device, dtype=dtype)


@dataclass(frozen=True)
class CheckpointMap:
    """Where each model tensor comes from in a checkpoint.

    Attributes:
        sources: Model tensor name -> its :class:`TensorSource` (the targets of one source share it).
        unmatched: Checkpoint keys that are no model tensor once renamed, in checkpoint order.
    """

    sources: dict[str, TensorSource]
    unmatched: list[str]

    def groups(self, targets: Iterable[str]) -> list[TensorSource]:
        """The distinct sources of ``targets`` (those in the checkpoint), in first-target order."""
        seen: dict[int, TensorSource] = {}
        for name in targets:
            source = self.sources.get(name)
            if source is not None:
                seen.setdefault(id(source), source)
        return list(seen.values())


def map_checkpoint(model: PreTrainedModel, checkpoint_keys: Iterable[str]) -> CheckpointMap:
    """Map a checkpoint's keys to ``model``'s tensors as ``from_pretrained`` does, reading no tensor.

    Args:
        model: The (meta) model; its state dict names the targets.
        checkpoint_keys: Every key of the checkpoint.
    """
    mapping = get_model_conversion_mapping(model)
    renamings = [entry for entry in mapping if isinstance(entry, WeightRenaming)]
    converters = [entry for entry in mapping if isinstance(entry, WeightConverter)]
    by_pattern = {pattern: converter for converter in converters for pattern in converter.source_patterns}
    expected = model.state_dict()
    prefix = model.base_model_prefix
    sources: dict[str, TensorSource] = {}
    unmatched: list[str] = []
    # Natural order, as `convert_and_load_state_dict_in_model` sorts: experts are stacked in this order.
    for key in sorted(checkpoint_keys, key=dot_natural_key):
        target, pattern = rename_source_key(key, renamings, converters, prefix, expected)
        if target not in expected and key in expected:
            target, pattern = rename_source_key(key, [], [], base_model_prefix=prefix, meta_state_dict=expected)
        if target not in expected:
            unmatched.append(key)
            continue
        if pattern is None:
            sources[target] = TensorSource([target], [(key, key)])
            continue
        source = sources.get(target)
        if source is None:
            converter = by_pattern[pattern]
            names = [target.replace(converter.target_patterns[0], other, 1) for other in converter.target_patterns]
            source = TensorSource(names, converter=converter)
            for name in names:
                sources[name] = source
        source.inputs.append((key, pattern))
    return CheckpointMap(sources, unmatched)


__all__ = ["CheckpointMap", "TensorSource", "map_checkpoint"]
