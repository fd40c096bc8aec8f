"""``CausalLMFineTune``: LoRA on a local Hugging Face checkpoint loaded as NF4 (or dense), the module the YAMLs train.

Example::

    lightning-blockwise fit --config configs/qwen2.5-7b.yaml
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from lightning.pytorch.utilities.types import OptimizerLRScheduler
from peft import PeftModel
from torch import Tensor

from lightning_blockwise.export.adapter import check_export_target, export_adapter
from lightning_blockwise.export.training_record import TrainingRecord
from lightning_blockwise.recipes import base_record
from lightning_blockwise.recipes.finetune_build import build_model
from lightning_blockwise.recipes.finetune_checkpoint import record_run, recorded_kernels, resume_fit
from lightning_blockwise.recipes.finetune_loss import batch_loss
from lightning_blockwise.recipes.kernel_choice import check_resumed_kernels, kernel_choice
from lightning_blockwise.recipes.optimizers import build_optimizer
from lightning_blockwise.recipes.rank_zero_export import export_on_rank_zero
from lightning_blockwise.recipes.recipe_options import check_recipe_options
from lightning_blockwise.recipes.schedules import warmup_cosine
from lightning_blockwise.strategy.blockwise import BlockwiseStrategy


class CausalLMFineTune(pl.LightningModule):
    """Train LoRA adapters on a frozen local causal-LM checkpoint loaded as bitsandbytes NF4 with double quantization.

    The model is loaded in :meth:`configure_model`. Under :class:`BlockwiseStrategy` the
    decoder layers go straight into the host arena with
    :func:`~lightning_blockwise.loading.load.load_blockwise` (quantized on the GPU one tensor at a
    time, in the strategy's ``block_size``), so the whole base never sits on the GPU; under any
    other strategy ``from_pretrained`` loads it onto the Trainer's device.
    Lightning checkpoints hold only the trainable (adapter) parameters and load back
    non-strictly over a freshly loaded base; at the end of fitting the adapter is exported
    as a PEFT directory (``PeftModel.from_pretrained(base, adapter_dir)`` loads it).

    Args:
        checkpoint: A local checkpoint directory (``config.json`` and weights); never downloaded.
        target_modules: Names of the decoder layers' linears that get adapters (``q_proj``, ...); ``None``:
            every linear of the decoder layers (fused ones such as Phi-3's ``qkv_proj`` included). Linears
            outside the decoder layers (a vision tower) never get adapters.
        lora_r: LoRA rank.
        lora_alpha: LoRA scaling numerator (updates are scaled by ``lora_alpha / lora_r``).
        lora_dropout: Dropout on the adapters' input.
        use_dora: DoRA instead of LoRA (its magnitude vectors are adapters too; blockwise DoRA passes the same
            parity tests as LoRA).
        dora_norm: How DoRA's row norm ``||W + s B A||`` is computed: ``"dense"``: PEFT's, which forms the
            ``d_out x d_in`` product ``B A``; ``"factored"``: from the factors, never the dense product
            (:func:`~lightning_blockwise.adapters.dora_norm.factor_dora_norms`; high ranks). It changes the rounding,
            so it applies under every strategy (NOTE [ Factored DoRA norm ] in adapters/dora_norm.py).
        compute_dtype: Dtype the 4-bit matmuls compute in (``"bfloat16"``, ``"float16"``, ``"float32"``), and the
            dtype of a dense base; ``None``: ``adapter_path``'s record, else ``"bfloat16"``.
        quantize: Load the base as NF4 (``None``: ``adapter_path``'s record, else NF4). ``False``: a dense base in
            ``compute_dtype`` (about 3.6x the host bytes of NF4; exact LoRA on the real weights rather than their 4-bit
            approximation), loaded as ``load_blockwise(quantize=False)`` or ``from_pretrained(dtype=...)`` loads it;
            the checkpoint must be unquantized.
        learning_rate: Peak AdamW learning rate.
        weight_decay: AdamW weight decay.
        optimizer: ``"adamw"``: torch's AdamW, fp32 moments (8 bytes a trainable parameter);
            ``"adamw8bit"``: bitsandbytes' ``AdamW8bit``, 8-bit moments (~2 bytes a parameter; adapter
            matrices under 4096 elements keep fp32 ones); ``"paged_adamw8bit"``: ``PagedAdamW8bit``, the same
            in CUDA unified memory that pages to host RAM under pressure (NOTE [ 8-bit AdamW ] in
            compat/bitsandbytes/optimizers.py). Each trains blockwise exactly as resident.
        warmup_steps: Optimizer steps of linear warmup before the cosine decay.
        min_lr_ratio: Final learning rate as a fraction of the peak.
        adapter_dir: Where to export the adapter at the end of fitting; ``None``: ``<log_dir>/adapter``. Written
            atomically; a directory that already holds files is refused when fitting starts.
        overwrite_adapter: Replace an adapter already at ``adapter_dir`` (atomically: the old one stays until
            the new one is complete).
        loader: ``"auto"``: ``load_blockwise`` under ``BlockwiseStrategy``, ``from_pretrained`` otherwise;
            ``"standard"``: always ``from_pretrained`` (e.g. a multimodal checkpoint whose vision tower is
            quantized too, which ``load_blockwise`` refuses); ``"blockwise"``: always ``load_blockwise``.
        random_init: Build the model from ``checkpoint``'s ``config.json`` with random weights instead of
            loading them (a real shape without its weights: smoke runs and memory checks). Under
            ``BlockwiseStrategy`` (unless ``loader="standard"``) it is built one layer at a time straight into the
            host arena (:func:`~lightning_blockwise.loading.random_base.random_blockwise`, any size), otherwise
            on the device (:func:`~lightning_blockwise.recipes.random_init.random_nf4_model`); the same bytes either
            way. Seeded by ``seed_everything``.
        loss_chunk_tokens: Train and validate on
            :func:`~lightning_blockwise.longcontext.loss.chunked_causal_lm_loss` with this many rows of logits at a
            time, never the full-vocabulary logits (long context); ``None``: the model's own loss. It changes the
            rounding, so it applies under every strategy (NOTE [ Chunked loss ] in longcontext/loss.py).
        mlp_tile_tokens: Run every decoder layer's MLP this many tokens at a time
            (:func:`~lightning_blockwise.longcontext.tiling.tile_mlps`; long context, slower per step); ``None``:
            untiled. Like the chunked loss, it applies under every strategy (NOTE [ Tiled MLP ] in
            longcontext/tiling.py).
        attention_tile_tokens: Run every decoder layer's attention this many queries at a time
            (:func:`~lightning_blockwise.longcontext.attention.tile_attention`; long context, one more attention
            forward per step); ``None``: untiled. The model must use ``attn_implementation="sdpa"`` without attention
            dropout, and the batches must have no padding and no packing (refused at the first longer batch). It
            applies under every strategy (NOTE [ Tiled attention ] in longcontext/attention.py).
        kernels: Faster layers, one name or a list: ``"liger"``, Liger-Kernel's Triton RMSNorm, RoPE and SwiGLU
            (GeGLU on Gemma) (:func:`~lightning_blockwise.kernels.liger.use_liger_kernels`; CUDA only; ``pip install
            "lightning-blockwise[kernels]"``; with ``mlp_tile_tokens`` its RMSNorm and RoPE only, the MLPs tiled);
            ``"fused_lora"``, each LoRA update added inside its second matmul
            (:func:`~lightning_blockwise.kernels.fused_lora.use_fused_lora`; any device; plain LoRA, not DoRA).
            ``"auto"`` (default): the fused update for plain LoRA, and Liger's where it is installed and the Trainer
            trains on CUDA (with tiled MLPs its RMSNorm and RoPE), decided when the model is built (the log says what);
            ``None``: the model's and PEFT's own layers. Each changes the rounding, so it applies under every
            strategy (NOTE [ Liger kernels and exactness ] in kernels/liger.py).
        adapter_path: A PEFT adapter directory (an earlier run's export, ``<log_dir>/adapter``) to start from
            instead of fresh adapters: to continue training it, or to ``validate`` or ``test`` it. The adapter's own
            ``adapter_config.json`` then decides the rank, alpha, dropout, targets and DoRA (the LoRA arguments above
            are ignored), its ``lightning_blockwise.json`` the ``compute_dtype`` and ``quantize`` not given (others
            warn), and ``checkpoint`` must be the base it records (NOTE [ The training record of an adapter ]).
        allow_other_base: Go on, with a warning, over another base than ``adapter_path`` or a resumed checkpoint has.

    The long-context options are also the attributes ``loss_chunk_tokens``, ``mlp_tile_tokens`` and
    ``attention_tile_tokens``, which :class:`BlockwiseStrategy`'s planner reads.

    Raises:
        MisconfigurationException: If ``loader``, ``optimizer`` or ``dora_norm`` is not one of its choices, a flag
            (``use_dora``, ``quantize``, ...) is not ``True`` or ``False`` (a string: NOTE [ A string is not a flag ]
            in compat/flags.py), ``loss_chunk_tokens``,
            ``mlp_tile_tokens`` or ``attention_tile_tokens`` is neither ``None`` nor an integer of at least 1, or
            ``kernels`` names an unknown kernel, ``"liger"`` without Liger-Kernel installed, ``"fused_lora"`` with
            DoRA, or (when the model is built, before the base loads) ``adapter_path`` holds no
            ``adapter_config.json``, ``"fused_lora"`` is asked for a DoRA adapter directory, or ``"liger"``
            for a device other than CUDA; ``attention_tile_tokens`` with a config that has attention dropout or a data
            module that packs (before the base loads), or (once it is loaded) a model whose attention is not sdpa;
            (in a step) a packed batch with ``attention_tile_tokens``.

    Example::

        module = CausalLMFineTune("/models/Qwen2.5-7B", lora_r=16)
        Trainer(strategy="blockwise", precision="bf16-mixed", max_steps=1000).fit(module, datamodule=data)
    """

    def __init__(
        self,
        checkpoint: str,
        target_modules: list[str] | None = None,
        lora_r: int = 16,
        lora_alpha: int = 32,
        lora_dropout: float = 0.05,
        use_dora: bool = False,
        dora_norm: str = "dense",
        compute_dtype: str | None = None,
        learning_rate: float = 2e-4,
        weight_decay: float = 0.0,
        optimizer: str = "adamw",
        warmup_steps: int = 10,
        min_lr_ratio: float = 0.1,
        adapter_dir: str | None = None,
        loader: str = "auto",
        random_init: bool = False,
        overwrite_adapter: bool = False,
        loss_chunk_tokens: int | None = None,
        mlp_tile_tokens: int | None = None,
        quantize: bool | None = None,
        adapter_path: str | None = None,
        kernels: str | list[str] | None = "auto",
        attention_tile_tokens: int | None = None,
        allow_other_base: bool = False,
    ) -> None:
        super().__init__()
        check_recipe_options(locals())
        # With `adapter_path` the adapter's own config decides DoRA: checked when the model is built, before the base.
        self._kernels = kernel_choice(kernels, mlp_tile_tokens, use_dora and adapter_path is None)
        compute_dtype, quantize = base_record.adapter_settings(adapter_path, compute_dtype, quantize)
        self.save_hyperparameters()
        # Resolved, not as given: under LightningCLI `save_hyperparameters` records the config's values (None here).
        self.hparams.update(compute_dtype=compute_dtype, quantize=quantize)
        # Read by `BlockwiseStrategy`'s planner (the module declares what its step builds).
        self.loss_chunk_tokens = loss_chunk_tokens
        self.mlp_tile_tokens = mlp_tile_tokens
        self.attention_tile_tokens = attention_tile_tokens
        self.model: PeftModel | None = None
        # Checkpoints hold only the adapters (`BlockwiseStrategy`'s lean checkpoints, or `on_save_checkpoint` under
        # other strategies); the frozen base comes from `checkpoint`.
        self.strict_loading = False
        # The kernels installed when the model was built (recorded in checkpoints); None until then.
        self._installed_kernels: list[str] | None = None
        self._record: TrainingRecord | None = None  # the base as checkpoints record it; set with the model
        self._export_target: Path | None = None  # where this fit exports, set at its setup; recorded in checkpoints
        # Whether this fit exported its adapter (NOTE [ A resume with nothing to train ]).
        self._exported = False

    def configure_model(self) -> None:
        """Load (or build) the NF4 (or dense) base and add the adapters (once).

        Raises:
            MisconfigurationException: If ``loader="blockwise"`` is asked for under another strategy.
        """
        if self.model is not None:
            return
        hp = self.hparams
        self._record = base_record.module_record(hp.checkpoint, hp.compute_dtype, hp.quantize, hp.random_init)
        self.model, self._installed_kernels = build_model(
            hp, self._kernels, self._record, self.mlp_tile_tokens, self.attention_tile_tokens, self._trainer
        )

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        """The causal-LM loss of the batch (labels -100 where nothing is learned)."""
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        return loss

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        """The validation loss, averaged over the epoch."""
        loss = self._loss(batch)
        self.log("val_loss", loss, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        return loss

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        """The test loss, averaged over the epoch."""
        loss = self._loss(batch)
        self.log("test_loss", loss, batch_size=batch["input_ids"].shape[0])
        return loss

    def configure_optimizers(self) -> OptimizerLRScheduler:
        """AdamW (``optimizer``) on the adapters, linear warmup then cosine decay over the run's optimizer steps."""
        hp = self.hparams
        params = [p for p in self.parameters() if p.requires_grad]
        optimizer = build_optimizer(hp.optimizer, params, lr=hp.learning_rate, weight_decay=hp.weight_decay)
        scheduler = warmup_cosine(
            optimizer, hp.warmup_steps, int(self.trainer.estimated_stepping_batches), hp.min_lr_ratio
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def setup(self, stage: str) -> None:
        """Refuse, before any training, an adapter directory the export at the end would overwrite."""
        if stage == "fit":
            # On every rank: `log_dir` is a collective (NOTE [ One export, every rank in step ] in rank_zero_export.py).
            hp, target = self.hparams, self._adapter_dir()
            self._export_target = target.resolve()
            inputs = [hp.checkpoint] if Path(hp.checkpoint).exists() else []
            check_export_target(target, hp.overwrite_adapter, f"CausalLMFineTune(adapter_dir={target})", inputs=inputs)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep only the trainable parameters: the frozen base is the checkpoint directory's, gigabytes not to copy.

        Under :class:`BlockwiseStrategy` the strategy already decides (NOTE [ Lean checkpoints ] in
        checkpointing.py, ``save_frozen_base``); elsewhere the module does the same. The kernels the model computes
        with, and the base (recipes/base_record.py), are recorded, so that a resume is checked against them.
        """
        record_run(checkpoint, self.hparams.optimizer, self._export_target, self._installed_kernels, self._record)
        if isinstance(self.trainer.strategy, BlockwiseStrategy):
            return
        trainable = {name for name, param in self.named_parameters() if param.requires_grad}
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in trainable}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Refuse a resume over another base, with other kernels than ``"auto"`` chose, or with another optimizer.

        The optimizer is checked when fitting, before Lightning loads its state (NOTE [ An optimizer's state resumes
        into its own kind only ] in recipes/optimizers.py), and what a killed export of the checkpoint's run left
        beside its adapter directory is removed (NOTE [ A resume cleans its run's export ] in export/adapter.py).

        Raises:
            MisconfigurationException: Naming what differs and the argument that resumes the run as it was.
        """
        frozen = {name for name, param in self.named_parameters() if not param.requires_grad}
        self._record = base_record.check_resumed_base(checkpoint, self._record, frozen, self.hparams.allow_other_base)
        check_resumed_kernels(recorded_kernels(checkpoint), self._installed_kernels, self.hparams.kernels)
        # Only a fit loads the optimizer's state and exports (`load_from_checkpoint` has no trainer).
        if self._trainer is None or self.trainer.state.fn != TrainerFn.FITTING:
            return
        resume_fit(checkpoint, self.hparams.optimizer, self.trainer.is_global_zero)

    def on_fit_start(self) -> None:
        """Note that this fit has not exported its adapter yet."""
        self._exported = False

    def on_train_end(self) -> None:
        """Export the adapter as a PEFT directory (atomically: NOTE [ Atomic adapter export ] in export/adapter.py)."""
        self._export()

    def on_fit_end(self) -> None:
        """Export the adapter if training ended without ``on_train_end`` (NOTE [ A resume with nothing to train ])."""
        # NOTE [ A resume with nothing to train ]
        # A run killed after its last checkpoint (while it wrote the adapter, say) and resumed from that
        # checkpoint restores `global_step == max_steps`: Lightning's fit loop is done before it starts and
        # skips `on_train_end`, so the adapter the run exists for would never be written. `on_fit_end` runs
        # either way; the weights are the checkpoint's, restored, so the adapter is the one the run trained.
        if not self._exported:
            rank_zero_info(
                "CausalLMFineTune: nothing left to train; exporting the adapter restored from the checkpoint."
            )
            self._export()

    def _export(self) -> None:
        self._exported = True
        # Every rank reads the directory (a collective) and waits for rank 0's export (NOTE [ One export, every rank in
        # step ] in recipes/rank_zero_export.py).
        target, hp = self._adapter_dir(), self.hparams
        written = export_on_rank_zero(
            self.trainer.strategy,
            lambda: export_adapter(self.model, target, overwrite=hp.overwrite_adapter, record=self._record),
            "CausalLMFineTune",
        )
        rank_zero_info(f"CausalLMFineTune: adapter saved to {written}")

    def _loss(self, batch: dict[str, Tensor]) -> Tensor:
        return batch_loss(self.model, batch, self.loss_chunk_tokens, self.attention_tile_tokens)

    def _adapter_dir(self) -> Path:
        if self.hparams.adapter_dir:
            return Path(self.hparams.adapter_dir)
        return Path(self.trainer.log_dir or self.trainer.default_root_dir) / "adapter"


__all__ = ["CausalLMFineTune"]
