"""Deterministic mode with and without torch's fill of uninitialized memory, arms alternating in one process.

    CUBLAS_WORKSPACE_CONFIG=:4096:8 python -m benchmarks.deterministic_fill --shape 32b --steps 4 --repeats 2

With ``torch.use_deterministic_algorithms(True)`` (what ``Trainer(deterministic=True)`` sets) torch fills every
new tensor's memory (``torch.utils.deterministic.fill_uninitialized_memory``, on by default), which adds a fill
kernel per allocation, e.g. per dequantized NF4 weight. The step benchmark's ``resident`` and ``blockwise:1:2``
arms run with the fill on and off, alternating ``--repeats`` times, so host drift falls on both. One JSON line
per arm and repeat.
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from benchmarks.step_benchmark import SHAPES, build_model, run_arm


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="32b", choices=sorted(SHAPES))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--arms", nargs="+", default=["resident", "blockwise:1:2"])
    parser.add_argument("--out", default=None, help="append the JSON lines here")
    args = parser.parse_args()
    if os.environ.get("CUBLAS_WORKSPACE_CONFIG") != ":4096:8":
        parser.error("deterministic mode needs CUBLAS_WORKSPACE_CONFIG=:4096:8 in the environment")
    device = torch.device("cuda")
    model, config = build_model(args.shape, device)
    for repeat in range(args.repeats):
        for fill in (True, False) if repeat % 2 == 0 else (False, True):
            torch.utils.deterministic.fill_uninitialized_memory = fill
            for arm in args.arms:
                model.to(device)
                result = run_arm(model, arm, args.steps, args.warmup, config.vocab_size, True)
                row = {"shape": args.shape, "arm": arm, "fill": fill, "repeat": repeat, **result}
                print(json.dumps(row), flush=True)
                if args.out:
                    with open(args.out, "a") as out:
                        out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
