"""Forward hooks and `output_hidden_states` under rematerialized layers: exact and once, or refused (issue 25).

NOTE [ Forward hooks inside a rematerialized layer ] in replay/hooks.py and NOTE [ Gradients that bypass the next
layer ] in replay/remat.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor

from lightning_blockwise.replay import hooks, remat
from tests.helpers.models import CausalLMModule, RunResult, assert_equal_runs, build_model, fit, runs_differ

HOOKED = 1  # the decoder layer whose modules are hooked


class _Hooked(CausalLMModule):
    """A llama whose layer 1 carries the user's hooks; ``mode`` says what the training step does with them.

    - ``"observe"``: hooks on layer 1's MLP (pre and post, one with kwargs) and on the layer itself count and keep
      detached copies of what they see; the loss is the model's.
    - ``"aux"``: the MLP's output, kept by its hook, enters the loss (an auxiliary term).
    - ``"replace"``: the MLP's hook returns a scaled output.
    - ``"hidden"``: `output_hidden_states=True` and an intermediate hidden state enters the loss.
    - ``"hidden_observed"``: `output_hidden_states=True`, the hidden states only logged (detached).
    """

    def __init__(self, mode: str) -> None:
        super().__init__(lambda: build_model("llama"))
        self.mode = mode
        self.calls: dict[str, int] = {"pre": 0, "post": 0, "layer": 0}
        self.seen: list[Tensor] = []
        self.kept: list[Tensor] = []
        self.norms: list[Tensor] = []
        layer = self.model.get_decoder().layers[HOOKED]
        layer.mlp.register_forward_pre_hook(self._pre)
        layer.mlp.register_forward_hook(self._post, with_kwargs=True)
        layer.register_forward_hook(self._layer)

    def _pre(self, module: Any, args: tuple[Tensor, ...]) -> None:
        self.calls["pre"] += 1
        self.seen.append(args[0].detach().clone())

    def _post(self, module: Any, args: Any, kwargs: Any, output: Tensor) -> Tensor | None:
        self.calls["post"] += 1
        self.seen.append(output.detach().clone())
        self.kept.append(output)
        return output * 2 if self.mode == "replace" else None

    def _layer(self, module: Any, args: Any, output: Tensor) -> None:
        self.calls["layer"] += 1
        self.seen.append(output.detach().clone())

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        self.kept = []
        hidden = self.mode in ("hidden", "hidden_observed")
        out = self.model(**batch, output_hidden_states=True) if hidden else self.model(**batch)
        loss = out.loss
        if self.mode == "aux":
            loss = loss + 0.1 * self.kept[0].pow(2).mean()
        elif self.mode == "hidden":
            loss = loss + 0.1 * out.hidden_states[HOOKED + 1].pow(2).mean()
        elif self.mode == "hidden_observed":
            self.norms.append(torch.stack([h.detach().norm() for h in out.hidden_states]))
        self.losses.append(loss.detach().clone())
        return loss


def _fit(mode: str, strategy: str) -> tuple[_Hooked, RunResult]:
    module = _Hooked(mode)
    return module, fit(module, strategy, max_steps=2)


def test_hooks_fire_once_and_see_what_they_see_resident() -> None:
    """Hooks on a module inside a layer and on the layer: the same calls and the same tensors, training exact."""
    resident, expected = _fit("observe", "auto")
    blockwise, run = _fit("observe", "blockwise")
    assert_equal_runs(expected, run)
    assert blockwise.calls == resident.calls == {"pre": 4, "post": 4, "layer": 4}  # one per micro-batch
    assert len(blockwise.seen) == len(resident.seen)
    for a, b in zip(resident.seen, blockwise.seen, strict=True):
        assert torch.equal(a, b)


def test_control_hooks_fire_again_in_the_recompute_when_not_silenced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(remat.RematLayer, "rerun", remat.RematLayer.run)
    blockwise, _ = _fit("observe", "blockwise")
    assert blockwise.calls == {"pre": 8, "post": 8, "layer": 4}


def test_a_loss_on_what_a_hook_kept_is_refused() -> None:
    with pytest.raises(
        MisconfigurationException,
        match=r"forward hook on `layers\.1\.mlp` \(the hook `.*_Hooked\._post`\) received.*strategy='auto'",
    ):
        _fit("aux", "blockwise")


def test_control_a_loss_on_what_a_hook_kept_silently_loses_its_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without the refusing aliases the run trains, and differs from resident training: the term's gradient is lost."""
    _, expected = _fit("aux", "auto")
    monkeypatch.setattr(hooks, "_refusing", lambda value, name, anchor: value)
    _, run = _fit("aux", "blockwise")
    assert runs_differ(expected, run)


def test_a_hook_that_replaces_an_output_is_refused() -> None:
    with pytest.raises(
        MisconfigurationException, match=r"hook `.*_Hooked\._post` on `layers\.1\.mlp` returned a replacement output"
    ):
        _fit("replace", "blockwise")


def test_hidden_states_in_the_loss_are_refused() -> None:
    with pytest.raises(
        MisconfigurationException, match=r"output of decoder layer 1 other than through decoder layer 2"
    ):
        _fit("hidden", "blockwise")


def test_control_hidden_states_in_the_loss_differ_when_let_through(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let through, the gradients differ from resident training (the same sum in another order)."""
    _, expected = _fit("hidden", "auto")
    monkeypatch.setattr(remat, "_refuse_a_bypass", lambda ctx, grad_output: None)
    _, run = _fit("hidden", "blockwise")
    assert runs_differ(expected, run)


def test_observed_hidden_states_are_exact() -> None:
    """`output_hidden_states=True` with the hidden states only observed: nothing refused, every tensor equal."""
    resident, expected = _fit("hidden_observed", "auto")
    blockwise, run = _fit("hidden_observed", "blockwise")
    assert_equal_runs(expected, run)
    for a, b in zip(resident.norms, blockwise.norms, strict=True):
        assert torch.equal(a, b)
