"""The files of a merged model besides its weights: ``config.json``, the base's tokenizer and generation files, a card.

The config and the card say what was merged into what (NOTE [ What a merge adds ] in
export/weights.py): a model merged into the checkpoint's original weights is not the model that
was trained, and is labelled so in both.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import BitsAndBytesConfig

#: The ``config.json`` entry that records the merge.
CONFIG_KEY = "lightning_blockwise_export"
#: The base's files copied as they are (when present): what ``from_pretrained``, ``generate`` and the tokenizer read.
COPIED_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)


def write_model_files(
    base: Path,
    directory: Path,
    config: Any,
    dtype: torch.dtype,
    quantization_config: BitsAndBytesConfig | None,
    facts: dict[str, Any],
    *,
    target: Path,
) -> None:
    """Write ``config.json`` and ``README.md`` into ``directory`` and copy the base's tokenizer and generation files.

    Args:
        base: The base checkpoint directory.
        directory: The export's staging directory.
        config: The base's config; changed here (dtype, quantization, the merge record) and saved.
        dtype: The dtype of the model's unquantized tensors.
        quantization_config: The NF4 settings of an NF4 export; ``None`` for a dense one.
        facts: What was merged (``merge``, ``merged_into``, ``compute_dtype``, ``compute_dtype_origin``,
            ``trained_compute_dtype``, ``device``, ``adapter``, ``base``, ``trained_on``, ``pre_quantized_base``,
            ``adapted_linears``).
        target: The directory ``directory`` becomes once complete, which the card names.
    """
    config.dtype = dtype
    if quantization_config is not None:
        config.quantization_config = quantization_config
    elif hasattr(config, "quantization_config"):
        # A dense export of a base saved in NF4 is not quantized any more.
        del config.quantization_config
    setattr(config, CONFIG_KEY, facts)
    config.save_pretrained(directory)
    for name in COPIED_FILES:
        if (base / name).is_file():
            shutil.copyfile(base / name, directory / name)
    (directory / "README.md").write_text(model_card(facts, target))


def model_card(facts: dict[str, Any], target: Path) -> str:
    """A ``README.md`` that says what the export holds and how it was made.

    Args:
        facts: What was merged (see :func:`write_model_files`).
        target: The export's final directory: the card's title is its name, its loading example its path.
    """
    stored = "re-quantized to NF4 (bitsandbytes, double quantization)" if facts["merge"] == "nf4" else facts["merge"]
    delta = "(B @ A) * scaling"
    if facts["merged_into"] == "original":
        what = (
            "**Not the model that was trained.** Each adapted linear holds `W + "
            f"{delta}`, where `W` is the base checkpoint's original weight. The adapter was trained against the"
            " NF4-quantized base, so this model differs from the trained one by the quantization error of every"
            " linear; it was written because `--merge-into-original` asked for it."
        )
    elif facts.get("base_format") == "dense":
        what = _dense_base(facts, delta)
    else:
        compute, trained = facts["compute_dtype"], facts.get("trained_compute_dtype")
        # A pre-quantized base is merged from its own NF4 bytes, which no compute dtype changes.
        unknown = trained is None and not facts["pre_quantized_base"]
        other = trained not in (None, compute) and not facts["pre_quantized_base"]
        how = f"compute dtype {compute}: {facts['compute_dtype_origin']}; quantized on {facts['device']}"
        what = (
            f"Each adapted linear holds `dequant(NF4(W)) + {delta}`: the base weight quantized"
            f"{'' if unknown or other else ' exactly as training loaded it'} ({how}), dequantized, plus the"
            f" adapter's delta{'' if unknown or other else ', which is the function the adapter was trained with'}."
            " Linears without an adapter hold `dequant(NF4(W))` (an NF4 export keeps their training NF4 bytes)."
        )
        if other:
            what += (
                f"\n\n**Not the model that was trained.** The adapter was trained over the base quantized in {trained};"
                f" `--compute-dtype {compute}` quantized it to other NF4 bytes."
            )
        elif unknown:
            what += (
                f"\n\nThe adapter does not record the compute dtype it was trained with; {compute} was assumed. If"
                " training used another, this is not the model that was trained."
            )
    if facts.get("base_format") == "nf4" and facts.get("trained_base_format") == "dense":
        what += (
            "\n\n**Not the model that was trained.** The adapter was trained over the dense base, and `--nf4-base`"
            " merged it into the NF4-quantized one."
        )
    trained_on = f" (trained on `{facts['trained_on']}`)" if facts.get("trained_on") else ""
    return f"""---
library_name: transformers
tags:
- lightning-blockwise
- merged-lora
---

# {target.name}

A causal LM with a LoRA adapter merged in, written by `lightning-blockwise export --merge {facts["merge"]}`.

- Base: `{facts["base"]}`
- Adapter: `{facts["adapter"]}`{trained_on}, {facts["adapted_linears"]} adapted linears
- Weights: {stored}

## What was merged

{what}

`config.json` records the same under `{CONFIG_KEY}`.

## Loading

```python
from transformers import AutoModelForCausalLM

model = AutoModelForCausalLM.from_pretrained("{target.resolve()}")
```
"""


def _dense_base(facts: dict[str, Any], delta: str) -> str:
    """What a merge over the dense base holds (NOTE [ The training record of an adapter ])."""
    compute, trained = facts["compute_dtype"], facts.get("trained_compute_dtype")
    what = (
        f"Each adapted linear holds `W + {delta}`, where `W` is the base checkpoint's weight in {compute}"
        f" ({facts['compute_dtype_origin']}), the dense base the adapter was trained over"
        f" ({facts['base_format_origin']}). Linears without an adapter hold `W`."
    )
    if facts.get("trained_base_format") != "dense":
        what += (
            "\n\n**Not the model that was trained.** The adapter does not say it was trained over the dense base;"
            " `--dense-base` merged it into the checkpoint's weights, not into the NF4-quantized ones."
        )
    elif trained != compute:
        what += (
            f"\n\n**Not the model that was trained.** The adapter was trained over the base in {trained};"
            f" `--compute-dtype {compute}` loaded it in another dtype."
        )
    return what


__all__ = ["CONFIG_KEY", "COPIED_FILES", "model_card", "write_model_files"]
