"""Where a run stands (what a checkpoint records to resume exactly) and its learning-rate schedule."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class TrainState:
    epoch: int = 0  # epoch in progress
    step_in_epoch: int = 0  # batches of `epoch` already trained
    global_step: int = 0
    best_rsum: float = -1.0
    best_epoch: int = -1
    # where the batches are made (vsekit.training.data_path: "device:cuda", "device:cpu", "loader"): a resumed
    # run under train.data_on_device=auto keeps it, so its batches are those of an uninterrupted run
    data_path: str = ""


def lr_at_epoch(base_lr: float, epoch: int, decay_epochs: list[int], decay: float) -> float:
    """Step decay applied once per listed epoch (not compounding every epoch, unlike vse_2ad's code)."""
    return base_lr * decay ** sum(1 for e in decay_epochs if epoch >= e)
