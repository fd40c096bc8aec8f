"""Training-step time on a real pretrained model: resident (`strategy: auto`) against blockwise, one process.

Trains configs/smollm2-135m.yaml (SmolLM2-135M-Instruct, NF4 base, LoRA r8 on every decoder linear, fp32
compute, the shipped instruction pairs) in each arm from the same seed, and reports the median wall time of a
training batch (`on_train_batch_start` to `on_train_batch_end`: forward, backward, optimizer step) after the
warm-up steps, and whether the arms' losses were `torch.equal`. The checkpoint directory is the one
examples/smollm2_checkpoint.py writes.

    python examples/smollm2_checkpoint.py /tmp/smollm2
    OMP_NUM_THREADS=1 python benchmarks/real_model_step.py /tmp/smollm2 [--steps 12] [--warmup 2] [--batch-size 4]
        [--accelerator cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from lightning_blockwise.cli import build_cli

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "smollm2-135m.yaml"


class _StepTimes(pl.Callback):
    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.losses: list[torch.Tensor] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *_: Any) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, *_: Any) -> None:
        if trainer.strategy.root_device.type == "cuda":
            torch.cuda.synchronize()
        self.seconds.append(time.perf_counter() - self._start)
        self.losses.append(outputs["loss"].detach().cpu())


def run_arm(checkpoint: Path, strategy: str, options: argparse.Namespace, root: Path) -> _StepTimes:
    """Train the config for ``warmup + steps`` steps under ``strategy`` (``auto`` or ``blockwise``)."""
    args = ["--config", str(CONFIG), f"--model.init_args.checkpoint={checkpoint}"]
    args += [f"--data.init_args.tokenizer={checkpoint}", f"--data.init_args.batch_size={options.batch_size}"]
    args += [f"--trainer.max_steps={options.warmup + options.steps}", "--trainer.limit_val_batches=0"]
    args += [f"--trainer.accelerator={options.accelerator}", f"--trainer.default_root_dir={root / strategy}"]
    args += [f"--model.init_args.adapter_dir={root / strategy / 'adapter'}", "--trainer.enable_progress_bar=false"]
    if strategy == "auto":
        args.append("--trainer.strategy=auto")
    cli = build_cli(args, run=False)
    times = _StepTimes()
    cli.trainer.callbacks.append(times)
    pl.seed_everything(0, verbose=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path, help="The directory examples/smollm2_checkpoint.py wrote.")
    parser.add_argument("--steps", type=int, default=12, help="Measured steps per arm (default: 12).")
    parser.add_argument("--warmup", type=int, default=2, help="Steps per arm before the measured ones (default: 2).")
    parser.add_argument("--batch-size", type=int, default=4, help="Rows per step (default: 4, the config's).")
    parser.add_argument("--accelerator", default="cpu", help="cpu or gpu (default: cpu).")
    options = parser.parse_args()
    result: dict[str, Any] = {
        "device": options.accelerator,
        "threads": torch.get_num_threads(),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
        "load_average_before": os.getloadavg(),
    }
    arms: dict[str, _StepTimes] = {}
    with tempfile.TemporaryDirectory() as root:
        for strategy in ("auto", "blockwise"):
            arms[strategy] = run_arm(options.checkpoint, strategy, options, Path(root))
            measured = arms[strategy].seconds[options.warmup :]
            result[strategy] = {
                "median_s": statistics.median(measured),
                "min_s": min(measured),
                "max_s": max(measured),
                "steps": len(measured),
            }
    result["blockwise_over_resident"] = result["blockwise"]["median_s"] / result["auto"]["median_s"]
    result["losses_equal"] = all(
        torch.equal(a, b) for a, b in zip(arms["auto"].losses, arms["blockwise"].losses, strict=True)
    )
    result["load_average_after"] = os.getloadavg()
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
