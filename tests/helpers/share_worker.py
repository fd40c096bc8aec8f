"""One process of the shared-load tests (tests/loading/test_sharing.py): load a checkpoint, report, wait.

``python -m tests.helpers.share_worker CHECKPOINT OUT.json [--no-share] [--hold FILE]``: loads with
``load_blockwise``, writes what it got (whether its arena is another process's read-only copy, a hash of the
arena's bytes and of the model's logits on fixed tokens) and, with ``--hold``, keeps the model alive until FILE
exists, so that another process can map its copy meanwhile.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import time
from pathlib import Path

import torch

from lightning_blockwise import BlockwiseStrategy, load_blockwise
from lightning_blockwise.residency.placement import host_copy_of
from tests.helpers.models import CausalLMModule, build_model, fit, padded_batches


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("out", type=Path)
    parser.add_argument("--no-share", action="store_true")
    parser.add_argument("--hold", type=Path, default=None)
    parser.add_argument("--device", default="cpu", help="where to quantize (cuda: the arena is page-locked)")
    parser.add_argument(
        "--pack",
        choices=["none", "true", "false"],
        default=None,
        help="build with from_pretrained and let BlockwiseStrategy(share_host_copy=...) pack it",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.pack is not None:
        _pack(args)
        return
    model = load_blockwise(args.checkpoint, compute_dtype=torch.float32, device=args.device, progress=False,
                           share=not args.no_share)  # fmt: skip
    copy = host_copy_of(model)
    assert copy is not None
    torch.manual_seed(0)  # the model is in train mode: the same dropout masks in every process
    with torch.no_grad():
        logits = model(input_ids=torch.arange(1, 13)[None]).logits
    report = {
        "read_only": copy.arena.read_only,
        "pinned": copy.arena.pinned,
        "serving": copy.serving is not None,
        "arena": hashlib.sha256(copy.arena.storage.numpy().tobytes()).hexdigest(),
        "logits": hashlib.sha256(logits.numpy().tobytes()).hexdigest(),
    }
    args.out.write_text(json.dumps(report))
    while args.hold is not None and not args.hold.exists():
        time.sleep(0.05)


def _pack(args: argparse.Namespace) -> None:
    """A fit step under ``BlockwiseStrategy(share_host_copy=...)`` of a ``from_pretrained`` NF4 model; report, wait."""
    share = {"none": None, "true": True, "false": False}[args.pack]
    module = CausalLMModule(lambda: build_model("llama", args.checkpoint, quantized=True))
    fit(module, BlockwiseStrategy(share_host_copy=share), padded_batches(2), max_steps=1, accumulate_grad_batches=1)
    copy = host_copy_of(module.model.get_base_model())
    assert copy is not None
    report = {
        "read_only": copy.arena.read_only,
        "serving": copy.serving is not None,
        "losses": [x.item() for x in module.losses],
    }
    args.out.write_text(json.dumps(report))
    while args.hold is not None and not args.hold.exists():
        time.sleep(0.05)


if __name__ == "__main__":
    main()
