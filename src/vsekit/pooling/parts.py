"""The poolings a recipe names (`model.image.pooling.name`, `model.text.pooling.name`): each one's settings and
builder, registered in `vsekit.registry`. Torch-free (the builders import their module when called), so listing
and validating recipes stays light.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vsekit.config import ConfigError
from vsekit.registry import MAX_WIDTH, Settings, register, setting


@dataclass
class KMaxSettings(Settings):
    k: int = setting(1, "number of largest values averaged per dimension", rule=">= 1", max=MAX_WIDTH)


@dataclass
class GPOSettings(Settings):
    d_pe: int = setting(32, "size of the sin/cos positional encoding of the ranks (even)", max=MAX_WIDTH)
    d_hidden: int = setting(32, "size of the BiGRU over the positional encodings", max=MAX_WIDTH)
    temperature: float = setting(
        0.1, "softmax temperature of the weights over the ranks", rule="a positive finite number"
    )

    def check(self, where: str, recipe: Any) -> None:
        if self.d_pe < 2 or self.d_pe % 2 or self.d_hidden < 1:
            raise ConfigError(
                f"{where}: gpo needs an even d_pe >= 2 (got {self.d_pe}), d_hidden >= 1 (got "
                f"{self.d_hidden}) and a positive temperature (got {self.temperature})"
            )


@dataclass
class ADPoolSettings(Settings):
    token_level: bool = setting(True, "use the token-level branch (a learned weight per rank)")
    embedding_level: bool = setting(
        True, "use the embedding-level branch (a softmax over the set per dimension)"
    )
    adpool_variant: str = setting(
        "reference",
        "reference (the released code behind the paper's Table 1: a "
        "D x D scorer + ReLU, a weight per rank and dimension) | paper (Eq. 3 "
        "as printed: one weight per rank); docs/vse_2ad.md",
        choices=("paper", "reference"),
    )
    adpool_mask_padding: bool = setting(
        True,
        "mask the padded positions; false = the released code's "
        "token-level softmax, which also runs over the batch's padding (its "
        "features are 0, its weights are not), so a set's embedding depends on "
        "how far it is padded",
    )

    def check(self, where: str, recipe: Any) -> None:
        if not (self.token_level or self.embedding_level):
            raise ConfigError(f"{where}: adpool needs token_level or embedding_level (both are false)")


def _avg(cfg: Any, dim: int) -> Any:
    from vsekit.pooling.basic import AvgPool

    return AvgPool()


def _max(cfg: Any, dim: int) -> Any:
    from vsekit.pooling.basic import MaxPool

    return MaxPool()


def _kmax(cfg: Any, dim: int) -> Any:
    from vsekit.pooling.basic import KMaxPool

    return KMaxPool(cfg.k)


def _gpo(cfg: Any, dim: int) -> Any:
    from vsekit.pooling.gpo import GPO

    return GPO(cfg.d_pe, cfg.d_hidden, cfg.temperature)


def _adpool(cfg: Any, dim: int) -> Any:
    from vsekit.pooling.adpool import ADPool

    return ADPool(
        dim,
        token_level=cfg.token_level,
        embedding_level=cfg.embedding_level,
        variant=cfg.adpool_variant,
        mask_padding=cfg.adpool_mask_padding,
    )


def _cls(cfg: Any, dim: int) -> Any:
    from vsekit.pooling.basic import ClsPool

    return ClsPool()


register("pooling", "avg", build=_avg, help="the mean of the set's vectors (padding masked)")
register("pooling", "max", build=_max, help="the largest value of each dimension")
register(
    "pooling", "kmax", KMaxSettings, build=_kmax, help="the mean of the k largest values of each dimension"
)
register(
    "pooling",
    "gpo",
    GPOSettings,
    build=_gpo,
    help="VSE∞'s generalized pooling operator: learned weights over each dimension's sorted values",
)
register(
    "pooling",
    "adpool",
    ADPoolSettings,
    build=_adpool,
    help="VSE+2AD's ADPOOL: a learned mix of a rank-weighted sum and a per-dimension softmax pooling",
)
register("pooling", "cls", build=_cls, help="the first vector of the set (a transformer's [CLS] state)")
