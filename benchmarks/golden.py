"""Golden outputs for behaviour-preserving refactors: run before and after, compare the files.

Writes into a directory: `plan-<model>.json` (`lightning-blockwise plan --json` for each model of
`configs/` at its published shape), `step-plans.json` (the step planner's plan and log line for the 7B and 72B
shapes over token counts, budgets, host memory and the options that change what it chooses: kept graphs and
attention, Liger, where the layer inputs wait), `layout-<arch>.json` (every slab entry's names, dtype, shape,
offset and size per validated architecture, NF4 tiny model, block size 2), `setup.log` (the
strategy's setup line for each architecture) and `demo-losses.json` (every training step's loss of
the demo config, 24 steps).

    python -m benchmarks.golden /tmp/golden-before
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.card_check import MODELS
from lightning_blockwise.cli import main as cli_main


def plans(out: Path) -> None:
    for name, config in MODELS.items():
        with tempfile.TemporaryDirectory() as directory:
            config().save_pretrained(directory)
            buffer = io.StringIO()
            with contextlib.redirect_stdout(buffer):
                # The model's own layers: the default (auto) would depend on whether Liger is installed here.
                plan_args = ["--seq-len", "1024", "--gpu-memory", "24GiB", "--kernels", "none", "--json"]
                cli_main(["plan", directory, *plan_args])
            (out / f"plan-{name}.json").write_text(buffer.getvalue())


def step_plans(out: Path) -> None:
    import dataclasses

    from lightning_blockwise.planning.shapes import shape_config
    from lightning_blockwise.planning.sizing import model_sizes
    from lightning_blockwise.planning.step_kernels import StepKernels

    rows = []
    for shape in ("7b", "72b"):
        sizes = model_sizes(shape_config(shape), dtype=torch.bfloat16, lora_rank=16)
        for gib in (None, 8, 16, 21.3, 60):
            for liger in (False, True):
                budget = None if gib is None else int(gib * 2**30)
                kernels = StepKernels(loss_chunk_tokens=1024, fused_norm=liger, fused_mlp=liger)
                try:
                    planned = sizes.step_budget(budget=budget, kernels=kernels)
                except ValueError as error:
                    rows.append({"shape": shape, "gib": gib, "liger": liger, "refused": str(error)})
                    continue
                for choose, card in ((True, True), (False, False)):
                    step = dataclasses.replace(planned, adapter_dropout=False, card=card, choose_inputs=choose)
                    for tokens in (1024, 4096, 16384, 32768, 131072):
                        for host in (0, 8 * 2**30, 100 * 10**9):
                            key = {"shape": shape, "gib": gib, "liger": liger, "choose": choose, "tokens": tokens}
                            key["host"] = host
                            try:
                                plan = step.plan(tokens, host_bytes=host)
                            except ValueError as error:
                                rows.append({**key, "refused": str(error)})
                                continue
                            residency, inputs = plan.residency, plan.inputs
                            rows.append({
                                **key, "line": step.describe(plan), "over_card": plan.over_card,
                                "resident": list(residency.resident), "kept": list(residency.kept),
                                "attention": list(residency.attention), "peak": residency.predicted_peak,
                                "offload": plan.offload, "levels": None if inputs is None else list(inputs.levels),
                            })  # fmt: skip
    (out / "step-plans.json").write_text(json.dumps(rows, indent=1))


def layouts_and_setup(out: Path) -> None:
    from lightning_blockwise import BlockwiseStrategy
    from tests.helpers.models import (
        CONFIGS,
        CausalLMModule,
        build_model,
        loader,
        padded_batches,
        save_checkpoint,
        trainer,
    )

    records = io.StringIO()
    handler = logging.StreamHandler(records)
    logging.getLogger("lightning.pytorch").addHandler(handler)
    with tempfile.TemporaryDirectory() as root:
        for arch in sorted(CONFIGS):
            path = save_checkpoint(arch, Path(root) / arch)
            strategy = BlockwiseStrategy(vram_budget=None, block_size=2)
            module = CausalLMModule(lambda p=path, a=arch: build_model(a, p, quantized=True))
            trainer(strategy, max_steps=1, accumulate_grad_batches=1).fit(module, loader(padded_batches(1)))
            layouts = [
                [
                    {
                        "names": list(e.names),
                        "dtype": str(e.dtype),
                        "shape": list(e.shape),
                        "offset": e.offset,
                        "nbytes": e.nbytes,
                    }
                    for e in layout.entries
                ]
                for layout in strategy.host_copy.layouts
            ]
            (out / f"layout-{arch}.json").write_text(json.dumps(layouts, indent=1))
    logging.getLogger("lightning.pytorch").removeHandler(handler)
    lines = [line for line in records.getvalue().splitlines() if line.startswith("BlockwiseStrategy:")]
    (out / "setup.log").write_text("\n".join(lines) + "\n")


def demo_losses(out: Path) -> None:
    with tempfile.TemporaryDirectory() as root:
        override = Path(root) / "override.yaml"
        record = {"class_path": "tests.helpers.callbacks.RecordLosses", "init_args": {"directory": f"{root}/losses"}}
        override.write_text(
            json.dumps(
                {
                    "trainer": {
                        "max_steps": 24,
                        "enable_progress_bar": False,
                        "default_root_dir": root,
                        "logger": {
                            "class_path": "lightning.pytorch.loggers.CSVLogger",
                            "init_args": {"save_dir": root},
                        },
                        "callbacks": [record],
                    }
                }
            )
        )
        cli_main(["fit", "--config", "configs/demo.yaml", "--config", str(override)])
        losses = [torch.load(Path(root) / "losses" / f"{step}.pt").item() for step in range(1, 25)]
    (out / "demo-losses.json").write_text(json.dumps(losses))


if __name__ == "__main__":
    target = Path(sys.argv[1])
    target.mkdir(parents=True, exist_ok=True)
    plans(target)
    step_plans(target)
    layouts_and_setup(target)
    demo_losses(target)
