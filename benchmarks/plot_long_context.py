"""Plot peak allocated memory against sequence length per arm from ``benchmarks/results/h100_long_context.jsonl``.

python -m benchmarks.plot_long_context [--out docs/long_context_memory.png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

RESULTS = Path(__file__).parent / "results" / "h100_long_context.jsonl"
LABELS = {
    "resident_ckpt": "resident, HF checkpointing",
    "blockwise": "blockwise, options off",
    "blockwise+offload+chunked": "+ offload + chunked loss",
    "blockwise+offload+chunked+tiled": "+ offload + chunked loss + tiled MLP",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", default="docs/long_context_memory.png")
    args = parser.parse_args()
    rows = [json.loads(line) for line in RESULTS.read_text().splitlines() if line.strip()]
    figure, axes = plt.subplots(1, 3, figsize=(13, 4), sharey=True)
    for axis, shape in zip(axes, ("7b", "32b", "72b"), strict=True):
        for color, (arm, label) in enumerate(LABELS.items()):
            points = sorted(
                (r["seq"], r["peak_allocated_gb"])
                for r in rows
                if r.get("shape", "72b") == shape
                and r.get("arm", "blockwise+offload+chunked+tiled") == arm
                and r.get("chunk_tokens", 1024) == 1024
            )
            if points:
                axis.plot(*zip(*points, strict=True), marker="o", label=label, color=f"C{color}")
        # The 72B/32k card run's allocator cap (22 GiB).
        axis.axhline(22 * 2**30 / 1e9, color="grey", linestyle=":", linewidth=1)
        axis.set_title(f"Qwen2.5-{shape.upper()} shape, H100")
        axis.set_xscale("log", base=2)
        axis.set_xlabel("tokens per micro-batch")
    axes[0].set_ylabel("peak allocated GB")
    axes[0].legend(fontsize=8)
    figure.tight_layout()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(args.out, dpi=110)


if __name__ == "__main__":
    main()
