"""A random base's draws: each linear and other parameter, in the order ``random_nf4_model`` takes them.

:func:`random_linear` and :func:`random_parameter` are the rule both random builders follow;
:func:`draw_in_order` builds a meta model's parameters in ``random_nf4_model``'s order one decoder layer at a
time (NOTE [ Random draw order ]) for :func:`~lightning_blockwise.loading.random_base.random_blockwise`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers import PreTrainedModel

from lightning_blockwise.compat.bitsandbytes import move_to_host, nf4_linear


def random_linear(
    linear: nn.Linear, device: torch.device, compute_dtype: torch.dtype, std: float, quantize: bool = True
) -> nn.Linear:
    """The random replacement of ``linear``: its weight drawn on ``device``, NF4 (double quant) unless not ``quantize``.

    The weight is ``torch.randn(out, in) * std`` in ``compute_dtype`` from ``device``'s default generator, the bias
    (if any) zeros; both frozen. On the meta device nothing is drawn: the result predicts the bytes of the real one.
    The rule ``random_nf4_model`` and ``random_blockwise`` share (NOTE [ Random draw order ]).
    """
    weight = torch.randn(linear.out_features, linear.in_features, device=device, dtype=compute_dtype) * std
    if quantize:
        built: nn.Linear = nf4_linear(linear, weight, compute_dtype)
    else:
        built = nn.Linear(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        built.weight = nn.Parameter(weight, requires_grad=False)
    if linear.bias is not None:
        built.bias = nn.Parameter(torch.zeros_like(weight[:, 0]), requires_grad=False)
    return built


def random_parameter(param: torch.Tensor, device: torch.device, std: float) -> nn.Parameter:
    """A frozen random value for a (meta) parameter other than a linear's: 1-D (norms) all ones, else ``N(0, std)``.

    Only the ``normal_`` draws from the generator; a 1-D parameter takes none (NOTE [ Random draw order ]).
    """
    fresh = torch.empty(param.shape, dtype=param.dtype, device=device)
    fresh.fill_(1.0) if param.dim() == 1 else fresh.normal_(0, std)
    return nn.Parameter(fresh, requires_grad=False)


# NOTE [ Random draw order ]
# `random_nf4_model` draws from the device's generator in two passes over the whole model: first every
# linear's weight but the LM head's, in `named_modules` order (`random_linear`), then every other parameter
# in `modules()` order (`random_parameter`: the embeddings, the head; a 1-D parameter is filled, not drawn).
# Built layer by layer, the draws are the same numbers only if each is taken from the generator state it has
# there. For dense architectures a layer's other parameters are 1-D, so the layers are built in order, each
# drawing its linears where the first pass would, and the rest of the model follows. Where a layer holds other
# drawn parameters (qwen3_moe's 3-D experts, drawn in the second pass between the embeddings and the next
# layer), a first pass draws and drops every linear's weight to record the state at each layer's first linear
# and where the second pass starts; then the second pass walks `modules()` and builds each layer on reaching
# it: its linears from the recorded state, its other parameters from the second pass's own. The generator
# states are the whole of it: the same calls from the same states give the same numbers.
def draw_in_order(
    model: PreTrainedModel,
    layers: nn.ModuleList,
    linears: list[list[str]],
    device: torch.device,
    compute_dtype: torch.dtype,
    std: float,
    quantize: bool,
    generator: torch.Generator,
    built: Callable[[int], None],
) -> None:
    """Draw every parameter of a meta model in ``random_nf4_model``'s order, one decoder layer at a time.

    Args:
        model: The model, its parameters on the meta device (its decoder layers' linears converted as they will be).
        layers: Its decoder layers.
        linears: Each layer's linears' names (``named_modules`` order), drawn by :func:`random_linear`.
        device: Where to draw (and quantize).
        compute_dtype: The linears' dtype.
        std: Standard deviation of the draws.
        quantize: NF4 linears, else dense.
        generator: ``device``'s default generator, seeded.
        built: Called with ``i`` once layer ``i`` is on the host (to pack its block).

    Raises:
        RuntimeError: If a parameter is left on the meta device (a bug).
    """
    index = {id(layer): i for i, layer in enumerate(layers)}
    inside = {id(sub) for layer in layers for sub in layer.modules()}
    interleaved = any(p.dim() != 1 for layer in layers for p in _other_parameters(layer))
    starts: list[torch.Tensor] | None = None
    if interleaved:
        starts = []
        for layer, names in zip(layers, linears, strict=True):
            starts.append(generator.get_state())
            for name in names:
                linear = layer.get_submodule(name)
                torch.randn(linear.out_features, linear.in_features, device=device, dtype=compute_dtype)

    def build(i: int) -> None:
        rest = generator.get_state()
        if starts is not None:
            generator.set_state(starts[i])
        for name in linears[i]:
            built_linear = random_linear(layers[i].get_submodule(name), device, compute_dtype, std, quantize)
            _to_host(built_linear)
            layers[i].set_submodule(name, built_linear)
        if starts is not None:
            generator.set_state(rest)
        for sub in layers[i].modules():
            _draw_parameters(sub, device, std)
        built(i)

    if starts is None:
        for i in range(len(layers)):
            build(i)
    for module in model.modules():
        if starts is not None and id(module) in index:
            build(index[id(module)])
        elif id(module) not in inside:
            _draw_parameters(module, device, std)
    left = [name for name, param in model.named_parameters() if param.is_meta]
    if left:
        raise RuntimeError(f"random_blockwise: {', '.join(left[:5])} were not built; this is a bug.")


def _other_parameters(layer: nn.Module) -> list[torch.Tensor]:
    """A meta layer's parameters that are not its linears' (its linears are converted already)."""
    return [p for sub in layer.modules() if not isinstance(sub, nn.Linear) for p in sub.parameters(recurse=False)]


def _draw_parameters(module: nn.Module, device: torch.device, std: float) -> None:
    """Draw ``module``'s own meta parameters on ``device`` (``random_parameter``) and keep them on the host."""
    for name, param in list(module.named_parameters(recurse=False)):
        if param.is_meta:
            setattr(module, name, nn.Parameter(random_parameter(param, device, std).to("cpu"), requires_grad=False))


def _to_host(linear: nn.Linear) -> None:
    """Move a built linear to the host: an NF4 weight with its quant state (the same objects), or a dense one."""
    if hasattr(linear.weight, "quant_state"):
        move_to_host(linear.weight)
    else:
        linear.weight = nn.Parameter(linear.weight.to("cpu"), requires_grad=False)
    if linear.bias is not None:
        linear.bias = nn.Parameter(linear.bias.to("cpu"), requires_grad=False)


__all__ = ["draw_in_order", "random_linear", "random_parameter"]
