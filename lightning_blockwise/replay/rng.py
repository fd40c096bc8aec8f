"""RNG snapshots: a layer's, replayed in its recompute; the run's global generators, saved for an exact resume."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

# NOTE [ RNG replay ]
# A layer with dropout draws random numbers in its forward. The backward recomputes the
# layer, and the recompute must draw exactly the numbers the forward drew, or its graph
# is a different function from the one whose output the loss saw. So the CPU generator
# and the generator of the layer's device are captured right before the forward and
# restored right before the recompute. The restore happens inside
# ``torch.random.fork_rng`` so that, once the recompute is done, the global generators
# are back where the backward found them: the run's random stream advances exactly as in
# resident training, where the backward draws nothing.

try:
    import numpy as np
except ImportError:  # NumPy is optional for torch; without it there is no NumPy generator to keep.
    np = None  # type: ignore[assignment]


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

    def unchanged(self) -> bool:
        """Whether the generators are still in the captured state (nothing drew from them since)."""
        now = RngSnapshot.capture(self.device or torch.device("cpu"))
        same_device = self.device_state is None or torch.equal(self.device_state, now.device_state)
        return same_device and torch.equal(self.cpu_state, now.cpu_state)

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


# NOTE [ Exact resume ]
# Lightning saves no RNG state, so a run resumed from a checkpoint draws its dropout masks
# (and anything else random) from wherever the new process's generators happen to be. The
# strategy saves every global generator a training step may draw from (Python's, NumPy's,
# torch's CPU generator and every CUDA device's) next to the weights and restores them when
# the resumed run starts training. They are kept as tensors, ints, floats and lists, so the
# checkpoint loads with `torch.load(weights_only=True)`, which is how Lightning's `ckpt_path`
# and the CLI load it (a raw `numpy.random.get_state()` tuple holds an ndarray and would not).


@dataclass(frozen=True)
class GlobalRngState:
    """Every global generator a training step may draw from: Python, NumPy, torch CPU, each CUDA device.

    Args:
        python: ``random.getstate()``.
        numpy: ``numpy.random.get_state()``, or ``None`` without NumPy.
        cpu: ``torch.get_rng_state()``.
        cuda: ``torch.cuda.get_rng_state_all()`` (empty without CUDA).
    """

    python: tuple[Any, ...]
    numpy: tuple[Any, ...] | None
    cpu: Tensor
    cuda: tuple[Tensor, ...]

    @classmethod
    def capture(cls) -> GlobalRngState:
        """The generators' states now."""
        cuda = tuple(torch.cuda.get_rng_state_all()) if torch.cuda.is_initialized() else ()
        numpy_state = np.random.get_state() if np is not None else None
        return cls(random.getstate(), numpy_state, torch.get_rng_state(), cuda)

    def restore(self) -> None:
        """Set every generator to its captured state."""
        random.setstate(self.python)
        if np is not None and self.numpy is not None:
            np.random.set_state(self.numpy)
        torch.set_rng_state(self.cpu)
        if self.cuda:
            torch.cuda.set_rng_state_all(list(self.cuda))

    def state_dict(self) -> dict[str, Any]:
        """The states as tensors, ints, floats and lists: loadable with ``torch.load(weights_only=True)``."""
        version, internal, gauss_next = self.python
        state: dict[str, Any] = {
            "python": {"version": version, "internal": list(internal), "gauss_next": gauss_next},
            "torch": self.cpu.clone(),
            "cuda": [s.clone() for s in self.cuda],
        }
        if self.numpy is not None:
            kind, keys, pos, has_gauss, cached_gaussian = self.numpy
            state["numpy"] = {
                "kind": str(kind),
                "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64).copy()),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached_gaussian),
            }
        return state

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> GlobalRngState:
        """The inverse of :meth:`state_dict`."""
        python = state["python"]
        numpy_state = None
        if state.get("numpy") is not None and np is not None:
            n = state["numpy"]
            keys = n["keys"].numpy().astype(np.uint32)
            numpy_state = (n["kind"], keys, n["pos"], n["has_gauss"], n["cached_gaussian"])
        return cls(
            (python["version"], tuple(python["internal"]), python["gauss_next"]),
            numpy_state,
            state["torch"],
            tuple(state.get("cuda", ())),
        )
