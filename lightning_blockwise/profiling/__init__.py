"""Profiling a blockwise run: the stream trace and per-batch timelines; the summary table, JSON and PNG."""
