"""`benchmarks/data_parallel.py`'s command line: each arm's strategy, and what it refuses before any model work."""

from __future__ import annotations

import pytest

from benchmarks.data_parallel import BLOCK_MAJOR, arm_strategy, parse_args
from lightning_blockwise import BlockwiseStrategy


def _args(*argv: str) -> list[str]:
    return [*argv, "--out", "results.jsonl"]


def test_block_major_arm_streams_every_block_in_windows() -> None:
    args = parse_args(_args("--arm", BLOCK_MAJOR, "--accumulate", "4", "--devices", "2"))
    assert args.accumulate == 4
    strategy = arm_strategy(args.arm, args.devices, args.seq)
    assert isinstance(strategy, BlockwiseStrategy) and strategy.options.block_major_accumulation
    # Every block streamed (no budget, not the card's): the copies a window saves are what the arm measures.
    assert (
        strategy.options.vram_budget is None
        and not strategy.options.uses_card
        and strategy.options.budget_tokens == args.seq
    )


def test_the_other_arms() -> None:
    args = parse_args(_args("--arm", "blockwise"))
    assert args.accumulate == 1
    plain = arm_strategy("blockwise", 2, 2048)
    assert (
        isinstance(plain, BlockwiseStrategy)
        and plain.options.vram_budget is None
        and not plain.options.block_major_accumulation
    )
    budget = arm_strategy("blockwise:20GiB", 2, 2048)
    assert isinstance(budget, BlockwiseStrategy) and budget.options.vram_budget == 20 * 2**30
    assert arm_strategy("ddp", 2, 2048) == "ddp" and arm_strategy("ddp", 1, 2048) == "auto"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--arm", BLOCK_MAJOR), "--accumulate 2 or more"),
        (("--arm", BLOCK_MAJOR, "--accumulate", "1"), "--accumulate 2 or more"),
        (("--arm", "blockwise", "--accumulate", "0"), "at least 1"),
        (("--arm", "fsdp"), "one of blockwise"),
        (("--arm", "ddp", "--random-init"), "only the blockwise arms"),
    ],
)
def test_refused_before_model_work(argv: tuple[str, ...], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(_args(*argv))
    assert message in capsys.readouterr().err
