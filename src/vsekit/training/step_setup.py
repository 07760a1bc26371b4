"""How the training step will run, and every setting it cannot run with, refused in one place.

`check_step_setup` is called once, before anything is read or written (the trainer calls it first thing;
a `TrainStep` built on its own calls it when it is not given the result). It checks the recipe as a whole
first (`config.validate_recipe`: its own contradictions, such as train.grad_cache_chunk with train.compile,
also for a recipe changed after it was read), then gathers what each way of running the step says it cannot
do here — gradient caching (`grad_cache.grad_cache_blockers`), CUDA graphs (`cuda_graph.cuda_graph_blockers`)
— and raises one `ConfigError` naming them all. A new refusal is one entry in the list of the part it concerns.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from vsekit.config import ConfigError, Recipe, validate_recipe
from vsekit.distributed import DistContext
from vsekit.models.pair import members_of
from vsekit.registry import has_fact
from vsekit.similarity.parts import scores_sets
from vsekit.training.cuda_graph import cuda_graph_blockers
from vsekit.training.grad_cache import GradCacheError, grad_cache_blockers

logger = logging.getLogger(__name__)

GRAPH_MODES = ("cuda", "eager")


@dataclass(frozen=True)
class StepSetup:
    """The checked way of running the step: `graph` "cuda" (train.cuda_graph), "eager" (the graph machinery
    with the capture replaced by eager execution: CPU tests) or None; `grad_cache_chunk` (0: off)."""

    graph: str | None = None
    grad_cache_chunk: int = 0


def check_step_setup(
    recipe: Recipe, device: torch.device, dist: DistContext | None = None, graph: str | None = None
) -> StepSetup:
    """The step's setup for `recipe` on `device` (and `dist`), or a `ConfigError` naming every setting that
    keeps it from running (a `GradCacheError` when gradient caching is among them). `graph` overrides
    train.cuda_graph: "cuda", or "eager" (not refused on a CPU: nothing is captured)."""
    if graph not in (None, *GRAPH_MODES):
        raise ValueError(f"graph must be one of {', '.join(GRAPH_MODES)} or None, got {graph!r}")
    mode = graph if graph is not None else ("cuda" if recipe.train.cuda_graph else None)
    validate_recipe(recipe)
    cache = grad_cache_blockers(recipe, dist)
    problems = list(cache) + co_teaching_blockers(recipe, dist)
    if dist is not None and dist.enabled and scores_sets(recipe.model.similarity.name):
        problems.append(
            f"model.similarity.name={recipe.model.similarity.name} scores sets of vectors, which the "
            "all-gather of global negatives under torchrun does not carry (their widths differ by "
            "rank); train it in one process"
        )
    if mode == "cuda" and (blockers := cuda_graph_blockers(recipe, device, dist)):
        problems.append(
            "train.cuda_graph=true cannot capture this run's step: "
            + "; ".join(blockers)
            + ". Set train.cuda_graph=false"
        )
    if problems:
        raise (GradCacheError if cache else ConfigError)("; also ".join(problems))
    setup = StepSetup(graph=mode, grad_cache_chunk=recipe.train.grad_cache_chunk)
    logger.debug("training step: %s", setup)
    return setup


def co_teaching_blockers(recipe: Recipe, dist: DistContext | None) -> list[str]:
    """Why a two-network recipe cannot train here (empty: it can, or it is not a two-network recipe)."""
    if members_of(recipe) != 2:
        return []
    policy, out = recipe.train.sample_policy.name, []
    if dist is not None and dist.enabled:
        out.append(f"train.sample_policy.name={policy} trains two networks in turn: run it in one process")
    if recipe.train.grad_cache_chunk > 0:
        out.append(
            f"train.grad_cache_chunk with train.sample_policy.name={policy} (its steps take per-batch targets)"
        )
    if recipe.train.cuda_graph:
        out.append(
            f"train.cuda_graph with train.sample_policy.name={policy} (its steps take per-batch targets)"
        )
    loss = recipe.loss.name
    if not (has_fact("loss", loss, "takes_targets") or has_fact("loss", loss, "peer_queues")):
        out.append(
            f"train.sample_policy.name={policy} hands the loss co-rectified targets, which "
            f"loss.name={loss} does not read (a loss with the fact takes_targets: ncr; or one trained "
            "through peer queues, peer_queues: in2r)"
        )
    return out
