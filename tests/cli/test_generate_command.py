"""`lightning-blockwise generate` (cli/generate_command.py): replies from an adapter or a .ckpt, one-line errors."""

from __future__ import annotations

import io
import sys
from pathlib import Path
from unittest import mock

import lightning.pytorch as pl
import pytest
import torch

from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.cli import DESCRIPTION, main
from lightning_blockwise.cli.generate_command import generate_command
from lightning_blockwise.recipes.data import SyntheticTokensDataModule
from lightning_blockwise.recipes.finetune import CausalLMFineTune
from lightning_blockwise.recipes.generation import MAX_NEW_TOKENS_LIMIT, Reply, Sampling
from tests.helpers.chat import save_adapter, save_chat_checkpoint

#: Arguments every run here takes: the CPU, fp32 (the tiny model's shapes), short replies.
CPU = ["--device", "cpu", "--compute-dtype", "float32", "--max-new-tokens", "6"]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat")
    checkpoint = save_chat_checkpoint(root / "base")
    return {
        "base": checkpoint,
        "adapter": save_adapter(checkpoint, root / "adapter", seed=1),
        "other": save_adapter(checkpoint, root / "other", seed=2),
    }


def _tokens(replies: list[Reply]) -> list[torch.Tensor]:
    return [reply.tokens for reply in replies]


def _equal(a: list[Reply], b: list[Reply]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(_tokens(a), _tokens(b), strict=True))


def test_streamed_replies_equal_resident_ones(chat_model: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    prompts = ["--prompt", "hi", "--prompt", "name a color", "--prompt", "and a number", "--batch-size", "2"]
    args = [str(chat_model["base"]), "--adapter", str(chat_model["adapter"]), *prompts, *CPU]
    streamed = generate_command(args)
    out, err = capsys.readouterr()
    assert [reply.prompt for reply in streamed] == ["hi", "name a color", "and a number"]
    assert all(f">>> {reply.prompt}\n{reply.text}" in out for reply in streamed)
    # The expected speed once, the measured one per batch (two batches: 2 prompts, then 1).
    assert err.count("BlockwiseStrategy on the CPU") == 1 and err.count("tokens/s") == 2
    resident = generate_command([*args, "--resident"])
    assert _equal(streamed, resident)
    # The control: another adapter gives other replies.
    other = generate_command([str(chat_model["base"]), "--adapter", str(chat_model["other"]), *prompts, *CPU])
    assert not _equal(streamed, other)


def test_a_ckpt_gives_the_replies_of_its_exported_adapter(chat_model: dict[str, Path], tmp_path: Path) -> None:
    """A lean `.ckpt` of a CausalLMFineTune run (its base named in its hyperparameters) = the adapter it exported."""
    module = CausalLMFineTune(str(chat_model["base"]), lora_r=4, compute_dtype="float32", warmup_steps=1,
                              learning_rate=0.05, adapter_dir=str(tmp_path / "exported"))  # fmt: skip
    pl.seed_everything(0, verbose=False)
    fitter = pl.Trainer(
        strategy=BlockwiseStrategy(), accelerator="cpu", max_steps=2, limit_val_batches=0, logger=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=tmp_path,
    )  # fmt: skip
    fitter.fit(module, datamodule=SyntheticTokensDataModule(seq_len=12, vocab_size=259, num_samples=4, batch_size=2))
    ckpt = tmp_path / "run.ckpt"
    fitter.save_checkpoint(ckpt)
    prompts = ["--prompt", "hi", "--prompt", "name a color"]
    from_ckpt = generate_command(["--ckpt", str(ckpt), *prompts, *CPU])
    exported = generate_command([str(chat_model["base"]), "--adapter", str(tmp_path / "exported"), *prompts, *CPU])
    assert _equal(from_ckpt, exported)
    # The control: the trained adapter answers otherwise than the untrained one (B = 0: the base's replies).
    untrained = CausalLMFineTune(str(chat_model["base"]), lora_r=4, compute_dtype="float32")
    untrained.configure_model()
    untrained.model.save_pretrained(tmp_path / "untrained")
    base = generate_command([str(chat_model["base"]), "--adapter", str(tmp_path / "untrained"), *prompts, *CPU])
    assert not _equal(from_ckpt, base)


def test_without_prompts_it_chats_on_stdin(
    chat_model: dict[str, Path], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("hi\n\n/reset\nhi\n/quit\nnot read\n"))
    replies = generate_command([str(chat_model["base"]), "--adapter", str(chat_model["adapter"]), *CPU])
    # Two turns (the blank line skipped, nothing after /quit); after the reset the same first turn again.
    assert [reply.prompt for reply in replies] == ["hi", "hi"] and _equal(replies[:1], replies[1:])
    out, err = capsys.readouterr()
    assert out.splitlines() == [replies[0].text, replies[1].text]
    assert "/reset starts over" in err and "(conversation reset)" in err


def test_main_dispatches_generate(chat_model: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    main(["generate", str(chat_model["base"]), "--adapter", str(chat_model["adapter"]), "--prompt", "hi", *CPU])
    assert capsys.readouterr().out.startswith(">>> hi\n")
    assert "generate (talk to a trained adapter" in DESCRIPTION


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--max-new-tokens", "0"], f"max_new_tokens=0 must be from 1 to {MAX_NEW_TOKENS_LIMIT}"),
        (["--max-new-tokens", str(MAX_NEW_TOKENS_LIMIT + 1)], f"must be from 1 to {MAX_NEW_TOKENS_LIMIT}"),
        (["--temperature", "-1"], "temperature=-1.0 must be 0 (greedy) or positive"),
        (["--temperature", "1", "--top-p", "1.5"], "top_p=1.5 must be above 0 and at most 1"),
        (["--top-k", "40"], "temperature=0 is greedy. Give a temperature above 0"),
        (["--batch-size", "0"], "argument --batch-size: 0 must be at least 1"),
        (["--device", "tpu"], "argument --device: invalid choice: 'tpu'"),
        (["--vram-budget", "20GiB"], "--vram-budget caps a GPU's memory"),
        (["--adapter", "NOWHERE"], "holds no adapter_config.json"),
        (["--ckpt", "NOWHERE.ckpt"], "--ckpt NOWHERE.ckpt does not exist"),
        (["--chat-template", "NOFILE"], "is neither 'auto', 'alpaca', a Jinja template"),
        # Issue 41 item 10: these three gave raw tracebacks (an overflow in torch, the Trainer's ValueError, Hugging
        # Face's "Repo id must be in the form ...").
        (["--seed", str(2**70)], f"seed={2**70} must be an integer from 0 to 2**64 - 1"),
        (["--seed", "-1"], "seed=-1 must be an integer from 0 to 2**64 - 1"),
        (["--precision", "bogus"], "argument --precision: invalid choice: 'bogus' (choose from 'bf16-mixed',"),
        (["--tokenizer", "NOWHERE"], "--tokenizer NOWHERE does not exist. Give the local directory"),
    ],
)
def test_bad_arguments_are_refused_in_one_line_before_the_model_loads(
    chat_model: dict[str, Path], tmp_path: Path, args: list[str], message: str
) -> None:
    args = [arg.replace("NOWHERE", str(tmp_path / "nowhere")) for arg in args]
    given = ["--adapter", str(chat_model["adapter"])] if "--adapter" not in args and "--ckpt" not in args else []
    base = [] if "--ckpt" in args else [str(chat_model["base"])]
    with (
        mock.patch("lightning_blockwise.recipes.finetune_model.load_blockwise") as loaded,
        mock.patch("lightning_blockwise.recipes.finetune_model.AutoModelForCausalLM.from_pretrained") as resident,
        pytest.raises(SystemExit) as exit_info,
    ):
        generate_command([*base, *given, "--prompt", "hi", "--device", "cpu", *args])
    text = str(exit_info.value.code)
    assert text.startswith("lightning-blockwise generate: ") and "\n" not in text
    assert message.replace("NOWHERE", str(tmp_path / "nowhere")) in text
    assert loaded.call_count == resident.call_count == 0


def test_the_sources_must_be_one_and_name_a_base(chat_model: dict[str, Path], tmp_path: Path) -> None:
    adapter = str(chat_model["adapter"])
    cases = [
        (["--adapter", adapter, "--ckpt", str(tmp_path / "x.ckpt")], "give --adapter DIR or --ckpt FILE, not both"),
        (["--adapter", adapter], "give the base checkpoint directory"),
        ([str(tmp_path), "--adapter", adapter], "holds no config.json"),
    ]
    torch.save({"hyper_parameters": {"hidden_size": 64}}, tmp_path / "demo.ckpt")
    cases.append((["--ckpt", str(tmp_path / "demo.ckpt")], "was not saved by a CausalLMFineTune run"))
    for args, message in cases:
        with pytest.raises(SystemExit, match=message):
            generate_command([*args, "--prompt", "hi", "--device", "cpu"])


def test_help_says_the_speed_and_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        generate_command(["--help"])
    assert exit_info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "about 0.75 s at 72B" in text and "(default: 256)" in text and "0: greedy" in text


def test_control_the_seed_range_is_torchs() -> None:
    """The largest seed that `generate --seed` takes seeds torch's generator; one more overflows inside torch."""
    torch.Generator().manual_seed(2**64 - 1)
    with pytest.raises(ValueError, match="Overflow"):
        torch.Generator().manual_seed(2**64)
    assert Sampling(seed=2**64 - 1).seed == 2**64 - 1
