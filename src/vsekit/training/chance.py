"""The chance alarm (`train.chance_validations`): a run whose validation ranks no better than random scores is
named, once, with the known causes, instead of training on to a model that retrieves nothing.

The collapse alarm (vsekit.training.collapse) sees the loss sitting exactly at its all-scores-equal value. A run
can also end near chance without that: scores that differ only by noise put the loss a little above that
value (CHAN with the release's hinge margin 0.05 on its unrescaled log-sum-exp scores, trained from scratch,
ends 20-25 % above it with dev recalls at chance; docs/chan.md). What such runs share is what the user sees:
dev rsum no better than a matrix of random scores would give. `vsekit.metrics.chance_rsum` gives that level
on the dev split's own caption->image map (its expectation and a bound on its std); a validation counts as at
chance when its rsum is below the expectation + `SIGMAS` std, and `train.chance_validations` consecutive ones
raise the warning. On a dev split too small to tell a model from chance (that level at or above the highest
rsum, 600) the alarm is off.
"""

from __future__ import annotations

import numpy as np

from vsekit.metrics import chance_rsum

SIGMAS = 3.0
MAX_RSUM = 600.0  # six recalls of 100 %

CAUSES = (
    "a hinge margin far below the scale of the scores (scores that are not cosines, e.g. a log-sum-exp late "
    "interaction, satisfy a small margin by being equal: --set loss.margin=...); a learning rate too high or "
    "too low (--set optim.lr=...); a training set too small for the recipe (compare the bag-of-words floor, "
    "--recipe bow)"
)


class ChanceAlarm:
    """Counts consecutive validations at chance; `update` returns the warning once, when they reach `patience`."""

    def __init__(self, cap2img: np.ndarray, n_images: int, patience: int) -> None:
        if patience < 1:
            raise ValueError(f"patience must be >= 1, got {patience}")
        self.mean, self.std = chance_rsum(cap2img, n_images)
        self.limit = self.mean + SIGMAS * self.std
        self.patience = patience
        self.enabled = self.limit < MAX_RSUM
        self.streak = 0
        self.reported = False

    def update(self, epoch: int, rsum: float) -> str | None:
        """One validation (epoch counted from 1): the warning when this one completes the streak, else None."""
        if not self.enabled or self.reported:
            return None
        self.streak = self.streak + 1 if rsum < self.limit else 0
        if self.streak < self.patience:
            return None
        self.reported = True
        which = "" if self.patience == 1 else f" and the {self.patience - 1} validation(s) before it"
        return (
            f"dev retrieval is no better than chance at epoch {epoch}{which}: rsum {rsum:.1f}, where random "
            f"scores give {self.mean:.1f} ± {self.std:.1f} on this split (at chance: below {self.limit:.1f}). "
            f"The model has not learned to rank. Known causes: {CAUSES}"
        )
