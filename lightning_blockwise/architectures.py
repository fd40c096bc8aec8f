"""Finding the Hugging Face decoder stack inside a LightningModule, and its adapters.

The strategy only relies on what every Hugging Face causal LM of transformers 5 has:
a ``PreTrainedModel`` whose ``get_decoder()`` owns an ``nn.ModuleList`` named ``layers``
of decoder layers, each called as ``layer(hidden_states, **kwargs)`` and returning the
new hidden states. Architectures whose parity has been tested end to end are listed in
:data:`VALIDATED_MODEL_TYPES`; others are refused unless the user opts in.
"""

from __future__ import annotations

from dataclasses import dataclass

from bitsandbytes.nn import Linear4bit
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn
from transformers import PreTrainedModel

#: The seven projections of a Llama-style decoder layer (Qwen2/3, Llama, Mistral, Gemma 2/3): LoRA on all of them is
#: the usual QLoRA recipe. Phi-3 fuses them (``qkv_proj``, ``gate_up_proj``).
LLAMA_STYLE_PROJECTIONS: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

#: ``config.model_type`` values whose blockwise training is tested bit-identical to resident training. ``qwen3_moe``:
#: LoRA on attention (NF4) and on the fused bf16 experts (PEFT ``target_parameters``), without router logits
#: (NOTE [ Router logits ]).
VALIDATED_MODEL_TYPES: frozenset[str] = frozenset(
    {"qwen2", "qwen3", "qwen3_moe", "llama", "mistral", "gemma2", "gemma3_text", "phi3"}
)


@dataclass(frozen=True)
class DecoderStack:
    """The decoder layers of the one Hugging Face model found in a LightningModule.

    Attributes:
        model: The Hugging Face model (inside any PEFT wrapper).
        model_type: ``model.config.model_type``.
        layers: The decoder layers, in execution order.
    """

    model: PreTrainedModel
    model_type: str
    layers: nn.ModuleList


def find_decoder_stack(module: nn.Module, allow_unvalidated: bool = False) -> DecoderStack:
    """Locate the decoder layers of the single Hugging Face model inside ``module``.

    Args:
        module: The LightningModule (or any module) holding a Hugging Face causal LM,
            PEFT-wrapped or not.
        allow_unvalidated: Accept a ``model_type`` outside :data:`VALIDATED_MODEL_TYPES`.

    Raises:
        MisconfigurationException: If no Hugging Face model or decoder stack is found, if
            there is more than one model, or if the architecture is not validated.
    """
    models = pretrained_models(module)
    if not models:
        raise MisconfigurationException(
            f"BlockwiseStrategy found no Hugging Face `PreTrainedModel` inside `{type(module).__name__}`. Build the"
            " model in `__init__` or `configure_model` (e.g. `AutoModelForCausalLM.from_pretrained(...)`) and assign"
            " it to an attribute of the LightningModule."
        )
    if len(models) > 1:
        names = ", ".join(f"`{name}` ({type(m).__name__})" for name, m in models)
        raise MisconfigurationException(
            f"BlockwiseStrategy streams one decoder stack, but `{type(module).__name__}` holds {len(models)} Hugging"
            f" Face models: {names}. Keep one model in the module being trained."
        )
    name, model = models[0]
    model_type = str(getattr(model.config, "model_type", ""))
    layers = decoder_layers(model)
    if layers is None:
        raise MisconfigurationException(
            f"BlockwiseStrategy {no_decoder_stack(model, name or type(module).__name__)}, and"
            " `BlockwiseStrategy(allow_unvalidated=True)` would not help: it accepts other model types, but only with"
            " their layers at `get_decoder().layers`."
        )
    if model_type not in VALIDATED_MODEL_TYPES and not allow_unvalidated:
        raise MisconfigurationException(
            f"BlockwiseStrategy has not validated model_type {model_type!r} (validated: "
            f"{', '.join(sorted(VALIDATED_MODEL_TYPES))}). To try it anyway, pass"
            " `BlockwiseStrategy(allow_unvalidated=True)` and add the `ParityCheck` callback to verify the run."
        )
    return DecoderStack(model=model, model_type=model_type, layers=layers)


def decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    """The decoder layers at ``model.get_decoder().layers``, or ``None`` where there is no non-empty list there."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    layers = getattr(decoder, "layers", None)
    return layers if isinstance(layers, nn.ModuleList) and len(layers) > 0 else None


def no_decoder_stack(model: nn.Module, name: str) -> str:
    """Why ``model`` (called ``name``) has no decoder stack, naming where its layers are: for the caller's error.

    One message for the strategy and ``load_blockwise``: a causal LM such as GPT-2 that keeps its layers elsewhere
    (``transformer.h``) is told so, not that it is not a causal LM.
    """
    model_type = str(getattr(getattr(model, "config", None), "model_type", ""))
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    kind = (
        f"model_type {model_type!r}"
        if name == type(model).__name__
        else f"{type(model).__name__}, model_type {model_type!r}"
    )
    return (
        f"found no decoder stack in `{name}` ({kind}): it streams the"
        f" layers at `get_decoder().layers` (a non-empty `nn.ModuleList`), but {_where_the_layers_are(model, decoder)}"
        " Models that keep their layers elsewhere are not supported"
    )


def adapter_parameters(layer: nn.Module) -> dict[str, nn.Parameter]:
    """The PEFT adapter parameters inside ``layer`` (LoRA A/B, DoRA magnitudes, ...), by qualified name.

    Adapters are recognized the way PEFT itself knows them: the parameters under the
    ``adapter_layer_names`` of each ``BaseTunerLayer``.
    """
    found: dict[str, nn.Parameter] = {}
    for module_name, module in layer.named_modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        for attr in module.adapter_layer_names:
            container = getattr(module, attr, None)
            if not isinstance(container, nn.Module):
                continue
            for param_name, param in container.named_parameters():
                found[".".join(filter(None, (module_name, attr, param_name)))] = param
    return found


def check_trainable(stack: DecoderStack) -> None:
    """Check that the decoder layers train adapters, and only adapters.

    Raises:
        MisconfigurationException: If a trainable parameter in a decoder layer is not an
            adapter (the base must be frozen), if no adapter parameter is trainable, or if an MoE
            model is configured to return its router logits (NOTE [ Router logits ]).
    """
    _refuse_router_logits(stack)
    num_adapters = 0
    for index, layer in enumerate(stack.layers):
        adapters = {id(p) for p in adapter_parameters(layer).values()}
        for name, param in layer.named_parameters():
            if not param.requires_grad:
                continue
            if id(param) not in adapters:
                raise MisconfigurationException(
                    f"BlockwiseStrategy streams a frozen base, but `layers.{index}.{name}` is trainable and is not a"
                    " PEFT adapter. Freeze it (`requires_grad_(False)`) or train it through a PEFT adapter"
                    " (`get_peft_model(model, LoraConfig(...))` freezes the base for you)."
                )
            num_adapters += 1
    if num_adapters == 0:
        raise MisconfigurationException(
            "BlockwiseStrategy found no trainable adapter in the decoder layers: there is nothing to train. Wrap the"
            " model with `peft.get_peft_model(model, LoraConfig(target_modules=[...]))` targeting modules inside"
            " the decoder layers."
        )


# NOTE [ Router logits ]
# With `output_router_logits=True` an MoE causal LM (qwen3_moe, ...) collects each layer's router
# logits through transformers' output recorder (a forward hook on the router) and adds
# `router_aux_loss_coef * load_balancing_loss` to the loss. Blockwise, the hook fires in the
# layer's no-grad forward (replay/remat.py), so the recorded logits carry no graph: the loss
# value is the resident one, but none of the auxiliary loss's gradient reaches the adapters and
# training drifts from the first optimizer step (tests/test_moe.py shows it). Returning the
# logits as differentiable outputs of the rematerialized layer would fix it; until then it is
# refused here, from the config, at fit start. A per-call `model(..., output_router_logits=True)`
# is not seen here; it is refused at the first backward instead (the router's hook sees aliases that
# refuse a gradient: NOTE [ Forward hooks inside a rematerialized layer ] in replay/hooks.py).
def _refuse_router_logits(stack: DecoderStack) -> None:
    if getattr(stack.model.config, "output_router_logits", False):
        raise MisconfigurationException(
            f"BlockwiseStrategy cannot train {stack.model_type!r} with `config.output_router_logits=True`: the"
            " router logits are recorded in the layers' no-grad forward, so the auxiliary load-balancing loss would"
            " change the loss but none of its gradient would reach the adapters, unlike resident training. Set"
            " `model.config.output_router_logits = False` (the auxiliary loss is then left out, as under any"
            " strategy), or train this model resident."
        )


def eval_mode_4bit_modules(stack: DecoderStack) -> list[str]:
    """Names of bitsandbytes 4-bit linears in the decoder layers that are in eval mode.

    See NOTE [ bitsandbytes CPU inference kernel ].
    """
    return [
        f"layers.{index}.{name}"
        for index, layer in enumerate(stack.layers)
        for name, module in layer.named_modules()
        if isinstance(module, Linear4bit) and not module.training
    ]


def _where_the_layers_are(model: nn.Module, decoder: nn.Module | None) -> str:
    """What ``model.get_decoder()`` is instead, and the module lists inside it (where layers may be), as a clause."""
    owner = type(model).__name__
    if not hasattr(model, "get_decoder"):
        return f"`{owner}` has no `get_decoder()`."
    if decoder is None:
        return f"`{owner}.get_decoder()` returns `None`."
    prefix = next((f"{path}." for path, sub in model.named_modules() if sub is decoder and path), "")
    lists: list[str] = []
    for path, sub in decoder.named_modules():
        # The outermost lists only: a list of layers is the thing to name, not the lists inside each layer.
        if isinstance(sub, nn.ModuleList) and len(sub) > 0 and not any(path.startswith(f"{o}.") for o in lists):
            lists.append(path)
    found = ", ".join(f"`{prefix}{path}`" for path in lists[:3]) if lists else "none"
    return (
        f"`{owner}.get_decoder()` is a `{type(decoder).__name__}` with no `layers` (module lists inside it: {found})."
    )


def pretrained_models(module: nn.Module) -> list[tuple[str, PreTrainedModel]]:
    """Hugging Face models in ``module`` that are not inside another one, with their names (pre-order walk).

    A PEFT wrapper is not a ``PreTrainedModel``: the model found is the one it wraps, adapters injected.

    Args:
        module: Any module, e.g. a LightningModule; ``module`` itself counts (its name is ``""``).
    """
    found: list[tuple[str, PreTrainedModel]] = []
    for name, sub in module.named_modules():
        inside_found = any(outer == "" or name.startswith(f"{outer}.") for outer, _ in found)
        if isinstance(sub, PreTrainedModel) and not inside_found:
            if not any(sub is m for _, m in found):
                found.append((name, sub))
    return found
