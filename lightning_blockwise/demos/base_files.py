"""The demo's base on disk: a checkpoint directory written once and loaded back the way users load theirs.

Kept (``DemoCausalLM``'s ``<default_root_dir>/base``, ``outputs/demo/base`` in ``configs/demo.yaml``), it is a
base like any other for ``lightning-blockwise generate`` and ``export`` and for the next run; unkept, it lives
in a temporary directory for the length of the load.

Example::

    checkpoint = keep_base(model, "outputs/demo/base")  # config.json, model.safetensors, the byte-level tokenizer
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from safetensors.torch import save_model
from transformers import AutoModelForCausalLM, PreTrainedModel

from lightning_blockwise.compat.bitsandbytes import disable_cpu_repack, nf4_config
from lightning_blockwise.export.leftovers import scratch_directory
from lightning_blockwise.loading.base_identity import base_identity
from lightning_blockwise.recipes.encoding import byte_tokenizer


def load_base(
    model: PreTrainedModel, quantize: bool, device: torch.device | str, base_dir: str | Path | None
) -> PreTrainedModel:
    """The fp32 ``model`` as the demo trains over it: written to disk and loaded back as NF4 if ``quantize``.

    Args:
        model: The random-init base, fp32, on the CPU.
        quantize: Load it back as bitsandbytes NF4 with double quantization (fp32 compute).
        device: Where the loaded weights go.
        base_dir: Keep the checkpoint there (:func:`keep_base`); ``None``: a temporary directory, removed once loaded.

    Returns:
        The base in eval mode, as ``from_pretrained`` returns it.
    """
    if base_dir is None and not quantize:
        return model.to(device).eval()
    if base_dir is None:
        # NOTE [ Cleaning what is ours ] in export/leftovers.py: a kill mid-load leaves the checkpoint behind,
        # named for this process, and the next demo removes it.
        checkpoint = scratch_directory(tempfile.gettempdir(), "lightning-blockwise-demo", ".model")
        try:
            write_base(model, checkpoint)
            model = _load_nf4(checkpoint, device)
        finally:
            shutil.rmtree(checkpoint, ignore_errors=True)
    else:
        checkpoint = keep_base(model, base_dir)
        model = _load_nf4(checkpoint, device) if quantize else model.to(device).eval()
    # What adapters saved over it name as their base (PEFT's `base_model_name_or_path`): nothing for a removed one.
    model.name_or_path = model.config.name_or_path = "" if base_dir is None else str(base_dir)
    # NOTE [ bitsandbytes CPU inference kernel ] in compat/bitsandbytes/cpu_kernel.py: validation's eval-mode, no-grad
    # forwards must not repack the weights.
    disable_cpu_repack(model)
    return model


def _load_nf4(checkpoint: Path, device: torch.device | str) -> PreTrainedModel:
    """Load ``checkpoint`` the way users load a real one: from disk, through ``quantization_config``."""
    return AutoModelForCausalLM.from_pretrained(
        checkpoint,
        quantization_config=nf4_config(torch.float32),
        device_map={"": torch.device(device)},
        dtype=torch.float32,
        local_files_only=True,
    )


def write_base(model: PreTrainedModel, directory: Path) -> None:
    """Write ``model`` as a checkpoint directory: its ``config.json``, ``model.safetensors`` and the data's tokenizer.

    Not ``save_pretrained``, which writes the weights on global rank 0 only: every rank writes and loads its own copy
    of the same weights (the demo's ``seed``), and no rank waits for another.
    """
    model.config.architectures = [type(model).__name__]  # as `save_pretrained` writes it: the fingerprint reads it
    model.config.save_pretrained(directory)
    save_model(model, str(directory / "model.safetensors"), metadata={"format": "pt"})
    # The tokenizer the demo's data are encoded with (`InstructionDataModule(tokenizer=None)`), so that `generate`
    # finds it in the base as it finds a real checkpoint's.
    byte_tokenizer().save_pretrained(directory)


def keep_base(model: PreTrainedModel, base_dir: str | Path) -> Path:
    """Write ``model`` to ``base_dir``, or reuse what is there if it is the same base; return the directory.

    The base is written beside ``base_dir`` and renamed into place, so a reader (or another rank doing the same)
    never sees a half-written one.

    Raises:
        MisconfigurationException: If ``base_dir`` holds another base (an earlier run with other base arguments):
            overwriting it would orphan the adapters trained over it.
    """
    base_dir = Path(base_dir)
    staging = scratch_directory(base_dir.parent, f".{base_dir.name}", ".partial")
    try:
        write_base(model, staging)
        if not base_dir.exists():
            try:
                os.rename(staging, base_dir)
                return base_dir
            except OSError:
                if not base_dir.exists():
                    raise
                # Another process (a rank of the same run) put its copy in place first: compare with it below.
        _check_same_base(base_dir, staging)
        return base_dir
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _check_same_base(base_dir: Path, built: Path) -> None:
    try:
        differing = base_identity(built).differences(base_identity(base_dir))
    except ValueError as error:
        differing = [f"files ({error})"]
    if differing:
        raise MisconfigurationException(
            f"DemoCausalLM(base_dir={str(base_dir)!r}) holds another base than these arguments build (its"
            f" {' and '.join(differing)} differ): an earlier run with other base arguments, whose adapters need it."
            " Give another `base_dir` (`--model.init_args.base_dir=...`), or remove that directory."
        )


__all__ = ["keep_base", "load_base", "write_base"]
