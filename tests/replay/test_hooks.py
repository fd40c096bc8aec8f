"""Forward hooks and `output_hidden_states` under rematerialized layers: exact and once, or refused (issue 25).

NOTE [ Forward hooks inside a rematerialized layer ] in replay/hooks.py and NOTE [ Gradients that bypass the next
layer ] in replay/bypass.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn

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
    monkeypatch.setattr(remat, "refuse_a_bypass", lambda ctx, grad_output: None)
    _, run = _fit("hidden", "blockwise")
    assert runs_differ(expected, run)


def test_observed_hidden_states_are_exact() -> None:
    """`output_hidden_states=True` with the hidden states only observed: nothing refused, every tensor equal."""
    resident, expected = _fit("hidden_observed", "auto")
    blockwise, run = _fit("hidden_observed", "blockwise")
    assert_equal_runs(expected, run)
    for a, b in zip(resident.norms, blockwise.norms, strict=True):
        assert torch.equal(a, b)


# NOTE [ A layer's modules, listed once ]: what changes after the first step is seen.

LATE_BATCH = 2  # the first micro-batch of the second optimizer step


class _Late(CausalLMModule):
    """A llama that, at micro-batch ``LATE_BATCH``, registers an observing hook on layer 1's MLP, or (``wrap``) puts
    a module carrying such a hook around the MLP's activation."""

    def __init__(self, wrap: bool = False) -> None:
        super().__init__(lambda: build_model("llama"))
        self.wrap = wrap
        self.calls = 0
        self.seen: list[Tensor] = []

    def _observe(self, module: nn.Module, args: Any, output: Tensor) -> None:
        self.calls += 1
        self.seen.append(output.detach().clone())

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if batch_idx != LATE_BATCH:
            return
        mlp = self.model.get_decoder().layers[HOOKED].mlp
        if self.wrap:
            probe = _Probe(mlp.act_fn)
            probe.register_forward_hook(self._observe)
            mlp.act_fn = probe
        else:
            mlp.register_forward_hook(self._observe)


class _Probe(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, x: Tensor) -> Tensor:
        return self.inner(x)


def _fit_late(strategy: str, wrap: bool) -> tuple[_Late, RunResult]:
    module = _Late(wrap)
    return module, fit(module, strategy, max_steps=2)


@pytest.mark.parametrize("wrap", [False, True], ids=["hook", "module"])
def test_a_hook_or_module_added_after_the_first_step_fires_once_and_is_exact(
    wrap: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    listings = []
    listed = hooks._InnerModules.__init__
    monkeypatch.setattr(
        hooks._InnerModules, "__init__", lambda self, layer: listings.append(layer) or listed(self, layer)
    )
    resident, expected = _fit_late("auto", wrap)
    blockwise, run = _fit_late("blockwise", wrap)
    assert_equal_runs(expected, run)
    assert blockwise.calls == resident.calls == 2  # once per micro-batch since it was added
    assert all(torch.equal(a, b) for a, b in zip(resident.seen, blockwise.seen, strict=True))
    # Each layer listed once, and the changed one again after its change (the list is kept, not walked per pass).
    layers = len(blockwise.model.get_decoder().layers)
    assert len({id(layer) for layer in listings}) == layers and len(listings) == layers + wrap


def test_control_a_list_of_the_hooked_modules_misses_a_later_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache of the modules that had hooks when first listed (none here) leaves the late hook to fire again."""
    first: dict[int, list[nn.Module]] = {}
    listing = hooks._inner_modules

    def hooked_when_first_listed(layer: nn.Module) -> tuple[Any, list[nn.Module]]:
        listed, modules = listing(layer)
        return listed, first.setdefault(id(layer), [m for m in modules if m._forward_hooks])

    monkeypatch.setattr(hooks, "_inner_modules", hooked_when_first_listed)
    blockwise, _ = _fit_late("blockwise", wrap=False)
    assert blockwise.calls == 4  # the forward and the recompute of 2 micro-batches


def test_control_a_list_blind_to_the_layers_tree_misses_an_added_module(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hooks._InnerModules, "alive", lambda self: [ref() for ref, _ in self.tree[1:]])
    blockwise, _ = _fit_late("blockwise", wrap=True)
    assert blockwise.calls == 4
