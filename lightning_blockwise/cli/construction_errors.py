"""A class's own refusal, out from under jsonargparse's report, when the CLI builds the model, data or Trainer.

jsonargparse instantiates ``model: LightningModule | None`` by trying each member of the union, so a
constructor that refuses its arguments (``InstructionDataModule(tokenizer='/nope')``, ``kernels='liger'``
without Liger-Kernel) reaches the user as "Does not validate against any of the Union subtypes", the
message listed among the union's members, the whole config as the "Given value", some 80 lines of
traceback, and last "Expected a <class 'NoneType'>". The constructor's exception is that report's
``__cause__``: the CLI raises it alone, and ``lightning-blockwise`` prints its message as one line.
"""

from __future__ import annotations

from lightning.pytorch.utilities.exceptions import MisconfigurationException


def constructor_error(error: BaseException) -> BaseException | None:
    """The exception a constructor raised under jsonargparse's union report ``error``, or ``None`` if there is none.

    Args:
        error: What ``LightningCLI.instantiate_classes`` raised.

    Returns:
        The innermost cause, where ``error`` is jsonargparse's report over it; ``None`` for any other error.
    """
    if not isinstance(error, ValueError) or error.__cause__ is None:
        return None
    cause = error.__cause__
    # jsonargparse nests one report per level of class_path (a callback inside the trainer, say).
    while isinstance(cause, ValueError) and cause.__cause__ is not None:
        cause = cause.__cause__
    return cause


def one_line(error: MisconfigurationException) -> str:
    """What ``lightning-blockwise`` prints for a user's mistake: ``error: <message>``, the message's lines joined."""
    return "error: " + " ".join(line.strip() for line in str(error).splitlines() if line.strip())


__all__ = ["constructor_error", "one_line"]
