"""The package layout: an acyclic, layered import graph; old module paths are gone; old checkpoints are converted."""

from __future__ import annotations

import ast
import importlib
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException

import lightning_blockwise
from lightning_blockwise.cli import build_cli

PACKAGE = Path(lightning_blockwise.__file__).parent
ROOT = PACKAGE.parent

#: Layers from the bottom up: a module may import from its own layer and the layers below, never above.
LAYERS: list[set[str]] = [
    {"compat"},
    {"architectures"},
    {"longcontext", "adapters", "kernels"},
    {"residency"},
    {"replay"},
    # The memory model and a step's plan: arithmetic over a config and the engine's byte layout.
    {"planning"},
    # The strategy's parts are units of their own (`strategy.<module>`), in three floors.
    {
        "loading",
        "strategy.checkpointing",
        "strategy.checkpoint_files",
        "strategy.fit_loop",
        "strategy.batch_comparison",
        "strategy.device_memory",
        "strategy.rank_watchdog",
        "strategy.streamed_stack",
        "strategy.module_budget",
        "strategy.step_tokens",
        "strategy.namespace_check",
    },
    # What the strategy delegates to: its step plan over the run and the step it times, its checkpoints, where
    # the module goes, DDP, block-major windows, and what callbacks ask it.
    {
        "strategy.step_planner",
        "strategy.step_timing",
        "strategy.checkpoint_hooks",
        "strategy.options",
        "strategy.run",
        "strategy.module_placement",
        "strategy.data_parallel",
        "strategy.accumulation",
        "strategy.queries",
    },
    {"strategy", "strategy.blockwise"},
    {"verification", "profiling"},
    {"callbacks"},
    {"export"},
    {"recipes", "demos"},
    {"cli"},
    {"__init__", "__main__"},
]


def _unit(module: str) -> str:
    """The layer unit of a dotted module name inside the package (its folder, or its file)."""
    parts = module.split(".")
    if parts[1:2] == ["strategy"] and len(parts) > 2:
        return f"strategy.{parts[2]}"
    return parts[1] if len(parts) > 1 else "__init__"


def _modules() -> dict[str, ast.Module]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = ast.parse(path.read_text())
    return found


def _imports(name: str, tree: ast.Module, top_level_only: bool) -> set[str]:
    """Package modules ``name`` imports (``from lightning_blockwise.x import y`` counts ``x`` and ``x.y``)."""
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    targets = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            targets |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            targets.add(node.module)
            targets |= {f"{node.module}.{alias.name}" for alias in node.names}
    return {t for t in targets if t.startswith("lightning_blockwise") and t != name}


def _layer(unit: str) -> int:
    (index,) = [i for i, layer in enumerate(LAYERS) if unit in layer]
    return index


def test_every_package_unit_has_a_layer() -> None:
    units = {_unit(name) for name in _modules()}
    assert units <= set().union(*LAYERS), units - set().union(*LAYERS)


def _upward(modules: dict[str, ast.Module]) -> list[str]:
    """Imports from a higher layer, counting every import: at the top, under ``TYPE_CHECKING``, in functions."""
    wrong = []
    for name, tree in modules.items():
        for target in _imports(name, tree, top_level_only=False):
            if target not in modules or _unit(target) == "__init__":
                continue  # a name imported from a package, or the package's public surface (lazily)
            if _layer(_unit(target)) > _layer(_unit(name)):
                wrong.append(f"{name} -> {target}")
    return wrong


def test_imports_point_down_the_layers() -> None:
    assert _upward(_modules()) == []
    # Control: the engine importing the planner, in a function, points up.
    pair = {
        "lightning_blockwise.residency.streamer": ast.parse(
            "def plan():\n    from lightning_blockwise.planning.step_budget import StepBudget"
        ),
        "lightning_blockwise.planning.step_budget": ast.parse("from lightning_blockwise.residency.arena import X"),
    }
    assert _upward(pair) == ["lightning_blockwise.residency.streamer -> lightning_blockwise.planning.step_budget"]


def _cycle(modules: dict[str, ast.Module]) -> list[str] | None:
    """An import cycle among ``modules``, counting every import: at the top, under ``TYPE_CHECKING``, in functions."""
    graph = {
        name: {t for t in _imports(name, tree, top_level_only=False) if t in modules} for name, tree in modules.items()
    }
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for target in graph[node]:
            if state.get(target) == 1:
                return [*path, node, target]
            if target not in state and (found := visit(target, [*path, node])):
                return found
        state[node] = 2
        return None

    for name in graph:
        if name not in state and (found := visit(name, [])):
            return found
    return None


def test_module_import_graph_is_acyclic_counting_type_checking_imports() -> None:
    cycle = _cycle(_modules())
    assert cycle is None, f"import cycle: {' -> '.join(cycle or [])}"
    # Control: a cycle closed only under `TYPE_CHECKING` is found.
    pair = {
        "lightning_blockwise.a": ast.parse("from lightning_blockwise.b import B"),
        "lightning_blockwise.b": ast.parse(
            "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from lightning_blockwise.a import A"
        ),
    }
    assert _cycle(pair) is not None


def test_callbacks_import_no_private_names() -> None:
    for name, tree in _modules().items():
        if _unit(name) != "callbacks":
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("lightning_blockwise"):
                private = [alias.name for alias in node.names if alias.name.startswith("_")]
                assert not private, f"{name} imports {private} from {node.module}"


def test_the_flat_module_paths_are_gone() -> None:
    flat = ["arena", "capture", "data", "demo", "embedding", "finetune", "host", "loader", "placement", "plan"]
    flat += ["random_init", "remat", "rng", "sizing", "streamer", "_deprecated"]
    for old in flat:
        assert not (PACKAGE / f"{old}.py").exists(), old
        with pytest.raises(ModuleNotFoundError):
            importlib.import_module(f"lightning_blockwise.{old}")


def test_checkpoint_written_before_the_move_is_refused_then_resumes_once_converted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A demo checkpoint of the flat layout (its hyperparameters name `lightning_blockwise.demo.DemoCausalLM`)."""
    saved = torch.load(ROOT / "tests" / "data" / "demo-before-layout.ckpt", weights_only=True)
    assert saved["hyper_parameters"]["_class_path"] == "lightning_blockwise.demo.DemoCausalLM"
    checkpoint = tmp_path / "old.ckpt"
    torch.save(saved, checkpoint)
    monkeypatch.setattr(sys, "argv", ["lightning-blockwise"])
    args = ["fit", "--config", str(ROOT / "configs" / "demo.yaml"), f"--ckpt_path={checkpoint}"]
    with pytest.raises(MisconfigurationException, match=r"`lightning_blockwise\.demos\.tiny\.DemoCausalLM`") as refused:
        build_cli([*args, "--trainer.max_steps=1"])
    assert "lightning_blockwise.demo.DemoCausalLM" in str(refused.value)
    # The conversion the message gives.
    saved["hyper_parameters"]["_class_path"] = "lightning_blockwise.demos.tiny.DemoCausalLM"
    torch.save(saved, checkpoint)
    args += [f"--trainer.default_root_dir={tmp_path}", f"--trainer.logger.init_args.save_dir={tmp_path}"]
    args += ["--trainer.max_steps=3", "--trainer.callbacks=[]", "--trainer.enable_progress_bar=false"]
    args += ["--data.init_args.batch_size=2", "--trainer.num_sanity_val_steps=0"]
    cli = build_cli(args)
    assert cli.trainer.global_step == 3
    # The adapters went on from the checkpoint's, not from a fresh initialization.
    assert type(cli.model).__module__ == "lightning_blockwise.demos.tiny"
    trained = dict(cli.model.named_parameters())
    assert all(name in trained for name in saved["state_dict"])
