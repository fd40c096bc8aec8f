"""``python -m lightning_blockwise``: the same as the ``lightning-blockwise`` command."""

from lightning_blockwise.cli import main

if __name__ == "__main__":
    main()
