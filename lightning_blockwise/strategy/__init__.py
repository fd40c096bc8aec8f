"""The blockwise strategy: Lightning's hooks (``blockwise.py``) and the parts they delegate to.

Its options (``options.py``), where the module goes (``module_placement.py``), the step plan over the run and its
budget (``step_planner.py``, what the planner reads of the module in ``module_budget.py``, ``step_tokens.py``,
``step_timing.py``), the decoder stack it streams (``streamed_stack.py``), checkpoints (``checkpointing.py``,
``checkpoint_files.py``, ``checkpoint_hooks.py``, and the Lightning hooks that save and resume them,
``resumable.py``), device memory (``device_memory.py``), block-major windows (``accumulation.py``,
``batch_comparison.py``), data parallelism (``data_parallel.py``, ``rank_watchdog.py``) and what callbacks ask it
(``queries.py``).
"""

from lightning_blockwise.strategy.blockwise import BlockwiseStrategy

__all__ = ["BlockwiseStrategy"]
