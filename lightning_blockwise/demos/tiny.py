"""A self-contained demo: a tiny random-init Qwen2 with LoRA adapters on an NF4 base.

Nothing here touches the network: the "pretrained" base is a random-init model saved to a
temporary directory and loaded back the way users load a real checkpoint, so the demo
exercises the same ``from_pretrained(..., quantization_config=...)`` path. ``configs/demo.yaml``
trains it on the instruction pairs shipped in ``data/``
(:class:`~lightning_blockwise.recipes.data.InstructionDataModule` with its byte-level
tokenizer); :mod:`lightning_blockwise.demos.progressions` holds the smallest data a frozen
random base with LoRA adapters learns to continue within a few dozen steps.

Example::

    lightning-blockwise fit --config configs/demo.yaml
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from lightning.pytorch.utilities.types import OptimizerLRScheduler
from peft import LoraConfig, PeftModel, get_peft_model
from torch import Tensor
from transformers import AutoModelForCausalLM, PreTrainedModel, Qwen2Config

from lightning_blockwise.architectures import LLAMA_STYLE_PROJECTIONS
from lightning_blockwise.demos.base_files import load_base
from lightning_blockwise.export.adapter import check_export_target, export_adapter
from lightning_blockwise.export.training_record import TrainingRecord
from lightning_blockwise.loading.base_identity import base_identity
from lightning_blockwise.recipes.rank_zero_export import export_on_rank_zero
from lightning_blockwise.recipes.schedules import warmup_cosine

#: Token id that pads sequences on the right; the data never use it otherwise.
PAD_TOKEN_ID = 0

#: The LoRA targets: every projection of a Qwen2 decoder layer.
LORA_TARGETS = list(LLAMA_STYLE_PROJECTIONS)


def build_base_model(
    hidden_size: int = 64,
    num_hidden_layers: int = 4,
    vocab_size: int = 128,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 128,
    initializer_range: float = 0.125,
    quantize: bool = True,
    seed: int = 0,
    device: torch.device | str = "cpu",
    base_dir: str | Path | None = None,
) -> PreTrainedModel:
    """Build the demo's frozen base: a random-init Qwen2 causal LM, optionally loaded back in NF4.

    The weights depend on ``seed`` alone (the global RNG is left as it was), so the same
    arguments give the same base, e.g. to load a saved adapter onto.

    Args:
        hidden_size: Width of the residual stream.
        num_hidden_layers: Number of decoder layers.
        vocab_size: Number of token ids.
        num_attention_heads: Query heads per layer.
        num_key_value_heads: Key/value heads per layer (grouped-query attention).
        intermediate_size: Width of the MLP.
        initializer_range: Standard deviation of the random weights. The default,
            ``1 / sqrt(hidden_size)``, makes the frozen ``lm_head`` large enough for the
            adapters to reach confident predictions; Hugging Face's usual 0.02 caps the
            logits near +-1, and with them how far the loss can fall.
        quantize: Load the base as bitsandbytes NF4 with double quantization.
        seed: Seed of the random initialization.
        device: Where ``from_pretrained`` places the quantized weights.
        base_dir: Keep the base there as a checkpoint directory (config, safetensors, the byte-level tokenizer),
            for ``generate``, ``export`` and later runs, reusing it if it holds the same base; ``None``: a
            temporary directory, removed once loaded.

    Returns:
        The base model in fp32 (its linear weights NF4 if ``quantize``), in eval mode as
        ``from_pretrained`` returns it.
    """
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        intermediate_size=intermediate_size,
        initializer_range=initializer_range,
        max_position_embeddings=256,
        pad_token_id=PAD_TOKEN_ID,
        bos_token_id=None,
        eos_token_id=None,
        tie_word_embeddings=False,
    )
    with _seeded(seed, device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return load_base(model, quantize, device, base_dir)


@contextmanager
def _seeded(seed: int, device: torch.device | str) -> Iterator[None]:
    """Draw from RNGs seeded with ``seed`` (the CPU's and ``device``'s), restoring the global ones after."""
    device = torch.device(device)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type):
        torch.manual_seed(seed)
        yield


class DemoCausalLM(pl.LightningModule):
    """A tiny Qwen2 causal LM whose LoRA adapters train on a frozen, optionally NF4, base.

    The model is built in :meth:`configure_model`, where the Trainer's device is known, so
    the quantized base is loaded straight onto it. At the end of fitting the adapter is
    saved with ``save_pretrained`` to ``<log_dir>/adapter``.

    Args:
        hidden_size: Width of the residual stream.
        num_hidden_layers: Number of decoder layers.
        vocab_size: Number of token ids; must cover the data's.
        num_attention_heads: Query heads per layer.
        num_key_value_heads: Key/value heads per layer.
        intermediate_size: Width of the MLP.
        initializer_range: Standard deviation of the base's random weights (see :func:`build_base_model`).
        quantize: Load the frozen base as bitsandbytes NF4 with double quantization.
        lora_r: Rank of the LoRA adapters.
        lora_alpha: LoRA scaling numerator (the update is scaled by ``lora_alpha / lora_r``).
        lora_dropout: Dropout on the adapters' input.
        learning_rate: Peak learning rate of AdamW.
        weight_decay: AdamW weight decay.
        warmup_steps: Optimizer steps of linear warmup before the cosine decay.
        min_lr_ratio: Final learning rate of the cosine decay, as a fraction of the peak.
        seed: Seed of the base's random initialization and of the adapters' initialization.
        adapter_path: A directory saved by an earlier run (``<log_dir>/adapter``) to load the
            adapters from instead of initializing them, e.g. to ``validate`` or ``test`` a
            trained adapter; the LoRA arguments above are then ignored. Needs the same
            base arguments and ``seed`` as the run that saved it.
        base_dir: Where the base is kept as a checkpoint directory, for ``lightning-blockwise generate`` and
            ``export`` and for later runs (reused where it holds the same base, refused where another);
            ``None``: ``<default_root_dir>/base`` under a Trainer, a temporary directory without one.

    Example::

        trainer = Trainer(strategy="blockwise", max_steps=60)
        trainer.fit(DemoCausalLM(), datamodule=DemoDataModule())  # demos.progressions
    """

    def __init__(
        self,
        hidden_size: int = 64,
        num_hidden_layers: int = 4,
        vocab_size: int = 128,
        num_attention_heads: int = 4,
        num_key_value_heads: int = 2,
        intermediate_size: int = 128,
        initializer_range: float = 0.125,
        quantize: bool = True,
        lora_r: int = 8,
        lora_alpha: int = 16,
        lora_dropout: float = 0.05,
        learning_rate: float = 2e-2,
        weight_decay: float = 0.0,
        warmup_steps: int = 5,
        min_lr_ratio: float = 0.1,
        seed: int = 0,
        adapter_path: str | None = None,
        base_dir: str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: PeftModel | None = None
        self._first_train_loss: float | None = None
        # Whether this fit saved its adapter (NOTE [ A resume with nothing to train ] in recipes/finetune.py).
        self._exported = False
        self._last_train_loss: float | None = None
        self._record = TrainingRecord(torch.float32)

    def configure_model(self) -> None:
        """Build the base on the Trainer's device and wrap it with LoRA adapters (once)."""
        if self.model is not None:
            return
        hp = self.hparams
        device = self.trainer.strategy.root_device if self._trainer is not None else torch.device("cpu")
        # The base's arguments are those of `build_base_model`, under the same names; the device is the Trainer's.
        base_args = {name: hp[name] for name in inspect.signature(build_base_model).parameters if name != "device"}
        if hp.base_dir is None and self._trainer is not None:
            base_args["base_dir"] = Path(self.trainer.default_root_dir) / "base"
        base = build_base_model(**base_args, device=device)
        # What the adapter records (NOTE [ The training record of an adapter ] in export/training_record.py): `export`
        # and `generate` load a kept base as trained here, in fp32 (`build_base_model`'s `nf4_config(torch.float32)`).
        kept = base_args["base_dir"]
        self._record = TrainingRecord(torch.float32, hp.quantize, None if kept is None else base_identity(kept))
        if hp.adapter_path is not None:
            # The saved adapter's own config decides its rank and targets.
            self.model = PeftModel.from_pretrained(base, hp.adapter_path, is_trainable=True, local_files_only=True)
        else:
            lora = LoraConfig(
                r=hp.lora_r,
                lora_alpha=hp.lora_alpha,
                lora_dropout=hp.lora_dropout,
                target_modules=LORA_TARGETS,
                task_type="CAUSAL_LM",
            )
            # The adapters' initialization draws from the RNG too; keep it a function of `seed` alone.
            with _seeded(hp.seed + 1, device):
                self.model = get_peft_model(base, lora)
        # `from_pretrained` returns eval mode and Lightning keeps the modes it finds, but training wants train
        # mode: for the adapters' dropout, and because bitsandbytes picks its CPU kernel by mode (see
        # NOTE [ bitsandbytes CPU inference kernel ] in compat/bitsandbytes/cpu_kernel.py). Lightning
        # still switches to eval for validation and back.
        self.model.train()

    def setup(self, stage: str) -> None:
        """Refuse data whose token ids the embedding does not cover, or an adapter directory in use, before any step.

        Raises:
            MisconfigurationException: If the datamodule's ``vocab_size`` exceeds the model's, or (when fitting)
                ``<log_dir>/adapter`` already holds files (NOTE [ Atomic adapter export ] in export/adapter.py).
        """
        if stage == "fit":
            check_export_target(self._adapter_dir(), overwrite=False, owner="DemoCausalLM")
        datamodule = self._trainer.datamodule if self._trainer is not None else None
        data_vocab = getattr(datamodule, "vocab_size", None)
        if data_vocab is not None and data_vocab > self.hparams.vocab_size:
            raise MisconfigurationException(
                f"The data module's vocab_size={data_vocab} produces token ids the model cannot embed:"
                f" DemoCausalLM(vocab_size={self.hparams.vocab_size}). Give both the same `vocab_size`."
            )

    def forward(self, input_ids: Tensor, attention_mask: Tensor, labels: Tensor | None = None) -> Tensor:
        """The model's causal-LM loss if ``labels`` are given, else its logits."""
        outputs = self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels)
        return outputs.logits if labels is None else outputs.loss

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        """Next-token loss of one batch, logged as ``train_loss``."""
        loss = self(**batch)
        self.log("train_loss", loss, prog_bar=True)
        # Kept for the one-line summary at the end; `.item()` syncs, but only once per step.
        self._last_train_loss = loss.item()
        if self._first_train_loss is None:
            self._first_train_loss = self._last_train_loss
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        """Next-token loss of one batch, averaged over the epoch as ``val_loss``."""
        self.log("val_loss", self(**batch), prog_bar=True)

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> None:
        """Next-token loss of one batch, averaged over the epoch as ``test_loss``."""
        self.log("test_loss", self(**batch))

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        """Greedy next-token predictions at every position (padding positions included)."""
        return self(batch["input_ids"], batch["attention_mask"]).argmax(dim=-1)

    def configure_optimizers(self) -> OptimizerLRScheduler:
        """AdamW over the adapters, with linear warmup then cosine decay, stepped every optimizer step.

        Raises:
            MisconfigurationException: If the run has no finite length to decay over.
        """
        hp = self.hparams
        total_steps = self.trainer.estimated_stepping_batches
        if not math.isfinite(total_steps):
            raise MisconfigurationException(
                "DemoCausalLM decays its learning rate over the whole run, which has no end: set `trainer.max_steps`"
                " or `trainer.max_epochs`."
            )
        optimizer = torch.optim.AdamW(
            [p for p in self.parameters() if p.requires_grad], lr=hp.learning_rate, weight_decay=hp.weight_decay
        )
        scheduler = warmup_cosine(optimizer, hp.warmup_steps, int(total_steps), hp.min_lr_ratio)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_fit_start(self) -> None:
        """Note that this fit has not saved its adapter yet."""
        self._exported = False

    def on_fit_end(self) -> None:
        """Save the adapter if training ended without ``on_train_end``: a resume with nothing left to train.

        NOTE [ A resume with nothing to train ] in recipes/finetune.py.
        """
        if not self._exported:
            rank_zero_info("DemoCausalLM: nothing left to train; saving the adapter the checkpoint restored.")
            self.on_train_end()

    def on_train_end(self) -> None:
        """Save the adapter to ``<log_dir>/adapter`` and say where, with the first and last train loss."""
        self._exported = True
        # Every rank reads the directory (a collective) and waits for rank 0's export (NOTE [ One export, every rank in
        # step ] in recipes/rank_zero_export.py).
        target = self._adapter_dir()
        write = lambda: export_adapter(self.model, target, record=self._record)  # noqa: E731
        adapter_dir = export_on_rank_zero(self.trainer.strategy, write, "DemoCausalLM")
        summary = f"DemoCausalLM: adapter saved to {adapter_dir}"
        if self._first_train_loss is not None:
            summary += (
                f" (train_loss {self._first_train_loss:.3f} -> {self._last_train_loss:.3f} over"
                f" {self.trainer.global_step} steps)"
            )
        rank_zero_info(summary)

    def _adapter_dir(self) -> Path:
        return Path(self.trainer.log_dir or self.trainer.default_root_dir) / "adapter"


__all__ = ["DemoCausalLM", "build_base_model"]
