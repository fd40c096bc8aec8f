"""Every kind of hook on a rematerialized layer: with kwargs, returning what it was given, process-wide, on tensors.

Issue 41 (items 4 and 12) and issue 42 (item 3). NOTE [ Forward hooks inside a rematerialized layer ] in
replay/hooks.py and NOTE [ Gradients that bypass the next layer ] in replay/bypass.py. Each run: 2 optimizer steps of
2 micro-batches of the tests' tiny Llama, dropout on.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import Tensor, nn
from torch.nn.modules.module import register_module_forward_hook

from lightning_blockwise.replay import hooks, remat
from tests.helpers.models import CausalLMModule, RunResult, assert_equal_runs, build_model, fit, runs_differ

HOOKED = 1  # the decoder layer whose modules are hooked
MICRO_BATCHES = 4


class _Probed(CausalLMModule):
    """A llama whose training step adds ``0.1 * mean(kept[0] ** 2)`` to the loss when ``aux`` and a hook kept a tensor.

    ``install(module, layer)`` registers the test's hooks on decoder layer ``HOOKED``; they append to ``kept``.
    """

    def __init__(self, install: Callable[[_Probed, nn.Module], None], aux: bool = False) -> None:
        super().__init__(lambda: build_model("llama"))
        self.aux = aux
        self.kept: list[Tensor] = []
        self.calls: Counter[str] = Counter()
        install(self, self.model.get_decoder().layers[HOOKED])

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        self.kept = []
        loss = self.model(**batch).loss
        if self.aux and self.kept:
            loss = loss + 0.1 * self.kept[0].pow(2).mean()
        self.losses.append(loss.detach().clone())
        return loss


def _fit(install: Callable[[_Probed, nn.Module], None], strategy: str, aux: bool = False) -> tuple[_Probed, RunResult]:
    module = _Probed(install, aux)
    return module, fit(module, strategy, max_steps=2)


# Hooks registered with kwargs: the decoder layer calls its attention with `hidden_states=` as a keyword.


def _kwargs_post(module: _Probed, layer: nn.Module) -> None:
    def keep(attn: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        module.calls["post"] += 1
        module.kept.append(kwargs["hidden_states"])

    layer.self_attn.register_forward_hook(keep, with_kwargs=True)


def _kwargs_pre(module: _Probed, layer: nn.Module) -> None:
    def keep(attn: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        module.calls["pre"] += 1
        module.kept.append(kwargs["hidden_states"])

    layer.self_attn.register_forward_pre_hook(keep, with_kwargs=True)


@pytest.mark.parametrize("install", [_kwargs_post, _kwargs_pre], ids=["forward_hook", "pre_hook"])
def test_a_loss_on_the_kwargs_a_hook_kept_is_refused(install: Callable[[_Probed, nn.Module], None]) -> None:
    """The refusal names the module and the hook (its module and qualified name)."""
    with pytest.raises(MisconfigurationException, match=rf"hook on `layers\.1\.self_attn` \(the hook `{__name__}\."):
        _fit(install, "blockwise", aux=True)


@pytest.mark.parametrize("install", [_kwargs_post, _kwargs_pre], ids=["forward_hook", "pre_hook"])
def test_control_kwargs_left_bare_lose_the_terms_gradient(
    install: Callable[[_Probed, nn.Module], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    """As before issue 41: keyword arguments handed to the hook as they are; the run trains and differs from auto."""
    refusing = hooks._refusing
    monkeypatch.setattr(hooks, "_refusing", lambda v, n, a: v if isinstance(v, dict) else refusing(v, n, a))
    resident, expected = _fit(install, "auto", aux=True)
    blockwise, run = _fit(install, "blockwise", aux=True)
    assert runs_differ(expected, run)
    assert resident.calls == blockwise.calls and sum(resident.calls.values()) == MICRO_BATCHES


# Hooks that return what they were given observe (Lightning's PyTorchProfiler, tracers); a real replacement does not.


def _as_given(module: _Probed, layer: nn.Module) -> None:
    """A pre-hook and a forward hook on each module of the layer, as PyTorchProfiler registers them, and a pair
    with kwargs: each returns the very objects it received."""

    def pre(sub: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        module.calls["pre"] += 1
        return args

    def post(sub: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        module.calls["post"] += 1
        return output

    def pre_kwargs(sub: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
        module.calls["pre_kwargs"] += 1
        return args, kwargs

    for sub in layer.modules():
        if sub is not layer:
            sub.register_forward_pre_hook(pre)
            sub.register_forward_hook(post)
    layer.self_attn.register_forward_pre_hook(pre_kwargs, with_kwargs=True)


def test_hooks_that_return_what_they_were_given_observe() -> None:
    resident, expected = _fit(_as_given, "auto")
    blockwise, run = _fit(_as_given, "blockwise")
    assert_equal_runs(expected, run)
    assert blockwise.calls == resident.calls and resident.calls["pre_kwargs"] == MICRO_BATCHES


def test_control_every_returned_value_taken_for_a_replacement(monkeypatch: pytest.MonkeyPatch) -> None:
    """As before issue 42: any value a hook returns is a replacement, and the first hook inside the layer is refused."""
    monkeypatch.setattr(hooks, "_returned_as_given", lambda result, given, pre: False)
    with pytest.raises(MisconfigurationException, match=r"pre-hook `.*_as_given\.<locals>\.pre` on `layers\.1\."):
        _fit(_as_given, "blockwise")


def _equal_copy(module: _Probed, layer: nn.Module) -> None:
    layer.mlp.register_forward_hook(lambda sub, args, output: output.clone())


def test_a_replacement_of_equal_value_is_refused_naming_the_hook() -> None:
    with pytest.raises(
        MisconfigurationException, match=rf"hook `{__name__}\._equal_copy\.<locals>\.<lambda>` on `layers\.1\.mlp`"
    ):
        _fit(_equal_copy, "blockwise")


# Process-wide forward hooks (`register_module_forward_hook`).


@contextmanager
def _process_hook(module: _Probed, keep: str | None = None) -> Iterator[None]:
    """A process-wide forward hook counting each module's calls (by name) and keeping the outputs of ``keep``."""
    names = {id(m): n for n, m in module.named_modules()}

    def count(sub: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        name = names.get(id(sub))
        if name is not None and module.training:
            module.calls[name] += 1
            if name == keep:
                module.kept.append(output)

    handle = register_module_forward_hook(count)
    try:
        yield
    finally:
        handle.remove()


def _fit_with_process_hook(strategy: str, keep: str | None = None) -> tuple[_Probed, RunResult]:
    module = _Probed(lambda m, layer: None, aux=keep is not None)
    with _process_hook(module, keep):
        return module, fit(module, strategy, max_steps=2)


MLP = f"model.base_model.model.model.layers.{HOOKED}.mlp"


def test_a_process_wide_hook_fires_once_per_module_per_step() -> None:
    resident, expected = _fit_with_process_hook("auto")
    blockwise, run = _fit_with_process_hook("blockwise")
    assert_equal_runs(expected, run)
    assert resident.calls[MLP] == MICRO_BATCHES and blockwise.calls == resident.calls


def test_control_a_process_wide_hook_fires_again_in_the_recompute(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the process-wide hooks left out of the wrapping (as the mutation pass of issue 41 did), the hook fires
    again in each layer's recompute."""
    monkeypatch.setattr(hooks, "_GLOBAL_HOOK_DICTS", ())
    resident, _ = _fit_with_process_hook("auto")
    blockwise, _ = _fit_with_process_hook("blockwise")
    assert blockwise.calls[MLP] == 2 * resident.calls[MLP]


def test_a_loss_on_what_a_process_wide_hook_kept_is_refused() -> None:
    with pytest.raises(MisconfigurationException, match=r"forward hook on `layers\.1\.mlp` \(the hook `.*count`\)"):
        _fit_with_process_hook("blockwise", keep=MLP)


def test_control_a_loss_on_what_a_process_wide_hook_kept_loses_its_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    _, expected = _fit_with_process_hook("auto", keep=MLP)
    monkeypatch.setattr(hooks, "_refusing", lambda value, name, anchor: value)
    _, run = _fit_with_process_hook("blockwise", keep=MLP)
    assert runs_differ(expected, run)


# Tensor hooks on a layer's output (`register_hook` on the hidden states).


def _tensor_hook(scale: float | None) -> Callable[[_Probed, nn.Module], None]:
    """A forward hook on the layer that registers a tensor hook on its output: observing, or scaling the gradient."""

    def install(module: _Probed, layer: nn.Module) -> None:
        def on_output(sub: nn.Module, args: tuple[Any, ...], output: Tensor) -> None:
            def on_grad(grad: Tensor) -> Tensor | None:
                module.calls["grad"] += 1
                return None if scale is None else grad * scale

            output.register_hook(on_grad)

        layer.register_forward_hook(on_output)

    return install


@pytest.mark.parametrize("scale", [None, 2.0], ids=["observing", "scaling"])
def test_tensor_hooks_on_a_layers_output_are_exact(scale: float | None) -> None:
    resident, expected = _fit(_tensor_hook(scale), "auto")
    blockwise, run = _fit(_tensor_hook(scale), "blockwise")
    assert_equal_runs(expected, run)
    assert blockwise.calls == resident.calls == {"grad": MICRO_BATCHES}


def test_control_a_scaling_tensor_hook_differs_from_none() -> None:
    """The comparison sees what the hook does: the scaled run differs from the observed one."""
    _, observed = _fit(_tensor_hook(None), "blockwise")
    _, scaled = _fit(_tensor_hook(2.0), "blockwise")
    assert runs_differ(observed, scaled)


def test_control_without_the_arrival_note_a_tensor_hook_is_blamed_on_hidden_states(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Checked after the user's tensor hook (before issue 41), the new gradient looked like a bypass."""
    monkeypatch.setattr(remat, "note_arrival", lambda arrival, grad: None)
    with pytest.raises(MisconfigurationException, match="other than through decoder layer 2"):
        _fit(_tensor_hook(2.0), "blockwise")
