"""Issue 44's small levers, each alone and together: the chunked loss split (not sliced), a layer's modules listed once.

Both levers are in the package now; the ``before`` arms put the old code back for their run only (the sliced loss as
it was before NOTE [ One gradient write per chunk ], and the hooks' two ``named_modules()`` walks per pass before
NOTE [ A layer's modules, listed once ]), so one process measures every arm on the same model. Three parts:

- ``loss``: the chunked loss alone (its forward and backward, the decoder's output a leaf), the 7B shape's head
  (3584 x 152064, bf16 autocast, chunks of 1024 rows), sliced against split: median ms and the peak memory it adds;
- ``hooks``: the CPU time of one pass's hook handling (``hooks_once``, ``hooks_silenced``) at a 7B-shaped Qwen2
  layer with LoRA r16 on the seven projections (built on the meta device: the walk needs no weights), walked
  against listed;
- ``attention``: the host time of one no-grad call of a LoRA'd Qwen2 layer (the ``tiny`` shape, so the host's cost
  shows, not the matmuls') without a mode, inside kept attention's record (a dispatch mode over every operator,
  NOTE [ Kept attention ]) and inside the next lever's candidate (entered around the SDPA call only);
- ``step``: training steps of ``benchmarks.peer_arms.lightning_arm``'s arm (``ours+liger+fused`` by default: the
  issue's configuration) at each point, in four arms: ``before``, ``split_loss``, ``listed_hooks``, ``both``.

    python -m benchmarks.small_levers --parts loss hooks step --points random:4096x1 random:16384x1 \
        --cap-gib 22 --steps 3 --out /tmp/small_levers.jsonl

``--device cpu --shape tiny`` runs every part on the CPU in seconds (tests/benchmarks/test_small_levers.py).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
import timeit
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import transformers
from peft import LoraConfig, get_peft_model
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from benchmarks.peer_arms import lightning_arm, measure
from benchmarks.peer_arms.spec import CHUNK_TOKENS, parse_arm, parse_point
from benchmarks.step_benchmark import SHAPES, TARGETS
from lightning_blockwise.longcontext import loss as loss_module
from lightning_blockwise.replay import hooks
from lightning_blockwise.replay.kept_attention import KeptAttention

#: The arms of the ``step`` part: which levers each runs with (the others put back as they were).
ARMS = {"before": (), "split_loss": ("loss",), "listed_hooks": ("hooks",), "both": ("loss", "hooks")}
PARTS = ("loss", "hooks", "step", "attention")


def sliced_chunked_loss(
    model: nn.Module, input_ids: Tensor | None, labels: Tensor, attention_mask: Tensor | None = None,
    chunk_tokens: int = loss_module.DEFAULT_CHUNK_TOKENS, num_items_in_batch: int | Tensor | None = None,
    **kwargs: Any,
) -> loss_module.ChunkedLossOutput:  # fmt: skip
    """``chunked_causal_lm_loss`` as it was before NOTE [ One gradient write per chunk ]: chunks sliced."""
    decoder, head, config = loss_module.causal_lm_parts(model)
    hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, **kwargs).last_hidden_state
    targets = F.pad(labels, (0, 1), value=loss_module.IGNORE_INDEX)[..., 1:].reshape(-1).to(hidden.device)
    rows = targets.ne(loss_module.IGNORE_INDEX).nonzero().squeeze(1)
    hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, rows)
    targets = targets.index_select(0, rows)
    softcap = getattr(config, "final_logit_softcapping", None)
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, rows.numel(), chunk_tokens):
        part = slice(start, start + chunk_tokens)
        total = total + checkpoint(
            loss_module._chunk_loss, head, hidden[part], targets[part], softcap, use_reentrant=False
        )
    if rows.numel() == 0:
        total = total + hidden.sum() * 0
    divisor = max(rows.numel(), 1) if num_items_in_batch is None else num_items_in_batch
    if isinstance(divisor, Tensor):
        divisor = divisor.to(total.device)
    return loss_module.ChunkedLossOutput(loss=total / divisor, num_tokens=int(rows.numel()))


class _Walked:
    """What ``hooks`` did per pass before NOTE [ A layer's modules, listed once ]: every name, then every module."""

    def __init__(self, layer: nn.Module) -> None:
        self.names = {id(m): name for name, m in layer.named_modules() if name}

    def name(self, module: nn.Module, index: int) -> str:
        return f"layers.{index}.{self.names.get(id(module), '?')}"


def _walked_modules(layer: nn.Module) -> tuple[_Walked, list[nn.Module]]:
    return _Walked(layer), [m for name, m in layer.named_modules() if name]


@contextmanager
def levers(on: tuple[str, ...]) -> Iterator[None]:
    """The levers not in ``on`` put back as they were, for the block's run only."""
    with ExitStack() as stack:
        if "loss" not in on:
            stack.enter_context(_replaced(lightning_arm, "chunked_causal_lm_loss", sliced_chunked_loss))
        if "hooks" not in on:
            stack.enter_context(_replaced(hooks, "_inner_modules", _walked_modules))
        yield


@contextmanager
def _replaced(owner: Any, name: str, value: Any) -> Iterator[None]:
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def _config(shape: str) -> transformers.PretrainedConfig:
    return {**SHAPES, **lightning_arm.EXTRA_SHAPES}[shape]()


class _Head(nn.Module):
    """A causal LM whose decoder returns a fixed leaf (``hidden``), so that only the loss runs."""

    def __init__(self, config: transformers.PretrainedConfig, tokens: int, device: torch.device) -> None:
        super().__init__()
        self.config = config
        self.hidden = nn.Parameter(torch.randn(1, tokens, config.hidden_size, device=device, dtype=torch.bfloat16))
        # Frozen, as a LoRA run's head is: its backward computes the input's gradient only.
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, device=device, dtype=torch.bfloat16)
        self.head.requires_grad_(False)

    def get_decoder(self) -> nn.Module:
        return _Decoder(self.hidden)

    def get_output_embeddings(self) -> nn.Module:
        return self.head


class _Decoder(nn.Module):
    def __init__(self, hidden: Tensor) -> None:
        super().__init__()
        self.hidden = hidden

    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None) -> Any:
        return transformers.modeling_outputs.BaseModelOutput(last_hidden_state=self.hidden * 1)


def loss_part(shape: str, tokens: int, device: torch.device, repeats: int) -> list[dict[str, Any]]:
    """The chunked loss alone at ``tokens``, sliced and split, alternated ``repeats`` times."""
    torch.manual_seed(0)
    config = _config(shape)
    model = _Head(config, tokens, device)
    ids = torch.randint(0, config.vocab_size, (1, tokens), device=device)
    arms: dict[str, Callable[..., Any]] = {"sliced": sliced_chunked_loss, "split": loss_module.chunked_causal_lm_loss}
    times: dict[str, list[float]] = {name: [] for name in arms}
    peaks: dict[str, float] = {}
    for repeat in range(repeats + 1):  # the first round warms up
        for name, loss_fn in arms.items():
            model.zero_grad(set_to_none=True)
            measure.now(device)
            base = torch.cuda.memory_allocated(device) if device.type == "cuda" else 0
            measure.reset_peaks(device)
            start = measure.now(device)
            with torch.autocast(device.type, dtype=torch.bfloat16):
                loss = loss_fn(model, input_ids=ids, labels=ids, chunk_tokens=CHUNK_TOKENS).loss
            loss.backward()
            elapsed = measure.now(device) - start
            if repeat:
                times[name].append(elapsed)
            if device.type == "cuda":
                peaks[name] = (torch.cuda.max_memory_allocated(device) - base) / measure.GB
    return [
        {"part": "loss", "shape": shape, "tokens": tokens, "arm": name, "chunk_tokens": CHUNK_TOKENS,
         "ms": 1e3 * statistics.median(times[name]), "times_ms": [round(1e3 * t, 3) for t in times[name]],
         "peak_added_gb": peaks.get(name)}
        for name in arms
    ]  # fmt: skip


def hooks_part(shape: str, number: int) -> list[dict[str, Any]]:
    """CPU microseconds per pass of ``hooks_once`` and ``hooks_silenced`` at a LoRA'd layer of ``shape``, each way."""
    config = _config(shape)
    config.num_hidden_layers = 1
    with torch.device("meta"):
        model = get_peft_model(
            transformers.AutoModelForCausalLM.from_config(config), LoraConfig(r=16, target_modules=TARGETS)
        )
    layer = model.get_base_model().get_decoder().layers[0]
    anchor = torch.empty(0, requires_grad=True)

    def once() -> None:
        with hooks.hooks_once(layer, 0, anchor):
            pass

    def silenced() -> None:
        with hooks.hooks_silenced(layer):
            pass

    rows = []
    for arm, on in (("walked", ()), ("listed", ("hooks",))):
        with levers(on):
            for name, call in (("hooks_once", once), ("hooks_silenced", silenced)):
                best = min(timeit.repeat(call, number=number, repeat=5)) / number
                rows.append({"part": "hooks", "shape": shape, "arm": arm, "pass": name, "us": 1e6 * best,
                             "modules": sum(1 for _ in layer.modules()) - 1})  # fmt: skip
    return rows


class _AroundSdpa(TorchFunctionMode):
    """The next lever's candidate: the kept-attention record entered around ``F.scaled_dot_product_attention`` only.

    A torch-function mode sees each torch call of the layer once (not every ATen operator beneath it, as the
    dispatch mode does); it enters the dispatch mode for the attention call alone.
    """

    def __init__(self, kept: KeptAttention) -> None:
        super().__init__()
        self.kept = kept

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        if func is F.scaled_dot_product_attention:
            with self.kept.record():
                return func(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))


def attention_part(number: int) -> list[dict[str, Any]]:
    """Host microseconds of one no-grad call of a LoRA'd Qwen2 layer (the ``tiny`` shape: the host's cost, not the
    matmuls') without a mode, inside the kept-attention record (NOTE [ Kept attention ]) and inside the candidate."""
    config = _config("tiny")
    config.num_hidden_layers = 1
    model = get_peft_model(
        transformers.AutoModelForCausalLM.from_config(config), LoraConfig(r=16, target_modules=TARGETS)
    )
    decoder = model.get_base_model().get_decoder()
    layer = decoder.layers[0]
    hidden = torch.randn(1, 16, config.hidden_size)
    positions = torch.arange(16)[None]
    embeddings = decoder.rotary_emb(hidden, positions)

    def call(mode: Any) -> Callable[[], None]:
        def run() -> None:
            with torch.no_grad(), mode():
                layer(hidden, attention_mask=None, position_embeddings=embeddings, position_ids=positions)

        return run

    arms = {
        "none": contextlib.nullcontext,
        "recorded": lambda: KeptAttention().record(),
        "around_sdpa": lambda: _AroundSdpa(KeptAttention()),
    }
    rows = []
    for arm, mode in arms.items():
        best = min(timeit.repeat(call(mode), number=number, repeat=5)) / number
        rows.append({"part": "attention", "shape": "tiny", "arm": arm, "us": 1e6 * best})
    return rows


def step_part(args: argparse.Namespace, device: torch.device) -> list[dict[str, Any]]:
    """Each point's training steps in each arm of :data:`ARMS`, one model built once."""
    arm = parse_arm(args.arm)
    model, _ = lightning_arm.build(arm, args.shape, device)
    run_args = argparse.Namespace(steps=args.steps, profile=False, profile_gaps=False, budgets={})
    rows = []
    for point in sorted(args.points):
        for name, on in ARMS.items():
            with levers(on):
                started = time.perf_counter()
                row = lightning_arm.run_point(model, arm, point, run_args, device)
            rows.append({"part": "step", "shape": args.shape, "point": point.key, "arm": name, "system": args.arm,
                         "wall_s": round(time.perf_counter() - started, 1), **row})  # fmt: skip
            measure.emit(rows[-1], args.out)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    parser.add_argument("--shape", default="7b", choices=sorted({*SHAPES, *lightning_arm.EXTRA_SHAPES}))
    parser.add_argument("--points", nargs="+", type=parse_point, default=[parse_point("random:4096x1")])
    parser.add_argument("--loss-tokens", nargs="+", type=int, default=[4096, 16384, 32768])
    parser.add_argument("--arm", default="ours+liger+fused", help="the lightning arm the step part runs")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per point and arm")
    parser.add_argument("--cap-gib", type=float, default=None, help="cap the allocator (a 24 GB card: 22)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--out", type=Path, required=True, help="append one JSON line per row here")
    args = parser.parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    settings = measure.cap_allocator(device, args.cap_gib)
    rows: list[dict[str, Any]] = []
    if "hooks" in args.parts:
        for row in hooks_part(args.shape, number=200 if device.type == "cpu" else 2000):
            measure.emit({**row, **settings}, args.out)
            rows.append(row)
    if "loss" in args.parts:
        for tokens in args.loss_tokens:
            for row in loss_part(args.shape, tokens, device, repeats=5):
                measure.emit({**row, **settings}, args.out)
                rows.append(row)
    if "attention" in args.parts:
        for row in attention_part(number=50):
            measure.emit({**row, **settings}, args.out)
            rows.append(row)
    if "step" in args.parts:
        rows += step_part(args, device)
    print("\n| part | where | arm | value |\n| --- | --- | --- | --- |")
    for row in rows:
        if row["part"] == "attention":
            print(f"| attention | a no-grad layer call's host time | {row['arm']} | {row['us']:.1f} us |")
        elif row["part"] == "hooks":
            print(f"| hooks | {row['pass']} ({row['modules']} modules) | {row['arm']} | {row['us']:.1f} us |")
        elif row["part"] == "loss":
            peak = "" if row["peak_added_gb"] is None else f", +{row['peak_added_gb']:.2f} GB peak"
            print(f"| loss | {row['tokens']} tokens | {row['arm']} | {row['ms']:.2f} ms{peak} |")
        else:
            value = f"{row['s_per_step']:.3f} s/step" if row.get("status") == "ok" else row.get("status")
            print(f"| step | {row['point']} | {row['arm']} | {value} |")


if __name__ == "__main__":
    main()
