"""An arm is a string, a system and its options joined by ``+`` (``ours+liger+budget=7.5GB``); a point, tokens x batch.

Pure (no torch): the driver parses every arm before it starts a process, so a typo fails in a second, not after a
model was built.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

#: The systems: this package (streamed, or resident as the compute floor), transformers + PEFT, Unsloth.
SYSTEMS = ("ours", "resident", "peft", "unsloth")
#: The ``system`` field of the rows: what a reader of the table calls each.
SYSTEM_NAMES = {"ours": "lightning-blockwise", "resident": "lightning-blockwise", "peft": "transformers+peft",
                "unsloth": "unsloth"}  # fmt: skip
#: Options each system takes; ``name`` alone is a flag, ``name=value`` a value.
OPTIONS: dict[str, tuple[str, ...]] = {
    "ours": ("liger", "fused", "budget", "offload", "chunked", "tiled", "hfloss", "det", "noattn"),
    "resident": ("liger", "fused", "chunked", "tiled", "hfloss", "det"),
    "peft": ("liger", "fused", "chunked", "tiled", "hfloss", "det"),
    "unsloth": ("gc",),
}
#: What each option does, for the help text and the refusals.
OPTION_HELP = {
    "liger": "Liger kernels (lightning_blockwise.kernels.use_liger_kernels(model))",
    "fused": "the fused LoRA update (lightning_blockwise.kernels.fused_lora.use_fused_lora(model))",
    "budget": "BlockwiseStrategy(vram_budget=VALUE): bytes, a size such as 7.5GB, or 'unsloth' (--equal-memory)",
    "offload": "BlockwiseStrategy(offload_activations=True)",
    "chunked": "chunked_causal_lm_loss(chunk_tokens=VALUE or 1024): the default loss of every arm but unsloth",
    "tiled": "tile_mlps(model, VALUE or 4096)",
    "hfloss": "Hugging Face's loss (model(**batch).loss) instead of the chunked one",
    "det": "deterministic mode: Trainer(deterministic=True), CUBLAS_WORKSPACE_CONFIG=:4096:8",
    "noattn": "recomputed layers keep no attention outputs (StepBudget.keep_attention=False; NOTE [ Kept attention ])",
    "gc": "Unsloth's use_gradient_checkpointing: unsloth (its default), true or false",
}
#: The chunked loss's rows of logits at a time and the MLP tile, as benchmarks/long_context.py uses them.
CHUNK_TOKENS = 1024
TILE_TOKENS = 4096
#: Up to this many tokens in a step a point times 5 steps after 2 of warm-up; beyond it 3 after 1 (a 32k step of a
#: 7B model takes seconds, and three agree within a few percent on one machine).
LONG_TOKENS = 16384
STEPS = {False: (5, 2), True: (3, 1)}
#: The budget that --equal-memory resolves per point: Unsloth's peak reserved bytes at that point.
UNSLOTH_BUDGET = "unsloth"


@dataclass(frozen=True)
class Arm:
    """A parsed arm name.

    Attributes:
        name: The name as given (the table's column, the rows' ``arm``).
        system: One of :data:`SYSTEMS`.
        options: Option name to value (``True`` for a flag).
    """

    name: str
    system: str
    options: dict[str, str | bool] = field(default_factory=dict)

    @property
    def loss(self) -> str:
        """``chunked:N`` (the chunked loss, N rows of logits at a time), ``hf``, or ``unsloth`` (its own)."""
        if self.system == "unsloth":
            return "unsloth"
        if "hfloss" in self.options:
            return "hf"
        chunk = self.options.get("chunked", True)
        return f"chunked:{CHUNK_TOKENS if chunk is True else int(chunk)}"

    @property
    def budget(self) -> str | None:
        """The ``vram_budget`` as given (``None``: the strategy's default)."""
        value = self.options.get("budget")
        return None if value is None else str(value)


def parse_arm(name: str) -> Arm:
    """Parse ``system[+option[=value]]...``.

    Raises:
        ValueError: If the system or an option is unknown, a flag has a value it cannot take, or a value is missing.
    """
    system, *parts = name.split("+")
    if system not in SYSTEMS:
        raise ValueError(f"arm {name!r}: the system {system!r} is not one of {', '.join(SYSTEMS)}.")
    options: dict[str, str | bool] = {}
    for part in parts:
        key, _, value = part.partition("=")
        if key not in OPTIONS[system]:
            raise ValueError(
                f"arm {name!r}: {system} takes no option {key!r}; its options are "
                + "; ".join(f"{o}: {OPTION_HELP[o]}" for o in OPTIONS[system])
            )
        if key in ("budget", "gc") and not value:
            raise ValueError(f"arm {name!r}: {key} needs a value ({OPTION_HELP[key]}), e.g. {key}=...")
        if key in ("chunked", "tiled") and value and not value.isdigit():
            raise ValueError(f"arm {name!r}: {key}={value!r} must be a whole number of tokens.")
        if key in ("liger", "fused", "offload", "hfloss", "det") and value:
            raise ValueError(f"arm {name!r}: {key} is a flag and takes no value (got {key}={value!r}).")
        if key == "gc" and value not in ("unsloth", "true", "false"):
            raise ValueError(f"arm {name!r}: gc={value!r} must be unsloth, true or false.")
        options[key] = value or True
    if "hfloss" in options and "chunked" in options:
        raise ValueError(f"arm {name!r}: hfloss and chunked are two losses; name one.")
    return Arm(name, system, options)


@dataclass(frozen=True, order=True)
class Point:
    """Where an arm is timed: ``batch`` rows of ``tokens`` each, random ids or the shipped data packed.

    Ordered by the tokens of a step, so a process runs its longest point last (an OOM there loses nothing earlier).

    Attributes:
        step_tokens: ``tokens * batch`` (first, for the order).
        tokens: Tokens per row.
        batch: Rows per step.
        data: ``random`` (ids over the whole vocabulary, labels = ids) or ``rows`` (data/instructions.jsonl packed).
    """

    step_tokens: int
    tokens: int
    batch: int
    data: str

    @property
    def key(self) -> str:
        """``random:4096x1``: the command line's and the rows' spelling."""
        return f"{self.data}:{self.tokens}x{self.batch}"

    def steps(self, fixed: int | None) -> tuple[int, int]:
        """Timed steps and warm-up steps: ``fixed`` timed steps if given, else by length (:data:`STEPS`)."""
        timed, warmup = STEPS[self.step_tokens > LONG_TOKENS]
        return (fixed, warmup) if fixed is not None else (timed, warmup)


def point(tokens: int, batch: int = 1, data: str = "random") -> Point:
    """A :class:`Point`, its step tokens filled in."""
    return Point(tokens * batch, tokens, batch, data)


_POINT = re.compile(r"^(random|rows):(\d+)x(\d+)$")


def parse_point(key: str) -> Point:
    """Parse :attr:`Point.key`.

    Raises:
        ValueError: If ``key`` is not ``random|rows:TOKENSxBATCH`` with both counts at least 1 (rows: at least 2).
    """
    match = _POINT.match(key)
    if not match or min(int(match[2]), int(match[3])) < 1:
        raise ValueError(f"point {key!r} must read random:TOKENSxBATCH or rows:TOKENSxBATCH, e.g. rows:4096x2.")
    return point(int(match[2]), int(match[3]), match[1])
