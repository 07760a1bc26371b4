"""The co-divide split of noisy-correspondence training (NCR, and IN2R on top of it), as pure functions.

Each epoch, every training pair gets a per-sample hinge loss (`split_losses`: batches of the split pass, so the
loss of a pair depends on which negatives shared its batch, as in the releases), the losses are min-max
normalised over the whole set (`min_max`), a two-component 1-D Gaussian mixture is fitted to them
(`fit_gmm`, EM written out in float64 as scikit-learn's `GaussianMixture(n_components=2, max_iter=10,
tol=1e-2, reg_covar=5e-4)` computes it) and the clean probability of a pair is its responsibility under the
low-loss component; `split_clean` thresholds it, with the releases' fallback when every pair passes.

The EM starts from given labels (`init_labels`); the releases draw them with scikit-learn's k-means and the
*global* numpy RNG, which no seed of ours controls, so `kmeans_labels` is our own seeded 1-D k-means: with the
recorded labels the fit reproduces the releases' probabilities, with ours a run is reproducible. vsekit does
not depend on scikit-learn.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from vsekit.utils.progress import progress_bar

log = logging.getLogger(__name__)

GMM_MAX_ITER = 10  # the releases' GaussianMixture settings (NCR, IN2R)
GMM_TOL = 1e-2
GMM_REG_COVAR = 5e-4
P_THRESHOLD = 0.5  # NCR/IN2R --p_threshold
NORM_EPS = 1e-8  # l2norm: x / (sqrt(sum x^2) + eps), the releases' form


def l2norm(x: torch.Tensor, eps: float = NORM_EPS) -> torch.Tensor:
    """Rows of `x` divided by their norm plus `eps` (the releases' l2norm; the epsilon is outside the root)."""
    return x / (x.pow(2).sum(dim=-1, keepdim=True).sqrt() + eps)


def centred_l2norm(raw: torch.Tensor) -> torch.Tensor:
    """IN2R's `forward_emb`: subtract the batch mean, then l2-normalise each row (train, split pass, eval)."""
    return l2norm(raw - raw.mean(0, keepdim=True))


def hinge_costs(sims: torch.Tensor, margin) -> tuple[torch.Tensor, torch.Tensor]:
    """(cost_s, cost_im) of a square `[images, captions]` batch: `max(0, m + S[i,j] - S[i,i])` and
    `max(0, m + S[i,j] - S[j,j])`, diagonals 0; `margin` a number or a tensor broadcast against `sims`."""
    n = sims.shape[0]
    diag = sims.diagonal()
    eye = torch.eye(n, dtype=torch.bool, device=sims.device)
    cost_s = (margin + sims - diag.view(n, 1)).clamp(min=0).masked_fill(eye, 0)
    cost_im = (margin + sims - diag.view(1, n)).clamp(min=0).masked_fill(eye, 0)
    return cost_s, cost_im


def hardest_hinge(sims: torch.Tensor, margin) -> torch.Tensor:
    """VSE++ as the releases compute it: row maxima of cost_s plus column maxima of cost_im, through
    `max(...)[0]`, which sends a tied maximum's gradient to one entry (`vsekit.losses.triplet` uses `amax`, which
    splits it: the same value, another gradient when two negatives tie)."""
    cost_s, cost_im = hinge_costs(sims, margin)
    return cost_s.max(1)[0].sum() + cost_im.max(0)[0].sum()


def pair_losses(sims: torch.Tensor, margin: float) -> torch.Tensor:
    """Per-pair loss of a batch: row mean of cost_s + column mean of cost_im (the zero diagonal counts in both
    means), the releases' `ContrastiveLoss(mode='eval_loss')`."""
    cost_s, cost_im = hinge_costs(sims, margin)
    return cost_s.mean(1) + cost_im.mean(0)


def split_losses(
    img: torch.Tensor,
    cap: torch.Tensor,
    cap2img: np.ndarray,
    order: np.ndarray,
    batch_size: int,
    margin: float,
    centre: bool = False,
    score: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    progress: bool = False,
) -> np.ndarray:
    """Per-caption loss (float32, indexed by caption) of the split pass: captions visited in `order`, in
    consecutive batches of `batch_size` (the last shorter), each scored against the images `cap2img` pairs
    them with. `img`/`cap` are normalised embeddings, or with `centre` raw outputs that each batch centres
    and normalises (IN2R). `score(images, captions)`: the batch's `[b, b]` similarities (default: the inner
    product; a run's own similarity in the trainer's split pass and the audit)."""
    order = np.asarray(order, dtype=np.int64)
    cap2img = np.asarray(cap2img, dtype=np.int64)
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    out = np.zeros(len(cap2img), dtype=np.float32)
    starts = range(0, len(order), batch_size)
    with torch.no_grad():
        for start in progress_bar(starts, desc="split pass", enabled=progress, leave=False):
            ids = order[start : start + batch_size]
            im = img[torch.as_tensor(cap2img[ids])]
            ca = cap[torch.as_tensor(ids)]
            if centre:
                im, ca = centred_l2norm(im), centred_l2norm(ca)
            sims = im @ ca.T if score is None else torch.as_tensor(score(im, ca))
            out[ids] = pair_losses(sims.float(), margin).cpu().numpy()
    return out


def min_max(losses: np.ndarray) -> np.ndarray:
    """`(l - min) / (max - min)` in the losses' own dtype (float32 in the releases); all equal -> zeros."""
    losses = np.asarray(losses)
    low, high = losses.min(), losses.max()
    span = high - low
    if span == 0:
        return np.zeros_like(losses)
    return (losses - low) / span


@dataclass
class GMMFit:
    """A fitted two-component 1-D mixture; `resp` holds each sample's responsibilities `[n, 2]` (float64)."""

    means: np.ndarray  # [2]
    variances: np.ndarray  # [2]
    weights: np.ndarray  # [2]
    n_iter: int
    converged: bool
    lower_bound: float
    resp: np.ndarray

    @property
    def clean_prob(self) -> np.ndarray:
        """Responsibility of the low-loss (lower-mean) component: the probability a pair is clean."""
        return self.resp[:, int(np.argmin(self.means))]


def _m_step(x: np.ndarray, resp: np.ndarray, reg_covar: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(counts, means, variances) as scikit-learn's `_estimate_gaussian_parameters` (full covariance, 1-D)."""
    nk = resp.sum(axis=0) + 10 * np.finfo(resp.dtype).eps
    means = (resp * x[:, None]).sum(axis=0) / nk
    diff = x[:, None] - means[None, :]
    variances = (resp * diff * diff).sum(axis=0) / nk + reg_covar
    return nk, means, variances


def _e_step(
    x: np.ndarray, means: np.ndarray, variances: np.ndarray, weights: np.ndarray
) -> tuple[float, np.ndarray]:
    """(mean log-likelihood, responsibilities) as scikit-learn's E-step, through the Cholesky precision."""
    prec_chol = 1.0 / np.sqrt(variances)
    y = (x[:, None] - means[None, :]) * prec_chol[None, :]
    log_prob = -0.5 * (math.log(2 * math.pi) + y * y) + np.log(prec_chol)[None, :]
    weighted = log_prob + np.log(weights)[None, :]
    top = weighted.max(axis=1, keepdims=True)
    norm = top[:, 0] + np.log(np.exp(weighted - top).sum(axis=1))
    return float(norm.mean()), np.exp(weighted - norm[:, None])


def fit_gmm(
    values: np.ndarray,
    init_labels: np.ndarray,
    max_iter: int = GMM_MAX_ITER,
    tol: float = GMM_TOL,
    reg_covar: float = GMM_REG_COVAR,
) -> GMMFit:
    """EM for a two-component 1-D Gaussian mixture started from hard labels (0/1 per sample): initial weights
    = counts / n; each iteration an E-step then an M-step (weights renormalised), stopping when the mean
    log-likelihood changes by less than `tol`; a final E-step gives the responsibilities."""
    x = np.asarray(values, dtype=np.float64).reshape(-1)
    labels = np.asarray(init_labels).reshape(-1)
    if len(labels) != len(x):
        raise ValueError(f"init_labels has {len(labels)} entries for {len(x)} values")
    if not np.isin(labels, (0, 1)).all():
        raise ValueError("init_labels must hold 0 or 1 for each value")
    resp = np.zeros((len(x), 2), dtype=np.float64)
    resp[np.arange(len(x)), labels.astype(np.int64)] = 1.0
    nk, means, variances = _m_step(x, resp, reg_covar)
    weights = nk / len(x)
    lower_bound, converged, n_iter = -np.inf, False, 0
    while n_iter < max_iter:
        n_iter += 1
        previous = lower_bound
        lower_bound, resp = _e_step(x, means, variances, weights)
        nk, means, variances = _m_step(x, resp, reg_covar)
        weights = nk / nk.sum()
        if abs(lower_bound - previous) < tol:
            converged = True
            break
    if not converged:
        log.info("GMM did not converge in %d iterations (tol %g)", max_iter, tol)
    _, resp = _e_step(x, means, variances, weights)
    return GMMFit(means, variances, weights, n_iter, converged, float(lower_bound), resp)


def kmeans_labels(values: np.ndarray, seed: int, max_iter: int = 300) -> np.ndarray:
    """Seeded 2-means labels of 1-D values (k-means++ start, Lloyd iterations), the start `fit_gmm` needs:
    our own, so a split is reproducible from the run's seed (the releases use the unseeded global RNG)."""
    x = np.asarray(values, dtype=np.float64).reshape(-1)
    rng = np.random.RandomState(seed)
    first = x[rng.randint(len(x))]
    d2 = (x - first) ** 2
    second = x[rng.choice(len(x), p=d2 / d2.sum())] if d2.sum() > 0 else first
    centres = np.array([first, second])
    labels = np.full(len(x), -1, dtype=np.int64)
    for _ in range(max_iter):
        new = np.argmin(np.abs(x[:, None] - centres[None, :]), axis=1)
        if (new == labels).all():
            break
        labels = new
        for k in (0, 1):
            if (labels == k).any():
                centres[k] = x[labels == k].mean()
    return labels


def clean_probability(losses: np.ndarray, seed: int) -> tuple[np.ndarray, GMMFit | None]:
    """(clean probability per pair, the fit) from per-pair losses: min-max, the GMM from seeded k-means labels,
    the low-loss posterior. Losses all equal: every pair 1 and no fit (nothing singles one out)."""
    norm = min_max(losses)
    if len(norm) < 2 or float(norm.max()) == 0.0:
        return np.ones(len(norm), dtype=np.float64), None
    fit = fit_gmm(norm, kmeans_labels(norm, seed))
    return fit.clean_prob, fit


def split_clean(prob: np.ndarray, p_threshold: float = P_THRESHOLD) -> tuple[np.ndarray, float]:
    """(pred, threshold): `pred = prob > threshold`; when every probability exceeds `p_threshold` the
    threshold becomes `sort(prob)[len(prob) // 100]`, so about 1 % still goes to the unlabeled side."""
    prob = np.asarray(prob)
    threshold = float(p_threshold)
    if prob.min() > threshold:
        threshold = float(np.sort(prob)[len(prob) // 100])
    return prob > threshold, threshold
