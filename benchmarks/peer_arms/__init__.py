"""The arms of `benchmarks/peers.py`, each run in a process of its own.

- :mod:`.spec`: an arm's name parsed into options (``ours+liger+budget=7.5GB``), and the points it runs at;
- :mod:`.measure`: what every arm records (versions, device, the allocator cap, a point's row);
- :mod:`.lightning_arm`: this package's arms and transformers + PEFT, trained through ``Trainer.fit``;
- :mod:`.unsloth_arm`: Unsloth, loaded by the peer probe, in a plain PyTorch loop;
- :mod:`.table`: the markdown table of the rows.
"""
