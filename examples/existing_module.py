"""An existing LightningModule trained with the blockwise strategy: two lines change.

The module below is written the ordinary way: a Hugging Face causal LM wrapped with PEFT
LoRA in ``__init__``, the loss from ``outputs.loss``, AdamW over the trainable parameters.
Nothing in it knows about lightning-blockwise. The only changes are marked ``# (1)`` and
``# (2)``. The model is a tiny random-init Llama, so this runs on a CPU (or a GPU, if there is one) in seconds and
downloads nothing; with a real checkpoint you would call ``from_pretrained`` with a 4-bit
``BitsAndBytesConfig`` instead.

Comparing against ``strategy="auto"`` on the CPU with a 4-bit base? Wrap the load, in ``__init__``::

    model = lightning_blockwise.keep_4bit_trainable_on_cpu(
        AutoModelForCausalLM.from_pretrained(path, quantization_config=BitsAndBytesConfig(load_in_4bit=True))
    ).train()

Without it, bitsandbytes repacks the 4-bit weights in place at the first validation pass (the
sanity check included) or ``generate``, and the resident run trains another function after it.
The blockwise strategy guards its own runs. ``.train()``: ``from_pretrained`` returns eval mode,
and Lightning does not switch it. More in ``docs/exactness.md``.

Run with:  python examples/existing_module.py
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch
from peft import LoraConfig, get_peft_model
from torch.utils.data import DataLoader, TensorDataset
from transformers import AutoModelForCausalLM, LlamaConfig

import lightning_blockwise  # noqa: F401  (1) registers strategy="blockwise"


class LoRAFineTune(pl.LightningModule):
    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__()
        self.lr = lr
        config = LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            initializer_range=0.18,  # ~1/sqrt(hidden_size): lets LoRA alone move a random base's predictions
        )
        model = AutoModelForCausalLM.from_config(config)
        lora = LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
            task_type="CAUSAL_LM",
        )
        self.model = get_peft_model(model, lora)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        (input_ids,) = batch
        loss = self.model(input_ids=input_ids, labels=input_ids).loss
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.parameters() if p.requires_grad], lr=self.lr)


def main() -> None:
    pl.seed_everything(0)
    # Every sequence counts up from a random token: easy to learn, so the loss visibly falls.
    starts = torch.randint(0, 64, (256, 1))
    input_ids = (starts + torch.arange(16)) % 64
    data = DataLoader(TensorDataset(input_ids), batch_size=16, shuffle=True)

    trainer = pl.Trainer(
        strategy="blockwise",  # (2) instead of the default "auto"
        max_steps=30,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(LoRAFineTune(), data)
    # A uniform guess over the 64 tokens scores log(64); the adapters should end well below it.
    print(f"final train_loss: {trainer.callback_metrics['train_loss'].item():.3f} (chance: {math.log(64):.3f})")


if __name__ == "__main__":
    main()
