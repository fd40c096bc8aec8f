"""RNG snapshots taken before a layer's forward and replayed in its recompute.

# NOTE [ RNG replay ]
# A layer with dropout draws random numbers in its forward. The backward recomputes the
# layer, and the recompute must draw exactly the numbers the forward drew, or its graph
# is a different function from the one whose output the loss saw. So the CPU generator
# and the generator of the layer's device are captured right before the forward and
# restored right before the recompute. The restore happens inside
# ``torch.random.fork_rng`` so that, once the recompute is done, the global generators
# are back where the backward found them: the run's random stream advances exactly as in
# resident training, where the backward draws nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class RngSnapshot:
    """The CPU generator state and, on an accelerator, that device's generator state.

    Args:
        cpu_state: ``torch.get_rng_state()`` at capture time.
        device: The accelerator device whose state was captured, or ``None`` on CPU.
        device_state: That device's generator state, or ``None`` on CPU.
    """

    cpu_state: Tensor
    device: torch.device | None
    device_state: Tensor | None

    @classmethod
    def capture(cls, device: torch.device) -> RngSnapshot:
        """Snapshot the generators a layer running on ``device`` may draw from."""
        if device.type == "cuda":
            return cls(torch.get_rng_state(), device, torch.cuda.get_rng_state(device))
        return cls(torch.get_rng_state(), None, None)

    @contextmanager
    def replay(self) -> Iterator[None]:
        """Run the body with the captured states, then put the current states back.

        See NOTE [ RNG replay ].
        """
        devices = [self.device] if self.device is not None else []
        with torch.random.fork_rng(devices=devices, device_type="cuda"):
            torch.set_rng_state(self.cpu_state)
            if self.device is not None and self.device_state is not None:
                torch.cuda.set_rng_state(self.device_state, self.device)
            yield
