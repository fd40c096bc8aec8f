"""Learning-rate schedules of the recipes."""

from __future__ import annotations

import torch


def warmup_cosine(
    optimizer: torch.optim.Optimizer, warmup_steps: int, total_steps: int, min_lr_ratio: float
) -> torch.optim.lr_scheduler.LRScheduler:
    """Linear warmup to the optimizer's learning rate, then cosine decay to ``min_lr_ratio`` of it.

    Stepped once per optimizer step, the rate climbs linearly from ``lr / (warmup_steps + 1)``
    to ``lr`` at step ``warmup_steps``, then falls along a cosine to ``min_lr_ratio * lr`` at
    step ``total_steps``.

    Args:
        optimizer: The optimizer, with one learning rate for all its groups.
        warmup_steps: Steps of warmup; capped at ``total_steps - 1`` so that some decay remains.
        total_steps: Length of the whole schedule.
        min_lr_ratio: Final rate as a fraction of the peak.

    Returns:
        A scheduler to step after every optimizer step.
    """
    warmup_steps = max(0, min(warmup_steps, total_steps - 1))
    peak = optimizer.defaults["lr"]
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(
        optimizer, T_max=max(1, total_steps - warmup_steps), eta_min=peak * min_lr_ratio
    )
    if warmup_steps == 0:
        # SequentialLR with a milestone at 0 starts differently across torch versions; there is nothing to chain.
        return cosine
    # LinearLR needs a positive start factor; 1 / (warmup + 1) makes the climb reach `lr` in even steps.
    warmup = torch.optim.lr_scheduler.LinearLR(optimizer, start_factor=1 / (warmup_steps + 1), total_iters=warmup_steps)
    return torch.optim.lr_scheduler.SequentialLR(optimizer, [warmup, cosine], milestones=[warmup_steps])


__all__ = ["warmup_cosine"]
