"""NCR's co-divide as the policy object of `train.sample_policy: ncr` (the co-teaching trainer drives it).

Each epoch after the warm-up, each network's per-pair losses of the split pass become its clean
probabilities (`vsekit.losses.noisy_split.clean_probability`: min-max, the two-component GMM from seeded
k-means labels) and its split (`split_clean`, the release's threshold and fallback); a network then trains on
its *peer's* split: the labeled pairs with co-rectified soft margins, the unlabeled ones (from
`unlabeled_start_epoch` on, the release's `num_epochs // 2` by default) with the mean of both networks'
predictions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from vsekit.losses.noisy_split import GMMFit, clean_probability, split_clean

MIN_LABELED = 2  # a batch needs two pairs: with fewer labeled pairs, every pair is labeled


@dataclass
class MemberSplit:
    """One network's split of the training pairs: `prob` (float64, per pair), `labeled` (bool) and what made
    them (`threshold` after the release's fallback, the GMM `fit`, None when every loss was equal)."""

    prob: np.ndarray
    labeled: np.ndarray
    threshold: float
    fit: GMMFit | None

    def summary(self) -> dict[str, Any]:
        """A JSON-able line of the split (what the run's metrics.jsonl records per epoch and network)."""
        out: dict[str, Any] = {
            "labeled": int(self.labeled.sum()),
            "pairs": len(self.labeled),
            "threshold": self.threshold,
            "mean_prob": float(self.prob.mean()),
        }
        if self.fit is not None:
            out.update(
                gmm_means=[float(m) for m in self.fit.means],
                gmm_iterations=self.fit.n_iter,
                gmm_converged=bool(self.fit.converged),
            )
        return out


class CoDivide:
    """`train.sample_policy: ncr`: the split rule and its schedule (module docstring); state-free (every
    epoch's split is computed from that epoch's model and saved by the trainer with its checkpoint)."""

    members = 2

    def __init__(self, cfg: Any) -> None:
        self.p_threshold = float(cfg.p_threshold)
        self.unlabeled_start_epoch = int(cfg.unlabeled_start_epoch)
        self.split_batch_size = int(cfg.split_batch_size)

    def trains_unlabeled(self, epoch: int, epochs: int) -> bool:
        """Whether epoch `epoch` (from 0) trains the unlabeled pairs (release: from `num_epochs // 2` on)."""
        start = epochs // 2 if self.unlabeled_start_epoch < 0 else self.unlabeled_start_epoch
        return epoch >= start

    def divide(self, losses: np.ndarray, seed: int) -> MemberSplit:
        """One network's split from its per-pair losses; `seed` starts the GMM's k-means."""
        prob, fit = clean_probability(losses, seed)
        labeled, threshold = split_clean(prob, self.p_threshold)
        if labeled.sum() < MIN_LABELED:
            labeled = np.ones(len(prob), dtype=bool)
        return MemberSplit(prob, labeled, threshold, fit)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None
