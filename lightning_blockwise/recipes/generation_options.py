"""How a generation chooses its tokens: greedy or sampled, and how many at most.

Used by :class:`~lightning_blockwise.recipes.generation.ChatSession` and ``lightning-blockwise generate``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

#: Tokens generated per prompt unless asked otherwise: a paragraph, about 3 minutes at 72B streamed on an H100.
DEFAULT_MAX_NEW_TOKENS = 256
#: The most tokens one reply may have (NOTE [ A generated token streams every block ] in callbacks/generation.py).
MAX_NEW_TOKENS_LIMIT = 4096


@dataclass(frozen=True)
class Sampling:
    """How tokens are chosen: greedy at ``temperature=0`` (the default), else sampled.

    Attributes:
        max_new_tokens: Tokens per reply at most, 1 to :data:`MAX_NEW_TOKENS_LIMIT`; a reply ends sooner at EOS.
        temperature: ``0``: greedy (the most likely token, no randomness); above ``0``: sample from the
            softmax of the logits divided by it.
        top_p: Sample from the smallest set of tokens whose probabilities add up to ``top_p`` (``1``: all).
        top_k: Sample from the ``top_k`` most likely tokens (``0``: all).
        seed: Seeds torch's generators when the session starts: sampled replies are reproducible. 0 to 2**64 - 1.

    Raises:
        ValueError: If a value is out of its range (the message names it and the range).
    """

    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not 1 <= self.max_new_tokens <= MAX_NEW_TOKENS_LIMIT:
            raise ValueError(
                f"max_new_tokens={self.max_new_tokens} must be from 1 to {MAX_NEW_TOKENS_LIMIT}: each token streams"
                " the whole streamed base once."
            )
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature={self.temperature} must be 0 (greedy) or positive, e.g. 0.7.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be above 0 and at most 1 (1: no nucleus cut), e.g. 0.9.")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be 0 (no cut) or positive, e.g. 50.")
        if isinstance(self.seed, bool) or not 0 <= self.seed < 2**64:
            # torch's generators take 64 bits; a larger seed failed inside the run ("Overflow when unpacking long").
            raise ValueError(f"seed={self.seed} must be an integer from 0 to 2**64 - 1 (torch's generators: 64 bits).")
        if self.greedy and (self.top_p != 1 or self.top_k != 0):
            raise ValueError(
                f"top_p={self.top_p} and top_k={self.top_k} apply to sampling, but temperature=0 is greedy. Give a"
                " temperature above 0 (e.g. 0.7) to sample."
            )

    @property
    def greedy(self) -> bool:
        """Whether tokens are chosen greedily (``temperature == 0``)."""
        return self.temperature == 0

    def generate_options(self) -> dict[str, Any]:
        """The keyword arguments of ``model.generate`` (no sampling knobs when greedy: it warns about them)."""
        options: dict[str, Any] = {"max_new_tokens": self.max_new_tokens, "num_beams": 1, "do_sample": not self.greedy}
        if not self.greedy:
            options.update(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k)
        return options


__all__ = ["DEFAULT_MAX_NEW_TOKENS", "MAX_NEW_TOKENS_LIMIT", "Sampling"]
