"""Module-side choices about the adapters themselves: DoRA's factored row norm (``dora_norm.py``)."""
