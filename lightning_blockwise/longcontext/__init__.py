"""The module-side long-context tools: a chunked loss (``loss.py``) and tiled MLPs (``tiling.py``).

They bound what the head and the MLPs hold at once, so the strategy's per-layer peak does not grow with the
vocabulary or the intermediate size times the tokens; ``planning`` sizes a run with them.
"""
