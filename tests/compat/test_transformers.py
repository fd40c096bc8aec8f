"""The KV cache under every name transformers has given it: dropped from a rematerialized layer's call."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from lightning_blockwise.compat import transformers as compat_transformers
from lightning_blockwise.replay import capture
from tests.helpers.models import CausalLMModule, assert_equal_runs, build_model, fit, padded_batches, runs_differ


@pytest.mark.parametrize("name", compat_transformers.CACHE_ARGUMENTS)
def test_capture_drops_a_cache_by_name(name: str) -> None:
    """A legacy tuple cache is known only by its argument's name."""
    legacy = (torch.zeros(1), torch.zeros(1))
    call = capture.LayerCall.capture(torch.device("cpu"), (), {name: legacy, "position_ids": torch.arange(3)})
    assert call.kwargs[name] is None
    assert torch.equal(call.kwargs["position_ids"], torch.arange(3))


def test_capture_drops_a_cache_under_a_name_it_has_never_seen() -> None:
    """The next rename is caught by the cache's type, as keyword and as positional argument."""
    cache = DynamicCache()
    call = capture.LayerCall.capture(torch.device("cpu"), (cache, 3), {"kv_state_of_2027": cache, "use_cache": True})
    assert call.kwargs == {"kv_state_of_2027": None, "use_cache": False}
    assert call.args == (None, 3)


def _batches_with_cache() -> list[dict[str, object]]:
    """Training batches that ask the model for a cache, so one reaches every decoder layer under the current name."""
    return [{**batch, "use_cache": True} for batch in padded_batches(8)]


def test_training_with_a_cache_requested_is_exact() -> None:
    resident = fit(CausalLMModule(lambda: build_model("llama")), "auto", _batches_with_cache())
    blockwise = fit(CausalLMModule(lambda: build_model("llama")), "blockwise", _batches_with_cache())
    assert_equal_runs(resident, blockwise)


def test_control_a_cache_passed_to_the_recompute_breaks_training(monkeypatch: pytest.MonkeyPatch) -> None:
    """Control: with the cache kept in the captured call, the recompute writes it a second time."""
    resident = fit(CausalLMModule(lambda: build_model("llama")), "auto", _batches_with_cache())
    monkeypatch.setattr(capture, "is_cache_argument", lambda name, value: False)
    try:
        blockwise = fit(CausalLMModule(lambda: build_model("llama")), "blockwise", _batches_with_cache())
    except RuntimeError as error:  # the recomputed attention sees twice the keys: shapes disagree
        assert "size of tensor" in str(error)
        return
    assert runs_differ(resident, blockwise)
