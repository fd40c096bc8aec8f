"""One autograd node per NF4 projection (kernels/nf4_lora.py): the fused update's forward, exact blockwise."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from peft import LoraConfig, get_peft_model
from torch import Tensor, nn
from transformers import AutoModelForCausalLM

from lightning_blockwise import BlockwiseStrategy
from lightning_blockwise.compat.bitsandbytes import nf4_config
from lightning_blockwise.kernels.fused_lora import use_fused_lora
from tests.helpers.models import (
    DEFAULT_TARGETS,
    CausalLMModule,
    assert_equal_runs,
    fit,
    padded_batches,
    runs_differ,
    unmasked,
)

NODE = "Nf4LoraFunctionBackward"


def _bf16_nf4(checkpoint: Path, dropout: float = 0.0) -> Callable[[], nn.Module]:
    """NF4 computing in bf16 with bf16 hidden states (the GPU recipe's dtypes), LoRA r4 with random B."""

    def build() -> nn.Module:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(
            checkpoint, quantization_config=nf4_config(torch.bfloat16), device_map="cpu", dtype=torch.bfloat16
        )
        model.train()
        lora = LoraConfig(
            r=4, lora_alpha=6, lora_dropout=dropout, target_modules=DEFAULT_TARGETS, init_lora_weights=False
        )
        return get_peft_model(model, lora)

    return build


def _nodes(loss: Tensor) -> dict[str, int]:
    """How many nodes of each kind the graph behind ``loss`` has."""
    counts: dict[str, int] = {}
    seen, stack = set(), [loss.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        counts[type(node).__name__] = counts.get(type(node).__name__, 0) + 1
        stack.extend(next_node for next_node, _ in node.next_functions)
    return counts


def _step(model: nn.Module, autocast: bool = True) -> tuple[Tensor, dict[str, int], dict[str, Tensor]]:
    batch = padded_batches(1)[0]
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # the config's attention dropout
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = model(**batch).loss
    nodes = _nodes(loss)
    loss.backward()
    return loss.detach(), nodes, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _projections(model: nn.Module) -> int:
    return sum(1 for m in model.modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer"))


def test_one_node_runs_the_fused_forward_and_gradients_close_to_it(checkpoints: dict[str, Path]) -> None:
    """The first call of a fresh model already runs one node: the choice does not depend on the layer's history."""
    build = _bf16_nf4(checkpoints["llama"])
    three = build()
    use_fused_lora(three)
    one = build()
    assert use_fused_lora(one, one_node=True) == _projections(one) > 0
    three_loss, three_nodes, three_grads = _step(three)
    one_loss, one_nodes, one_grads = _step(one)
    assert one_nodes.get(NODE) == _projections(one) and NODE not in three_nodes
    # (bitsandbytes builds no node where the input needs no gradient: the first layer's q, k and v.)
    assert three_nodes["MatMul4BitBackward"] > 0 and "MatMul4BitBackward" not in one_nodes
    assert torch.equal(one_loss, three_loss)  # the same forward ops
    assert one_grads.keys() == three_grads.keys()
    error = max(((one_grads[n] - three_grads[n]).norm() / three_grads[n].norm()).item() for n in three_grads)
    assert error < 5e-2  # the input's gradient rounded once instead of twice, in bf16 (1.6% on this model)
    # Control: a wrong scaling is far outside that.
    for layer in one.modules():
        if isinstance(getattr(layer, "scaling", None), dict):
            layer.scaling = {name: 3 * s for name, s in layer.scaling.items()}
    _, _, wrong = _step(one)
    assert max(((wrong[n] - three_grads[n]).norm() / three_grads[n].norm()).item() for n in three_grads) > 1


@pytest.mark.parametrize(
    ("dropout", "bf16", "autocast", "one_node"),
    [(0.1, True, True, False), (0.0, False, True, False), (0.0, True, False, False), (0.0, True, True, True)],
    ids=["dropout", "fp32-states", "fp32-adapters-without-autocast", "control"],
)
def test_where_one_node_would_compute_something_else_the_separate_nodes_run(
    checkpoints: dict[str, Path], dropout: float, bf16: bool, autocast: bool, one_node: bool
) -> None:
    """Dropout feeds the adapter another input; fp32 hidden states make bitsandbytes compute in fp32 while autocast
    runs the adapter in bf16; fp32 adapters without autocast run PEFT's first matmul in fp32."""
    if bf16:
        model = _bf16_nf4(checkpoints["llama"], dropout)()
    else:
        model = AutoModelForCausalLM.from_pretrained(
            checkpoints["llama"], quantization_config=nf4_config(), device_map="cpu", dtype=torch.float32
        )
        model = get_peft_model(model.train(), LoraConfig(r=4, target_modules=DEFAULT_TARGETS, lora_dropout=dropout))
    use_fused_lora(model, one_node=True)
    assert (NODE in _step(model, autocast)[1]) is one_node


class _Module(CausalLMModule):
    """Installs the fused update where the module builds its model, with one node per projection or not."""

    def __init__(self, build: Callable[[], nn.Module], one_node: bool) -> None:
        super().__init__(build, in_configure_model=True)
        self.one_node = one_node

    def configure_model(self) -> None:
        super().configure_model()
        use_fused_lora(self.model, one_node=self.one_node)


class _KeepStreamedBlocks(Callback):
    """Blocks 1 and 2 stream and keep their graphs: their backward reads the packed weights' forward-time views."""

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        trainer.strategy._layers.restream(resident=(), kept=(1, 2))


def test_one_node_module_blockwise_equals_resident(checkpoints: dict[str, Path]) -> None:
    """8 micro-batches in bf16: the streamed forward pass, the recompute and resident training build the same node;
    so do kept graphs of streamed blocks (NOTE [ Kept graphs of streamed blocks ])."""
    build = _bf16_nf4(checkpoints["llama"])
    # Unmasked rows: a re-plan for masked ones at the first step would put back the plan's kept blocks.
    batches = unmasked(padded_batches(8))
    resident = fit(_Module(build, one_node=True), "auto", batches, precision="bf16-mixed")
    blockwise = fit(_Module(build, one_node=True), BlockwiseStrategy(), batches, precision="bf16-mixed")
    assert_equal_runs(resident, blockwise)
    kept = fit(
        _Module(build, one_node=True), BlockwiseStrategy(block_size=1), batches, precision="bf16-mixed",
        callbacks=[_KeepStreamedBlocks()],
    )  # fmt: skip
    assert_equal_runs(resident, kept)
    # Control: the separate nodes give other bits (the input's gradient rounded twice).
    separate = fit(_Module(build, one_node=False), "auto", batches, precision="bf16-mixed")
    assert runs_differ(resident, separate)
