"""``lightning-blockwise plan``: a run's block bytes, host RAM and predicted VRAM, from a checkpoint's config alone.

No weights are read: the sizes come from :mod:`lightning_blockwise.planning.sizing`, a card's
recommendation from :mod:`lightning_blockwise.planning.recommend`. :mod:`lightning_blockwise.cli.plan_arguments`
parses the arguments, this module computes the report, :mod:`lightning_blockwise.cli.plan_render` lays it out.
The command is handled before LightningCLI parses (LightningCLI knows only the Trainer's subcommands), by
:func:`~lightning_blockwise.cli.main`.

Example::

    lightning-blockwise plan /models/Qwen2.5-7B --seq-len 2048 --lora-r 16 --gpu-memory 24GiB --json
    lightning-blockwise plan /models/Qwen2.5-7B --seq-len 16384 --gpu-memory 24GiB --offload-activations auto
    lightning-blockwise plan /models/Qwen2.5-72B --seq-len 32768 --loss-chunk-tokens 1024 --mlp-tile-tokens 4096
    lightning-blockwise plan /models/Qwen2.5-7B --seq-len 262144 --mlp-tile-tokens 4096 --attention-tile-tokens 16384
    lightning-blockwise plan --shape 7b --card 22GiB --host-ram 128GiB --longest --kernels liger \
        --attention-tile-tokens 16384 --mlp-tile-tokens 4096 --loss-chunk-tokens 1024
    lightning-blockwise plan /models/Qwen2.5-72B --seq-len 4096 --devices 2 --gpu-memory 80GB
    lightning-blockwise plan --shape 72b --seq-len 4096 --devices 8 --nodes 8
    lightning-blockwise plan /models/Qwen2.5-7B --card 24GB --host-ram 128GB --longest
    lightning-blockwise plan --shape 72b --host-ram 256GiB --table
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from lightning_blockwise.cli.plan_arguments import OFFLOAD_CHOICES, PLAN_COMMAND, plan_parser
from lightning_blockwise.cli.plan_kernels import modelled_kernels
from lightning_blockwise.cli.plan_nodes import add_nodes_argument, check_nodes, nodes_fields, throughput_fields
from lightning_blockwise.planning.shapes import DOCUMENTED_SHAPES, shape_config


def plan(args: list[str] | None = None) -> dict[str, Any]:
    """``lightning-blockwise plan``: print a model's block bytes, host RAM and predicted VRAM, from its config alone.

    Args:
        args: The arguments after ``plan``; ``None`` reads ``sys.argv[2:]``.

    Returns:
        The report that ``--json`` prints (sizes in bytes).

    Raises:
        SystemExit: With a one-line message starting ``lightning-blockwise plan:`` for a bad argument (checked
            before the config is read), a checkpoint that does not exist, or a plan that cannot work.
    """
    parser = plan_parser()
    add_nodes_argument(parser)
    options = parser.parse_args(sys.argv[2:] if args is None else args)
    # The report's modules import torch and Lightning: only once the arguments parse, so that `plan --help` starts
    # without them (NOTE [ The command starts without Lightning ] in cli/__init__.py).
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    from lightning_blockwise.cli.plan_context import longest_report
    from lightning_blockwise.cli.plan_render import print_report

    try:
        check_nodes(options.nodes, options.longest or options.table)
    except MisconfigurationException as error:
        raise SystemExit(f"lightning-blockwise plan: {error}") from None
    config = _config(options.checkpoint, options.shape)
    if options.longest or options.table:
        return longest_report(config, options)
    try:
        report = plan_report(
            config,
            tokens=options.seq_len * options.batch_size,
            lora_rank=options.lora_r,
            targets=options.targets,
            dora=options.dora,
            dtype=options.dtype,
            block_size=options.block_size,
            prefetch_depth=options.prefetch_depth,
            vram_budget=options.vram_budget,
            gpu_memory=options.gpu_memory,
            offload_activations=OFFLOAD_CHOICES[options.offload_activations],
            loss_chunk_tokens=options.loss_chunk_tokens,
            mlp_tile_tokens=options.mlp_tile_tokens,
            attention_tile_tokens=options.attention_tile_tokens,
            quantize=not options.dense,
            block_major=options.block_major,
            devices=options.devices,
            kernels=options.kernels,
            masked_row=options.seq_len if options.masked_attention else None,
        )
    except MisconfigurationException as error:
        raise SystemExit(f"lightning-blockwise plan: {error}") from None
    if options.nodes * options.devices > 1:  # one GPU: no all-reduce, and the report as before
        report.update(nodes_fields(report, options.nodes))
        report.update(throughput_fields(report, config, options.tflops, options.link_gbps))
    if options.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report)
    return report


def plan_report(
    config: Any,
    tokens: int,
    lora_rank: int = 16,
    targets: list[str] | None = None,
    dora: bool = False,
    dtype: str | None = None,
    block_size: int = 1,
    prefetch_depth: int = 2,
    vram_budget: int | None = None,
    gpu_memory: int | None = None,
    offload_activations: bool | None = None,
    loss_chunk_tokens: int | None = None,
    mlp_tile_tokens: int | None = None,
    quantize: bool = True,
    block_major: int | None = None,
    devices: int = 1,
    attention_tile_tokens: int | None = None,
    kernels: str = "none",
    masked_row: int | None = None,
) -> dict[str, Any]:
    """The numbers ``plan`` prints, for a model config (see :mod:`lightning_blockwise.planning.sizing`).

    Args:
        config: The model's ``PretrainedConfig``.
        tokens: Tokens per micro-batch (batch size x sequence length).
        lora_rank: LoRA rank.
        targets: Linears with adapters; ``None``: every linear of the decoder layers.
        dora: DoRA instead of LoRA.
        dtype: Dtype of the unquantized tensors (``"bfloat16"``, ...); ``None``: the config's.
        block_size: Decoder layers per block.
        prefetch_depth: Blocks copied ahead of the one in use.
        vram_budget: The ``vram_budget`` to plan for, in bytes.
        gpu_memory: A card's memory, in bytes, to recommend a budget, block size, offload, loss and MLP tiling for.
            Without a ``vram_budget``, automatic offload also plans for it (as the strategy does for the card it runs
            on).
        offload_activations: The strategy's ``offload_activations``: ``None`` turns offload on when the step does
            not fit (the budget, else the card) without it.
        loss_chunk_tokens: Rows of logits the module's loss builds at a time
            (:func:`~lightning_blockwise.longcontext.loss.chunked_causal_lm_loss`); ``None``: Hugging Face's loss.
        mlp_tile_tokens: Tokens per tile of the module's tiled MLPs
            (:func:`~lightning_blockwise.longcontext.tiling.tile_mlps`); ``None``: untiled.
        quantize: ``False``: a dense base in ``dtype`` (``load_blockwise(quantize=False)``,
            ``CausalLMFineTune(quantize=False)``); else NF4 with double quantization.
        block_major: ``accumulate_grad_batches`` of a run with ``block_major_accumulation=True`` (the window's
            micro-batches' layer inputs are saved at once, its workers' cuBLAS workspaces count); ``None``: off.
        devices: Data-parallel processes on the machine, one GPU each. The VRAM figures are one rank's (its GPU
            holds DDP's gradient buckets too when there are several); host RAM is the machine's: one shared arena
            (NOTE [ One host copy per machine ]), each rank's offloaded layer inputs and host embedding table.
        attention_tile_tokens: Queries per tile of the module's tiled attention
            (:func:`~lightning_blockwise.longcontext.attention.tile_attention`); ``None``: untiled.
        kernels: ``--kernels``: ``"liger"`` counts Liger-Kernel's RMSNorm and RoPE, which keep no fp32 copies of
            the norms' inputs, and its SwiGLU where the MLPs are untiled; ``"auto"`` the same where Liger-Kernel is
            installed here; ``"none"`` the model's own layers (NOTE [ The kernels plan counts ] in plan_kernels.py).
        masked_row: ``--masked-attention``: the rows (of this many tokens) are padded or packed, so attention runs
            with a mask (NOTE [ Masked attention ] in planning/step_shape.py); ``None``: causal rows.

    Raises:
        MisconfigurationException: If ``targets`` names a linear the decoder layers do not have, ``kernels`` is not
            a choice, ``block_size`` is out of range, ``vram_budget`` below the minimum, or ``gpu_memory`` no more
            than the CUDA context takes.
    """
    import torch
    from lightning.pytorch.utilities.exceptions import MisconfigurationException

    from lightning_blockwise.cli.plan_render import plan_fields, recommendation_fields
    from lightning_blockwise.planning.recommend import CUDA_CONTEXT_RESERVE, recommend
    from lightning_blockwise.planning.sizing import model_sizes
    from lightning_blockwise.planning.step_kernels import StepKernels

    try:
        model = model_sizes(
            config,
            dtype=None if dtype is None else getattr(torch, dtype),
            lora_rank=lora_rank,
            targets=targets,
            dora=dora,
            quantize=quantize,
        )
    except ValueError as error:
        # How `model_sizes` refuses targets the layers lack, and transformers a config it cannot build: the
        # message stands alone.
        raise MisconfigurationException(str(error)) from None
    sizes = model.per_rank(devices)  # what one rank's GPU holds
    try:
        modelled = modelled_kernels(kernels, sizes.model_type, mlp_tile_tokens is not None)
    except ValueError as error:
        raise MisconfigurationException(f"--kernels: {error}") from None
    step_kernels = StepKernels(
        loss_chunk_tokens=loss_chunk_tokens,
        mlp_tile_tokens=mlp_tile_tokens,
        attention_tile_tokens=attention_tile_tokens,
        fused_norm=modelled.liger,
        fused_mlp=modelled.fused_mlp,
    )
    if masked_row is not None and attention_tile_tokens is not None and attention_tile_tokens < tokens:
        raise MisconfigurationException(
            "--masked-attention with --attention-tile-tokens: tiled attention runs causal rows without padding only"
            " (CausalLMFineTune refuses packed rows with it); drop one of them."
        )
    if block_size > sizes.num_layers:
        raise MisconfigurationException(
            f"--block-size {block_size} is more than the {sizes.num_layers} decoder layers of this"
            f" {sizes.model_type} model; pick 1 to {sizes.num_layers}."
        )
    # Without a budget, the strategy decides automatic offload against the card it runs on (`device_limit`).
    card_limit = None if gpu_memory is None else gpu_memory - CUDA_CONTEXT_RESERVE
    step_budget = sizes.step_budget(
        block_size,
        prefetch_depth,
        vram_budget,
        offload_activations,
        step_kernels,
        device_limit=card_limit,
        window=block_major or 1,
        masked_row=masked_row,
    )
    if block_major is not None and block_major > 1 and offload_activations:
        raise MisconfigurationException(
            "--block-major: a block-major window saves its micro-batches' layer inputs on the device; leave"
            " --offload-activations at auto or off."
        )
    try:
        step = step_budget.plan(tokens)
    except ValueError as error:
        raise MisconfigurationException(
            f"--vram-budget: {error}{_smaller_step_hint(loss_chunk_tokens, mlp_tile_tokens)}"
        ) from None
    # Host RAM is the machine's: one arena for all ranks, each rank's own offloaded inputs and embedding table.
    offload_host_bytes = step.offload_host_bytes * devices
    report: dict[str, Any] = {
        "model_type": sizes.model_type,
        "base": "nf4" if quantize else "dense",
        "num_layers": sizes.num_layers,
        "tokens": tokens,
        "devices": devices,
        "block_size": block_size,
        "prefetch_depth": prefetch_depth,
        "block_bytes": sizes.block_bytes(block_size),
        "host_arena_bytes": sizes.host_bytes(block_size),
        "host_embedding_bytes": sizes.host_embedding_bytes * devices,
        "device_frozen_bytes": model.device_bytes,
        "ddp_bucket_bytes": sizes.device_bytes - model.device_bytes,
        "adapter_bytes": sizes.trainable_bytes,
        "vram_budget": vram_budget,
        **plan_fields(step.residency),
        "offload_activations_option": _option_name(offload_activations),
        "offload_activations": step.offload,
        "loss_chunk_tokens": loss_chunk_tokens,
        "mlp_tile_tokens": mlp_tile_tokens,
        "attention_tile_tokens": attention_tile_tokens,
        "kernels_option": kernels,
        "kernels": "liger" if modelled.liger else "none",
        "kernels_reason": modelled.reason,
        "fused_mlp": step.shape.fused_mlp,
        "masked_row": masked_row,
        "block_major": block_major,
        "offload_host_bytes": offload_host_bytes,
        "host_pinned_bytes": sizes.host_bytes(block_size) + offload_host_bytes,
    }
    if gpu_memory is not None:
        try:
            advice = recommend(sizes, gpu_memory, tokens, prefetch_depth, offload_activations, step_kernels, masked_row)
        except ValueError as error:
            raise MisconfigurationException(f"--gpu-memory: {error}.") from None
        report["recommendation"] = recommendation_fields(advice, sizes.host_bytes(advice.block_size), devices)
    return report


def _smaller_step_hint(loss_chunk_tokens: int | None, mlp_tile_tokens: int | None) -> str:
    """Where a budget is too small: the module's options that would make the step smaller, not given yet."""
    from lightning_blockwise.longcontext.loss import DEFAULT_CHUNK_TOKENS
    from lightning_blockwise.planning.recommend import RECOMMENDED_MLP_TILE_TOKENS

    if loss_chunk_tokens is None:
        return (
            f" Or plan for the chunked loss (--loss-chunk-tokens {DEFAULT_CHUNK_TOKENS}), which never holds every"
            " token's logits."
        )
    if mlp_tile_tokens is None:
        return (
            f" Or plan for tiled MLPs (--mlp-tile-tokens {RECOMMENDED_MLP_TILE_TOKENS}), which run each layer's MLP"
            " a tile of tokens at a time."
        )
    return ""


def _option_name(offload_activations: bool | None) -> str:
    return next(name for name, value in OFFLOAD_CHOICES.items() if value is offload_activations)


def _config(checkpoint: Path | None, shape: str | None) -> Any:
    """The config to plan for: a checkpoint's, or a documented shape's."""
    if (checkpoint is None) == (shape is None):
        given = "both a checkpoint and --shape" if shape else "neither a checkpoint nor --shape"
        raise SystemExit(
            f"lightning-blockwise plan: {given} given; give one: a checkpoint directory (or its config.json), or"
            f" --shape {'/'.join(DOCUMENTED_SHAPES)}."
        )
    return shape_config(shape) if shape is not None else _load_config(checkpoint)


def _load_config(path: Path) -> Any:
    """A checkpoint's config, from its directory or its ``config.json``, never from the network."""
    from transformers import AutoConfig

    if not path.exists():
        raise SystemExit(
            f"lightning-blockwise plan: {path} does not exist. Give a local checkpoint directory or its config.json."
        )
    return AutoConfig.from_pretrained(path, local_files_only=True)


__all__ = ["PLAN_COMMAND", "plan", "plan_report"]
