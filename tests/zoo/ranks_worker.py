"""One rank of the zoo's two-rank run (tests/zoo/test_two_ranks.py): two clients, each under ``strategy="ddp"`` and
``strategy="blockwise"`` on 2 CPU ranks (gloo), in one process per rank, one after the other.

Run as ``python -m tests.zoo.ranks_worker OUT BASE`` once per rank with torchrun's variables set
(tests/helpers/ranks.py); writes ``OUT/rank<RANK>.pt``: ``{(client, strategy): ZooRun}``.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

import lightning_blockwise  # noqa: F401  (registers "blockwise")
from tests.zoo.harness import ZooRun, zoo_fit
from tests.zoo.test_qlora_scripts import LitConfigureModel, PlQLoRA

#: The clients run on two ranks: the `pytorch_lightning` script whose loss is logged with `sync_dist=True`, and the
#: `lightning` one built in `configure_model` whose torchmetrics `Perplexity` syncs its state across the ranks.
CLIENTS = {"PlQLoRA": PlQLoRA, "LitConfigureModel": LitConfigureModel}
STRATEGIES = ("ddp", "blockwise")


def main() -> None:
    out, base = Path(sys.argv[1]), sys.argv[2]
    torch.set_num_threads(1)
    runs: dict[tuple[str, str], ZooRun] = {}
    for client, make in CLIENTS.items():
        for strategy in STRATEGIES:
            root = out / f"{client}-{strategy}"
            runs[client, strategy] = zoo_fit(lambda make=make: make(base), strategy, root, devices=2)
    torch.save(runs, out / f"rank{os.environ['RANK']}.pt")


if __name__ == "__main__":
    main()
