"""A tiny chat model saved with the byte-level tokenizer, and adapters for it: what `generate` talks to."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from lightning_blockwise.recipes.encoding import byte_tokenizer

#: A chat template whose rendering of a conversation starts with its rendering of any earlier prefix.
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def save_chat_checkpoint(path: Path, seed: int = 0) -> Path:
    """A random 4-layer Llama over the byte tokenizer's 259 ids, saved with the tokenizer and :data:`TEMPLATE`."""
    tokenizer = byte_tokenizer()
    tokenizer.chat_template = TEMPLATE
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def save_adapter(checkpoint: Path, path: Path, seed: int) -> Path:
    """A LoRA adapter with random (non-zero) A and B on the attention and MLP projections of ``checkpoint``."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    lora = LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False)
    get_peft_model(model, lora).save_pretrained(path)
    return path
