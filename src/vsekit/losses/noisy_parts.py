"""The noisy-correspondence parts a recipe names, torch-free: RCL's loss is in `vsekit.losses.parts`; here
NCR's loss (`loss.name: ncr`) and its co-divide (`train.sample_policy.name: ncr`, two networks), and IN2R's
terms (`loss.name: in2r`: on the same co-divide, each network trained through its peer's memory queue)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vsekit.config import ConfigError
from vsekit.losses.parts import MarginSettings
from vsekit.registry import MAX_BATCH, MAX_COUNT, MAX_WIDTH, Settings, fact, register, setting


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


@dataclass
class IN2RLossSettings(MarginSettings):
    in2r_embed_dim: int | None = setting(
        None,
        "in2r: width of its queues and refiners, the joint space's; null (the default): model.embed_dim, which a "
        "value given here must equal",
        rule=">= 1",
        max=MAX_WIDTH,
    )
    in2r_queue_size: int = setting(
        65536,
        "in2r: rows of each network's memory queue of confidently clean pairs (the release's --queue_size)",
        rule=">= 1",
        max=MAX_BATCH,
    )
    in2r_neighbours: int = setting(
        5,
        "in2r: queue rows a refiner reads per unlabeled sample (--k; the release's argparse default 1)",
        rule=">= 1",
        max=MAX_COUNT,
    )
    in2r_directions: str = setting(
        "both",
        "in2r: the unlabeled terms: both (--i2t --t2i) | i2t | t2i",
        choices=("both", "i2t", "t2i"),
    )
    in2r_unlabeled_weight: float = setting(
        0.5,
        "in2r: weight of each unlabeled InfoNCE term (the release's correction_weight)",
        rule=">= 0 and finite",
    )
    in2r_intra_margin: float = setting(
        0.3,
        "in2r: margin of the hinges between a batch's two passes (image-image, caption-caption)",
        rule=">= 0 and finite",
    )
    in2r_tau: float = setting(0.05, "in2r: temperature of its InfoNCE terms", rule="a positive finite number")
    in2r_refiner_dropout: float = setting(
        0.1, "in2r: dropout of the refiners' attention output in training", rule="in [0, 1)"
    )

    def check(self, where: str, recipe: Any) -> None:
        policy = recipe.train.sample_policy.name
        if fact("sample_policy", policy, "members", 1) != 2:
            raise ConfigError(
                f"{where}.name=in2r trains two networks through each other's memory queues: it needs a "
                f"two-network sample policy (train.sample_policy.name=ncr), got train.sample_policy.name={policy}"
            )
        width = recipe.model.embed_dim if self.in2r_embed_dim is None else self.in2r_embed_dim
        if width != recipe.model.embed_dim:
            raise ConfigError(
                f"{where}.in2r_embed_dim={self.in2r_embed_dim} must equal model.embed_dim={recipe.model.embed_dim} "
                "(or be left out: null takes model.embed_dim)"
            )
        if recipe.model.embed_dim % REFINER_HEADS:
            raise ConfigError(
                f"{where}.name=in2r: its refiners split model.embed_dim={recipe.model.embed_dim} into "
                f"{REFINER_HEADS} attention heads; choose a multiple of {REFINER_HEADS}"
            )


REFINER_HEADS = 4


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


def _in2r_loss(cfg: Any) -> Any:
    from vsekit.losses.in2r import IN2RLoss

    return IN2RLoss(
        cfg.margin,
        cfg.in2r_embed_dim,
        cfg.in2r_queue_size,
        cfg.in2r_neighbours,
        cfg.in2r_directions,
        cfg.in2r_unlabeled_weight,
        cfg.in2r_intra_margin,
        cfg.in2r_tau,
        cfg.in2r_refiner_dropout,
        REFINER_HEADS,
    )


register(
    "loss",
    "in2r",
    IN2RLossSettings,
    build=_in2r_loss,
    help="IN2R's terms: the hinge and the two passes' intra-modal hinges on labeled pairs, InfoNCE to "
    "partners rebuilt from the peer's memory queue on unlabeled ones, InfoNCE warm-up over two passes; with "
    "train.sample_policy.name=ncr",
    facts={"model_width_keys": ("in2r_embed_dim",), "peer_queues": True},
)
