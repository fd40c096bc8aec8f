"""The user's forward hooks inside a rematerialized decoder layer: once per step, and never a silent constant.

A rematerialized layer runs twice per step, without autograd in the forward and with it in the
recompute; a forward hook on a module inside it would fire in both, seeing tensors without a graph
first (NOTE [ Forward hooks inside a rematerialized layer ]).
"""

from __future__ import annotations

import functools
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn
from torch.nn.modules import module as torch_module

# NOTE [ Forward hooks inside a rematerialized layer ]
# Under `strategy="auto"` a forward hook (or pre-hook) on a module inside a decoder layer (a probe,
# an auxiliary loss, a regularizer, transformers' recorder of `output_attentions` or of router
# logits) fires once per step and sees tensors that carry the graph to the adapters. Under the
# strategy the layer's modules run in its no-grad forward and again in the recompute in the
# backward (remat.py): the hook fired twice, and what it kept from the forward had no graph, so a
# loss term built from it was a constant whose gradient was lost without an error. So:
#
# - In the forward, each such hook fires as in resident training, once, on aliases of the module's
#   inputs and outputs that refuse a gradient (`_NoGradient`): a hook that observes them (logs,
#   counts, detaches, keeps them for a metric) works as before; a loss built from them raises at the
#   first backward, naming the module, the hook and the fix, since its gradient cannot be had without
#   keeping the layer's graph. That holds for all a hook receives: the positional arguments, the
#   output, and the keyword arguments of a hook registered `with_kwargs=True` (a decoder layer calls its
#   attention with `hidden_states=` as a keyword; a loss on those lost 7 of 28 adapter gradients
#   without an error: issue 41).
# - A hook that returns what it was given (the same objects: Lightning's `PyTorchProfiler` returns its
#   input and output to close its record, so do many tracers) observes: nothing changes, and the module
#   goes on with its own tensors. A hook that returns anything else replaces what the layer computes and
#   is refused at once, naming the hook: the recompute would have to call it again, a second firing
#   (issue 42).
# - In the recompute the hooks are silenced, the process-wide ones (`register_module_forward_hook`)
#   included, so nothing fires a second time.
#
# The decoder layer's own hooks already fire once: `RematLayer` is the layer's `forward`, called by
# the module with its hooks, and the recompute calls the class's `forward` directly. Their output is
# differentiable; a loss on it (`output_hidden_states`) is NOTE [ Gradients that bypass the next layer ]
# in bypass.py.

# NOTE [ A layer's modules, listed once ]
# Every pass over a rematerialized layer (its no-grad forward, its recompute) looks at the forward-hook
# dicts of each module inside it, hooks or none. Walking `named_modules()` for that, twice in the forward
# (the names for messages, then the dicts) and once in the recompute, cost 0.3-0.9 ms a pass on the CPU
# thread that issues the layer's kernels (a Qwen2 layer with LoRA on seven projections holds 83 modules).
# So the modules are listed once per layer, kept beside it (weakly). Each pass reads every hook dict
# afresh, so a hook registered after the first step fires at its next pass, and first checks that each
# listed module is alive and holds the very children it held (their ids, no names built): a module added,
# replaced or removed anywhere inside the layer, by `setattr`, `add_module`, `ModuleList.insert` or a
# write into `_modules`, makes a new list. Names are built only when a hook is there to be named.
# Tests: tests/replay/test_hooks.py (a hook, and a module with a hook, added after the first step).

_HOOK_DICTS = ("_forward_hooks", "_forward_pre_hooks")
_GLOBAL_HOOK_DICTS = ("_global_forward_hooks", "_global_forward_pre_hooks")


@contextmanager
def hooks_once(layer: nn.Module, index: int, anchor: Tensor) -> Iterator[None]:
    """Around a layer's no-grad forward: the hooks inside it see aliases that refuse a gradient, and may not replace.

    Args:
        layer: The decoder layer.
        index: Its position in the decoder stack (for messages).
        anchor: A leaf that requires grad, so that the aliases do too inside the no-grad forward.
    """
    listed, modules = _inner_modules(layer)

    def wrap(dict_name: str, hook: Callable[..., Any]) -> Callable[..., Any]:
        pre = dict_name.endswith("pre_hooks")
        owner = _owner(hook)

        def once(module: nn.Module, *given: Any) -> None:
            # `given` is (args,) or (args, kwargs) for a pre-hook, (args, output) or (args, kwargs, output) after.
            name = listed.name(module, index)
            seen = tuple(_refusing(value, f"{name}` (the hook `{owner}`)", anchor) for value in given)
            result = hook(module, *seen)
            if result is not None and not _returned_as_given(result, seen, pre):
                raise MisconfigurationException(
                    f"BlockwiseStrategy: the forward {'pre-' if pre else ''}hook `{owner}` on `{name}` returned a"
                    f" replacement {'input' if pre else 'output'} (not the objects it was given), which changes what"
                    " the layer computes. A rematerialized layer would have to call it again in the recompute, a"
                    " second time per step (NOTE [ Forward hooks inside a rematerialized layer ]). Return `None` (or"
                    " what it was given) to observe; make the change inside the module (or with a PEFT adapter), or"
                    " train with `strategy='auto'`."
                )

        return once

    with _hooks_replaced(modules, wrap):
        yield


@contextmanager
def hooks_silenced(layer: nn.Module) -> Iterator[None]:
    """Around a layer's recompute: the forward hooks inside it (and process-wide ones) do not fire again."""
    with _hooks_replaced(_inner_modules(layer)[1], None):
        yield


class _NoGradient(torch.autograd.Function):
    """What a hook inside a rematerialized layer saw in the no-grad forward: a gradient reaching it is refused."""

    @staticmethod
    def forward(ctx: Any, name: str, value: Tensor, anchor: Tensor) -> Tensor:  # type: ignore[override]
        ctx.name = name
        ctx.set_materialize_grads(False)
        return value.view_as(value)

    @staticmethod
    def backward(ctx: Any, grad: Tensor | None) -> tuple[None, ...]:
        if grad is not None:
            raise MisconfigurationException(
                f"BlockwiseStrategy: the loss depends on a tensor that a forward hook on `{ctx.name} received."
                " Rematerialized layers run their modules without autograd in the forward (the recompute comes in"
                " the backward), so that term's gradient would be lost, unlike resident training (NOTE [ Forward"
                " hooks inside a rematerialized layer ]). Detach what the hook keeps if it is a metric, build the"
                " term from the decoder's output, or train this module with `strategy='auto'`."
            )
        return (None, None, None)


def _refusing(value: Any, name: str, anchor: Tensor) -> Any:
    """``value`` with its floating-point tensors (one level into tuples, lists, dicts) behind :class:`_NoGradient`."""
    if isinstance(value, Tensor):
        if not value.is_floating_point():
            return value
        with torch.enable_grad():
            return _NoGradient.apply(name, value, anchor)
    if isinstance(value, (tuple, list)):
        return type(value)(_refusing(v, name, anchor) for v in value)
    if isinstance(value, dict):
        return {k: _refusing(v, name, anchor) for k, v in value.items()}
    return value


def _returned_as_given(result: Any, given: tuple[Any, ...], pre: bool) -> bool:
    """Whether a hook's ``result`` is what it was ``given`` (it observed), read as torch reads a hook's return.

    A pre-hook returns the positional arguments (a lone value stands for a 1-tuple) or, registered with kwargs,
    the pair ``(args, kwargs)``; a forward hook returns the output.
    """
    if not pre:
        return _same(result, given[-1])
    if len(given) == 2:
        return isinstance(result, tuple) and len(result) == 2 and all(map(_same, result, given))
    args = given[0]
    return _same(result, args) or (not isinstance(result, tuple) and len(args) == 1 and result is args[0])


def _same(a: Any, b: Any) -> bool:
    """``a is b``, or containers holding the very same objects."""
    if a is b:
        return True
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return False


def _owner(hook: Callable[..., Any]) -> str:
    """Where ``hook`` comes from, for messages: its ``__module__`` and ``__qualname__`` (through ``partial``)."""
    while isinstance(hook, functools.partial):
        hook = hook.func
    named = hook if hasattr(hook, "__qualname__") else type(hook)
    return f"{getattr(named, '__module__', None) or '?'}.{named.__qualname__}"


class _InnerModules:
    """The modules of one decoder layer, listed once (NOTE [ A layer's modules, listed once ]).

    Held through weak references: kept in a dict keyed weakly by the layer, a strong one would keep the layer alive
    through any inner module that refers back to it.
    """

    def __init__(self, layer: nn.Module) -> None:
        # Each module of the layer (the layer first) with the ids of the children it holds. Ids compare safely: one
        # can be reused only by a new object once the old one died, and `alive` sees every listed module's death.
        self.tree = tuple((weakref.ref(m), tuple(map(id, m._modules.values()))) for m in layer.modules())
        self.names: dict[int, str] | None = None

    def alive(self) -> list[nn.Module] | None:
        """The modules inside the layer (not the layer), or None if one died or holds other children than listed."""
        modules = []
        for ref, children in self.tree:
            module = ref()
            if module is None or tuple(map(id, module._modules.values())) != children:
                return None
            modules.append(module)
        return modules[1:]

    def name(self, module: nn.Module, index: int) -> str:
        """``module``'s name in the decoder stack, for messages."""
        layer = self.tree[0][0]()
        if self.names is None and layer is not None:
            self.names = {id(m): name for name, m in layer.named_modules() if name}
        name = (self.names or {}).get(id(module))
        return f"a module of decoder layer {index}" if name is None else f"layers.{index}.{name}"


_LISTED: weakref.WeakKeyDictionary[nn.Module, _InnerModules] = weakref.WeakKeyDictionary()


def _inner_modules(layer: nn.Module) -> tuple[_InnerModules, list[nn.Module]]:
    """``layer``'s list and the modules inside it: as listed before, or listed anew if its tree changed since."""
    listed = _LISTED.get(layer)
    modules = None if listed is None else listed.alive()
    if listed is None or modules is None:
        listed = _LISTED[layer] = _InnerModules(layer)
        modules = [m for m in layer.modules() if m is not layer]
    return listed, modules


@contextmanager
def _hooks_replaced(
    modules: list[nn.Module], wrap: Callable[[str, Callable[..., Any]], Callable[..., Any]] | None
) -> Iterator[None]:
    """Replace the forward-hook dicts of ``modules`` (a layer's) and the global ones; ``wrap=None`` empties them.

    Hook ids are kept, so torch's per-id flags (``with_kwargs``, ``always_call``) still apply.
    """
    saved: list[tuple[Any, str, OrderedDict[int, Any]]] = []
    try:
        for owner in modules:
            if not (owner._forward_hooks or owner._forward_pre_hooks):
                continue  # no hooks, the usual case: one look, not two
            for dict_name in _HOOK_DICTS:
                hooks = getattr(owner, dict_name)
                if hooks:
                    saved.append((owner, dict_name, hooks))
                    setattr(owner, dict_name, _replaced(hooks, dict_name, wrap))
        for dict_name in _GLOBAL_HOOK_DICTS:
            hooks = getattr(torch_module, dict_name)
            if hooks:
                saved.append((torch_module, dict_name, hooks))
                setattr(torch_module, dict_name, _replaced(hooks, dict_name, wrap))
        yield
    finally:
        for owner, dict_name, hooks in reversed(saved):
            setattr(owner, dict_name, hooks)


def _replaced(
    hooks: OrderedDict[int, Any], dict_name: str, wrap: Callable[[str, Callable[..., Any]], Callable[..., Any]] | None
) -> OrderedDict[int, Any]:
    if wrap is None:
        return OrderedDict()
    return OrderedDict((hook_id, wrap(dict_name, hook)) for hook_id, hook in hooks.items())


__all__ = ["hooks_once", "hooks_silenced"]
