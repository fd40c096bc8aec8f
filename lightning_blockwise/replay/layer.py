"""What kept graphs and block-major windows need of a rematerialized layer (``remat.RematLayer`` is one).

A floor below ``remat.py``: the modules ``remat.py`` calls into name the layer by this protocol rather than
by its class, so their imports point down only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from torch import Tensor, nn

from lightning_blockwise.replay.capture import LayerCall
from lightning_blockwise.residency.base import Residency


class ReplayedLayer(Protocol):
    """A decoder layer run twice, once without a graph and once with one.

    Attributes:
        index: The layer's index in the decoder stack.
        params: The layer's trainable parameters (its adapters).
        residency: Where the layer's frozen tensors are made resident for a pass.
        anchor: What makes the replay's output need a gradient when only the adapters do.
    """

    index: int
    params: Sequence[nn.Parameter]
    residency: Residency
    anchor: Tensor

    def run(self, hidden: Tensor, call: LayerCall) -> Tensor:
        """Evaluate the layer on ``hidden`` with the recorded call arguments."""
        ...

    def run_once(self, hidden: Tensor, call: LayerCall) -> Tensor:
        """The no-grad forward, where the hooks inside the layer fire."""
        ...

    def rerun(self, hidden: Tensor, call: LayerCall) -> Tensor:
        """The recompute, where the hooks inside the layer stay silent."""
        ...
