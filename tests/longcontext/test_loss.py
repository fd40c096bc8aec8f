"""The chunked loss: Hugging Face's loss to fp32 rounding, no logits; exact across strategies for a module using it."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.longcontext import loss as loss_module
from lightning_blockwise.longcontext.loss import chunked_causal_lm_loss
from tests.helpers.models import CausalLMModule, assert_equal_runs, build_model, fit, padded_batches, runs_differ

#: A cap that bites: the tiny models' logits reach about 0.4, where Gemma 2's default cap of 30 is nearly linear.
SOFTCAP = 0.2


def _model(model_type: str) -> nn.Module:
    """A tiny fp32 LoRA model without dropout (eval mode), so that two forwards compute the same function."""
    overrides = {"final_logit_softcapping": SOFTCAP} if model_type == "gemma2" else {}
    return build_model(model_type, **overrides).eval()


def _batch() -> dict[str, Tensor]:
    """Three right-padded rows with their prompts (the first three tokens) not learned."""
    batch = padded_batches(1, batch_size=3, seed=7)[0]
    batch["labels"][:, :3] = -100
    assert (batch["attention_mask"] == 0).any()
    return batch


def _lora_grads(model: nn.Module, loss: Tensor) -> dict[str, Tensor]:
    model.zero_grad(set_to_none=True)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    assert grads and all(g is not None for g in grads.values())
    return grads


@pytest.mark.parametrize("chunk_tokens", [1, 5, 10000])
@pytest.mark.parametrize("model_type", ["llama", "gemma2"])
def test_chunked_loss_and_grads_match_hugging_face(model_type: str, chunk_tokens: int) -> None:
    model, batch = _model(model_type), _batch()
    reference = model(**batch).loss
    reference_grads = _lora_grads(model, reference)
    output = chunked_causal_lm_loss(model, **batch, chunk_tokens=chunk_tokens)
    assert output.num_tokens == int((batch["labels"][:, 1:] != -100).sum())
    assert torch.allclose(output.loss, reference, rtol=1e-6, atol=1e-6)
    grads = _lora_grads(model, output.loss)
    assert grads.keys() == reference_grads.keys()
    for name, grad in grads.items():
        assert torch.allclose(grad, reference_grads[name], rtol=1e-6, atol=1e-6), name


def test_control_gemma2_softcap_is_what_the_tolerance_sees(monkeypatch: pytest.MonkeyPatch) -> None:
    """The tolerance above is tight enough to see the softcap: without it the chunked loss falls outside."""
    model, batch = _model("gemma2"), _batch()
    reference = model(**batch).loss
    monkeypatch.setattr(model.get_base_model().config, "final_logit_softcapping", None)
    uncapped = chunked_causal_lm_loss(model, **batch, chunk_tokens=5).loss
    assert not torch.allclose(uncapped, reference, rtol=1e-6, atol=1e-6)


def test_num_items_in_batch_divides_the_sum() -> None:
    model, batch = _model("llama"), _batch()
    mean = chunked_causal_lm_loss(model, **batch, chunk_tokens=5)
    for items in (7, torch.tensor(7)):
        summed = chunked_causal_lm_loss(model, **batch, chunk_tokens=5, num_items_in_batch=items).loss
        assert torch.allclose(summed, mean.loss * mean.num_tokens / 7, rtol=1e-6, atol=1e-6)
        reference = model(**batch, num_items_in_batch=items).loss
        assert torch.allclose(summed, reference, rtol=1e-6, atol=1e-6)
    # Control: the sum over 7 is not the mean (there are more labelled tokens than 7).
    assert mean.num_tokens > 7 and not torch.allclose(summed, mean.loss)


def test_no_labelled_token_gives_zero_loss_and_zero_grads() -> None:
    model, batch = _model("llama"), _batch()
    batch["labels"] = torch.full_like(batch["labels"], -100)
    output = chunked_causal_lm_loss(model, **batch, chunk_tokens=5)
    assert output.num_tokens == 0 and torch.equal(output.loss, torch.tensor(0.0))
    grads = _lora_grads(model, output.loss)
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads.values())
    # Control: Hugging Face's mean over no token is nan, which these assertions would have caught.
    assert torch.isnan(model(**batch).loss)


def test_reading_logits_raises_and_says_why() -> None:
    output = chunked_causal_lm_loss(_model("llama"), **_batch())
    with pytest.raises(AttributeError, match="no logits"):
        _ = output.logits
    assert not hasattr(output, "logits")


@pytest.mark.parametrize("chunk_tokens", [0, -1, 2.0, True])
def test_chunk_tokens_below_one_or_not_an_int_is_refused(chunk_tokens: Any) -> None:
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_causal_lm_loss(_model("llama"), **_batch(), chunk_tokens=chunk_tokens)


def test_a_model_that_scales_its_logits_is_refused() -> None:
    with pytest.raises(ValueError, match="logit_scale"):
        chunked_causal_lm_loss(build_model("llama", logit_scale=2.0), **_batch())
    # Control: a scale of 1 changes nothing and is accepted.
    assert chunked_causal_lm_loss(build_model("llama", logit_scale=1.0), **_batch()).num_tokens > 0


def _sliced_loss(model: nn.Module, batch: dict[str, Tensor], chunk_tokens: int) -> Tensor:
    """The chunked loss as it was before NOTE [ One gradient write per chunk ]: the chunks sliced from the rows."""
    decoder, head, _ = loss_module.causal_lm_parts(model)
    hidden = decoder(input_ids=None, attention_mask=batch["attention_mask"], inputs_embeds=batch["inputs_embeds"])
    targets = F.pad(batch["labels"], (0, 1), value=-100)[..., 1:].reshape(-1)
    rows = targets.ne(-100).nonzero().squeeze(1)
    hidden = hidden.last_hidden_state.reshape(-1, hidden.last_hidden_state.shape[-1]).index_select(0, rows)
    targets = targets.index_select(0, rows)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, rows.numel(), chunk_tokens):
        part = slice(start, start + chunk_tokens)
        total = total + checkpoint(
            loss_module._chunk_loss, head, hidden[part], targets[part], None, use_reentrant=False
        )
    return total / rows.numel()


def _embedded_batch(model: nn.Module, dtype: torch.dtype) -> dict[str, Tensor]:
    """:func:`_batch` with its embeddings as a leaf that requires grad, so that the input gradient can be compared."""
    batch = _batch()
    embeds = model.get_input_embeddings()(batch.pop("input_ids")).detach().to(dtype).requires_grad_()
    return {**batch, "inputs_embeds": embeds}


def _loss_and_grads(model: nn.Module, batch: dict[str, Tensor], loss: Tensor) -> list[Tensor]:
    """The loss, the input gradient and every adapter gradient."""
    grads = _lora_grads(model, loss)
    return [loss.detach(), batch["inputs_embeds"].grad, *grads.values()]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk_tokens", [1, 5, 10000])
def test_split_chunks_give_the_sliced_chunks_bits(chunk_tokens: int, dtype: torch.dtype) -> None:
    """NOTE [ One gradient write per chunk ]: the loss, input and adapter gradients of slicing, bit for bit."""
    model = _model("llama").to(dtype)
    batch = _embedded_batch(model, dtype)
    split = _loss_and_grads(
        model, batch, chunked_causal_lm_loss(model, input_ids=None, **batch, chunk_tokens=chunk_tokens).loss
    )
    batch["inputs_embeds"].grad = None
    sliced = _loss_and_grads(model, batch, _sliced_loss(model, batch, chunk_tokens))
    assert len(split) == len(sliced) > 2
    assert all(torch.equal(a, b) for a, b in zip(split, sliced, strict=True))
    # Control: one input element one ulp up (a last-bit difference, as a changed summation order makes) is seen.
    embeds = batch["inputs_embeds"].detach().clone()
    embeds[0, 0, 0] = torch.nextafter(embeds[0, 0, 0], torch.tensor(float("inf"), dtype=dtype))
    nudged = {**batch, "inputs_embeds": embeds.requires_grad_()}
    other = _loss_and_grads(model, nudged, _sliced_loss(model, nudged, chunk_tokens))
    assert not all(torch.equal(a, b) for a, b in zip(split, other, strict=True))


class _WritesOfTheRows(TorchDispatchMode):
    """Counts the ops that produce a tensor of the labelled hidden states' shape, by op."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.shape = shape
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if isinstance(out, Tensor) and tuple(out.shape) == self.shape and func._schema.returns[0].alias_info is None:
            self.ops[func.__name__] += 1
        return out


def test_the_backward_writes_the_rows_gradient_once() -> None:
    """Split chunks' backward makes one tensor of the rows' size (a concatenation), where slices made one per chunk."""
    model = _model("llama")
    batch = _embedded_batch(model, torch.float32)
    rows = int((batch["labels"][:, 1:] != -100).sum())
    shape = (rows, batch["inputs_embeds"].shape[-1])
    split, sliced = _WritesOfTheRows(shape), _WritesOfTheRows(shape)
    loss = chunked_causal_lm_loss(model, input_ids=None, **batch, chunk_tokens=5).loss
    with split:
        loss.backward()
    loss = _sliced_loss(model, batch, 5)
    with sliced:
        loss.backward()
    assert split.ops == {"cat.default": 1}
    # Control: the sliced chunks' backward, one zero-filled gradient of the rows' size per chunk, and their sums.
    chunks = -(-rows // 5)
    assert chunks > 2 and sliced.ops == {"slice_backward.default": chunks, "add.Tensor": chunks - 1}


class _ChunkedLossModule(CausalLMModule):
    """Trains on the chunked loss, and declares its chunk to the planner."""

    loss_chunk_tokens = 4

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        loss = chunked_causal_lm_loss(self.model, **batch, chunk_tokens=self.loss_chunk_tokens).loss
        self.losses.append(loss.detach().clone())
        return loss


def _nf4_module(checkpoints: dict[str, Path], chunk_tokens: int = 4) -> _ChunkedLossModule:
    module = _ChunkedLossModule(lambda: build_model("llama", checkpoint=checkpoints["llama"], quantized=True))
    module.loss_chunk_tokens = chunk_tokens
    return module


def test_chunked_loss_module_blockwise_offloaded_equals_resident(checkpoints: dict[str, Path]) -> None:
    resident = fit(_nf4_module(checkpoints), "auto")
    strategy = BlockwiseStrategy(offload_activations=True)
    blockwise = fit(_nf4_module(checkpoints), strategy)
    # The planner read the module's chunk: it plans 4 rows of logits, not the whole batch's.
    assert strategy.step_plan is not None and strategy.step_plan.offload
    assert strategy.step_plan.shape.loss_chunk_tokens == 4
    assert_equal_runs(resident, blockwise)
    # Control: chunks of 3 rows instead of 4 add the same fp32 terms in other groups. On the CPU that
    # already moves the loss of the first micro-batch by an ulp (4.5525870 vs 4.5525875) and every
    # gradient of the first step, so a comparison that missed the loss's chunking would fail here.
    chunks_of_3 = fit(_nf4_module(checkpoints, chunk_tokens=3), BlockwiseStrategy(offload_activations=True))
    assert runs_differ(resident, chunks_of_3)
