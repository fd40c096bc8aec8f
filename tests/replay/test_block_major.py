"""Block-major gradient accumulation (NOTE [ Block-major accumulation ], NOTE [ A window's batches ]).

Through ``Trainer.fit`` with ``accumulate_grad_batches=4``: exact to resident training with the same
accumulation (losses, grads, weights, AdamW state), each block copied once per pass per window instead of
once per micro-batch, windows cut short at an epoch's end with a shuffling loader, micro-batches that
return ``None``, the rest of a step running in Lightning's call for it, a loader without a length, a
resume mid-epoch, and windows that run each adapter's hooks once (as on several ranks). Controls: a window backward that
takes its micro-batches in another order differs; dropout is refused at setup, and random numbers drawn
in a layer at run time are refused.
"""

from __future__ import annotations

import ast
import builtins
import dataclasses
import gc
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer, seed_everything
from lightning.pytorch.callbacks import GradientAccumulationScheduler, ModelCheckpoint
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader
from torchdata.stateful_dataloader.sampler import RandomSampler
from transformers import AutoModelForCausalLM

import lightning_blockwise  # noqa: F401
from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.replay import block_major, remat, window_forward
from lightning_blockwise.replay.block_major import WindowError
from lightning_blockwise.residency.stream_observer import StreamObserver
from lightning_blockwise.strategy.accumulation import BlockMajorSteps
from lightning_blockwise.strategy.batch_comparison import batches_differ
from tests.helpers.models import (
    CONFIGS,
    SEQ,
    CausalLMModule,
    assert_equal_runs,
    build_model,
    collect,
    fit,
    padded_batches,
    runs_differ,
    trainer,
    trainer_optimizer,
)

ACCUMULATE = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tests' tiny Llama, 8 layers, without attention dropout (block-major accumulation refuses dropout)."""
    path = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    config = CONFIGS["llama"]()
    config.attention_dropout = 0.0
    config.num_hidden_layers = 8  # more blocks than slots, so that copies are what the windows save
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def _module(checkpoint: Path, cls: type[CausalLMModule] = CausalLMModule, dropout: float = 0.0) -> CausalLMModule:
    return cls(lambda: build_model("llama", checkpoint=checkpoint, quantized=True, lora_dropout=dropout))


class _Copies(StreamObserver):
    def __init__(self) -> None:
        self.copies = 0

    def copy_started(self, block: int) -> None:
        self.copies += 1


def _blockwise(observer: StreamObserver | None = None, **options: Any) -> BlockwiseStrategy:
    strategy = BlockwiseStrategy(**options)
    if observer is not None:
        strategy.set_observer(observer)
    return strategy


@pytest.fixture(scope="module")
def resident(checkpoint: Path) -> Any:
    return fit(_module(checkpoint), "auto", accumulate_grad_batches=ACCUMULATE, max_steps=2)


def test_block_major_equals_resident_and_copies_each_block_once_per_window(checkpoint: Path, resident: Any) -> None:
    plain_copies, window_copies = _Copies(), _Copies()
    plain = fit(_module(checkpoint), _blockwise(plain_copies), accumulate_grad_batches=ACCUMULATE, max_steps=2)
    windowed = fit(
        _module(checkpoint),
        _blockwise(window_copies, block_major_accumulation=True),
        accumulate_grad_batches=ACCUMULATE,
        max_steps=2,
    )
    assert_equal_runs(plain, resident)
    assert_equal_runs(windowed, resident)
    # 2 windows of 4 micro-batches: the per-micro-batch traffic once per window.
    assert window_copies.copies > 0
    assert plain_copies.copies >= 3.5 * window_copies.copies, (plain_copies.copies, window_copies.copies)


def test_control_window_backward_in_another_orderbatches_differ(
    checkpoint: Path, resident: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The comparison sees the order in which a window's micro-batches reach the adapters' gradients."""
    # Same work, the micro-batches taken last first: the gradients' sums round differently.
    monkeypatch.setattr(block_major, "sorted", lambda keys: builtins.sorted(keys, reverse=True), raising=False)
    windowed = fit(
        _module(checkpoint),
        _blockwise(block_major_accumulation=True),
        accumulate_grad_batches=ACCUMULATE,
        max_steps=2,
    )
    assert runs_differ(windowed, resident)


class _Forwards(Callback):
    """The kinds of forward installed on the decoder layers after each micro-batch's step."""

    def __init__(self) -> None:
        self.seen: list[set[str]] = []

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, *args: Any) -> None:
        self.seen.append({type(vars(layer)["forward"]).__name__ for layer in trainer.strategy.layers})


def test_a_window_wraps_the_layers_and_the_engine_never_asks(checkpoint: Path) -> None:
    """Block-major installs its own forward over the layers while a window is open (NOTE [ A wrapper over the
    installed forward ]); without it the engine's forward is called directly and checks nothing per call."""
    windowed, plain = _Forwards(), _Forwards()
    fit(
        _module(checkpoint),
        _blockwise(block_major_accumulation=True),
        callbacks=[windowed],
        accumulate_grad_batches=ACCUMULATE,
        max_steps=1,
    )
    assert len(windowed.seen) == ACCUMULATE and all(seen == {"WindowForward"} for seen in windowed.seen)
    # Control: without block-major accumulation, the rematerializing forward itself.
    fit(_module(checkpoint), _blockwise(), callbacks=[plain], accumulate_grad_batches=ACCUMULATE, max_steps=1)
    assert len(plain.seen) == ACCUMULATE and all(seen == {"RematLayer"} for seen in plain.seen)
    # The engine's layer forward imports nothing of block-major accumulation (the window modules import it).
    assert not _window_imports(remat), _window_imports(remat)
    assert _window_imports(window_forward) == {"lightning_blockwise.replay.block_major"}  # control: it is seen


def _window_imports(module: Any) -> set[str]:
    """What ``module`` imports of block-major accumulation's modules, as dotted names."""
    names = set()
    for node in ast.walk(ast.parse(Path(module.__file__).read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module, *(f"{node.module}.{alias.name}" for alias in node.names)}
        elif isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
    return {name for name in names if name.rsplit(".", 1)[-1] in {"block_major", "window_forward"}}


class _ShortStepModule(CausalLMModule):
    """Skips one micro-batch per window (returns ``None``, the window's last one in the first window)."""

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor | None:
        loss = super().training_step(batch, batch_idx)
        # The step's tail runs in Lightning's call for its own batch (NOTE [ Block-major accumulation ]).
        assert self.trainer.fit_loop.epoch_loop.batch_idx == batch_idx
        return None if batch_idx in (3, 5) else loss


def test_windows_cut_at_epoch_end_shuffled_and_skipped_micro_batches(checkpoint: Path) -> None:
    """6 batches per epoch, windows of 4 then 2, a shuffling loader, micro-batches returning None: exact."""
    runs = []
    for strategy in ("auto", _blockwise(block_major_accumulation=True)):
        module = _module(checkpoint, _ShortStepModule)
        torch.manual_seed(0)
        run = trainer(strategy, accumulate_grad_batches=ACCUMULATE, max_steps=-1, max_epochs=2)
        data = DataLoader(padded_batches(6), batch_size=None, shuffle=True)
        seed_everything(0, verbose=False)
        run.fit(module, data)
        assert run.global_step == 4
        runs.append(collect(module, trainer_optimizer(module)))
    assert_equal_runs(runs[1], runs[0])


def test_dropout_refused_at_setup(checkpoint: Path) -> None:
    with pytest.raises(MisconfigurationException, match=r"dropout \(p=0.1\).*lora_dropout"):
        fit(
            _module(checkpoint, dropout=0.1),
            _blockwise(block_major_accumulation=True),
            accumulate_grad_batches=ACCUMULATE,
            max_steps=1,
        )


class _DropoutAfterSetup(Callback):
    """Turns one adapter's dropout on after the strategy's checks: the run-time check must catch it."""

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        lora = pl_module.model.get_decoder().layers[1].self_attn.q_proj
        lora.lora_dropout["default"] = nn.Dropout(0.5)


def test_random_numbers_in_a_layer_refused_at_run_time(checkpoint: Path) -> None:
    with pytest.raises(WindowError, match="decoder layer 1 of micro-batch 0 drew random numbers"):
        fit(
            _module(checkpoint),
            _blockwise(block_major_accumulation=True),
            accumulate_grad_batches=ACCUMULATE,
            max_steps=1,
            callbacks=[_DropoutAfterSetup()],
        )


def test_bad_combinations_refused_before_model_work() -> None:
    with pytest.raises(MisconfigurationException, match="offload_activations"):
        BlockwiseStrategy(block_major_accumulation=True, offload_activations=True)
    with pytest.raises(MisconfigurationException, match="True or False"):
        BlockwiseStrategy(block_major_accumulation="yes")  # type: ignore[arg-type]


class _Manual(CausalLMModule):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.automatic_optimization = False


def test_manual_optimization_refused(checkpoint: Path) -> None:
    with pytest.raises(MisconfigurationException, match="automatic optimization"):
        fit(_module(checkpoint, _Manual), _blockwise(block_major_accumulation=True), accumulate_grad_batches=2)


class _Stream(torch.utils.data.IterableDataset):
    """Batches without a length: Lightning's fetcher then holds the next batch ahead (NOTE [ A window's batches ])."""

    def __init__(self, batches: list[dict[str, Tensor]]) -> None:
        self.batches = batches

    def __iter__(self) -> Any:
        return iter(self.batches)


def test_loader_without_length(checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An iterable loader of 7 batches: windows of 4 and 3 (found at the stream's end), exact to resident."""
    sizes = []
    init = block_major.Window.__init__

    def recording_init(self: block_major.Window, count: int, *args: Any, **kwargs: Any) -> None:
        sizes.append(count)
        init(self, count, *args, **kwargs)

    monkeypatch.setattr(block_major.Window, "__init__", recording_init)
    runs = []
    for strategy in ("auto", _blockwise(block_major_accumulation=True)):
        module = _module(checkpoint)
        run = trainer(strategy, accumulate_grad_batches=ACCUMULATE, max_steps=-1, max_epochs=1)
        seed_everything(0, verbose=False)
        run.fit(module, DataLoader(_Stream(padded_batches(7)), batch_size=None))
        assert run.global_step == 2 and len(module.losses) == 7
        runs.append(collect(module, trainer_optimizer(module)))
    assert sizes == [4, 3]
    assert_equal_runs(runs[1], runs[0])


def _resumable_run(strategy: Any, max_steps: int, root: Path, checkpoint: Path, ckpt_path: Path | None = None) -> Any:
    """A run with a checkpoint after every optimizer step and a shuffling loader that resumes exactly (torchdata)."""
    seed_everything(0, verbose=False)
    module = _module(checkpoint)
    batches = padded_batches(8)
    data = StatefulDataLoader(
        batches,
        batch_size=None,
        sampler=RandomSampler(batches, generator=torch.Generator().manual_seed(7)),
        generator=torch.Generator().manual_seed(8),
    )
    callback = ModelCheckpoint(dirpath=root, every_n_train_steps=1, save_top_k=-1, filename="{step}")
    run = trainer(
        strategy,
        accumulate_grad_batches=ACCUMULATE,
        max_steps=max_steps,
        enable_checkpointing=True,
        callbacks=[callback],
        default_root_dir=root,
    )
    run.fit(module, data, ckpt_path=ckpt_path)
    return collect(module, trainer_optimizer(module))


def test_resume_mid_epoch_is_exact(checkpoint: Path, tmp_path: Path) -> None:
    """Two windows per epoch; stopped after 3 optimizer steps (mid-epoch 1) and resumed to 5: the tail equals."""
    whole = _resumable_run(_blockwise(block_major_accumulation=True), 5, tmp_path / "whole", checkpoint)
    resident = _resumable_run("auto", 5, tmp_path / "resident", checkpoint)
    assert_equal_runs(whole, resident)
    _resumable_run(_blockwise(block_major_accumulation=True), 3, tmp_path / "first", checkpoint)
    resumed = _resumable_run(
        _blockwise(block_major_accumulation=True),
        5,
        tmp_path / "second",
        checkpoint,
        tmp_path / "first" / "step=3.ckpt",
    )
    steps = 2
    assert len(resumed.losses) == steps * ACCUMULATE
    tail = type(whole)(whole.losses[-steps * ACCUMULATE :], whole.grads[-steps:], whole.weights, whole.optimizer)
    assert_equal_runs(tail, resumed)


def test_validation_inside_a_window(checkpoint: Path) -> None:
    """Validation every 2 batches runs between a window's micro-batches (its layers streamed as usual): exact."""
    runs = []
    for strategy in ("auto", _blockwise(block_major_accumulation=True)):
        module = _module(checkpoint)
        run = trainer(
            strategy,
            accumulate_grad_batches=ACCUMULATE,
            max_steps=2,
            limit_val_batches=1,
            val_check_interval=2,
        )
        seed_everything(0, verbose=False)
        batches = padded_batches(8)
        run.fit(module, DataLoader(batches, batch_size=None), DataLoader(batches[:1], batch_size=None))
        assert len(module.val_losses) == 4
        runs.append((collect(module, trainer_optimizer(module)), module.val_losses))
    assert_equal_runs(runs[1][0], runs[0][0])
    assert all(torch.equal(a, b) for a, b in zip(runs[1][1], runs[0][1], strict=True))


def test_with_a_budget_some_blocks_resident(checkpoint: Path, resident: Any) -> None:
    """A `vram_budget` that keeps some blocks resident (none kept: a window keeps no graphs): still exact."""
    probe = _blockwise(block_major_accumulation=True, budget_tokens=2 * SEQ)
    fit(_module(checkpoint), probe, accumulate_grad_batches=ACCUMULATE, max_steps=1)
    assert probe._planner is not None and probe.step_plan is not None
    budget, minimum = probe._planner.budget, probe.step_plan.residency.minimum
    split = next(
        b
        for b in range(minimum, 4 * minimum, 2**10)
        if 2 <= len(dataclasses.replace(budget, budget=b).plan(2 * SEQ).residency.resident) <= 4
    )
    strategy = _blockwise(block_major_accumulation=True, vram_budget=split, budget_tokens=2 * SEQ)
    windowed = fit(_module(checkpoint), strategy, accumulate_grad_batches=ACCUMULATE, max_steps=2)
    plan = strategy.step_plan
    assert plan is not None and 2 <= len(plan.residency.resident) <= 4 and not plan.residency.kept
    assert_equal_runs(windowed, resident)


# --- what the review found (each was silently inexact, a hang, a leak or a wrong refusal before its fix) ----------


class _HiddenStateLoss(CausalLMModule):
    """An auxiliary loss on an intermediate hidden state: its gradient cannot pass a window's graph-free layers."""

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        out = self.model(**batch, output_hidden_states=True)
        return out.loss + 0.1 * out.hidden_states[4].float().pow(2).mean()


def test_a_loss_on_an_intermediate_hidden_state_is_refused(checkpoint: Path) -> None:
    with pytest.raises(WindowError, match="depends on the output of decoder layer 3"):
        fit(_module(checkpoint, _HiddenStateLoss), _blockwise(block_major_accumulation=True), max_steps=1)


class _TwoPasses(CausalLMModule):
    """A second decoder pass in one step (a reference forward): refused, where it used to wait forever."""

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        with torch.no_grad():
            self.model(**batch)
        return loss


def test_a_second_decoder_pass_is_refused_not_a_hang(checkpoint: Path) -> None:
    with pytest.raises(WindowError, match="called decoder layer 0 after layer 7"):
        fit(_module(checkpoint, _TwoPasses), _blockwise(block_major_accumulation=True), max_steps=1)


class _InPlaceRandomHook(CausalLMModule):
    def on_after_batch_transfer(self, batch: dict[str, Tensor], dataloader_idx: int) -> dict[str, Tensor]:
        batch["labels"].masked_fill_(torch.rand(batch["labels"].shape) < 0.3, -100)
        return batch


def test_an_in_place_random_batch_hook_is_refused(checkpoint: Path) -> None:
    """On the CPU the transfer does not copy: the read-ahead works on copies, so the loop's batch shows the change."""
    with pytest.raises(WindowError, match="differs from the one read ahead"):
        fit(_module(checkpoint, _InPlaceRandomHook), _blockwise(block_major_accumulation=True), max_steps=1)


class _RandomLabels(torch.utils.data.Dataset):
    """Masks labels at random as it loads (in this process): the read-ahead moves these draws."""

    def __init__(self) -> None:
        self.batches = padded_batches(8)

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        batch = dict(self.batches[index])
        batch["labels"] = batch["labels"].masked_fill(torch.rand(batch["labels"].shape) < 0.3, -100)
        return batch


class _NoisyEmbeddings(CausalLMModule):
    """Random noise on the embeddings before the decoder (NEFTune-like)."""

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        embeddings = self.model.get_input_embeddings()(batch["input_ids"])
        embeddings = embeddings + 0.1 * (torch.rand_like(embeddings) - 0.5)
        return self.model(inputs_embeds=embeddings, attention_mask=batch["attention_mask"], labels=batch["labels"]).loss


def test_random_numbers_read_ahead_and_before_the_decoder_are_refused(checkpoint: Path) -> None:
    strategy = _blockwise(block_major_accumulation=True)
    with pytest.raises(WindowError, match="the code before the decoder in micro-batch 0"):
        fit(_module(checkpoint, _NoisyEmbeddings), strategy, batches=_RandomLabels(), max_steps=1)  # type: ignore[arg-type]


def test_random_numbers_read_ahead_alone_are_exact(checkpoint: Path, resident: Any) -> None:
    """Control of the refusal above: the loading's draws alone keep their order (exact to resident)."""
    runs = [
        fit(_module(checkpoint), strategy, batches=_RandomLabels(), max_steps=2)  # type: ignore[arg-type]
        for strategy in ("auto", _blockwise(block_major_accumulation=True))
    ]
    assert_equal_runs(runs[1], runs[0])


class _SaveAt(Callback):
    def __init__(self, path: Path, at: int = 1) -> None:
        self.path = path
        self.at = at

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, index: int
    ) -> None:
        if index == self.at:
            trainer.save_checkpoint(self.path)


def test_a_checkpoint_inside_a_window_records_the_loader_without_the_batches_read_ahead(
    checkpoint: Path, tmp_path: Path
) -> None:
    states = []
    for name, strategy in (("plain", _blockwise()), ("windowed", _blockwise(block_major_accumulation=True))):
        path = tmp_path / f"{name}.ckpt"
        module = _module(checkpoint)
        run = trainer(strategy, accumulate_grad_batches=ACCUMULATE, max_steps=1, callbacks=[_SaveAt(path)])
        run.fit(module, StatefulDataLoader(padded_batches(8), batch_size=None))
        states.append(torch.load(path, weights_only=False)["loops"]["fit_loop"]["state_dict"]["combined_loader"])
    assert states[0][0]["_num_yielded"] == 2
    assert states[1] == states[0]


def _loader_state_at(checkpoint: Path, path: Path, at: int) -> dict[str, Any]:
    """The loader state a windowed run's checkpoint after micro-batch ``at`` records (2 windows of 4)."""
    run = trainer(
        _blockwise(block_major_accumulation=True),
        accumulate_grad_batches=ACCUMULATE,
        max_steps=2,
        callbacks=[_SaveAt(path, at)],
    )
    run.fit(_module(checkpoint), StatefulDataLoader(padded_batches(8), batch_size=None))
    return torch.load(path, weights_only=False)["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]


@pytest.mark.parametrize("at", [0, 2, 5])
def test_a_checkpoint_elsewhere_in_a_window_records_the_batches_taken(
    checkpoint: Path, tmp_path: Path, at: int
) -> None:
    """The first and third micro-batches of the first window and the second of the next (issue 41, item 12): the
    loader is recorded after the batches the loop took, whatever the window read ahead."""
    assert _loader_state_at(checkpoint, tmp_path / "windowed.ckpt", at)["_num_yielded"] == at + 1


def test_control_a_checkpoint_in_a_window_records_the_read_ahead(
    checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without the strategy's correction the loader is recorded past the window's batches read ahead."""
    monkeypatch.setattr(BlockMajorSteps, "checkpoint_loader_state", lambda self, checkpoint: None)
    assert _loader_state_at(checkpoint, tmp_path / "windowed.ckpt", 2)["_num_yielded"] == ACCUMULATE


def test_windows_are_freed(checkpoint: Path) -> None:
    """No window outlives its step (a result kept in it held its graph, whose `_WindowTop` held the window)."""
    windows: list[weakref.ref] = []
    init = block_major.Window.__init__

    def recording_init(self: block_major.Window, *args: Any, **kwargs: Any) -> None:
        windows.append(weakref.ref(self))
        init(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(block_major.Window, "__init__", recording_init)
        fit(_module(checkpoint), _blockwise(block_major_accumulation=True), max_steps=2)
    gc.collect()
    assert len(windows) == 2 and all(window() is None for window in windows)


class _InputsRequireGrad(CausalLMModule):
    """As after PEFT's `prepare_model_for_kbit_training`: the embedding's output requires grad; nothing trains there."""

    def __init__(self, build: Any) -> None:
        def prepared() -> nn.Module:
            model = build()
            model.enable_input_require_grads()
            return model

        super().__init__(prepared)


def test_inputs_that_require_grad_without_a_parameter_are_accepted(checkpoint: Path) -> None:
    runs = [
        fit(_module(checkpoint, _InputsRequireGrad), strategy, max_steps=2)
        for strategy in ("auto", _blockwise(block_major_accumulation=True))
    ]
    assert_equal_runs(runs[1], runs[0])


def test_an_accumulation_schedule_runs_block_major(checkpoint: Path, resident: Any) -> None:
    """`GradientAccumulationScheduler({0: 4})` (the Trainer's own value is then 1): windows of 4, exact."""
    copies = _Copies()
    windowed = fit(
        _module(checkpoint),
        _blockwise(copies, block_major_accumulation=True),
        accumulate_grad_batches=1,
        max_steps=2,
        callbacks=[GradientAccumulationScheduler({0: ACCUMULATE})],
    )
    assert_equal_runs(windowed, resident)
    assert copies.copies < 30  # 2 windows; streamed per micro-batch it is 8 x ~10 (the first test: >= 3.5x more)


def test_hooks_once_window_equals_resident(checkpoint: Path, resident: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A window that runs each adapter's `AccumulateGrad` node for its last micro-batch only (as under DDP, NOTE
    [ Block-major windows on several ranks ]) leaves the same sums: the others are added as the node adds them.

    The node's post-hooks (DDP's reducer listens there) run once per window instead of once per micro-batch.
    """
    differentiate = block_major.differentiate_window

    def hooks_once(*args: Any, **kwargs: Any) -> None:
        differentiate(*args, **{**kwargs, "hooks_once": True})

    monkeypatch.setattr(block_major, "differentiate_window", hooks_once)
    module = _module(checkpoint)
    calls: list[str] = []
    for name, param in module.named_parameters():
        if param.requires_grad:
            param.register_post_accumulate_grad_hook(lambda _, name=name: calls.append(name))
    windowed = fit(module, _blockwise(block_major_accumulation=True), accumulate_grad_batches=ACCUMULATE, max_steps=2)
    assert_equal_runs(windowed, resident)
    trainable = [name for name, param in module.named_parameters() if param.requires_grad]
    assert sorted(calls) == sorted(trainable * 2)  # 2 windows, each node once per window


def test_batch_comparison_bit_for_bit_and_read_once_per_window() -> None:
    """`batches_differ`: NaN equals NaN, a changed element or structure differs; device flags raise at the check."""
    batch = {"ids": torch.tensor([1, 2]), "x": torch.tensor([float("nan"), 1.0]), "meta": [3, "a"]}
    assert batches_differ(batch, {**batch, "x": batch["x"].clone()}) is False
    assert batches_differ(batch, {**batch, "ids": torch.tensor([1, 3])}) is True
    assert batches_differ(batch, {**batch, "meta": [3, "b"]}) is True
    assert batches_differ(batch, {"ids": batch["ids"]}) is True
    layers = [torch.nn.Linear(1, 1), torch.nn.Linear(1, 1)]
    steps = BlockMajorSteps(ACCUMULATE, layers=layers, device=torch.device("cpu"))
    steps._unchecked = [(5, torch.tensor(False)), (6, torch.tensor(False))]
    steps.check_batches()  # control: nothing differed
    steps._unchecked = [(5, torch.tensor(False)), (6, torch.tensor(True))]
    with pytest.raises(WindowError, match="batch 6 of this epoch differs"):
        steps.check_batches()
