"""The longest context that fits, and what a step of it costs in time: the search and the step-time formula.

Pure arithmetic. Whether a length fits a card and a host is the caller's question (``lightning-blockwise plan
--longest`` asks the planner, :mod:`lightning_blockwise.cli.plan_longest`); :func:`longest_fit` finds the longest
length that answers yes, and :func:`step_time` says how long a step of that length is expected to take.

Example::

    tokens = longest_fit(lambda n: plan_fits(n), granularity=1024)
    cost = StepCost(matmul_params=7.1e9, num_layers=28, attention_size=3584, arena_bytes=3.4e9, offloaded_bytes=0)
    print(step_time(cost, tokens, tflops=150, link_gbps=25).seconds)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

#: Lengths are searched in steps of this many tokens (the answer is a multiple of it).
GRANULARITY = 1024
#: The longest length searched: 16M tokens, past any host's offloaded inputs.
SEARCH_LIMIT = 2**24
#: ``--link-gbps``'s default: PCIe 4.0 x16's sustained host-to-device rate, about 25 GB/s (the H100's PCIe 5 link
#: measured 54.5 GB/s from pinned memory, benchmarks/RESULTS.md).
DEFAULT_LINK_GBPS = 25.0
#: ``--tflops``'s default: a 24 GB RTX 4090-class card's sustained bf16 matmul rate. The H100 ran the 7B steps of
#: 32k-131k tokens at an effective 420-470 by this formula (benchmarks/RESULTS.md; docs/long-context.md).
DEFAULT_TFLOPS = 150.0

# NOTE [ Expected step time ]
# A step's time is the larger of its compute and its copies, since the streamer copies the next blocks
# while the current one computes (DESIGN.md section 3).
#
# Compute, in FLOPs: every frozen matmul runs forward twice (the no-grad forward and the recompute)
# and backward once for its input's gradient only (a LoRA step takes no weight gradient of the base):
# 2 + 2 + 2 = 6 x params x tokens, the adapters' own FLOPs being negligible. Causal attention's forward
# costs 2 x tokens^2 x (heads x head size) per layer (QK^T and PV, half of the square), its backward 2.5
# forwards: 9 x tokens^2 x size x layers for the step. A second-level recompute (every k-th layer's
# input kept, the layers between recomputed once more) runs a third forward: 8 and 11. A tiled MLP and
# the chunked loss recompute their matmuls in their backward: 2 x their params x tokens more. Tiled
# attention (NOTE [ Tiled attention ] in longcontext/attention.py) runs each tile's forward again in
# its backward, in every layer, kept ones included: one attention forward more, 2 x tokens^2 x size
# per layer (the tiles' causal prefixes add up to the one causal square), where the sequence is
# longer than one tile (within one it runs untiled).
# Layers that keep their activations under a budget (NOTE [ Kept activations ] in planning/memory.py)
# run as in resident training, one forward: neither the recompute nor a second-level one, so theirs
# are taken off (2 x their params x tokens and 2 x tokens^2 x size for each forward they skip).
# Recomputed layers that keep their attention outputs (NOTE [ Kept attention ] in replay/kept_attention.py)
# skip the recompute's attention forward: 2 x tokens^2 x size each taken off.
#
# Copies, in bytes over the host link: every block's slab twice per step (forward and backward; three
# times with a second-level recompute), and with offload the layer inputs out and back. The link is
# full duplex, so the time is the larger direction: (passes x arena + offloaded) / rate host-to-device,
# offloaded / rate back.


@dataclass(frozen=True)
class StepCost:
    """What a step's expected time depends on (NOTE [ Expected step time ]).

    Attributes:
        matmul_params: Weights of the matmuls a token passes through: the decoder layers' linears and the LM head.
        num_layers: Decoder layers.
        attention_size: Attention heads x head size (the width of Q, and of K and V as attention reads them).
        arena_bytes: The frozen decoder layers' host arena, copied to the device per weight pass.
        offloaded_bytes: Layer inputs offloaded per step (each way); 0 without offload.
        recomputed_params: Weights whose matmuls run one forward more per step: a tiled MLP's (each tile
            recomputed in its backward) and the LM head under the chunked loss (each chunk recomputed).
        recompute_every: A second-level recompute keeping every k-th layer's input (``None``: off).
        kept_layers: Decoder layers that keep their autograd graphs from the forward to the backward: they run
            one forward per step, not :attr:`forwards`.
        kept_params: Weights of those layers' matmuls.
        tiled_attention: Attention runs in query tiles, each tile's forward run again in its backward: one attention
            forward more per layer and step, kept layers included.
        attention_layers: Recomputed layers that keep their attention outputs: one attention forward less each.
    """

    matmul_params: int
    num_layers: int
    attention_size: int
    arena_bytes: int
    offloaded_bytes: int = 0
    recomputed_params: int = 0
    recompute_every: int | None = None
    kept_layers: int = 0
    kept_params: int = 0
    tiled_attention: bool = False
    attention_layers: int = 0

    @property
    def forwards(self) -> int:
        """Forward passes of a recomputed layer per step: the no-grad forward, the recompute, and a second-level one."""
        return 3 if self.recompute_every else 2

    @property
    def weight_passes(self) -> int:
        """Times the arena crosses the link per step."""
        return 3 if self.recompute_every else 2

    def flops(self, tokens: int) -> float:
        """A step's FLOPs at ``tokens`` tokens: the matmuls' and causal attention's."""
        skipped = self.forwards - 1  # forwards a kept layer does not run
        params = (2 * self.forwards + 2) * self.matmul_params - 2 * skipped * self.kept_params
        matmuls = (params + 2 * self.recomputed_params) * tokens
        layers = (2 * self.forwards + 5) * self.num_layers - 2 * skipped * self.kept_layers
        layers += 2 * self.num_layers * self.tiled_attention - 2 * self.attention_layers
        attention = layers * tokens**2 * self.attention_size
        return float(matmuls + attention)

    def link_bytes(self) -> int:
        """Bytes a step moves over the busier direction of the host link."""
        return max(self.weight_passes * self.arena_bytes + self.offloaded_bytes, self.offloaded_bytes)


@dataclass(frozen=True)
class StepTime:
    """A step's expected time and its two parts, in seconds.

    Attributes:
        compute: The step's FLOPs at the card's rate.
        link: The step's copies at the link's rate.
    """

    compute: float
    link: float

    @property
    def seconds(self) -> float:
        """The step's expected time: the larger part, since the copies overlap the compute."""
        return max(self.compute, self.link)

    @property
    def bound(self) -> str:
        """``"compute"`` or ``"link"``: which part sets the step's time."""
        return "compute" if self.compute >= self.link else "link"


def step_time(cost: StepCost, tokens: int, tflops: float, link_gbps: float) -> StepTime:
    """A step's expected time at ``tokens`` tokens (NOTE [ Expected step time ]).

    Args:
        cost: What the step computes and copies.
        tokens: Tokens per micro-batch.
        tflops: The card's sustained bf16 matmul rate, in TFLOP/s.
        link_gbps: The host link's rate, in GB/s.

    Raises:
        ValueError: If a rate is not positive.
    """
    if not tflops > 0 or not link_gbps > 0:
        raise ValueError(f"tflops={tflops} and link_gbps={link_gbps} must both be positive rates.")
    return StepTime(compute=cost.flops(tokens) / (tflops * 1e12), link=cost.link_bytes() / (link_gbps * 1e9))


def longest_fit(fits: Callable[[int], bool], granularity: int = GRANULARITY, limit: int = SEARCH_LIMIT) -> int | None:
    """The longest multiple of ``granularity`` tokens, at most ``limit``, for which ``fits`` says yes.

    ``fits`` must be monotone (a length that fits means every shorter one does), as memory is: the
    search doubles the length until it does not fit, then bisects.

    Args:
        fits: Whether a micro-batch of that many tokens fits.
        granularity: The step between lengths tried.
        limit: The longest length tried.

    Returns:
        The longest length that fits, or ``None`` if even ``granularity`` tokens do not.

    Raises:
        ValueError: If ``granularity`` is below 1 or above ``limit``.
    """
    if not 1 <= granularity <= limit:
        raise ValueError(f"granularity={granularity} must be between 1 and limit={limit}.")
    if not fits(granularity):
        return None
    good, steps = 1, 2  # in units of `granularity`: `good` fits, `bad` does not (or is past the limit)
    top = limit // granularity
    while steps <= top and fits(steps * granularity):
        good, steps = steps, steps * 2
    bad = min(steps, top + 1)
    while bad - good > 1:
        middle = (good + bad) // 2
        if fits(middle * granularity):
            good = middle
        else:
            bad = middle
    return good * granularity


__all__ = [
    "DEFAULT_LINK_GBPS",
    "DEFAULT_TFLOPS",
    "GRANULARITY",
    "SEARCH_LIMIT",
    "StepCost",
    "StepTime",
    "longest_fit",
    "step_time",
]
