"""Input checkpoints: a second level of rematerialization, keeping every k-th layer input and replaying the rest.

The forward keeps the input of the first layer of each segment of ``k`` layers only; the backward, on
reaching a segment, replays its layers forward from that input to recompute the inputs of the others.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from lightning_blockwise.replay.capture import LayerCall
from lightning_blockwise.replay.layer import ReplayedLayer
from lightning_blockwise.replay.rng import RngSnapshot
from lightning_blockwise.residency.activations import ActivationOffload
from lightning_blockwise.residency.base import Pass
from lightning_blockwise.residency.saved_inputs import SavedInput

# NOTE [ Input checkpoints ]
# A rematerialized layer keeps its input between forward and backward (NOTE [ Exact
# rematerialization ] in remat.py): layers x tokens x hidden x 2 B, more than a card or a host
# holds at long context. With ``input_checkpoint_every=k`` the layers form segments ``[c, c+k)``
# (``c`` a multiple of ``k``) and only the first layer of each keeps its input, on the device or
# in host memory as the layer-input offload decides for layer ``c`` (NOTE [ Split layer inputs ]
# in residency/activations.py). The others keep their RNG state and call (NOTE [ RNG replay ],
# NOTE [ Per-layer call replay ]), as every rematerialized layer does, and a reference to their
# segment.
#
# The backward reaches a segment at its top layer ``t``. Before ``t`` is recomputed, the segment
# replays layers ``c..t-1`` forward from input ``c``, without a graph, each under its own RNG state
# and call, its autocast state restored: the very function each layer's no-grad forward evaluated,
# on the very input, so each output is, bit for bit, the input the next layer had in the forward.
# The segment holds those inputs on the device; each layer's recompute then takes its own, as it
# would have taken a kept one, and the last (layer ``c``'s) frees the checkpoint. Weight traffic
# grows from two passes to about three: the replay streams ``c..t-1`` once more, in forward order
# (``Pass.REPLAY``; the streamer prefetches along the step's order, NOTE [ Prefetch order ] in
# residency/streamer.py). Each layer but a segment's top runs three times per step.
#
# A layer joins the segment of the layer below only when its input is that layer's output, as
# autograd sees it (its ``grad_fn`` is the layer below's node) and unchanged since (the same
# version): anything between two layers (a hook that replaces the hidden states, a layer that is
# not rematerialized, an in-place change) would not be replayed, so the layer above starts a new
# segment and keeps its own input instead. The replay's inputs live on the segment, not in saved
# tensors: a second backward through the same graph (``retain_graph=True``) is refused.


class Segment:
    """Consecutive rematerialized layers of one forward, from a checkpointed input (NOTE [ Input checkpoints ]).

    Args:
        hidden: The first layer's input.
        offload: Where it waits for the backward (``None``: on the device, as a saved tensor would).
        to_host: With an ``offload``, whether it waits in host memory.
    """

    __slots__ = ("_checkpoint", "_inputs", "_offload", "_version", "members", "replayed")

    def __init__(self, hidden: Tensor, offload: ActivationOffload | None, to_host: bool) -> None:
        self._offload = offload
        if offload is None:
            self._checkpoint: Tensor | SavedInput | None = hidden
        else:
            self._checkpoint = offload.save(hidden) if to_host else offload.keep(hidden)
        self._version = hidden._version
        #: The layers, in order, with what replays each: the layer, its call and its RNG state.
        self.members: list[tuple[ReplayedLayer, LayerCall, RngSnapshot]] = []
        #: Layer runs the replays made (a count for tests and profiles).
        self.replayed = 0
        self._inputs: dict[int, Tensor] = {}

    def join(self, layer: ReplayedLayer, call: LayerCall, rng: RngSnapshot) -> int:
        """Add the next layer; its position in the segment."""
        self.members.append((layer, call, rng))
        return len(self.members) - 1

    def input_of(self, position: int) -> Tensor:
        """The input of the layer at ``position``, replayed if needed; handed out once.

        Raises:
            RuntimeError: If the segment's inputs were all handed out already (a second backward).
        """
        if position not in self._inputs:
            below = max((p for p in self._inputs if p < position), default=None)
            if below is None:
                self._inputs[0] = self._take_checkpoint()
                below = 0
            self._replay(below, position)
        return self._inputs.pop(position)

    def _take_checkpoint(self) -> Tensor:
        checkpoint, self._checkpoint = self._checkpoint, None
        if checkpoint is None:
            index = self.members[0][0].index
            raise RuntimeError(
                f"BlockwiseStrategy: a second backward reached the input checkpoint of decoder layer {index}, whose"
                " inputs the first one consumed (NOTE [ Input checkpoints ]). To backpropagate twice"
                " (`retain_graph=True`), train without `input_checkpoint_every`."
            )
        if isinstance(checkpoint, SavedInput):
            assert self._offload is not None
            return self._offload.load(checkpoint)
        if checkpoint._version != self._version:
            raise RuntimeError(
                f"BlockwiseStrategy: the input of decoder layer {self.members[0][0].index}, kept for the backward as an"
                " input checkpoint, was modified in place after the forward. Do not modify decoder hidden states in"
                " place."
            )
        return checkpoint

    def _replay(self, below: int, position: int) -> None:
        """Run the layers at ``below..position-1`` forward without a graph, keeping the inputs they make."""
        hidden = self._inputs[below]
        for index in range(below, position):
            layer, call, rng = self.members[index]
            layer.residency.acquire(layer.index, Pass.REPLAY)
            with rng.replay(), torch.no_grad(), call.autocast_context():
                hidden = layer.rerun(hidden, call)
            layer.residency.release(layer.index, Pass.REPLAY)
            self._inputs[index + 1] = hidden
            self.replayed += 1


def segment_for(
    below: Any,
    every: int,
    layer: ReplayedLayer,
    call: LayerCall,
    rng: RngSnapshot,
    hidden: Tensor,
    offload: ActivationOffload | None,
    to_host: bool,
) -> tuple[Segment, int]:
    """The segment a layer joins in the forward, and its position there (NOTE [ Input checkpoints ]).

    Args:
        below: The autograd node of the rematerialized layer whose output ``hidden`` is, or ``None``.
        every: Layers per segment.
        layer: The layer.
        call: Its call.
        rng: Its RNG state before the forward.
        hidden: Its input.
        offload: Where a checkpointed input waits (``None``: on the device).
        to_host: With an ``offload``, whether this layer's input would wait in host memory.
    """
    segment: Segment | None = getattr(below, "segment", None)
    joins = (
        segment is not None
        and layer.index % every != 0
        and below.position == len(segment.members) - 1
        and hidden._version == below.output_version
    )
    if not joins:
        segment = Segment(hidden, offload, to_host)
    assert segment is not None
    return segment, segment.join(layer, call, rng)


__all__ = ["Segment", "segment_for"]
