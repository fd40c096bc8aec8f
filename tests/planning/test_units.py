"""Memory sizes from the user (planning/units.py): a card's "24GB" is 24 GiB, and `plan` says which size it used."""

from __future__ import annotations

import re

import pytest

from lightning_blockwise.cli import main
from lightning_blockwise.planning import card_bytes, parse_bytes


@pytest.mark.parametrize("spelling", ["24GB", "24GiB", "24 gb", "24576MB", "24576MiB"])
def test_a_card_in_gb_is_read_in_gib(spelling: str) -> None:
    assert card_bytes(spelling) == 24 * 2**30


def test_other_sizes_keep_the_decimal_gb() -> None:
    # Control arm: a budget or a file in GB is decimal as before; only a card is sold in binary units.
    assert parse_bytes("24GB") == 24 * 10**9
    assert card_bytes(24 * 10**9) == 24 * 10**9  # a count of bytes is a count of bytes


@pytest.mark.parametrize("bad", ["-24GB", "24XB", "infGB"])
def test_a_bad_card_size_is_worded_with_what_was_written(bad: str) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(bad))):
        card_bytes(bad)


def _longest(card: str, capsys: pytest.CaptureFixture[str]) -> str:
    main(["plan", "--shape", "7b", "--card", card, "--host-ram", "128GiB", "--longest", "--kernels", "none"])
    return capsys.readouterr().out.splitlines()[0]


def test_plan_reads_24gb_and_24gib_as_the_same_card(capsys: pytest.CaptureFixture[str]) -> None:
    gb, gib = _longest("24GB", capsys), _longest("24GiB", capsys)
    assert gb == gib
    # The size planned for is printed in both units, and the answer is the README table's for a 24 GiB card.
    assert "on a 24 GiB card (25.77 GB) and 128 GiB of host RAM: 122,880 tokens" in gb
    # Control arm: 24e9 bytes, the decimal reading `--card 24GB` had, is a smaller card with a shorter answer.
    decimal = _longest(str(24 * 10**9), capsys)
    assert "on a 22.3517 GiB card (24.00 GB) and 128 GiB of host RAM: 112,640 tokens" in decimal
