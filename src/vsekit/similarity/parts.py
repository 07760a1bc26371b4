"""The similarities a recipe names (`model.similarity.name`): each one's settings and builder, registered in
`vsekit.registry`. Torch-free (the builders import their module when called)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vsekit.config import ConfigError
from vsekit.registry import MAX_ITERATIONS, MAX_WIDTH, Settings, register, setting


@dataclass
class CosineSettings(Settings):
    def check(self, where: str, recipe: Any) -> None:
        views = recipe.model.image.views
        if views > 1:
            raise ConfigError(f"model.image.views={views} (multi-view) needs model.similarity.name=aeom")


@dataclass
class AEOMSettings(Settings):
    block_dim: int = setting(
        512, "block size d2 (the embedding size is a multiple of it)", rule=">= 1", max=MAX_WIDTH
    )
    sinkhorn_iters: int = setting(20, "dustbin-Sinkhorn iterations c", rule=">= 1", max=MAX_ITERATIONS)
    use_sinkhorn: bool = setting(True, "false = the released code's block max-sum (same as readout: maxsum)")
    dustbin_init: float = setting(1.0, "initial value of the learned dustbin score z", rule="a finite number")
    readout: str = setting(
        "log_plan",
        "how S = sum_j max_i A*_ij reads the Sinkhorn plan: log_plan = the log "
        "plan, as the released code's Sinkhorn line; plan = the plan's probabilities "
        "(Eq. 2 read literally; scores vary ~8x less); maxsum = no Sinkhorn, the block "
        "max-sum of the cosines (the released code's active line); docs/avse.md",
        choices=("log_plan", "plan", "maxsum"),
    )
    temperature: float = setting(
        1.0,
        "entropic temperature: the Sinkhorn runs on A / temperature (the dustbin "
        "score z is in those units); the paper names none and the released code "
        "divides by nothing: 1",
        rule="a positive finite number",
    )

    def check(self, where: str, recipe: Any) -> None:
        if recipe.model.embed_dim % self.block_dim:
            raise ConfigError(f"model.embed_dim must be a multiple of {where}.block_dim")


def scores_sets(similarity: str) -> bool:
    """Whether the similarity `similarity` scores sets of vectors (late interaction, e.g. chan) rather than one
    vector per item: its registered fact `takes_sets`."""
    from vsekit import registry

    return registry.has_fact("similarity", similarity, "takes_sets")


def _cosine(cfg: Any, embed_dim: int, views: int) -> Any:
    from vsekit.similarity.cosine import CosineSimilarity

    if views != 1:
        raise ValueError("multi-view image embeddings need model.similarity.name=aeom")
    return CosineSimilarity()


def _aeom(cfg: Any, embed_dim: int, views: int) -> Any:
    from vsekit.similarity.aeom import AEOMSimilarity

    return AEOMSimilarity(embed_dim, views, cfg)


register(
    "similarity",
    "cosine",
    CosineSettings,
    build=_cosine,
    help="the inner product of the L2-normalised embeddings",
    facts={"inner_product": True},
)
register(
    "similarity",
    "aeom",
    AEOMSettings,
    build=_aeom,
    help="AVSE's asymmetric embedding optimal matching: block-wise dustbin-Sinkhorn matching of a multi-view "
    "image embedding and a caption embedding",
)
