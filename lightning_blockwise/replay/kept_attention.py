"""Kept attention: a recomputed layer's attention outputs, saved in the forward and served to its recompute."""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

# NOTE [ Kept attention ]
# A rematerialized layer runs its forward twice a step (NOTE [ Exact rematerialization ] in remat.py).
# At long context most of that second forward is attention, whose cost grows with the square of the
# tokens while its output grows with the tokens alone: at the 7B shape and 16k tokens a layer's
# attention output and log-sum-exp take 0.12 GB and its forward about 4 ms (32 ms per GB), where a whole
# kept graph takes 2.5 GB to save about 20 ms (8 ms per GB). So a recomputed layer may keep what its
# attention kernel returned in the forward, and its recompute takes those tensors instead of running
# the kernel again; attention's backward reads them as it reads the kernel's own outputs in resident
# training (it saves the output and the log-sum-exp, and the queries, keys and values, which the
# recompute still computes).
#
# The kernels are ATen's fused SDPA operators (flash, memory-efficient, cuDNN, the CPU's flash), caught
# below autograd by a dispatch mode around the layer's call: in the forward each call's outputs are
# recorded in order; in the recompute the calls come again in the same order (the same function of the
# same inputs, NOTE [ Exact rematerialization ]) and each is answered from the record, after checking that
# the operator and its inputs' shapes, strides and dtypes are the ones recorded and that no recorded
# tensor was written since (a tensor's version, as autograd checks its saved tensors). A call that does not
# match is computed, as without this feature: the recompute is the same function either way, so a
# mismatch costs time, never bits; ``misses`` counts them. The answered tensors are the same bits the
# kernel would return: the run stays bit-identical where the GPU's kernels repeat their bits
# (deterministic mode) and on the CPU.
#
# Three things the forward must do as the recompute would:
# - The no-grad forward asks the memory-efficient and cuDNN kernels for no log-sum-exp (autograd asks for
#   it only when an input needs a gradient), but attention's backward needs it: the recording asks for it,
#   as resident training's forward does.
# - A call with dropout draws random numbers inside the kernel; answered from the record, the recompute
#   would not draw them, and the generator's state after it (the adapters' dropout reads it) would move
#   on differently. Such calls are not recorded and are computed in the recompute (RNG replay makes them
#   exact, as always).
# - Nothing else in the layer is touched: every other operator runs as it would without the mode.
#
# A layer whose forward records nothing (its attention is not one of these kernels: an eager or external
# implementation) or whose recompute misses says so once per process: the plan counted memory for records
# that are not there, or that the recompute does not use.

_ATEN = torch.ops.aten
#: The fused attention operators whose outputs a layer keeps, and their argument that asks for the log-sum-exp.
ATTENTION_OPERATORS: dict[Any, str | None] = {
    _ATEN._scaled_dot_product_flash_attention.default: None,
    _ATEN._scaled_dot_product_efficient_attention.default: "compute_log_sumexp",
    _ATEN._scaled_dot_product_cudnn_attention.default: "compute_log_sumexp",
    _ATEN._scaled_dot_product_flash_attention_for_cpu.default: None,
    _ATEN._scaled_dot_product_fused_attention_overrideable.default: None,
}


def _leaves(value: Any) -> list[Any]:
    """The values in ``value``'s nested tuples and lists (an operator's arguments and outputs nest no deeper)."""
    if isinstance(value, (tuple, list)):
        return [leaf for item in value for leaf in _leaves(item)]
    return [value]


def _tensors(value: Any) -> list[Tensor]:
    return [leaf for leaf in _leaves(value) if isinstance(leaf, Tensor)]


def _signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """What must match between the forward's call and the recompute's: each tensor's layout, the other arguments."""
    leaves = _leaves((args, sorted(kwargs.items())))
    return tuple(
        (leaf.shape, leaf.stride(), leaf.dtype, leaf.device) if isinstance(leaf, Tensor) else leaf for leaf in leaves
    )


def _argument(func: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[int | None, Any]:
    """The position and value of argument ``name`` of ``func`` as called (position ``None``: a keyword)."""
    for position, argument in enumerate(func._schema.arguments):
        if argument.name == name:
            if position < len(args):
                return position, args[position]
            return None, kwargs.get(name, argument.default_value)
    raise KeyError(name)


def _with_log_sumexp(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], Any]:
    """The call with its log-sum-exp asked for, where the operator has that argument."""
    name = ATTENTION_OPERATORS[func]
    if name is None:
        return args, kwargs
    position, _ = _argument(func, name, args, kwargs)
    if position is None:
        return args, {**kwargs, name: True}
    return (*args[:position], True, *args[position + 1 :]), kwargs


@dataclass
class _Entry:
    func: Any
    signature: tuple[Any, ...]
    outputs: Any
    versions: tuple[int, ...]


@dataclass
class KeptAttention:
    """One layer call's attention outputs, from its forward to its recompute (NOTE [ Kept attention ])."""

    #: The decoder layer's index, for the warnings.
    index: int = 0
    entries: list[_Entry | None] = field(default_factory=list)
    #: Calls the recompute computed because they did not match the record (or were not recorded: dropout).
    misses: int = 0

    @property
    def nbytes(self) -> int:
        """Device bytes the recorded outputs hold."""
        total = 0
        for entry in self.entries:
            if entry is not None:
                total += sum(t.untyped_storage().nbytes() for t in _tensors(entry.outputs))
        return total

    def record(self) -> TorchDispatchMode:
        """The mode around the forward's layer call: it records every attention call's outputs."""
        return _Record(self)

    def serve(self) -> TorchDispatchMode:
        """The mode around the recompute's layer call: it answers the attention calls from the record."""
        return _Serve(self)


class _Record(TorchDispatchMode):
    def __init__(self, kept: KeptAttention) -> None:
        super().__init__()
        self.kept = kept

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func not in ATTENTION_OPERATORS:
            return func(*args, **kwargs)
        if _argument(func, "dropout_p", args, kwargs)[1]:
            self.kept.entries.append(None)
            return func(*args, **kwargs)
        # The backward needs the log-sum-exp the no-grad forward does not ask for (NOTE [ Kept attention ]).
        args, kwargs = _with_log_sumexp(func, args, kwargs)
        signature = _signature(args, kwargs)
        outputs = func(*args, **kwargs)
        # Detached: the record holds the bits, not the forward's tensors (the recompute's autograd takes them over).
        kept = tuple(t.detach() if isinstance(t, Tensor) else t for t in outputs)
        versions = tuple(t._version for t in _tensors(kept))
        self.kept.entries.append(_Entry(func, signature, kept, versions))
        return outputs


class _Serve(TorchDispatchMode):
    def __init__(self, kept: KeptAttention) -> None:
        super().__init__()
        self.kept = kept
        self.position = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func not in ATTENTION_OPERATORS:
            return func(*args, **kwargs)
        entries = self.kept.entries
        entry = entries[self.position] if self.position < len(entries) else None
        if self.position < len(entries):
            # Answered or not, the record's entry is dropped: its memory is not needed past this call.
            entries[self.position] = None
        self.position += 1
        signature = _signature(*_with_log_sumexp(func, args, kwargs))
        if entry is None or entry.func is not func or entry.signature != signature or not _unchanged(entry):
            self.kept.misses += 1
            return func(*args, **kwargs)
        return entry.outputs


def _unchanged(entry: _Entry) -> bool:
    return tuple(t._version for t in _tensors(entry.outputs)) == entry.versions


#: What :func:`recording` and :func:`serving` give for a layer that keeps nothing: one shared no-op, every layer call.
_NOTHING = contextlib.nullcontext()


def recording(kept: KeptAttention | None) -> contextlib.AbstractContextManager[None]:
    """Record the attention outputs of the forward inside into ``kept`` (``None``: record nothing)."""
    return _NOTHING if kept is None else _recorded(kept)


def serving(kept: KeptAttention | None) -> contextlib.AbstractContextManager[None]:
    """Answer the recompute's attention calls inside from ``kept`` (``None``: compute them)."""
    return _NOTHING if kept is None else _served(kept)


@contextlib.contextmanager
def _recorded(kept: KeptAttention) -> Iterator[None]:
    with kept.record():
        yield
    if not kept.entries:
        _warn_once(
            "empty",
            f"BlockwiseStrategy: decoder layer {kept.index} ran no fused attention kernel of PyTorch's SDPA in its"
            " forward, so it keeps no attention outputs for its recompute and the memory the plan counted for them"
            " goes unused (NOTE [ Kept attention ]). Load the model with `attn_implementation='sdpa'` to have its"
            " recompute skip attention, or pass `keep_activations=False`.",
        )


@contextlib.contextmanager
def _served(kept: KeptAttention) -> Iterator[None]:
    with kept.serve():
        yield
    if kept.misses:
        _warn_once(
            "missed",
            f"BlockwiseStrategy: decoder layer {kept.index}'s recompute computed {kept.misses} attention call(s) that"
            " its forward's record did not answer (another kernel, another shape, an output written since, or"
            " dropout). The run stays exact; those calls cost what they cost without kept attention (NOTE [ Kept"
            " attention ]).",
        )


_WARNED: set[str] = set()


def _warn_once(kind: str, message: str) -> None:
    if kind not in _WARNED:
        _WARNED.add(kind)
        warnings.warn(message, stacklevel=3)


__all__ = ["ATTENTION_OPERATORS", "KeptAttention", "recording", "serving"]
