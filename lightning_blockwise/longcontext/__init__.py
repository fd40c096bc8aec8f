"""The module-side long-context tools: a chunked loss, tiled MLPs and tiled attention.

``loss.py``, ``tiling.py`` and ``attention.py`` bound what the head, the MLPs and attention's backward hold at once,
so the strategy's per-layer peak does not grow with the vocabulary or the intermediate size times the tokens;
``planning`` sizes a run with them.
"""
