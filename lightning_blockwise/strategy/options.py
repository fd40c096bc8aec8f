"""Checks of the strategy's options and of the module it is handed, before any work: errors that say the fix."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from lightning.fabric.utilities.types import _DEVICE
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from torch import nn

from lightning_blockwise.compat.accelerate import accelerate_hooked_modules
from lightning_blockwise.compat.bitsandbytes import named_8bit_linears
from lightning_blockwise.compat.flags import check_flag
from lightning_blockwise.planning import parse_bytes


def check_count(name: str, value: Any, why: str = "") -> None:
    """Refuse a strategy option that must be an integer of at least 1 (a bool is not one)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise MisconfigurationException(f"`BlockwiseStrategy({name}={value!r})` must be an integer of at least 1.{why}")


def check_optional_bool(name: str, value: Any) -> None:
    """Refuse a strategy option that must be ``True``, ``False`` or ``None`` (NOTE [ A string is not a flag ])."""
    check_flag("BlockwiseStrategy", name, value, none_means="decides from the plan")


def check_bool(name: str, value: Any) -> None:
    """Refuse a strategy option that must be ``True`` or ``False`` (NOTE [ A string is not a flag ] in compat/flags.py).

    A string is refused too: ``"no"`` and ``"false"`` are truthy, so ``save_frozen_base="no"`` would write the
    whole base into every checkpoint.
    """
    check_flag("BlockwiseStrategy", name, value)


#: The ``vram_budget`` that plans for the whole card (NOTE [ The card as the default budget ] in device_memory.py).
CARD = "card"


def check_offload(value: Any) -> None:
    """Refuse an ``offload_activations`` that is not ``True``, ``False``, ``None`` or a count of layers."""
    if value is None or isinstance(value, bool) or (isinstance(value, int) and value >= 0):
        return
    raise MisconfigurationException(
        f"`BlockwiseStrategy(offload_activations={value!r})` must be True, False, None (None decides from the plan)"
        " or how many layers, the first ones, save their inputs in host memory (an integer of at least 0)."
    )


def offload_split(value: bool | int | None, num_layers: int) -> tuple[bool | None, int | None]:
    """``offload_activations`` as the step budget takes it: offload on/off/auto, and how many layers offload.

    An integer ``m`` offloads the first ``m`` layers' inputs (NOTE [ Split layer inputs ] in
    residency/activations.py); ``None`` as the count means every layer.

    Raises:
        MisconfigurationException: If ``m`` is more than the decoder layers.
    """
    if value is None or isinstance(value, bool):
        return value, None
    if value > num_layers:
        raise MisconfigurationException(
            f"`BlockwiseStrategy(offload_activations={value})` asks for more layers' inputs in host memory than the"
            f" model's {num_layers} decoder layers; pass at most {num_layers} (or True for all of them)."
        )
    return value > 0, value


def check_input_checkpoints(every: Any, block_major_accumulation: bool) -> None:
    """Refuse an ``input_checkpoint_every`` that is not ``None`` or at least 2, or that block-major windows exclude.

    NOTE [ Input checkpoints ] in replay/segments.py.
    """
    if every is None:
        return
    if isinstance(every, bool) or not isinstance(every, int) or every < 2:
        raise MisconfigurationException(
            f"`BlockwiseStrategy(input_checkpoint_every={every!r})` must be None (every layer input kept) or an integer"
            " of at least 2: the layers whose inputs are kept, one in that many, the others replayed in the backward."
        )
    if block_major_accumulation:
        raise MisconfigurationException(
            f"`BlockwiseStrategy(block_major_accumulation=True, input_checkpoint_every={every})`: a block-major window"
            " keeps every micro-batch's layer inputs on the device and runs its own backward; drop one of the two."
        )


def budget_bytes(vram_budget: int | str | None) -> int | None:
    """``vram_budget`` in bytes (``None`` and ``"card"``, decided at setup, give ``None``), or a clear error."""
    if vram_budget is None or vram_budget == CARD:
        return None
    try:
        return parse_bytes(vram_budget)
    except ValueError as error:
        raise MisconfigurationException(
            f"`BlockwiseStrategy(vram_budget={vram_budget!r})`: {error} Or write `vram_budget='card'` (the default:"
            " the card's free memory) or `vram_budget=None` (no budget: every block streams)."
        ) from None


def check_device(device: _DEVICE | None) -> None:
    """Refuse a GPU device on a machine without CUDA."""
    if device is not None and torch.device(device).type == "cuda" and not torch.cuda.is_available():
        raise MisconfigurationException(
            f"`BlockwiseStrategy(device={str(device)!r})` asks for a GPU, but CUDA is not available. Install a"
            " CUDA build of torch on a machine with an NVIDIA GPU, or train on the CPU (`accelerator='cpu'`)."
        )


@dataclass(frozen=True)
class BlockwiseOptions:
    """What a user chose for a :class:`~lightning_blockwise.BlockwiseStrategy`, checked; the strategy's ``options``.

    The strategy's arguments of the same names, as its run reads them (see the strategy for each one's meaning);
    built by :meth:`checked`, which refuses a wrong type, range or combination before any work.

    Attributes:
        vram_budget: The budget in bytes; ``None`` with ``"card"`` (:attr:`uses_card`) or no budget.
        uses_card: Whether the run plans for the card's budget (``vram_budget="card"``), measured at each setup.
    """

    block_size: int = 1
    prefetch_depth: int = 2
    vram_budget: int | None = None
    uses_card: bool = True
    budget_tokens: int | None = None
    offload_activations: bool | int | None = None
    keep_activations: bool = True
    allow_unvalidated: bool = False
    save_frozen_base: bool = False
    share_host_copy: bool | None = None
    block_major_accumulation: bool = False
    input_checkpoint_every: int | None = None

    @classmethod
    def checked(
        cls,
        vram_budget: int | str | None,
        device: _DEVICE | None = None,
        parallel_devices: Any = None,
        ddp_kwargs: Any = None,
        **options: Any,
    ) -> BlockwiseOptions:
        """The options, or the first one that is wrong refused naming its value and the fix.

        Args:
            vram_budget: ``"card"``, bytes, a size such as ``"16GiB"``, or ``None``.
            device: The strategy's ``device`` argument (checked, not kept).
            parallel_devices: The strategy's ``parallel_devices`` argument (checked, not kept).
            ddp_kwargs: The strategy's ``ddp_kwargs`` argument (checked, not kept).
            options: The other fields by name.

        Raises:
            MisconfigurationException: Naming the option, its value and the fix.
        """
        _check_options(device=device, parallel_devices=parallel_devices, ddp_kwargs=ddp_kwargs, **options)
        return cls(vram_budget=budget_bytes(vram_budget), uses_card=vram_budget == CARD, **options)


def _check_options(
    *,
    block_size: Any,
    prefetch_depth: Any,
    budget_tokens: Any,
    offload_activations: Any,
    keep_activations: Any,
    block_major_accumulation: Any,
    input_checkpoint_every: Any,
    allow_unvalidated: Any,
    save_frozen_base: Any,
    share_host_copy: Any,
    device: _DEVICE | None,
    parallel_devices: Any,
    ddp_kwargs: Any = None,
) -> None:
    """Refuse ``BlockwiseStrategy``'s options that are of the wrong type or range, or that do not go together.

    Raises:
        MisconfigurationException: Naming the option, its value and the fix.
    """
    check_count("block_size", block_size)
    check_count(
        "prefetch_depth",
        prefetch_depth,
        " the block after the one in use has to be on its way for copies to overlap compute.",
    )
    if budget_tokens is not None:
        check_count("budget_tokens", budget_tokens)
    check_offload(offload_activations)
    check_bool("keep_activations", keep_activations)
    check_bool("block_major_accumulation", block_major_accumulation)
    if block_major_accumulation and offload_activations:
        raise MisconfigurationException(
            "`BlockwiseStrategy(block_major_accumulation=True, offload_activations=True)`: a block-major window"
            " saves its micro-batches' layer inputs on the device; leave `offload_activations` unset (or False)."
        )
    check_input_checkpoints(input_checkpoint_every, block_major_accumulation)
    if (ddp_kwargs or {}).get("find_unused_parameters"):
        # Measured on 2 gloo ranks: DDP's search for unused parameters walks the forward's graph from the outputs,
        # which does not reach the adapters of recomputed layers (their graphs are built in the backward), so it
        # marks them unused and then again ready when their gradients arrive: "marked ready only once" fails.
        raise MisconfigurationException(
            "`BlockwiseStrategy(ddp_kwargs={'find_unused_parameters': True})`: DDP cannot see which adapters the"
            " step uses (each layer's graph is rebuilt in the backward), so every recomputed adapter would be"
            " reported ready twice and the backward fails. Leave it False: every adapter of the decoder gets a"
            " gradient in each step; give parameters no step uses `requires_grad=False`."
        )
    check_device(device)
    if device is not None and parallel_devices is not None:
        raise MisconfigurationException(
            f"`BlockwiseStrategy` was given both `device={device!r}` and `parallel_devices={parallel_devices!r}`;"
            " pass one (or neither, and let the Trainer's `devices` decide)."
        )
    check_bool("allow_unvalidated", allow_unvalidated)
    check_bool("save_frozen_base", save_frozen_base)
    check_optional_bool("share_host_copy", share_host_copy)


def refuse_compiled(module: torch.nn.Module) -> None:
    """Refuse ``torch.compile`` anywhere in the module, with the reason, before any model work."""
    compiled = getattr(module, "_compiler_ctx", None) is not None or any(
        isinstance(sub, torch._dynamo.eval_frame.OptimizedModule) or getattr(sub, "_compiled_call_impl", None)
        for sub in module.modules()
    )
    if compiled:
        raise MisconfigurationException(
            "BlockwiseStrategy does not support `torch.compile`: the frozen decoder tensors are rebound to other"
            " memory (host arena, device slots) between and within steps, and are views of one byte buffer with"
            " different dtypes, which AOTAutograd cannot trace. Train the module uncompiled (drop"
            " `torch.compile` / `module.compile()`)."
        )


def refuse_cpu_eval_mode_4bit(names: list[str]) -> None:
    """Refuse bitsandbytes 4-bit layers in eval mode when CPU training is set up (their names given).

    Called at setup, before the sanity validation and any callback's fit-start work (a `ParityCheck` would
    otherwise report a bit-identical run first).

    NOTE [ bitsandbytes CPU inference kernel ] in compat/bitsandbytes/cpu_kernel.py. Training wants train
    mode anyway (dropout is off in eval mode).
    """
    if names:
        raise MisconfigurationException(
            f"BlockwiseStrategy: {len(names)} bitsandbytes 4-bit layers are in eval mode at the start of"
            f" training (e.g. `{names[0]}`). On the CPU, bitsandbytes then switches eval-mode layers to another"
            " kernel depending on whether their input requires grad, which rematerialization changes. Call"
            " `model.train()` after loading (`from_pretrained` returns the model in eval mode)."
        )


def refuse_accelerate_hooks(layers: Sequence[nn.Module]) -> None:
    """Refuse accelerate hooks in the decoder ``layers``, at setup (NOTE [ accelerate's hooks replace forward ])."""
    hooked = list(accelerate_hooked_modules(layers))
    if hooked:
        name, hook = hooked[0]
        raise MisconfigurationException(
            f"BlockwiseStrategy: {len(hooked)} modules in the decoder layers carry an accelerate hook (e.g. `{hook}`"
            f" on `{name}`, added with `accelerate.hooks.add_hook_to_module`), which replaces the module's `forward`:"
            " a rematerialized decoder layer runs its modules twice per step (the forward and the recompute), so the"
            " hook would fire twice. Observe with a torch forward hook"
            " (`module.register_forward_hook(...)`), which fires once per step as in resident training, remove the"
            ' hook (`accelerate.hooks.remove_hook_from_module(module)`), or train with `strategy="auto"`.'
        )


def refuse_8bit_linears(layers: Sequence[nn.Module]) -> None:
    """Refuse bitsandbytes 8-bit linears in the decoder ``layers``, at setup, before anything moves.

    NOTE [ 8-bit bases do not stream ] in compat/bitsandbytes/linears.py.
    """
    names = [f"layers.{index}.{name}" for index, layer in enumerate(layers) for name, _ in named_8bit_linears(layer)]
    if names:
        raise MisconfigurationException(
            f"BlockwiseStrategy cannot stream a base loaded in 8-bit: {len(names)} bitsandbytes `Linear8bitLt` layers"
            f" in the decoder layers (e.g. `{names[0]}`) keep their int8 weight and scales where they were loaded,"
            " out of the host arena's reach. Load the base in 4-bit NF4, which streams:"
            ' `BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")`, or train the 8-bit base resident'
            ' with `strategy="auto"`.'
        )


__all__ = [
    "CARD",
    "BlockwiseOptions",
    "budget_bytes",
    "check_bool",
    "check_count",
    "check_device",
    "check_input_checkpoints",
    "check_offload",
    "check_optional_bool",
    "offload_split",
    "refuse_8bit_linears",
    "refuse_accelerate_hooks",
    "refuse_compiled",
    "refuse_cpu_eval_mode_4bit",
]
