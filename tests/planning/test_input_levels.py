"""input_levels: the saved layer inputs on the card, in host memory, and one kept in k, cheapest first."""

from __future__ import annotations

import pytest

from lightning_blockwise.planning.input_levels import InputLevels, input_levels

GIB = 2**30


def _levels(device_inputs: int, host_inputs: int, layers: int = 8) -> InputLevels:
    """Levels for a card and a host that hold ``device_inputs`` and ``host_inputs`` inputs of 1 MiB."""
    one = 512 * 1024 * 2  # 512 tokens x hidden 1024 x 2 B
    return input_levels(layers, 512, 1024, device_inputs * one, host_inputs * one)


def test_every_input_on_the_card_when_it_fits() -> None:
    assert _levels(8, 0) == InputLevels(8, 0, None)
    assert _levels(8, 0).offload_activations() is False


def test_the_fewest_inputs_go_to_the_host() -> None:
    """Card for 5: 2 kept + 3 in flight leaves 6 to offload (1 kept + 3 in flight + 5 offloaded would be 4)."""
    levels = _levels(5, 8)
    assert levels == InputLevels(2, 6, None)
    assert levels.offload_activations() == 6
    assert _levels(3, 8) == InputLevels(0, 8, None) and _levels(3, 8).offload_activations() is True


def test_checkpoints_when_the_host_is_short_too() -> None:
    """Card for 6, host for 2: no split holds 8 inputs; k=2 keeps 4, all on the card, with a segment's 2 replayed."""
    assert _levels(6, 2) == InputLevels(4, 0, 2)
    # Card for 5: k=4 with both checkpoints in host memory holds a segment's 4 inputs and the next checkpoint coming
    # back, of which 2 are the in-flight ones counted anyway: 3 + 2.
    assert _levels(5, 2) == InputLevels(0, 2, 4)
    # Card for 4: k=2 needs 4 + 2, or 3 + 2 + 1 with one on the host; k=3 (3 kept) 3 + 3; k=4 2 + 4, or 5 as above.
    with pytest.raises(ValueError, match=r"least card memory with this host memory is 0\.00 GiB"):
        _levels(4, 2)


def test_the_72b_shape_at_64k_tokens() -> None:
    """80 layers of 1 GiB inputs (86 GB): 20 GiB of card and 60 GiB of host split no way; k=2 offloads 25 of 40.

    The strategy's options for it: `offload_activations=50` (checkpoints 0, 2, ..., 48 in host memory) and
    `input_checkpoint_every=2`.
    """
    levels = input_levels(80, 65536, 8192, 20 * GIB, 60 * GIB)
    assert levels == InputLevels(15, 25, 2)
    assert levels.offload_activations() == 50
    assert input_levels(80, 65536, 8192, 20 * GIB, 70 * GIB) == InputLevels(17, 63, None)


@pytest.mark.parametrize("field", ["layers", "tokens", "hidden", "element_bytes"])
def test_sizes_must_be_positive(field: str) -> None:
    sizes = dict(layers=8, tokens=512, hidden=1024, device_bytes=GIB, host_bytes=GIB, element_bytes=2)
    sizes[field] = 0
    with pytest.raises(ValueError, match=rf"^{field}=0 must be at least 1"):
        input_levels(**sizes)
