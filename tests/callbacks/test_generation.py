"""`SampleGenerations`: greedy generations at validation end, equal under blockwise and resident, leaving no trace."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch import Callback
from lightning.pytorch.loggers import Logger
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_blockwise import BlockwiseStrategy, SampleGenerations
from lightning_blockwise.callbacks.generation import MAX_NEW_TOKENS_LIMIT
from lightning_blockwise.recipes.encoding import byte_tokenizer
from tests.helpers.models import CausalLMModule, RunResult, build_model, collect, loader, padded_batches, trainer

#: Two prompts of different lengths, so the batch is left-padded.
PROMPTS = [[5, 6, 7, 8, 9], [11, 12, 13]]


def _fit(
    strategy: Any, callbacks: list[Callback], steps: int = 2, module: CausalLMModule | None = None, **kwargs: Any
) -> CausalLMModule:
    """Fit the tiny Llama (or ``module``) for ``steps`` optimizer steps from seed 0, validating one batch after each."""
    module = module or CausalLMModule(lambda: build_model("llama"))
    pl.seed_everything(0, verbose=False)
    fitter = trainer(
        strategy,
        max_steps=steps,
        accumulate_grad_batches=1,
        limit_val_batches=1,
        val_check_interval=1,
        callbacks=callbacks,
        **kwargs,
    )
    fitter.fit(module, loader(padded_batches(steps)), loader(padded_batches(1, seed=7)))
    return module


def _run(module: CausalLMModule) -> RunResult:
    return collect(module, module.trainer.optimizers[0])


def _tokens(callback: SampleGenerations) -> list[torch.Tensor]:
    return [sample.tokens for sample in callback.samples]


@pytest.mark.parametrize("use_cache", [True, False])
def test_greedy_generations_under_blockwise_equal_resident(use_cache: bool) -> None:
    resident, blockwise = (SampleGenerations(PROMPTS, max_new_tokens=6, use_cache=use_cache) for _ in range(2))
    module = _fit("auto", [resident])
    _fit(BlockwiseStrategy(), [blockwise])
    # One generation per prompt at each of the two validations (none in the sanity check).
    assert [s.step for s in blockwise.samples] == [1, 1, 2, 2]
    assert all(s.tokens.shape == (6,) for s in blockwise.samples)
    for a, b in zip(_tokens(resident), _tokens(blockwise), strict=True):
        assert torch.equal(a, b)

    # The control: the tokens follow the adapters. Generating again from the trained module gives the last
    # validation's tokens; after one adapter weight is perturbed, other tokens (so the comparison above could fail).
    last = _tokens(resident)[-2:]
    resident.on_validation_end(module.trainer, module)
    assert all(torch.equal(a, b) for a, b in zip(last, _tokens(resident)[-2:], strict=True))
    lora_b = next(p for n, p in module.named_parameters() if "lora_B" in n)
    with torch.no_grad():
        lora_b.add_(1.0)
    resident.on_validation_end(module.trainer, module)
    assert not all(torch.equal(a, b) for a, b in zip(last, _tokens(resident)[-2:], strict=True))


def test_the_kv_cache_is_used_under_streaming() -> None:
    """With the cache, each new token runs the streamed layers on one position; without it, on the whole sequence."""

    class LayerLengths(Callback):
        def __init__(self) -> None:
            self.lengths: list[int] = []

        def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            layer = trainer.strategy.layers[0]
            self.hook = layer.register_forward_pre_hook(self.record, with_kwargs=True)

        def record(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            hidden = args[0] if args else kwargs["hidden_states"]
            self.lengths.append(hidden.shape[1])

    for use_cache, expected in [(True, [5, 1, 1, 1]), (False, [5, 6, 7, 8])]:
        # The recorder installs its hook before the generation callback runs (callbacks run in order).
        lengths = LayerLengths()
        generations = SampleGenerations(PROMPTS, max_new_tokens=4, use_cache=use_cache)
        _fit(BlockwiseStrategy(), [lengths, generations], steps=1)
        lengths.hook.remove()
        assert lengths.lengths == expected


def test_generations_leave_the_training_run_unchanged() -> None:
    def assert_equal(a: RunResult, b: RunResult) -> None:
        assert len(a.losses) == len(b.losses) == 3
        assert all(torch.equal(x, y) for x, y in zip(a.losses, b.losses, strict=True))
        assert a.weights.keys() == b.weights.keys()
        assert all(torch.equal(a.weights[n], b.weights[n]) for n in a.weights)

    class DrawsAtValidationEnd(Callback):
        def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            torch.rand(1)

    plain = _run(_fit(BlockwiseStrategy(), [], steps=3))
    generating = _run(_fit(BlockwiseStrategy(), [SampleGenerations(PROMPTS, max_new_tokens=4)], steps=3))
    assert_equal(plain, generating)
    # The control: one random draw at validation end shifts the dropout masks of the next steps (LoRA and attention
    # dropout are on), so the comparison sees a callback that leaves a trace.
    with pytest.raises(AssertionError):
        assert_equal(plain, _run(_fit(BlockwiseStrategy(), [DrawsAtValidationEnd()], steps=3)))


def test_generations_put_the_rng_and_the_modes_back() -> None:
    """A model that draws random numbers while generating gives the run's generators back, and its train mode."""
    callback = SampleGenerations(PROMPTS, max_new_tokens=3)
    module = _fit("auto", [], steps=1)
    model = module.model.get_base_model()
    model.train()
    draws = []
    model.model.layers[0].self_attn.register_forward_pre_hook(lambda *args: draws.append(torch.rand(1)))
    rng = torch.get_rng_state()
    callback.on_validation_end(module.trainer, module)
    # Drawn once per generated token (the KV cache is on), each draw another number.
    assert len(draws) == 3 and not torch.equal(draws[0], draws[1])
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(m.training for m in model.modules())


def test_text_prompts_use_the_modules_tokenizer_and_stop_at_its_eos(caplog: pytest.LogCaptureFixture) -> None:
    tokenizer = byte_tokenizer()

    class WithTokenizer(CausalLMModule):
        def __init__(self) -> None:
            # A model whose config names no end of sequence: the tokenizer's is the one generation stops at.
            super().__init__(lambda: build_model("llama", vocab_size=len(tokenizer), eos_token_id=None))
            self.tokenizer = tokenizer

    module = WithTokenizer()
    model = module.model.get_base_model()
    assert model.generation_config.eos_token_id is None
    callback = SampleGenerations(["Say hi:", "A"], max_new_tokens=5)
    # Lightning's logger does not propagate to the root logger, where `caplog` listens.
    lightning_logger = logging.getLogger("lightning.pytorch")
    lightning_logger.addHandler(caplog.handler)
    try:
        with mock.patch.object(model, "generate", wraps=model.generate) as generate:
            _fit(BlockwiseStrategy(), [callback], steps=1, module=module)
    finally:
        lightning_logger.removeHandler(caplog.handler)
    assert generate.call_args.kwargs["eos_token_id"] == tokenizer.eos_token_id
    assert generate.call_args.kwargs["pad_token_id"] == tokenizer.pad_token_id
    prompt_ids = generate.call_args.kwargs["input_ids"]
    assert prompt_ids[1, -1] == tokenizer("A")["input_ids"][0] and prompt_ids[1, 0] == tokenizer.pad_token_id
    first, second = callback.samples
    assert (first.prompt, second.prompt) == ("Say hi:", "A")
    assert first.text == tokenizer.decode(first.tokens, skip_special_tokens=True)
    assert "SampleGenerations at step 1 (greedy, 5 new tokens at most):" in caplog.text
    assert f"[0] 'Say hi:' -> {first.text!r}" in caplog.text


def test_text_prompts_without_a_tokenizer_are_refused_before_the_model_is_built() -> None:
    module = CausalLMModule(lambda: build_model("llama"), in_configure_model=True)
    fitter = trainer("blockwise", callbacks=[SampleGenerations(["hello"])])
    with pytest.raises(MisconfigurationException, match="given text prompts but found no tokenizer"):
        fitter.fit(module, loader(padded_batches(1)))
    assert module.model is None


def test_token_ids_outside_the_vocabulary_are_refused_before_training() -> None:
    module = CausalLMModule(lambda: build_model("llama"))
    fitter = trainer("blockwise", callbacks=[SampleGenerations([[1, 2, 96]])])
    with pytest.raises(MisconfigurationException, match=r"token ids the model cannot embed: \[96\].*0 to 95"):
        fitter.fit(module, loader(padded_batches(1)))
    assert module.losses == []


@pytest.mark.parametrize("max_new_tokens", [0, -1, MAX_NEW_TOKENS_LIMIT + 1, None, True, 2.0])
def test_unbounded_or_too_many_new_tokens_are_refused_with_the_reason(max_new_tokens: Any) -> None:
    with pytest.raises(
        MisconfigurationException, match=r"from 1 to 256: under BlockwiseStrategy every generated token"
    ):
        SampleGenerations(PROMPTS, max_new_tokens=max_new_tokens)
    assert SampleGenerations(PROMPTS, max_new_tokens=MAX_NEW_TOKENS_LIMIT).max_new_tokens == MAX_NEW_TOKENS_LIMIT


@pytest.mark.parametrize("prompts", [[], "hello", ["hello", [1, 2]], [[]], [""], [[1, -2]], [[1, True]]])
def test_bad_prompts_are_refused(prompts: Any) -> None:
    with pytest.raises(MisconfigurationException, match="SampleGenerations\\(prompts="):
        SampleGenerations(prompts)


class _TextLogger(Logger):
    """A logger whose experiment has TensorBoard's ``add_text``, recording the calls."""

    def __init__(self) -> None:
        super().__init__()
        self.texts: list[tuple[str, str, int]] = []

    @property
    def name(self) -> str:
        return "text"

    @property
    def version(self) -> int:
        return 0

    @property
    def experiment(self) -> Any:
        return self

    def add_text(self, tag: str, text: str, step: int) -> None:
        self.texts.append((tag, text, step))

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        pass

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass


def test_generations_go_to_loggers_that_take_text(tmp_path: Path) -> None:
    logger = _TextLogger()
    callback = SampleGenerations(PROMPTS, max_new_tokens=2)
    _fit(BlockwiseStrategy(), [callback], steps=1, logger=logger, default_root_dir=tmp_path)
    assert [(tag, step) for tag, _, step in logger.texts] == [("samples/0", 1), ("samples/1", 1)]
    assert str(PROMPTS[1]) in logger.texts[1][1] and str(callback.samples[1].tokens.tolist()) in logger.texts[1][1]


def test_generations_reach_tensorboard(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard", reason="TensorBoard is optional: `pip install tensorboard` to run this test")
    from lightning.pytorch.loggers import TensorBoardLogger
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(tmp_path)
    _fit(BlockwiseStrategy(), [SampleGenerations(PROMPTS, max_new_tokens=2)], steps=1, logger=logger)
    events = EventAccumulator(logger.log_dir, size_guidance={"tensors": 0})
    events.Reload()
    assert {"samples/0/text_summary", "samples/1/text_summary"} <= set(events.Tags()["tensors"])


def test_text_prompts_are_encoded_as_the_training_rows_start() -> None:
    """With the data module's chat format a prompt's ids are those its training row starts with (Alpaca: BOS first)."""
    from types import SimpleNamespace

    from lightning_blockwise.recipes.data import InstructionDataModule
    from lightning_blockwise.recipes.encoding import encode

    data = InstructionDataModule("data/instructions.jsonl", chat_template="alpaca")
    record = {"instruction": "Reverse the word.", "input": "moon", "output": "noom"}
    row = encode(record, data.tokenizer, max_length=512, chat=data.chat)
    prompt = "### Instruction:\nReverse the word.\n\n### Input:\nmoon\n\n### Response:\n"
    callback = SampleGenerations([prompt], max_new_tokens=4)
    callback.setup(SimpleNamespace(datamodule=data), CausalLMModule(lambda: build_model("llama")), "fit")
    ids = callback._encode(prompt)
    assert ids[0] == data.tokenizer.bos_token_id
    assert ids == row["input_ids"][: len(ids)] and row["labels"][len(ids)] != -100
    # Control: the tokenizer's own special tokens (no BOS from this one) are not what training saw.
    assert list(data.tokenizer(prompt)["input_ids"]) != row["input_ids"][: len(ids)]
