"""The losses a recipe names (`loss.name`): each one's settings and builder, registered in `vsekit.registry`,
and the settings every loss takes (the all-negatives warm-up, AVSE's view regulariser, which `create_loss` wraps
around the named loss). Torch-free (the builders import their module when called)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from vsekit.config import ConfigError
from vsekit.registry import MAX_COUNT, Settings, register, register_shared, setting

# keys several losses read, each declared once


@dataclass
class MarginSettings(Settings):
    margin: float = setting(
        0.2, "the margin of the ranking hinge (adopt: its reference variant only)", rule=">= 0 and finite"
    )


@dataclass
class _Hardest(Settings):
    max_violation: bool = setting(
        True, "the hardest negative (VSE++) after the warm-up; false = the sum over all negatives (VSE0)"
    )


@dataclass
class _Negatives(Settings):
    mask_same_image: bool = setting(True, "captions of the same image are never negatives")


@dataclass
class _Temperature(Settings):
    temperature: float = setting(0.05, "softmax temperature", rule="a positive finite number")


@dataclass
class TripletSettings(_Negatives, _Hardest, MarginSettings):
    pass


@dataclass
class WarmupSettings(Settings):
    warmup_epochs: int = setting(
        1,
        "epochs that use the sum over all negatives (VSE0) before the hardest one (the "
        "trainer's warm-up flag; a loss without a warm-up form ignores it)",
        rule=">= 0",
    )


@dataclass
class InfoNCESettings(_Temperature, _Negatives):
    pass


@dataclass
class ADOPTSettings(MarginSettings, InfoNCESettings):
    adopt_variant: str = setting(
        "reference",
        "reference (the released K rule, whose K falls during training "
        "as in the paper's Fig. C-2) | paper (the printed Eq. 6, whose K stays "
        "near |B|); docs/vse_2ad.md",
        choices=("paper", "reference"),
    )
    adopt_scale: float = setting(
        1.25,
        "the exponent in K = cos(t^scale) x |B| (t: alignment + uniformity)",
        rule="a positive finite number",
    )
    adopt_zero_fill_negatives: bool = setting(
        False,
        "adopt reference only: pick negatives as the released code does "
        "(non-negatives set to 0 first, so the positive itself can be "
        "picked when few similarities are above 0); imported VSE+2AD runs "
        "set it",
    )

    def check(self, where: str, recipe: Any) -> None:
        if self.adopt_zero_fill_negatives and self.adopt_variant != "reference":
            raise ConfigError(
                f"{where}.adopt_zero_fill_negatives=true reproduces the released code: it needs "
                f"{where}.adopt_variant=reference"
            )


@dataclass
class ViewRegSettings(Settings):
    view_reg_weight: float = setting(
        0.0,
        "AVSE: weight of the dimension-wise view regulariser added to the named "
        "loss (0 = off; needs model.image.views >= 2)",
        rule=">= 0 and finite",
    )
    view_reg_offdiag: float = setting(
        0.0051, "AVSE: lambda_1, the weight of the regulariser's off-diagonal terms", rule=">= 0 and finite"
    )
    view_reg_variant: str = setting(
        "reference",
        "AVSE: reference (the released code's c = A^T B / B; at weight 1 its "
        "gradient is comparable to the ranking loss's) | paper (Eq. 3 cosine "
        "without /B: ~B x larger, it dominates the ranking loss); "
        "docs/avse.md",
        choices=("paper", "reference"),
    )

    def check(self, where: str, recipe: Any) -> None:
        if self.view_reg_weight > 0 and recipe.model.image.views < 2:
            raise ConfigError(
                f"{where}.view_reg_weight > 0 (the view regulariser) needs model.image.views >= 2"
            )


@dataclass
class LadderSettings(_Negatives, _Hardest):
    ladder_thresholds: list[float] = setting(
        [0.40],
        "relevance thresholds θ of the levels (0.40 for "
        "Sentence-BERT relevance, TMM paper Sec. IV-A; 0.63 was the AAAI "
        "CBoW+BERT value)",
        rule="a finite number",
    )
    ladder_margins: list[float] = setting([0.2, 0.01], "the margin of each level", rule=">= 0 and finite")
    ladder_weights: list[float] = setting(
        [1.0, 0.25], "the weight of each level's term", rule=">= 0 and finite"
    )
    ladder_cumulative: bool = setting(
        False,
        "a level-l candidate is pushed from the positive by the summed "
        "margins α_1 + … + α_l (the paper's text, the reference `cumulative`)",
    )
    ladder_levels_min: int = setting(2, "fewest levels the per-query k-means may choose", max=MAX_COUNT)
    ladder_levels_max: int = setting(4, "most levels the per-query k-means may choose", max=MAX_COUNT)
    ladder_variant: str = setting(
        "paper",
        "paper | reference (the released code's hard-contrastive sets: losses/ladder.py, docs/coherent.md)",
        choices=("paper", "reference"),
    )
    ladder_percentile: float | None = setting(
        None,
        "auto-threshold ladder (the released config.atl.py, e.g. 85): "
        "each query's one threshold is this percentile of its relevance "
        "row; replaces ladder_thresholds (2 levels); null = fixed "
        "thresholds",
    )
    ladder_threshold_share: float | None = setting(
        None,
        "θ_1 from the data instead of ladder_thresholds: the value "
        "that this share of the train split's different-image "
        "caption pairs reach, computed by the trainer from the "
        "relevance embeddings (recipe cvsepp: 0.15); null = "
        "ladder_thresholds; unused by ladder_auto and with "
        "ladder_percentile",
    )


@dataclass
class RCLSettings(_Temperature, _Negatives):
    rcl_method: str = setting(
        "log",
        "RCL's complementary cost of a negative's probability x: log -log(1-x) (the release's "
        "train_f30k.sh/train_coco.sh) | tan | abs | exp | gce | infoNCE (plain InfoNCE, for comparison)",
        choices=("log", "tan", "abs", "exp", "gce", "infoNCE"),
    )
    rcl_q: float = setting(
        0.2,
        "gce's q (the release passes --margin, 0.2, as q)",
        rule="a positive finite number",
    )
    rcl_negative_ratio: float = setting(
        -1.0,
        "share of each row's negatives drawn per step (in (0, 1)); any other value: every negative (the "
        "release's default -1)",
        rule="a finite number",
    )


def _triplet(cfg: Any) -> Any:
    from vsekit.losses.triplet import TripletLoss

    return TripletLoss(cfg.margin, cfg.max_violation, cfg.mask_same_image)


def _adopt(cfg: Any) -> Any:
    from vsekit.losses.adopt import create_adopt_loss

    return create_adopt_loss(cfg)


def _infonce(cfg: Any) -> Any:
    from vsekit.losses.adopt import create_adopt_loss

    return create_adopt_loss(cfg, adaptive=False)


def _rcl(cfg: Any) -> Any:
    from vsekit.losses.noisy_rcl import RCLLoss

    return RCLLoss(cfg.temperature, cfg.rcl_method, cfg.rcl_q, cfg.rcl_negative_ratio, cfg.mask_same_image)


def _ladder(cfg: Any) -> Any:
    from vsekit.losses.ladder import create_ladder_loss

    return create_ladder_loss(cfg)


def _ladder_auto(cfg: Any) -> Any:
    from vsekit.losses.ladder import create_ladder_loss

    return create_ladder_loss(cfg, adaptive=True)


# Each loss's value on a batch whose similarities are all equal (the collapse alarm, vsekit.training.collapse,
# whose docstring derives them): `negatives` [B] holds each query's in-batch negatives n_i, on the loss's device;
# `k` is the K ADOPT used in the step (on the same device when a tensor). Tensor methods only: torch-free here.
def _triplet_equal_score(cfg: Any, negatives: Any, hardest: bool, k: Any = None) -> tuple[str, Any]:
    n = negatives
    if cfg.max_violation and hardest:  # each query with a negative pays m in each direction
        return "hardest-negative triplet", 2 * cfg.margin * (n > 0).sum().to(n.dtype)
    return "triplet over all negatives", 2 * cfg.margin * n.sum()  # m per negative pair and direction


def _infonce_equal_score(cfg: Any, negatives: Any, hardest: bool, k: Any = None) -> tuple[str, Any]:
    return "InfoNCE", 2 * negatives.log1p().mean()  # log(1 + n_i) per query and direction


def _adopt_equal_score(cfg: Any, negatives: Any, hardest: bool, k: Any = None) -> tuple[str, Any]:
    if k is None:
        raise ValueError("the ADOPT collapse value needs the K of the step (the loss's K_i2t)")
    n = negatives
    kept = n.minimum(k.to(n.dtype)) if hasattr(k, "to") else n.clamp(max=float(k))
    if cfg.adopt_variant == "reference":
        return "ADOPT", (kept * math.exp(cfg.margin / cfg.temperature)).log1p().mean()
    return "ADOPT", 2 * kept.log1p().mean()


def _rcl_equal_score(cfg: Any, negatives: Any, hardest: bool, k: Any = None) -> tuple[str, Any]:
    # every probability is 1/B in both directions: each query pays n_i times the cost of 1/B, or log B
    b = negatives.numel()
    if cfg.rcl_method == "infoNCE":
        return "RCL (InfoNCE)", negatives.new_tensor(2 * math.log(b))
    x = 1.0 / b
    cost = {
        "log": -math.log(1 - x),
        "tan": math.tan(x),
        "abs": x,
        "exp": math.exp(x - 1),
        "gce": (1 - (1 - x) ** cfg.rcl_q) / cfg.rcl_q,
    }[cfg.rcl_method]
    kept = negatives
    if 0 < cfg.rcl_negative_ratio < 1:  # int(ratio B) drawn per row (the query's own captions then left out)
        kept = kept.clamp(max=int(cfg.rcl_negative_ratio * b))
    return f"RCL ({cfg.rcl_method})", 2 * cost * kept.mean()


def _adopt_graph_blockers(cfg: Any) -> list[str]:
    if cfg.adopt_zero_fill_negatives:
        return [
            "loss.adopt_zero_fill_negatives=true (the released selection reads K back to the host every step)"
        ]
    return []


register(
    "loss",
    "triplet",
    TripletSettings,
    build=_triplet,
    help="VSE++'s hinge triplet loss, both directions, on the hardest negative or the sum over all",
    facts={"cuda_graph": True, "equal_score": _triplet_equal_score},
)
register_shared("loss", WarmupSettings, help="the trainer's all-negatives warm-up")
register(
    "loss",
    "adopt",
    ADOPTSettings,
    build=_adopt,
    help="VSE+2AD's ADOPT: InfoNCE over the K hardest in-batch negatives, K from alignment and uniformity",
    facts={
        "cuda_graph": True,
        "cuda_graph_blockers": _adopt_graph_blockers,
        "equal_score": _adopt_equal_score,
    },
)
register(
    "loss",
    "infonce",
    InfoNCESettings,
    build=_infonce,
    help="symmetric InfoNCE over every in-batch negative",
    facts={"cuda_graph": True, "equal_score": _infonce_equal_score},
)
register_shared(
    "loss", ViewRegSettings, help="AVSE's view regulariser, added to any loss when its weight is > 0"
)
register(
    "loss",
    "rcl",
    RCLSettings,
    build=_rcl,
    help="RCL's complementary contrastive loss: the probability of every negative pushed down, robust to "
    "mismatched pairs",
    facts={"cuda_graph": True, "equal_score": _rcl_equal_score},
)
register(
    "loss",
    "ladder",
    LadderSettings,
    build=_ladder,
    help="CVSE++'s ladder loss: levels of relevance (fixed thresholds, or per-query percentile ones)",
)
register(
    "loss",
    "ladder_auto",
    LadderSettings,
    build=_ladder_auto,
    help="CVSE++ (Auto)'s adaptive ladder loss: per-query levels by 1-D k-means and the silhouette",
)
