"""Rematerializing decoder layers: a no-grad forward that keeps only the layer input.

The backward recomputes each layer under its saved RNG state and call arguments.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Collection, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_blockwise.replay.bypass import note_arrival, refuse_a_bypass
from lightning_blockwise.replay.capture import LayerCall
from lightning_blockwise.replay.hooks import hooks_once, hooks_silenced
from lightning_blockwise.replay.kept import KeptFunction
from lightning_blockwise.replay.kept_attention import KeptAttention, recording, serving
from lightning_blockwise.replay.rng import RngSnapshot
from lightning_blockwise.replay.segments import segment_for
from lightning_blockwise.residency.activations import ActivationOffload
from lightning_blockwise.residency.base import Pass, Residency

# NOTE [ Exact rematerialization ]
# The recompute in the backward must be the very function the forward evaluated, so that
# its gradients equal, bit for bit, those of resident training. That needs the same
# input (saved), the same random numbers (NOTE [ RNG replay ] in rng.py), the same call
# arguments and autocast state (NOTE [ Per-layer call replay ] in capture.py), and the
# same weights (the frozen base is never written; the residency only moves copies).
#
# Adapter parameters are not inputs of the autograd.Function, and their gradients do not
# leave it as outputs: the recompute's own backward accumulates them into ``.grad``
# (``torch.autograd.backward(..., inputs=...)``), through the parameters' own
# ``AccumulateGrad`` nodes, in the order resident training's backward reaches them. (As
# inputs that got no gradient back, their ``AccumulateGrad`` nodes would still run in the
# outer backward, and DDP's hooks on them fire a second time: "Expected to mark a variable
# ready only once".) The Function takes an empty leaf tensor that requires a gradient
# instead, so that its output needs one even where the layer input does not (the first
# layer's input comes from a frozen embedding); its gradient is never computed. Gradient
# accumulation, tensor hooks, clipping and Lightning's ``on_after_backward`` see them as in
# resident training either way; the order is for DDP's reducer, which lays out its buckets
# in the order gradients arrive: returned as outputs, a layer's gradients arrived together
# in the outer engine's queue order, DDP's rebuilt buckets differed from resident DDP's, and
# with 3 ranks a sum's order, and so its rounding, changed (tests/distributed: the
# second optimizer step's loss differed in the last bit).
#
# Parameters are kept on ``ctx`` as plain references, not through ``save_for_backward``:
# they are alive in the module anyway, and saving them would hand them to any
# saved-tensor hooks (activation offloading) for nothing. Between forward and backward
# autograd holds one tensor per layer: its input, or with an ``ActivationOffload`` only a
# handle to its copy in host memory (NOTE [ Layer-input offload ] in residency/activations.py).
#
# NOTE [ Graphs do not outlive residency ]
# bitsandbytes' ``MatMul4Bit`` keeps the packed weight and its quant state on ``ctx`` as
# plain attributes. A graph that survived its block's residency would read whatever a
# streamed slot holds next: forward exact, gradients silently wrong. So the recompute's
# graph is built, differentiated and dropped between ``acquire`` and ``release`` of the
# same backward step, and the no-grad forward builds no graph at all. (A kept layer's graph does outlive
# its block's residency: its backward brings the block back to the same slot first, NOTE [ Kept graphs
# of streamed blocks ] in kept.py.)


class RematLayer:
    """The forward installed on one decoder layer (an instance attribute; the class is untouched).

    Under grad mode with something to differentiate, the call goes through
    :class:`_RematFunction`; otherwise (validation, ``torch.no_grad()``) it runs the
    layer directly. Either way the layer's weights are acquired from the residency first.

    Args:
        layer: The decoder layer.
        index: Its position in the decoder stack.
        params: Its trainable parameters (the adapters).
        residency: Makes the layer's frozen tensors usable while it runs.
        offload: Where the layer's input waits for the backward; ``None`` keeps it on the device.
        to_host: With an ``offload``, whether the input goes to host memory (else it is kept on the device, on the
            offload's stack: NOTE [ Split layer inputs ] in residency/activations.py).
        checkpoint_every: Keep the input only if it starts a segment of this many layers, and replay the segment
            in the backward for the others (NOTE [ Input checkpoints ] in segments.py); ``None``: always keep it.
        keep: Keep the forward's graph to the backward instead of recomputing it (a layer of a
            streamed block whose activations fit the budget: NOTE [ Kept graphs of streamed blocks ]
            in kept.py).
        keep_attention: Keep the attention kernels' outputs from the forward for the recompute, which then does not
            run them again (NOTE [ Kept attention ] in kept_attention.py); not with ``checkpoint_every``.
    """

    def __init__(
        self,
        layer: nn.Module,
        index: int,
        params: Sequence[nn.Parameter],
        residency: Residency,
        offload: ActivationOffload | None = None,
        keep: bool = False,
        to_host: bool = True,
        checkpoint_every: int | None = None,
        keep_attention: bool = False,
    ) -> None:
        self.layer = layer
        self.index = index
        self.params = tuple(params)
        self.residency = residency
        self.offload = offload
        self.to_host = to_host
        self.checkpoint_every = checkpoint_every
        self.keep = keep
        # A segment's replay reruns layers whose forward kept nothing (NOTE [ Input checkpoints ] in segments.py).
        self.keep_attention = keep_attention and checkpoint_every is None
        # The instance's own checkpointing flag, put back by `uninstall` (None: the class default applied).
        self.saved_checkpointing: bool | None = vars(layer).get("gradient_checkpointing")
        # The layer's own forward: one a user set on the instance (NOTE [ A forward set on the layer ]), else the
        # class's (Hugging Face's checkpointing is switched off on the instance while this wrapper is installed).
        self.own_forward: Callable[..., Any] | None = vars(layer).get("forward")
        own = self.own_forward
        self._forward = type(layer).forward if own is None else (lambda _layer, *args, **kwargs: own(*args, **kwargs))
        # What makes the Function's output need a gradient when only the adapters do (NOTE [ Exact rematerialization ]).
        self.anchor = torch.empty(0, requires_grad=True)

    def run(self, hidden: Tensor, call: LayerCall) -> Tensor:
        """Evaluate the layer on ``hidden`` with the recorded call arguments."""
        output = self._forward(self.layer, hidden, *call.args, **call.kwargs)
        if not isinstance(output, Tensor):
            raise TypeError(
                f"BlockwiseStrategy expects decoder layer {self.index} ({type(self.layer).__name__}) to return the"
                f" hidden states as a tensor, got {type(output).__name__}. This architecture is not supported."
            )
        return output

    def run_once(self, hidden: Tensor, call: LayerCall) -> Tensor:
        """:meth:`run` as the no-grad forward: the hooks inside the layer fire here, on aliases that refuse a gradient.

        See NOTE [ Forward hooks inside a rematerialized layer ] in hooks.py.
        """
        with hooks_once(self.layer, self.index, self.anchor):
            return self.run(hidden, call)

    def rerun(self, hidden: Tensor, call: LayerCall) -> Tensor:
        """:meth:`run` as the recompute: the hooks inside the layer fired in the forward and stay silent."""
        with hooks_silenced(self.layer):
            return self.run(hidden, call)

    def __call__(self, *args: Any, **kwargs: Any) -> Tensor:
        """Run the layer as its own forward would be called: hidden states first, then its arguments."""
        if args:
            hidden, args = args[0], args[1:]
        else:
            hidden = kwargs.pop("hidden_states")
        params = tuple(p for p in self.params if p.requires_grad)
        if not torch.is_grad_enabled() or not (params or hidden.requires_grad):
            self.residency.acquire(self.index, Pass.FORWARD)
            output = self._forward(self.layer, hidden, *args, **kwargs)
            self.residency.release(self.index, Pass.FORWARD)
            return output
        call = LayerCall.capture(hidden.device, args, kwargs)
        if self.keep:
            return KeptFunction.apply(self, call, params, hidden, self.anchor)
        rng = RngSnapshot.capture(hidden.device)
        output = _RematFunction.apply(self, call, rng, params, hidden, self.anchor)
        # The gradient as it arrives, before the user's tensor hooks (NOTE [ Gradients that bypass the next layer ] in
        # bypass.py):
        # this hook is the output's first. A dict on the node, not the node in the hook, or the two hold each other.
        output.grad_fn.arrival = arrival = {}
        output.register_hook(functools.partial(note_arrival, arrival))
        return output


class _RematFunction(torch.autograd.Function):
    """See NOTE [ Exact rematerialization ]."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        remat: RematLayer,
        call: LayerCall,
        rng: RngSnapshot,
        params: tuple[nn.Parameter, ...],
        hidden: Tensor,
        anchor: Tensor,
    ) -> Tensor:
        ctx.attention = KeptAttention(remat.index) if remat.keep_attention else None
        remat.residency.acquire(remat.index, Pass.FORWARD)
        with recording(ctx.attention):
            output = remat.run_once(hidden, call)
        remat.residency.release(remat.index, Pass.FORWARD)
        ctx.remat, ctx.call, ctx.rng, ctx.params = remat, call, rng, params
        # The layer below, when it is rematerialized too (NOTE [ Gradients that bypass the next layer ]).
        ctx.below = hidden.grad_fn if isinstance(hidden.grad_fn, _RematFunction._backward_cls) else None
        # The offload the forward used, even if the strategy switches it before the backward.
        ctx.offload = remat.offload
        ctx.segment = None
        if remat.checkpoint_every is not None:
            # NOTE [ Input checkpoints ] in segments.py: the input is kept only where a segment starts.
            every, offload, to_host = remat.checkpoint_every, ctx.offload, remat.to_host
            ctx.segment, ctx.position = segment_for(ctx.below, every, remat, call, rng, hidden, offload, to_host)
            ctx.output_version = output._version
        elif ctx.offload is None:
            ctx.save_for_backward(hidden)
        elif remat.to_host:
            ctx.saved_input = ctx.offload.save(hidden)
        else:
            ctx.saved_input = ctx.offload.keep(hidden)
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        remat: RematLayer = ctx.remat
        refuse_a_bypass(ctx, grad_output)
        if ctx.segment is not None:
            hidden = ctx.segment.input_of(ctx.position)
        elif ctx.offload is None:
            (hidden,) = ctx.saved_tensors
        else:
            hidden = ctx.offload.load(ctx.saved_input)
            del ctx.saved_input
        wants_input_grad = ctx.needs_input_grad[4]
        params = list(ctx.params)  # those that required a gradient in the forward

        attention, ctx.attention = ctx.attention, None
        remat.residency.acquire(remat.index, Pass.BACKWARD)
        with ctx.rng.replay():
            x = hidden.detach().requires_grad_(wants_input_grad)
            with torch.enable_grad(), ctx.call.autocast_context(), serving(attention):
                output = remat.rerun(x, ctx.call)
        inputs = [x, *params] if wants_input_grad else params
        # Into `.grad`, in resident training's order (NOTE [ Exact rematerialization ]).
        torch.autograd.backward(output, grad_output, inputs=inputs)
        # The recompute graph dies here, inside the residency (NOTE [ Graphs do not outlive residency ]).
        del output
        remat.residency.release(remat.index, Pass.BACKWARD)
        grad_input = x.grad if wants_input_grad else None
        if ctx.below is not None:
            # Kept by reference: the layer below checks that this very tensor is all it receives.
            ctx.below.handed = grad_input
            ctx.below = None
        return (None, None, None, None, grad_input, None)


def install(
    layers: Sequence[nn.Module],
    params: Sequence[Sequence[nn.Parameter]],
    residency: Residency,
    offload: ActivationOffload | None = None,
    keep: Collection[int] = (),
    to_host: Collection[int] | None = None,
    checkpoint_every: int | None = None,
    keep_attention: Collection[int] = (),
) -> None:
    """Install a :class:`RematLayer` as the ``forward`` of each layer, in place; those in ``keep`` keep their graphs.

    With an ``offload``, the inputs of the layers in ``to_host`` (``None``: all) wait in host memory, the
    others on the device (NOTE [ Split layer inputs ] in residency/activations.py). With ``checkpoint_every``
    only every so many layers' inputs are kept, the others replayed (NOTE [ Input checkpoints ] in segments.py).
    Those in ``keep_attention`` keep their attention kernels' outputs for the recompute (NOTE [ Kept attention ] in
    kept_attention.py).

    Parameter names, ``state_dict`` keys and the layer classes are unchanged; only the
    instances get a ``forward`` attribute (removed by :func:`uninstall`). Hugging Face's own
    gradient checkpointing is switched off on the instances meanwhile: the recompute
    already does its job, and nesting it would run each layer a third time.
    """
    # NOTE [ A forward set on the layer ]
    # A `forward` assigned on a decoder layer's instance (a user's patch, `types.MethodType(...)`) is what resident
    # training calls. The wrapper takes that attribute's place, so it runs the patch (in the forward and the recompute,
    # as Hugging Face's checkpointing would) and `uninstall` puts it back; the class's forward trained another function,
    # silently. (accelerate's patches count calls: refused, NOTE [ accelerate's hooks replace forward ].)
    for index, (layer, layer_params) in enumerate(zip(layers, params, strict=True)):
        uninstall([layer])
        host = to_host is None or index in to_host
        layer.forward = RematLayer(
            layer,
            index,
            layer_params,
            residency,
            offload,
            keep=index in keep,
            to_host=host,
            checkpoint_every=checkpoint_every,
            keep_attention=index in keep_attention,
        )
        layer.gradient_checkpointing = False


def uninstall(layers: Sequence[nn.Module]) -> None:
    """Remove installed :class:`RematLayer` wrappers, restoring each layer's own forward and checkpointing flag."""
    for layer in layers:
        remat = installed(layer)
        if remat is None:
            continue
        del layer.forward  # a wrapper over it too (NOTE [ A wrapper over the installed forward ])
        if remat.own_forward is not None:
            layer.forward = remat.own_forward
        if remat.saved_checkpointing is None:
            vars(layer).pop("gradient_checkpointing", None)
        else:
            layer.gradient_checkpointing = remat.saved_checkpointing


# NOTE [ A wrapper over the installed forward ]
# An opt-in feature that changes how a rematerialized layer is called wraps the installed forward instead of making
# every call ask whether it is on: block-major accumulation's `WindowForward` (replay/window_forward.py), while its
# windows run. Such a wrapper holds the forward as `wrapped_remat`; `installed` looks through it, and `uninstall`
# removes both, so the streamed stack's re-installs and the contexts that give layers their own forward back work
# as without it.


def installed(layer: nn.Module) -> RematLayer | None:
    """The wrapper installed on ``layer``, if any, also under a wrapper over it.

    NOTE [ A wrapper over the installed forward ].
    """
    forward = vars(layer).get("forward")
    remat = getattr(forward, "wrapped_remat", forward)
    return remat if isinstance(remat, RematLayer) else None
