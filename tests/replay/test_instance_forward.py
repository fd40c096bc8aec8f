"""A `forward` a user set on a decoder layer's instance trains as in resident training, and is put back after.

NOTE [ A forward set on the layer ] in replay/remat.py: the wrapper used to call the class's forward, so a patched
layer trained another function under blockwise, silently.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import Tensor, nn

import lightning_blockwise  # noqa: F401
from tests.helpers.models import CausalLMModule, assert_equal_runs, build_model, fit, runs_differ

PATCHED = 1


def _decoder_layer(model: nn.Module) -> nn.Module:
    return model.get_base_model().model.layers[PATCHED]


def _halved_forward(self: nn.Module, hidden: Tensor, *args: Any, **kwargs: Any) -> Tensor:
    """A user's patch: the layer's own forward, its output halved (a function resident training would train)."""
    return type(self).forward(self, hidden, *args, **kwargs) * 0.5


def _build(patch: bool) -> Any:
    def build() -> nn.Module:
        model = build_model("llama")
        if patch:
            layer = _decoder_layer(model)
            layer.forward = types.MethodType(_halved_forward, layer)
        return model

    return build


def test_a_patched_layer_forward_trains_exactly_and_is_put_back() -> None:
    resident = fit(CausalLMModule(_build(patch=True)), "auto")
    module = CausalLMModule(_build(patch=True))
    patch = vars(_decoder_layer(module.model))["forward"]
    blockwise = fit(module, "blockwise")
    assert_equal_runs(resident, blockwise)
    # After training the layer's own attribute is the user's patch again, not the strategy's wrapper.
    assert vars(_decoder_layer(module.model)).get("forward") is patch


def test_control_the_patch_changes_training() -> None:
    """Calling the class's forward (what the wrapper did before) trains the unpatched function: another run."""
    patched = fit(CausalLMModule(_build(patch=True)), "auto")
    unpatched = fit(CausalLMModule(_build(patch=False)), "blockwise")
    assert not torch.equal(patched.losses[0], unpatched.losses[0])
    assert runs_differ(patched, unpatched)
