"""Both Lightning namespaces: the name, an instance, the callbacks, the recipes and the CLI under `pytorch_lightning`,
exact as under `lightning.pytorch`; what Lightning cannot mix is refused (NOTE [ Two Lightning namespaces ])."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as lightning_pl
import lightning_blockwise.pl as blockwise_pl
import pytest
import pytorch_lightning as pl
import torch
import yaml
from pytorch_lightning.utilities.exceptions import MisconfigurationException  # the twins raise their own

import lightning_blockwise
from lightning_blockwise import BlockwiseProfiler, BlockwiseStrategy, ParityCheck
from lightning_blockwise.callbacks import EpochProgressBar, MetricsPlot
from lightning_blockwise.compat import lightning_namespaces
from lightning_blockwise.replay.rng import RngSnapshot
from tests.helpers.models import CausalLMModule, assert_equal_runs, build_model, fit, runs_differ
from tests.helpers.pl_models import PlCausalLMModule, pl_fit, pl_trainer

PACKAGE = Path(lightning_blockwise.__file__).parent
NEUTRAL = {"MisconfigurationException", "rank_zero_debug", "rank_zero_info", "rank_zero_warn", "rank_zero_only"}


def _twinned(sources: dict[str, str]) -> set[str]:
    """Modules that import Lightning classes beyond its exceptions and rank-zero logging, those that import them,
    and their packages (``sources``: relative module name -> its text)."""
    imports: dict[str, set[str]] = {}
    twinned = set()
    for name, source in sources.items():
        imports[name] = set()
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                if node.module.startswith(("lightning.pytorch", "lightning.fabric")):
                    if any(alias.name not in NEUTRAL for alias in node.names):
                        twinned.add(name)
                if node.module.startswith("lightning_blockwise"):
                    module = node.module.removeprefix("lightning_blockwise").lstrip(".")
                    imports[name] |= {module, *(f"{module}.{a.name}".lstrip(".") for a in node.names)}
            elif isinstance(node, ast.Import):
                twinned |= {name for a in node.names if a.name.startswith(("lightning.pytorch", "lightning.fabric"))}
    while grown := {n for n, found in imports.items() if n not in twinned and n != "__main__" and found & twinned}:
        twinned |= grown
    return twinned | {".".join(n.split(".")[:i]) for n in twinned for i in range(1, n.count(".") + 1)}


def test_the_twinned_modules_are_those_that_touch_lightning_classes() -> None:
    sources = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        sources[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path.read_text()
    missing = _twinned(sources) - lightning_namespaces.TWINNED
    assert not missing, f"add {sorted(missing)} to `TWINNED` in compat/lightning_namespaces.py"
    assert _twinned(sources) == lightning_namespaces.TWINNED & set(sources)
    # Control: a shared module that subclasses a Lightning callback would be twinned, and so would its importer.
    sources["planning.made_up"] = "from lightning.pytorch.callbacks import Callback\n"
    sources["loading.user"] = "from lightning_blockwise.planning.made_up import X\n"
    assert {"planning", "planning.made_up", "loading.user"} <= _twinned(sources) - lightning_namespaces.TWINNED


def test_rewrite_renames_lightning_and_twinned_modules_only() -> None:
    source = (
        "from lightning.pytorch import Trainer\nfrom lightning.fabric.plugins import CheckpointIO\n"
        "from lightning_blockwise.strategy.blockwise import BlockwiseStrategy\n"
        "from lightning_blockwise.strategy.streamed_stack import StreamedStack\nfrom lightning_blockwise import X\n"
        "import lightning_blockwise\nfrom lightning_utilities import y\n"
    )
    assert lightning_namespaces.rewrite(source).splitlines() == [
        "from pytorch_lightning import Trainer",
        "from lightning_fabric.plugins import CheckpointIO",
        "from lightning_blockwise.pl.strategy.blockwise import BlockwiseStrategy",
        # Control: shared modules, the bare package name and other libraries keep their names.
        "from lightning_blockwise.strategy.streamed_stack import StreamedStack",
        "from lightning_blockwise.pl import X",
        "import lightning_blockwise",
        "from lightning_utilities import y",
    ]
    # User code never passes through the finder; a shared module under the twin package is the original itself.
    assert lightning_namespaces._FINDER.find_spec("tests.helpers.models", None) is None
    assert (
        importlib.import_module("lightning_blockwise.pl.strategy.streamed_stack")
        is sys.modules["lightning_blockwise.strategy.streamed_stack"]
    )


def test_blockwise_is_registered_in_both_registries_once() -> None:
    assert pl.strategies.StrategyRegistry["blockwise"]["strategy"] is blockwise_pl.BlockwiseStrategy
    assert lightning_pl.strategies.StrategyRegistry["blockwise"]["strategy"] is BlockwiseStrategy
    importlib.reload(blockwise_pl)  # a second registration must not raise
    assert isinstance(pl_trainer("blockwise").strategy, pl.strategies.Strategy)
    # Control: each registry builds its own namespace's class.
    assert not issubclass(BlockwiseStrategy, blockwise_pl.BlockwiseStrategy)


def test_pytorch_lightning_stays_optional(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pytorch_lightning", None)  # how Python blocks an import
    assert not lightning_namespaces.pytorch_lightning_installed()
    assert lightning_namespaces.load_twins() is None
    # Control: installed, the twin package is loaded and paired.
    monkeypatch.undo()
    assert lightning_namespaces.load_twins() is blockwise_pl


def test_an_instance_becomes_the_twin_of_the_trainer_that_adopts_it() -> None:
    strategy = BlockwiseStrategy(block_size=3, prefetch_depth=4)
    assert pl_trainer(strategy).strategy is strategy
    assert type(strategy) is blockwise_pl.BlockwiseStrategy
    assert (strategy.options.block_size, strategy.options.prefetch_depth) == (3, 4)
    assert isinstance(strategy, BlockwiseStrategy) and isinstance(strategy.accelerator, pl.accelerators.Accelerator)
    # Control: a lightning.pytorch Trainer keeps the class as built.
    kept = BlockwiseStrategy(block_size=3)
    assert lightning_pl.Trainer(strategy=kept, accelerator="cpu", logger=False).strategy is kept
    assert type(kept) is BlockwiseStrategy


def _build() -> torch.nn.Module:
    return build_model("qwen2")


@pytest.mark.parametrize("strategy", ["blockwise", "instance"])
def test_parity_under_pytorch_lightning_as_under_lightning(strategy: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The exactness test of tests/strategy/test_parity.py, driven by `pytorch_lightning.Trainer` with a `pl` module."""

    def chosen() -> Any:
        return "blockwise" if strategy == "blockwise" else BlockwiseStrategy(block_size=2)

    resident = pl_fit(PlCausalLMModule(_build), "auto")
    blockwise = pl_fit(PlCausalLMModule(_build), chosen())
    assert_equal_runs(resident, blockwise)
    # The same runs under lightning.pytorch give the same bits: one engine, two namespaces.
    assert_equal_runs(fit(CausalLMModule(_build), "auto"), resident)
    assert_equal_runs(fit(CausalLMModule(_build), chosen()), blockwise)
    # Control: without the RNG replay (dropout on) the comparison fails.
    monkeypatch.setattr(RngSnapshot, "replay", lambda self: torch.random.fork_rng(devices=[]))
    assert runs_differ(resident, pl_fit(PlCausalLMModule(_build), chosen()))


def test_callbacks_follow_the_trainer(tmp_path: Path) -> None:
    callbacks = [ParityCheck(), BlockwiseProfiler(dirpath=tmp_path), MetricsPlot()]
    pl_fit(PlCausalLMModule(_build), "blockwise", callbacks=callbacks, max_steps=2, default_root_dir=tmp_path)
    assert [type(c).__module__ for c in callbacks] == [
        "lightning_blockwise.pl.callbacks.parity",
        "lightning_blockwise.pl.callbacks.profiler",
        "lightning_blockwise.pl.callbacks.metrics_plot",
    ]
    assert callbacks[0].result is not None and callbacks[0].result.passed
    assert callbacks[1].summary and all(isinstance(c, pl.Callback) for c in callbacks)
    # Control: under lightning.pytorch they stay as built.
    kept = ParityCheck()
    fit(CausalLMModule(_build), "blockwise", callbacks=[kept], max_steps=1, accumulate_grad_batches=1)
    assert type(kept) is ParityCheck and kept.result is not None and kept.result.passed


def test_recipe_modules_come_from_the_twin_package(tmp_path: Path) -> None:
    from lightning_blockwise.pl.demos.tiny import DemoCausalLM
    from lightning_blockwise.pl.recipes.data import SyntheticTokensDataModule

    def run(module: Any, data: Any) -> None:
        trainer = pl_trainer("blockwise", max_steps=2, accumulate_grad_batches=1, default_root_dir=tmp_path)
        trainer.fit(module, datamodule=data)

    module, data = DemoCausalLM(quantize=False), SyntheticTokensDataModule(seq_len=8, vocab_size=128, num_samples=4)
    run(module, data)
    assert isinstance(module, pl.LightningModule) and module.trainer.global_step == 2
    # Control: the lightning.pytorch recipe data module is refused in one line, before any step.
    from lightning_blockwise.recipes.data import SyntheticTokensDataModule as LightningData

    fresh = DemoCausalLM(quantize=False)
    fix = r"from lightning_blockwise\.pl\.recipes\.data import SyntheticTokensDataModule"
    with pytest.raises(MisconfigurationException, match=fix):
        run(fresh, LightningData(seq_len=8, vocab_size=128, num_samples=4))
    assert fresh._trainer is None or fresh.trainer.global_step == 0


@pytest.mark.parametrize(
    "strategy_yaml",
    ["blockwise", {"class_path": "lightning_blockwise.BlockwiseStrategy", "init_args": {"block_size": 2}}],
)
def test_pytorch_lightning_cli(tmp_path: Path, strategy_yaml: Any) -> None:
    from pytorch_lightning.cli import LightningCLI

    config = tmp_path / "config.yaml"
    trainer = {"strategy": strategy_yaml, "accelerator": "cpu", "logger": False, "max_steps": 2}
    trainer["callbacks"] = [{"class_path": "lightning_blockwise.pl.ParityCheck"}]
    data = {"class_path": "lightning_blockwise.pl.recipes.data.SyntheticTokensDataModule"}
    data["init_args"] = {"seq_len": 8, "vocab_size": 128, "num_samples": 4}
    model = {"class_path": "lightning_blockwise.pl.demos.tiny.DemoCausalLM", "init_args": {"quantize": False}}
    config.write_text(yaml.safe_dump({"trainer": trainer, "model": model, "data": data}))
    cli = LightningCLI(args=["fit", "--config", str(config), f"--trainer.default_root_dir={tmp_path / 'run'}"])
    assert isinstance(cli.trainer.strategy, BlockwiseStrategy) and cli.trainer.global_step == 2
    assert cli.trainer.callbacks[0].result.passed  # type: ignore[attr-defined]
    if isinstance(strategy_yaml, dict):
        assert cli.trainer.strategy.options.block_size == 2  # type: ignore[attr-defined]
    # Control: the lightning.pytorch module is not a `pytorch_lightning.LightningModule`; jsonargparse refuses it.
    model["class_path"] = "lightning_blockwise.demos.tiny.DemoCausalLM"
    config.write_text(yaml.safe_dump({"trainer": trainer, "model": model, "data": data}))
    with pytest.raises(SystemExit):
        LightningCLI(args=["fit", "--config", str(config)])


@pytest.mark.parametrize(
    ("callback", "fix"),
    [
        (lambda: lightning_pl.callbacks.Timer(), r"`import pytorch_lightning as pl` for every import"),
        (lambda: EpochProgressBar(), r"from lightning_blockwise\.pl\.callbacks\.progress_bar import EpochProgressBar"),
    ],
    ids=["lightning-callback", "our-progress-bar"],
)
def test_mixing_namespaces_is_refused_before_any_work(callback: Any, fix: str) -> None:
    module = PlCausalLMModule(_build)
    with pytest.raises(MisconfigurationException, match=rf"is a `lightning\.pytorch` .*{fix}") as refused:
        pl_fit(module, "blockwise", callbacks=[callback()])
    assert "pytorch_lightning.Trainer" in str(refused.value) and "\n" not in str(refused.value)
    assert module.losses == []
    # Control: the same run with pytorch_lightning's callback trains.
    pl_fit(module, "blockwise", callbacks=[pl.callbacks.Timer()], max_steps=1)
    assert module.losses


_FRESH_PROCESS = """
import sys
import lightning_blockwise
import lightning.pytorch
from lightning_blockwise.compat import lightning_namespaces
{then}
import lightning_utilities.core.rank_zero as rank_zero
print("imported:", "pytorch_lightning" in sys.modules, "logger:", rank_zero.log.name)
import pytorch_lightning
from pytorch_lightning.strategies import StrategyRegistry
print("registered:", StrategyRegistry["blockwise"]["strategy"].__module__)
"""


@pytest.mark.parametrize(
    "then",
    ["", "lightning_namespaces.load_twins().BlockwiseStrategy"],
    ids=["lazy", "control-eager"],
)
def test_the_twins_wait_for_the_users_import_of_pytorch_lightning(then: str) -> None:
    """NOTE [ The twins load when pytorch_lightning does ]: `import lightning_blockwise` and `lightning.pytorch`
    leave Lightning's rank-zero logger `lightning.pytorch`'s; `import pytorch_lightning` afterwards still registers
    "blockwise".
    Control: loading the twins at once (what the import did before) hands the logger to `pytorch_lightning`."""
    done = subprocess.run(
        [sys.executable, "-c", _FRESH_PROCESS.format(then=then)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[-1] == "registered: lightning_blockwise.pl.strategy.blockwise"
    if then:
        assert lines[-2] == "imported: True logger: pytorch_lightning.utilities.rank_zero"
    else:
        assert lines[-2] == "imported: False logger: lightning.pytorch.utilities.rank_zero"
