"""What lightning_blockwise knows about accelerate's module hooks (``accelerate.hooks.add_hook_to_module``).

On an accelerate upgrade, check NOTE [ accelerate's hooks replace forward ] below.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from torch import nn

# NOTE [ accelerate's hooks replace forward ]
# `add_hook_to_module(module, hook)` does not register a torch hook: it keeps the module's forward as
# `module._old_forward`, sets `module._hf_hook = hook` and assigns a new `forward` to the instance that
# calls `hook.pre_forward`, the old forward and `hook.post_forward`. Inside a rematerialized decoder layer
# such a forward runs in the no-grad forward and again in the recompute: the hook fires twice per step
# (torch's hooks are fired once there: NOTE [ Forward hooks inside a rematerialized layer ] in
# replay/hooks.py), on the decoder layer itself too since the wrapper runs a forward set on the instance
# (NOTE [ A forward set on the layer ] in replay/remat.py; before that, the class's, so it never fired).
# Measured on the CPU (accelerate 1.15): an observing hook on layer 1 saw 3 outputs in 3 steps under
# `strategy="auto"` and none under the strategy (before that note); one on layer 2's MLP saw 3 and 6. The
# strategy refuses them at setup; the same observer as a torch forward hook sees what resident training shows.


def accelerate_hooked_modules(layers: Sequence[nn.Module]) -> Iterator[tuple[str, str]]:
    """``(name, hook class)`` of each module in the decoder ``layers`` (the layers included) with an accelerate hook.

    Names are ``layers.<index>[.<module>]``; see NOTE [ accelerate's hooks replace forward ].
    """
    for index, layer in enumerate(layers):
        for name, module in layer.named_modules():
            hook = getattr(module, "_hf_hook", None)
            if hook is not None and "forward" in vars(module):
                yield ".".join(filter(None, (f"layers.{index}", name))), type(hook).__name__
