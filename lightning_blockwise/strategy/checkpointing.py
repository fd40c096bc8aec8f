"""What a blockwise checkpoint holds: the trainable state, a fingerprint of the frozen base, the RNG states.

The frozen base is every tensor of the Hugging Face model that training does not change: the
decoder layers' frozen tensors (NF4 packed weights and their quantization statistics, norms,
biases), and the frozen input embedding, final norm and LM head. The checkpoint directory the
model was loaded from already holds them, so by default a checkpoint leaves them out
(NOTE [ Lean checkpoints ]) and records a fingerprint of the base instead, to refuse a
checkpoint resumed over another base.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

# What a checkpoint needs from bitsandbytes' state-dict entries; importable from here as before.
from lightning_blockwise.compat.bitsandbytes import is_saved_quantization_metadata as is_quantization_metadata
from lightning_blockwise.compat.bitsandbytes import saved_nested_offsets
from lightning_blockwise.replay.rng import GlobalRngState
from lightning_blockwise.residency.binding import views
from lightning_blockwise.residency.layout import BlockLayout

#: The checkpoint key under which the strategy keeps what it adds to Lightning's checkpoint.
CHECKPOINT_KEY = "blockwise"

#: Bumped when what is stored under ``CHECKPOINT_KEY`` changes meaning.
FORMAT_VERSION = 1

# Bytes sampled per tensor for the fingerprint: enough that two different bases (another seed,
# other trained weights) differ in some sampled byte, few enough that a 72B base takes a second.
_SAMPLES_PER_TENSOR = 4096

# Config entries that name where a model came from, not what it is.
_CONFIG_NOISE = ("_name_or_path", "name_or_path", "transformers_version", "_commit_hash")

# NOTE [ Lean checkpoints ]
# A checkpoint of a blockwise run keeps what training changes (trainable parameters, whatever the
# module holds outside the Hugging Face model, optimizer, schedulers, loops, callbacks) and leaves
# out the frozen base: at 72B that is ~40 GB a checkpoint that the base's own directory already
# has. In its place it records `base_fingerprint`: a hash of the model config and of a strided
# sample of every frozen tensor's bytes, so a lean checkpoint resumed over another base (same
# shapes, other weights) is refused instead of silently training a different model. With
# `save_frozen_base=True` the file is self-contained: every frozen tensor once, read from the host
# copy (never a device slot: NOTE [ One storage per slab entry ] in residency/binding.py), written
# straight to disk so that nothing of the base is copied in host memory.


@dataclass(frozen=True)
class BaseKeys:
    """Which keys of a LightningModule's ``state_dict`` are the frozen base, and which are trained.

    Attributes:
        frozen: Keys of the Hugging Face model's frozen tensors (bitsandbytes' quantization
            statistics included).
        trainable: Keys of parameters that require grad, anywhere in the module.
    """

    frozen: frozenset[str]
    trainable: frozenset[str]

    @classmethod
    def of(cls, module: nn.Module, base_model: nn.Module) -> BaseKeys:
        """Sort ``module``'s state-dict keys; ``base_model`` is the Hugging Face model inside it."""
        prefix = next(name for name, sub in module.named_modules(remove_duplicate=False) if sub is base_model)
        base = base_model.state_dict(prefix=f"{prefix}." if prefix else "", keep_vars=True)
        trainable = {name for name, p in module.named_parameters(remove_duplicate=False) if p.requires_grad}
        return cls(frozen=frozenset(base) - trainable, trainable=frozenset(trainable))


def base_fingerprint(config: Any, tensors: Iterable[Tensor]) -> str:
    """A hash of a model config and of a strided byte sample of each frozen tensor, in order.

    Args:
        config: The Hugging Face model's config (where the model was loaded from is ignored).
        tensors: The frozen base's tensors, in state-dict order (read where they are: a device
            tensor has only its sampled bytes copied).

    Returns:
        A hex digest.
    """
    settings = {k: v for k, v in config.to_dict().items() if k not in _CONFIG_NOISE}
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode())
    for tensor in tensors:
        digest.update(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
        flat = (
            tensor.detach().reshape(-1).view(torch.uint8) if tensor.numel() else tensor.new_empty(0, dtype=torch.uint8)
        )
        count = min(flat.numel(), _SAMPLES_PER_TENSOR)
        if count:
            index = torch.linspace(0, flat.numel() - 1, count, dtype=torch.float64).long()
            digest.update(flat[index.to(flat.device)].cpu().numpy().tobytes())
    return digest.hexdigest()


class HostViews:
    """The host-arena view of every decoder-layer frozen tensor, found from wherever it is bound now.

    A streamed block may be bound to a device slot when a checkpoint is written; the host
    arena is the authoritative copy (and the only one a full-state checkpoint should read or a
    full-state load should write). Tensors are matched by the address of their first byte.

    Args:
        layouts: Every block's layout.
        slabs: Every block's slab in the host arena.
    """

    def __init__(self, layouts: Iterable[BlockLayout], slabs: Iterable[Tensor]) -> None:
        self._by_address: dict[int, Tensor] = {}
        for layout, slab in zip(layouts, slabs, strict=True):
            for entry, view in zip(layout.entries, views(layout, slab), strict=True):
                for binding in entry.bindings:
                    self._by_address[binding.current().data_ptr()] = view

    def get(self, tensor: Tensor) -> Tensor | None:
        """The host view of ``tensor`` if it is a decoder layer's frozen tensor, else ``None``."""
        view = self._by_address.get(tensor.data_ptr()) if tensor.numel() else None
        if view is None or view.dtype != tensor.dtype or view.shape != tensor.shape:
            return None
        return view


class FrozenBase:
    """The frozen base of a module set up for blockwise training, as checkpoints see it.

    Knows which state-dict keys are the base (:class:`BaseKeys`), its fingerprint, and how to
    read and write its decoder tensors in the host copy (:class:`HostViews`). Built after the
    decoder layers were packed into the arena and before any block is bound to the device.

    Args:
        module: The LightningModule.
        base_model: The Hugging Face model inside it.
        layouts: Every block's layout.
        slabs: Every block's slab in the host arena.
    """

    def __init__(
        self, module: nn.Module, base_model: nn.Module, layouts: Iterable[BlockLayout], slabs: Iterable[Tensor]
    ) -> None:
        self.module = module
        self.base_model = base_model
        self._layouts = list(layouts)
        self._slabs = list(slabs)
        self.keys = BaseKeys.of(module, base_model)
        self.fingerprint = self._fingerprint()

    def checkpoint_state(self, state: dict[str, Any], include_base: bool) -> dict[str, Any]:
        """``module.state_dict()`` as a checkpoint holds it (NOTE [ Lean checkpoints ])."""
        if not include_base:
            return {key: value for key, value in state.items() if key not in self.keys.frozen}
        host = self._host()
        return {key: _prefer(host.get(value), value) for key, value in state.items()}

    def checkpoint_meta(self, include_base: bool) -> dict[str, Any]:
        """What a checkpoint records under :data:`CHECKPOINT_KEY`: the format, the base, the RNG states now.

        Args:
            include_base: Whether the checkpoint carries the frozen base (``save_frozen_base``).
        """
        return {
            "format_version": FORMAT_VERSION,
            "frozen_base": include_base,
            "base_fingerprint": self.fingerprint,
            # NOTE [ Exact resume ] in replay/rng.py.
            "rng": GlobalRngState.capture().state_dict(),
        }

    def take_checkpoint(self, checkpoint: Mapping[str, Any]) -> tuple[dict[str, Any], bool]:
        """Check a checkpoint against this base and write its frozen decoder tensors into the host copy.

        Returns:
            The rest of its state dict, to load into the module as usual, and whether it carried
            the base (then call :meth:`refresh` after that load).

        Raises:
            ValueError: If the checkpoint is of another base or lacks trainable parameters
                (:meth:`check_loadable`), or a frozen tensor's dtype or shape differs.
        """
        meta = checkpoint.get(CHECKPOINT_KEY) or {}
        state = dict(checkpoint["state_dict"])
        has_base = self.has_base(state)
        self.check_loadable(state, meta.get("base_fingerprint"))
        return (self.load_into_host(state) if has_base else state), has_base

    def mismatch(self, missing_keys: Iterable[str], unexpected_keys: Iterable[str]) -> str | None:
        """Why a ``load_state_dict(strict=False)`` result does not match the module, or ``None``.

        Missing frozen-base keys are expected (NOTE [ Lean checkpoints ]).
        """
        missing = [key for key in missing_keys if key not in self.keys.frozen]
        unexpected = list(unexpected_keys)
        if not (missing or unexpected):
            return None
        return (
            f"the checkpoint does not match the module: missing keys {missing[:5]}, unexpected keys {unexpected[:5]}."
            " Set `strict_loading = False` on the module to load what matches."
        )

    def has_base(self, state: Mapping[str, Any]) -> bool:
        """Whether a checkpoint's state dict carries (some of) the frozen base."""
        return any(key in self.keys.frozen for key in state)

    def check_loadable(self, state: Mapping[str, Any], saved_fingerprint: str | None) -> None:
        """Refuse a lean checkpoint of another base, and one that lacks trainable parameters.

        Raises:
            ValueError: With the reason and the fix.
        """
        if not self.has_base(state) and saved_fingerprint is not None and saved_fingerprint != self.fingerprint:
            raise ValueError(
                f"the checkpoint was written over another frozen base (its fingerprint {saved_fingerprint[:12]}..."
                f" differs from this model's {self.fingerprint[:12]}...: another config, other weights or another"
                " quantization). Load the base the checkpoint was trained on, or save checkpoints with"
                " `BlockwiseStrategy(save_frozen_base=True)` to carry the base along."
            )
        missing = sorted(self.keys.trainable - state.keys())
        if missing:
            raise ValueError(
                f"the checkpoint lacks {len(missing)} trainable parameters of the module (e.g. `{missing[0]}`), which"
                " would start again from their initial values. Resume with the adapter configuration (targets,"
                " rank) the checkpoint was trained with."
            )

    def load_into_host(self, state: Mapping[str, Any]) -> dict[str, Any]:
        """Write a checkpoint's frozen decoder tensors into the host copy; return the rest to load as usual.

        The host arena is the only authoritative copy of the decoder layers' frozen tensors, so they
        are written there, never into a device slot a block happens to be bound to. bitsandbytes'
        metadata entries are consumed (the nested offsets they carry included). Call
        :meth:`refresh` once the rest is loaded.

        Raises:
            ValueError: If a tensor's dtype or shape differs from the module's.
        """
        current = self.module.state_dict(keep_vars=True)
        host = self._host()
        rest = {}
        for key, value in state.items():
            target = current.get(key) if key in self.keys.frozen else None
            view = None if target is None else host.get(target)
            if view is None:
                if not is_quantization_metadata(key):
                    rest[key] = value
                continue
            if value.dtype != view.dtype or value.shape != view.shape:
                raise ValueError(
                    f"the checkpoint's `{key}` is {value.dtype} {tuple(value.shape)}, the module's {view.dtype}"
                    f" {tuple(view.shape)}. Build the module with the checkpoint's architecture and quantization."
                )
            view.copy_(value)
        for offset, saved in saved_nested_offsets(self.module, state):
            view = host.get(offset)
            if view is not None:
                view.copy_(saved)
        return rest

    def refresh(self) -> None:
        """Fingerprint the base again, after :meth:`load_into_host` and the load of the rest changed it."""
        self.fingerprint = self._fingerprint()

    def _host(self) -> HostViews:
        return HostViews(self._layouts, self._slabs)

    def _fingerprint(self) -> str:
        host = self._host()
        state = self.module.state_dict(keep_vars=True)
        tensors = [_prefer(host.get(t), t) for key, t in state.items() if key in self.keys.frozen]
        return base_fingerprint(self.base_model.config, tensors)


def _prefer(first: Tensor | None, second: Any) -> Any:
    return second if first is None else first


__all__ = [
    "CHECKPOINT_KEY",
    "FORMAT_VERSION",
    "BaseKeys",
    "FrozenBase",
    "HostViews",
    "base_fingerprint",
    "is_quantization_metadata",
    "saved_nested_offsets",
]
