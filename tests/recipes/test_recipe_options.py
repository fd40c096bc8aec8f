"""``CausalLMFineTune``'s options are checked in its constructor: choices, counts, and flags that must be bools."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from peft.tuners.lora.dora import DoraLinearLayer

from lightning_blockwise.recipes import recipe_options
from lightning_blockwise.recipes.finetune import CausalLMFineTune

FLAGS = ["use_dora", "random_init", "overwrite_adapter", "allow_other_base", "quantize"]


@pytest.mark.parametrize("name", FLAGS)
@pytest.mark.parametrize("value", ["no", "false", 0, 1])
def test_a_flag_that_is_not_a_bool_is_refused(name: str, value: Any) -> None:
    """NOTE [ A string is not a flag ]: `use_dora="no"` trained DoRA; now it is refused, naming the fix."""
    allowed = r"True, False or None \(None takes adapter_path's record" if name == "quantize" else "True or False"
    message = rf"^`CausalLMFineTune\({name}={re.escape(repr(value))}\)` must be {allowed}.*unquoted in YAML\.$"
    with pytest.raises(MisconfigurationException, match=message):
        CausalLMFineTune("/no/such/checkpoint", **{name: value})
    # Control: the bools are taken (the checkpoint is only read when the model is built).
    for ok in (True, False):
        assert CausalLMFineTune("/no/such/checkpoint", **{name: ok}).hparams[name] is ok


def test_control_without_the_check_a_no_trains_dora(
    checkpoints: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the check prevents: `use_dora="no"` builds DoRA adapters, as the issue found."""
    monkeypatch.setattr(recipe_options, "check_flag", lambda *args, **kwargs: None)
    module = CausalLMFineTune(str(checkpoints["llama"]), use_dora="no", quantize=False, compute_dtype="float32")
    module.configure_model()
    assert any(isinstance(layer, DoraLinearLayer) for layer in module.model.modules())


def test_choices_and_counts_are_still_checked() -> None:
    with pytest.raises(MisconfigurationException, match=r"^CausalLMFineTune\(loader='fast'\): choose one of 'auto',"):
        CausalLMFineTune("/no/such/checkpoint", loader="fast")
    with pytest.raises(MisconfigurationException, match=r"^CausalLMFineTune\(mlp_tile_tokens=0\) must be an integer"):
        CausalLMFineTune("/no/such/checkpoint", mlp_tile_tokens=0)
