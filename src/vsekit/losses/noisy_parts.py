"""The noisy-correspondence parts a recipe names, torch-free: RCL's loss is in `vsekit.losses.parts`; here
NCR's loss (`loss.name: ncr`) and its co-divide (`train.sample_policy.name: ncr`, two networks)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vsekit.losses.parts import MarginSettings
from vsekit.registry import MAX_BATCH, Settings, register, setting


@dataclass
class NCRLossSettings(MarginSettings):
    ncr_soft_margin: str = setting(
        "exponential",
        "NCR's soft margin M = margin x f(label): exponential (10^y - 1) / 9 (the release's default) | linear y "
        "| sin",
        choices=("exponential", "linear", "sin"),
    )


@dataclass
class CoDivideSettings(Settings):
    p_threshold: float = setting(
        0.5,
        "a pair whose clean probability exceeds this is labeled (the release's --p_threshold)",
        rule="in [0, 1]",
    )
    unlabeled_start_epoch: int = setting(
        -1,
        "the first epoch (from 0) that also trains the unlabeled pairs; -1: train.epochs // 2, as the release",
        rule="a finite number",
    )
    split_batch_size: int = setting(
        0,
        "captions per batch of the split pass (each pair's loss is against its batch's negatives); 0: "
        "train.batch_size, as the release",
        rule=">= 0",
        max=MAX_BATCH,
    )


def _ncr_loss(cfg: Any) -> Any:
    from vsekit.losses.noisy_ncr import NCRLoss

    return NCRLoss(cfg.margin, cfg.ncr_soft_margin)


def _co_divide(cfg: Any) -> Any:
    from vsekit.losses.co_divide import CoDivide

    return CoDivide(cfg)


register(
    "loss",
    "ncr",
    NCRLossSettings,
    build=_ncr_loss,
    help="NCR's soft-margin hinge on the hardest negative (co-rectified labels), its warm-up over all "
    "negatives; with train.sample_policy.name=ncr",
    facts={"takes_targets": True},
)
register(
    "sample_policy",
    "ncr",
    CoDivideSettings,
    build=_co_divide,
    help="NCR's co-divide: two networks, each epoch a GMM on each one's per-pair losses splits the pairs, "
    "each network trains on its peer's split (loss.name=ncr)",
    facts={"members": 2},
)
