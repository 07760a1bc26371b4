"""Ladder loss and adaptive ladder loss (CVSE++; Wang et al., "Adaptive Ladder Loss for Learning Coherent
Visual-Semantic Embedding", IEEE TMM 2022; reference code cdluminate/ladderloss).

The triplet inequality s(q, T_q) − s(q, T_p) > α becomes a chain over relevance levels (Eq. 5): the
non-positive candidates N^{-q} of a query are split into levels N_1 (most relevant) … N_L, and
  L_lad(q) = β_1 L^1(q) + Σ_{l≥2} β_l L^l(q)                                                 (Eq. 6)
  L^1  = VSE++ hardest-negative triplet with margin α_1 (the same code as `TripletLoss`)
  L^l  = [α_l − min_{i∈N_{l−1}} s(q, i) + max_{j∈N_{l:L}} s(q, j)]_+   (hard contrastive sampling, Eq. 8)
  cumulative variant: L^l = [α_1 + … + α_l − s(q, q) + max_{j∈N_{l:L}} s(q, j)]_+ (a level-l candidate is
  pushed from the positive by the summed margins, as in the paper's text and the reference `cumulative`).
Both directions (image→caption rows, caption→image columns) are summed, like VSE++.

Relevance (Eq. 1): R[i, j] = Sentence-BERT cosine between the batch's captions i and j (the query image i
is represented by the caption it is paired with, as in the reference code); captions of the same image
are totally relevant (level 0, never negatives). R is exactly symmetric, so the levels of caption query j
over images equal row j of the image-query levels; they are computed once for both directions.

Levels:
- fixed (`ladder`): thresholds θ_1 > θ_2 > …: level = 1 + #{l : R < θ_l}. Paper defaults for Sentence-BERT
  relevance: L = 2, θ_1 = 0.40, α = (0.2, 0.01), β = (1, 0.25).
- percentile (`ladder` with `ladder_percentile`; the released code's `AutoThreshLadderLoss`, not in the
  paper): 2 levels, level 1 = relevance at or above the query row's percentile (numpy linear interpolation).
- adaptive (`ladder_auto`, Eq. 9–12): per query row, 1-D k-means of the non-positive relevances for every
  k in [L_min, L_max], k chosen by the largest mean silhouette, level 1 = the highest-centre cluster.
  Batched on the loss's device, no per-row Python loop: 1-D k-means is solved *exactly* by dynamic
  programming over the sorted values (optimal k-means clusters are contiguous intervals), which is the
  solution Lloyd's algorithm (faiss in the reference) reaches when it finds the global optimum, and is
  deterministic without a seed. Paper defaults: (L_min, L_max) = (2, 4), α = (0.2, 0.01, 0.01, 0.01),
  β = (1, 1/4, 1/8, 1/16). k = 1 (allowed when L_min = 1) scores 0, so it wins only when every k ≥ 2 has
  a non-positive mean silhouette; rows with fewer than k + 1 candidates cannot use that k.

`variant="reference"` reproduces the released code where it differs from the paper: the "near" set of
ladder l is every candidate of level < l *including the positive* (so an empty N_{l−1} still yields the
term [α_l − s(q, q) + max …]_+) and its minimum is taken over S·near + 1·(not near); the hardest far
similarity is taken from S·mask and is therefore floored at 0 (and 0 when N_{l:L} is empty), and the
adaptive clustering runs on the whole row including the positive (its cluster mates become level 1).
`reference_ladder_loss` is the same computation as a plain function of (sims, relevance) with the released
code's options, checked number for number against its outputs in tests/test_parity_ladderloss.py.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from vsekit.config import ConfigError, LossConfig
from vsekit.losses.base import InBatchLoss, StepContext, warmup_of
from vsekit.losses.triplet import positive_mask, triplet_loss

VARIANTS = ("paper", "reference")
MAX_LEVELS = 8


# ------------------------------------------------------------------------------ batched 1-D k-means


def _work_dtype(values: torch.Tensor) -> torch.dtype:
    """Float32 in training (plenty for relevances in [-1, 1] after centring); float64 input stays float64."""
    if values.dtype == torch.float64 and values.device.type != "mps":
        return torch.float64
    return torch.float32


def _sorted_valid(values: torch.Tensor, valid: torch.Tensor):
    """Rows sorted ascending, invalid entries moved to the end and zeroed, valid ones centred on the row mean
    (k-means and silhouette are shift invariant; centring keeps the prefix sums well conditioned)."""
    n = values.shape[1]
    big = torch.finfo(values.dtype).max
    xs, order = torch.sort(values.masked_fill(~valid, big), dim=1, stable=True)
    n_valid = valid.sum(1)
    vmask = torch.arange(n, device=values.device)[None] < n_valid[:, None]
    xs = xs.masked_fill(~vmask, 0.0)
    mean = xs.sum(1, keepdim=True) / n_valid.clamp(min=1)[:, None].to(xs.dtype)
    return (xs - mean).masked_fill(~vmask, 0.0), order, n_valid, vmask


class _KMeansDP:
    """Exact 1-D k-means of sorted rows x [Q, N] (the first n_valid entries are data) for k = 1..k_max.

    D_k[b] = min_a D_{k−1}[a − 1] + cost(a, b), with cost(a, b) the within-segment sum of squares of
    x[a..b] from prefix sums, stored as [Q, b, a] so the minimum runs over the contiguous axis. Full
    tables are built only for k < k_max; every k's optimum at the row's last point costs one [Q, N] step.
    """

    CPU_BLOCK = 1 << 19  # elements of one [rows, N, N] block on CPU: cache-sized blocks run ~2x faster

    def __init__(self, x: torch.Tensor, n_valid: torch.Tensor, k_max: int) -> None:
        q, n = x.shape
        self.n = n
        self.end = (n_valid - 1).clamp(min=0)
        rows = max(1, self.CPU_BLOCK // max(n * n, 1)) if x.device.type == "cpu" else q
        if rows >= q:
            self.inertia, self.arg_end, self.arg_full = self._solve(x, self.end, k_max)
            return
        blocks = [self._solve(x[r : r + rows], self.end[r : r + rows], k_max) for r in range(0, q, rows)]
        self.inertia = [torch.cat([b[0][j] for b in blocks]) for j in range(k_max)]
        self.arg_end = {k: torch.cat([b[1][k] for b in blocks]) for k in range(2, k_max + 1)}
        self.arg_full = {k: torch.cat([b[2][k] for b in blocks]) for k in range(2, k_max)}

    @staticmethod
    def _solve(x: torch.Tensor, end: torch.Tensor, k_max: int):
        q, n = x.shape
        pos = torch.arange(n, device=x.device)
        inf = float("inf")
        s1 = F.pad(x.cumsum(1), (1, 0))
        s2 = F.pad((x * x).cumsum(1), (1, 0))
        seg_sum = s1[:, 1:, None] - s1[:, None, :-1]  # [Q, b, a] = sum of x[a..b]
        seg_sq = s2[:, 1:, None] - s2[:, None, :-1]
        inv_len = 1.0 / (pos[:, None] - pos[None, :] + 1).clamp(min=1).to(x.dtype)  # [b, a]
        # a > b is no segment; b >= n_valid needs no mask: no D_k[b] past a row's last point is ever read
        no_segment = torch.zeros(n, n, dtype=x.dtype, device=x.device).masked_fill_(
            pos[:, None] < pos[None, :], inf
        )
        cost = seg_sq.sub_(seg_sum.mul_(seg_sum).mul_(inv_len)).clamp_min_(0).add_(no_segment)
        cost_end = cost.gather(1, end[:, None, None].expand(q, 1, n)).squeeze(1)  # [Q, a]: cost(a, end)
        d = cost[:, :, 0]  # D_1[b]
        inertia = [d.gather(1, end[:, None]).squeeze(1)]
        arg_full: dict[int, torch.Tensor] = {}
        arg_end: dict[int, torch.Tensor] = {}
        for k in range(2, k_max + 1):
            prev = F.pad(d[:, :-1], (1, 0), value=inf)  # prev[a] = D_{k-1}[a - 1]
            d_end, arg_end[k] = (prev + cost_end).min(1)
            inertia.append(d_end)
            if k < k_max:
                d, arg_full[k] = (prev[:, None, :] + cost).min(2)
        return inertia, arg_end, arg_full

    def labels(self, k: int) -> torch.Tensor:
        """Cluster labels 0..k−1 (ascending values) of the sorted positions in the optimal k-partition."""
        return self.labels_many([k])[0]

    def labels_many(self, ks: Sequence[int]) -> torch.Tensor:
        """[len(ks), Q, N] labels of the optimal k-partitions, all k at once (one comparison, few gathers)."""
        q, device = self.end.shape[0], self.end.device
        k_max = max(ks)
        starts = []  # per k: [Q, k_max] first sorted position of each cluster, unused slots past the row
        for k in ks:
            firsts = [self.arg_end[k]] if k > 1 else []
            for kk in range(k - 1, 1, -1):
                firsts.append(self.arg_full[kk].gather(1, (firsts[-1] - 1).clamp(min=0)[:, None]).squeeze(1))
            firsts = [torch.zeros(q, dtype=torch.long, device=device), *firsts[::-1]]
            starts.append(F.pad(torch.stack(firsts, 1), (0, k_max - k), value=self.n))
        seg = torch.stack(starts)  # [K, Q, k_max]
        pos = torch.arange(self.n, device=device)
        return (pos >= seg[..., None]).sum(2) - 1


def _silhouette_sorted(
    x: torch.Tensor, labels: torch.Tensor, vmask: torch.Tensor, n_valid: torch.Tensor, k: int
) -> torch.Tensor:
    """Mean silhouette (Eq. 10–12, |·| distance) per row of sorted x whose clusters are contiguous.

    O(N k), no N x N matrix. Another cluster lies wholly on one side of point i, so i's mean distance to
    it is |x_i − its centre| (b, Eq. 11, is the smallest over non-empty other clusters); the distance sum
    to i's own cluster comes from prefix sums: members below i contribute x_i − x_j, members above
    x_j − x_i (a, Eq. 10). Singletons score 0, as in sklearn. Labels above a row's used clusters may be
    absent (empty clusters are ignored), so one call can score several k at once.
    """
    n = x.shape[1]
    lab = labels.clamp(0, k - 1).masked_fill(~vmask, 0)
    member = (lab[..., None] == torch.arange(k, device=x.device)) & vmask[..., None]  # [Q, N, k] (no one_hot:
    onehot = member.to(x.dtype)  # it checks its input on the host, a device sync per call)
    cnt = onehot.sum(1)  # [Q, k]
    centre = torch.bmm(x[:, None, :], onehot).squeeze(1) / cnt.clamp(min=1)
    own_cnt = cnt.gather(1, lab) * vmask  # [Q, N]
    bounds = (cnt.cumsum(1) - cnt).gather(1, lab).long()  # first sorted position of i's cluster
    s1 = F.pad(x.cumsum(1), (1, 0))  # s1[j] = x_0 + … + x_{j−1}
    ends = s1.gather(
        1, torch.cat([bounds, bounds + own_cnt.long()], 1)
    )  # s1 at the cluster's first, one past last
    two_i = 2 * torch.arange(n, device=x.device, dtype=x.dtype) + 1
    # Σ_{j in own cluster} |x_i − x_j| = x_i (2i + 1 − first − end) − (s1[i] + s1[i + 1]) + s1[first] + s1[end]
    dist_own = x * (two_i - bounds - bounds - own_cnt) - (s1[:, :n] + s1[:, 1:]) + ends[:, :n] + ends[:, n:]
    a = dist_own / (own_cnt - 1).clamp(min=1)
    b = (
        (x[..., None] - centre[:, None, :])
        .abs()
        .masked_fill(member | (cnt[:, None, :] == 0), float("inf"))
        .amin(-1)
    )
    # NaN (no other cluster: inf/inf; a = b = 0: 0/0) and singletons score 0
    sil = ((b - a) / torch.maximum(a, b)).nan_to_num_(0.0, 0.0, 0.0).masked_fill_(own_cnt < 2, 0.0)
    return sil.sum(1) / n_valid.clamp(min=1).to(sil.dtype)


def kmeans_1d(values: torch.Tensor, valid: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact k-means of each row's valid entries: (labels [Q, N] in 0..k−1 ordered by ascending centre,
    −1 where invalid; inertia [Q])."""
    xs, order, n_valid, vmask = _sorted_valid(values.detach().to(_work_dtype(values)), valid)
    dp = _KMeansDP(xs, n_valid, k)
    lab_sorted = dp.labels(k).masked_fill(~vmask, -1)
    labels = torch.empty_like(lab_sorted).scatter_(1, order, lab_sorted)
    return labels, dp.inertia[k - 1]


def silhouette_1d(values: torch.Tensor, valid: torch.Tensor, labels: torch.Tensor, k: int) -> torch.Tensor:
    """Mean silhouette of each row's valid entries under `labels` (0..k−1, clusters contiguous in value,
    as k-means clusters in 1-D are)."""
    xs, order, n_valid, vmask = _sorted_valid(values.detach().to(_work_dtype(values)), valid)
    return _silhouette_sorted(xs, labels.gather(1, order), vmask, n_valid, k)


def adaptive_levels(
    values: torch.Tensor, valid: torch.Tensor, k_min: int, k_max: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Levels of Eq. 9: per row, k-means for k in [k_min, k_max], k of the best mean silhouette.

    Returns (levels [Q, N]: 1 = highest-centre cluster … k, 0 where invalid; chosen k [Q]; its mean
    silhouette [Q]). Ties between k go to the smallest k.
    """
    if not 1 <= k_min <= k_max <= MAX_LEVELS:
        raise ValueError(f"need 1 <= levels_min <= levels_max <= {MAX_LEVELS}, got ({k_min}, {k_max})")
    dt = _work_dtype(values)
    xs, order, n_valid, vmask = _sorted_valid(values.detach().to(dt), valid)
    q = values.shape[0]
    # candidate 0 is k = 1 (one level: triplet only): it scores 0 when allowed, else -inf so that it wins only
    # when no k >= 2 is usable; argmax takes the first maximum, so ties go to the smaller k
    ks = list(range(max(k_min, 2), k_max + 1))
    levels_k = vmask.long()[None]  # [1 + K, Q, N]
    scores = torch.full((1, q), 0.0 if k_min == 1 else float("-inf"), dtype=dt, device=values.device)
    if ks:
        dp = _KMeansDP(xs, n_valid, k_max)
        labels = dp.labels_many(ks)  # [K, Q, N]
        n_k, k_col = len(ks), torch.arange(ks[0], k_max + 1, device=values.device)[:, None]  # no host copy
        # every k in one call, rows stacked k-major: clusters a k does not use are empty and ignored
        sil = _silhouette_sorted(
            xs.repeat(n_k, 1), labels.flatten(0, 1), vmask.repeat(n_k, 1), n_valid.repeat(n_k), k_max
        ).view(n_k, q)
        sil = sil.masked_fill(n_valid[None] < k_col + 1, float("-inf"))  # silhouette needs 2 <= k <= n - 1
        scores = torch.cat([scores, sil])
        levels_k = torch.cat([levels_k, (k_col[:, :, None] - labels) * vmask])  # level 1 = highest centre
    best = scores.argmax(0)  # [Q]
    best_score = scores.gather(0, best[None]).squeeze(0)
    best_k = torch.where(best > 0, best + (ks[0] - 1 if ks else 0), torch.ones_like(best))  # candidate -> k
    best_levels = levels_k.gather(0, best[None, :, None].expand(1, q, xs.shape[1])).squeeze(0)
    levels = torch.zeros_like(best_levels).scatter_(1, order, best_levels)
    return levels, best_k, best_score.to(values.dtype)


# ----------------------------------------------------------------------------------------- the loss


def fixed_levels(
    relevance: torch.Tensor, positives: torch.Tensor, thresholds: Sequence[float]
) -> torch.Tensor:
    """Level 0 for positives, else 1 + number of thresholds the relevance falls below."""
    levels = torch.ones_like(relevance, dtype=torch.long)
    for theta in thresholds:
        levels = levels + (relevance < theta).long()
    return levels.masked_fill(positives, 0)


def row_percentile(values: torch.Tensor, percentile: float) -> torch.Tensor:
    """Per-row `numpy.percentile(row, percentile)` ([Q, N] -> [Q]) with numpy's default linear interpolation,
    including its rounding: a + (b − a)·γ below γ = 0.5, b − (b − a)·(1 − γ) from there on."""
    if not 0 <= percentile <= 100:
        raise ValueError(f"percentile must be in [0, 100], got {percentile}")
    n = values.shape[-1]
    pos = (n - 1) * (float(percentile) / 100)
    lo = math.floor(pos)
    gamma = pos - lo
    xs = values.sort(dim=-1).values
    a, b = xs[..., lo], xs[..., min(lo + 1, n - 1)]
    diff = b - a
    return b - diff * (1 - gamma) if gamma >= 0.5 else a + diff * gamma


def percentile_levels(relevance: torch.Tensor, positives: torch.Tensor, percentile: float) -> torch.Tensor:
    """Auto-threshold levels (released `AutoThreshLadderLoss`): 1 where the relevance reaches its row's
    percentile (positive included in the row), else 2; 0 for positives."""
    theta = row_percentile(relevance, percentile)[..., None]
    return (1 + (relevance < theta).long()).masked_fill(positives, 0)


def reference_ladder_loss(
    sims: torch.Tensor,
    relevance: torch.Tensor | None,
    margins: Sequence[float],
    thresholds: Sequence[float] | None = None,
    betas: Sequence[float] = (),
    cumulative: bool = False,
    percentile: float | None = None,
) -> torch.Tensor:
    """The ladder loss as the released code (cdluminate/ladderloss) computes it, for number-for-number parity.

    Rung 0 is VSE++ (margin `margins[0]`, hardest negative). Rung l ≥ 1 (weight `betas[l − 1]`) splits each
    query's candidates into "similar" (relevance ≥ `thresholds[l − 1]`, the query's own pair only if its
    relevance reaches it) and "dissimilar"; with `percentile` there is one rung whose threshold is the row's
    percentile and the query's own pair is always similar. Per query: [α_l − min(S·similar + 1·dissimilar)
    + max(S·dissimilar)]_+, or [α_1 + … + α_l − s_qq + max(S·dissimilar)]_+ when `cumulative`. Image rows read
    the relevance rows, caption columns read the rows of its transpose, so it need not be symmetric.
    Training uses `LadderLoss(variant="reference")`, which equals this for symmetric relevance.
    """
    loss, _ = triplet_loss(sims, float(margins[0]), hardest=True)
    if percentile is not None and thresholds:
        raise ValueError("give thresholds or percentile, not both")
    n_levels = 2 if percentile is not None else len(thresholds or ()) + 1
    if n_levels < 2:
        return loss
    if relevance is None or relevance.shape != sims.shape:
        raise ValueError(f"relevance must be {tuple(sims.shape)} like sims")
    if len(margins) < n_levels or len(betas) < n_levels - 1:
        raise ValueError(f"{n_levels - 1} rung(s) need {n_levels} margins and {n_levels - 1} betas")
    rel = relevance.to(sims.device, sims.dtype)
    levels = torch.stack(
        [_reference_levels(rel, thresholds, percentile), _reference_levels(rel.T, thresholds, percentile)]
    )
    margin, weight = ladder_constants(margins, (1.0, *betas), n_levels, cumulative, sims.device, sims.dtype)
    s = torch.stack([sims, sims.T])  # image rows, caption columns
    extra, _ = _ladder_terms(s, levels, margin, weight, n_levels, cumulative, "reference")
    return loss + extra


def _reference_levels(
    relevance: torch.Tensor, thresholds: Sequence[float] | None, percentile: float | None
) -> torch.Tensor:
    """Released-code levels of each row: from the relevance alone (fixed thresholds) or with the diagonal
    at 0 (percentile)."""
    if percentile is not None:
        eye = torch.eye(relevance.shape[0], dtype=torch.bool, device=relevance.device)
        return percentile_levels(relevance, eye, percentile)
    return fixed_levels(relevance, torch.zeros_like(relevance, dtype=torch.bool), thresholds or ())


def ladder_constants(
    margins: Sequence[float],
    weights: Sequence[float],
    n_levels: int,
    cumulative: bool,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-ladder margins [L − 1, 1] (α_l, or α_1 + … + α_l when cumulative) and weights [L − 1] (β_l)."""
    m = [float(v) for v in margins[:n_levels]]
    m = [sum(m[: i + 1]) for i in range(n_levels)] if cumulative else m
    margin = torch.tensor(m[1:], dtype=dtype).view(-1, 1).to(device)
    return margin, torch.tensor([float(w) for w in weights[1:n_levels]], dtype=dtype).to(device)


def _ladder_terms(
    s: torch.Tensor,
    levels: torch.Tensor,
    margin: torch.Tensor,
    weight: torch.Tensor,
    n_levels: int,
    cumulative: bool,
    variant: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Σ_{l=2..n_levels} β_l Σ_q L^l(q) with hard contrastive sampling for the query rows of `s` ([D, B, B]:
    D directions, diagonal = positives, sharing `levels` [B, B] or each with its own [D, B, B]), with the
    margins and weights of `ladder_constants`; also returns the fraction of rows of the first direction where
    ladder 2 has a (possibly zero-cost) term.

    Every ladder and direction is computed at once on [D, L − 1, B, B] masks: a handful of kernels instead
    of a loop, which is what bounds the step time on a GPU.
    """
    lvl = torch.arange(2, n_levels + 1, device=s.device)[:, None, None]  # [M, 1, 1], M = L − 1 ladders
    lv = levels[None] if levels.dim() == 2 else levels[:, None]  # [1 or D, 1, B, B] against lvl [M, 1, 1]
    far = lv >= lvl  # [M, B, B] or [D, M, B, B]
    diag = s.diagonal(dim1=-2, dim2=-1)[:, None, :]  # [D, 1, B]
    sm = s[:, None]  # [D, 1, B, B]
    if variant == "reference":
        hn = (sm * far).amax(
            -1
        )  # S·mask: floored at 0 (and 0 with no far candidate), as in the released code
        # near set: S·similar + 1·dissimilar (positive included when its level is 0)
        hp = diag if cumulative else torch.where(lv <= lvl - 1, sm, 1.0).amin(-1)
        ok = torch.ones_like(hn, dtype=torch.bool)
    else:
        has_far = far.any(-1)  # [M, B]
        hn = sm.masked_fill(~far, float("-inf")).amax(-1)  # [D, M, B]
        if cumulative:
            hp, ok = diag, has_far.expand_as(hn)
        else:
            near = lv == lvl - 1
            hp = sm.masked_fill(~near, float("inf")).amin(-1)
            ok = (has_far & near.any(-1)).expand_as(hn)
        hn, hp = hn.masked_fill(~ok, 0.0), torch.where(ok, hp, torch.zeros_like(hp))  # no ±inf reach the sum
    term = (margin - hp + hn).clamp_min(0).masked_fill(~ok, 0.0)  # [D, M, B]
    total = (term.sum(-1) * weight).sum()
    return total, ok[0, 0].to(s.dtype).mean()


class LadderLoss(InBatchLoss):
    """CVSE++ ladder loss (fixed thresholds), adaptive ladder loss (`adaptive=True`) or the released code's
    auto-threshold ladder (`percentile=p`: each query's threshold is the p-th percentile of its relevance row).

    Needs the batch's `caption_ids` (rows of the train split's captions) and a relevance source: the
    sentence embeddings given by `set_caption_embeddings` (the trainer: `vsekit.relevance.prepare_ladder_relevance`), or an
    explicit `relevance=[B, B]` tensor passed to forward.
    """

    needs_caption_embeddings = True

    def __init__(
        self,
        margins: Sequence[float],
        weights: Sequence[float],
        thresholds: Sequence[float] = (0.40,),
        cumulative: bool = False,
        adaptive: bool = False,
        levels_min: int = 2,
        levels_max: int = 4,
        max_violation: bool = True,
        mask_same_image: bool = True,
        variant: str = "paper",
        cuda_graphs: bool = True,
        percentile: float | None = None,
        threshold_share: float | None = None,
    ) -> None:
        super().__init__()
        if variant not in VARIANTS:
            raise ConfigError(f"loss.ladder_variant={variant!r}; choose one of {', '.join(VARIANTS)}")
        if percentile is not None and (adaptive or not 0 <= percentile <= 100):
            raise ConfigError(
                f"loss.ladder_percentile={percentile!r} needs loss.name=ladder and a value in [0, 100]"
            )
        if threshold_share is not None and not 0 < threshold_share < 1:
            raise ConfigError(f"loss.ladder_threshold_share={threshold_share!r}; must lie in (0, 1)")
        if adaptive or percentile is not None:
            threshold_share = None  # it sets ladder_thresholds, which these levels do not use either
        if threshold_share is not None:
            if len(thresholds) != 1:
                raise ConfigError(
                    f"loss.ladder_threshold_share sets θ_1 of a 2-level ladder, but loss.ladder_thresholds "
                    f"has {len(thresholds)} thresholds {list(thresholds)}"
                )
        if adaptive:
            if not 1 <= levels_min <= levels_max <= MAX_LEVELS:
                raise ConfigError(
                    f"loss.ladder_levels_min/max must satisfy 1 <= min <= max <= {MAX_LEVELS}, "
                    f"got ({levels_min}, {levels_max})"
                )
            n_levels = levels_max
        elif percentile is not None:  # one threshold per row: its percentile of the relevance
            n_levels = 2
        else:
            th = list(thresholds)
            if any(b >= a for a, b in zip(th, th[1:])):
                raise ConfigError(
                    f"loss.ladder_thresholds must be strictly decreasing (θ_1 > θ_2 > …), got {th}"
                )
            n_levels = len(th) + 1
        if len(margins) < n_levels or len(weights) < n_levels:
            raise ConfigError(
                f"{'adaptive' if adaptive else 'fixed'} ladder with {n_levels} levels needs {n_levels} "
                f"loss.ladder_margins and loss.ladder_weights, got {len(margins)} and {len(weights)}"
            )
        self.margins = [float(m) for m in margins[:n_levels]]
        self.weights = [float(w) for w in weights[:n_levels]]
        self.thresholds = [float(t) for t in thresholds]
        self.cumulative = cumulative
        self.percentile = None if percentile is None else float(percentile)
        self.threshold_share = None if threshold_share is None else float(threshold_share)
        self.derived_thresholds: list[float] | None = None  # set by the trainer when threshold_share is given
        self.adaptive = adaptive
        self.levels_min, self.levels_max = levels_min, levels_max
        self.n_levels = n_levels
        self.max_violation = max_violation
        self.mask_same_image = mask_same_image
        self.variant = variant
        self.register_buffer("caption_emb", None, persistent=False)
        self._constants: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}
        self.cuda_graphs = cuda_graphs  # adaptive levels on CUDA: replay a captured graph (same results)
        self._graphs: dict[tuple, tuple] = {}

    # -------------------------------------------------------------------------------- relevance
    def set_derived_threshold(self, theta: float) -> None:
        """θ_1 derived by the trainer from `threshold_share` and the train split's caption-pair relevance
        (`vsekit.relevance.prepare_ladder_relevance`); the loss itself never loads a sentence model."""
        if self.threshold_share is None:
            raise RuntimeError("a derived θ_1 needs loss.ladder_threshold_share")
        self.thresholds = [float(theta)]
        self.derived_thresholds = [float(theta)]

    def set_caption_embeddings(self, emb: torch.Tensor) -> None:
        if emb.ndim != 2:
            raise ValueError(f"caption embeddings must be [captions, dim], got {tuple(emb.shape)}")
        device = self.caption_emb.device if self.caption_emb is not None else emb.device
        self.caption_emb = nn.functional.normalize(emb.float(), dim=-1).to(device)

    def batch_relevance(self, caption_ids: torch.Tensor) -> torch.Tensor:
        if self.caption_emb is None:
            raise RuntimeError(
                "ladder loss has no relevance: call vsekit.relevance.prepare_ladder_relevance or "
                "set_caption_embeddings(), or pass relevance=[B, B] to the loss"
            )
        n = self.caption_emb.shape[0]
        # checked on CPU ids only: on an accelerator the check would stall the step on a device sync (the
        # trainer's ids index the very split whose embeddings the trainer gave)
        if (
            caption_ids.device.type == "cpu"
            and caption_ids.numel()
            and (int(caption_ids.min()) < 0 or int(caption_ids.max()) >= n)
        ):
            raise IndexError(f"caption id out of range 0..{n - 1} (relevance embeddings of {n} captions)")
        e = self.caption_emb[caption_ids.to(self.caption_emb.device)]
        r = e @ e.T
        return (r + r.T) / 2  # exactly symmetric, so both directions share one set of levels

    def levels(self, relevance: torch.Tensor, positives: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, B] ladder level of every (query, candidate) pair and the number of levels per row."""
        if self.percentile is not None:
            lv = percentile_levels(relevance, positives, self.percentile)
            return lv, lv.amax(1)
        if not self.adaptive:
            lv = fixed_levels(relevance, positives, self.thresholds)
            return lv, lv.amax(1)
        if self.cuda_graphs and relevance.is_cuda and not torch.cuda.is_current_stream_capturing():
            return self._levels_graphed(relevance, positives)
        return self._adaptive_levels(relevance, positives)

    def _adaptive_levels(
        self, relevance: torch.Tensor, positives: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rel = relevance.masked_fill(positives, 1.0)
        if self.variant == "reference":  # cluster the whole row, positive included, then set it to level 0
            lv, k, _ = adaptive_levels(rel, torch.ones_like(positives), self.levels_min, self.levels_max)
        else:
            lv, k, _ = adaptive_levels(rel, ~positives, self.levels_min, self.levels_max)
        return lv.masked_fill(positives, 0), k

    def _levels_graphed(
        self, relevance: torch.Tensor, positives: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The adaptive levels replayed from a CUDA graph captured once per (device, batch size).

        The clustering is a few hundred tiny kernels on a 128 x 128 batch: on a GPU their launch overhead,
        not arithmetic, is its cost (about 3 ms eagerly, a quarter of a VSE++ step). One graph replay
        launches them all at once; the results are identical. If capture fails the eager path is used.
        """
        key = (relevance.device, tuple(relevance.shape))
        entry = self._graphs.get(key)
        if entry is None:
            static = (relevance.clone(), positives.clone())
            try:
                side = torch.cuda.Stream(relevance.device)
                side.wait_stream(torch.cuda.current_stream(relevance.device))
                with torch.cuda.stream(side):  # warm-up outside the capture (allocator, lazy init)
                    self._adaptive_levels(*static)
                torch.cuda.current_stream(relevance.device).wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    out = self._adaptive_levels(*static)
            except RuntimeError as e:  # an op that cannot be captured on this build: stay eager
                warnings.warn(
                    f"adaptive ladder: CUDA graph capture failed ({e}); using eager kernels", stacklevel=2
                )
                self.cuda_graphs = False
                return self._adaptive_levels(relevance, positives)
            entry = self._graphs[key] = (graph, static, out)
        graph, (rel_in, pos_in), (lv, k) = entry
        rel_in.copy_(relevance)
        pos_in.copy_(positives)
        graph.replay()
        return lv.clone(), k.clone()

    # ---------------------------------------------------------------------------------- forward
    def forward(
        self,
        sims: torch.Tensor,
        image_ids: torch.Tensor | None = None,
        caption_ids: torch.Tensor | None = None,
        *,
        warmup: bool = False,
        context: StepContext | None = None,
        relevance: torch.Tensor | None = None,
        **_: object,
    ):
        b = sims.shape[0]
        positives = positive_mask(image_ids if self.mask_same_image else None, b, sims.device)
        hardest = self.max_violation and not warmup_of(context, warmup)
        loss, diag = triplet_loss(sims, self.margins[0], hardest=hardest, positives=positives)
        loss = self.weights[0] * loss
        if self.n_levels < 2 or all(w == 0 for w in self.weights[1:]):
            return loss, diag
        if relevance is None:
            if caption_ids is None:
                raise ValueError(
                    "ladder loss needs the batch's caption_ids (or an explicit relevance matrix)"
                )
            relevance = self.batch_relevance(caption_ids)
        relevance = relevance.to(sims.device, torch.float32)
        if relevance.shape != sims.shape:
            raise ValueError(f"relevance {tuple(relevance.shape)} does not match sims {tuple(sims.shape)}")
        with torch.no_grad():
            levels, k = self.levels(relevance, positives)
        s = sims.float()
        # image rows and caption columns at once: R is symmetric, so both directions share the levels
        key = (s.device, s.dtype)
        if key not in self._constants:  # made once per device: a host-to-device copy per step would sync
            self._constants[key] = ladder_constants(
                self.margins, self.weights, self.n_levels, self.cumulative, s.device, s.dtype
            )
        extra, act = _ladder_terms(
            torch.stack([s, s.T]), levels, *self._constants[key], self.n_levels, self.cumulative, self.variant
        )
        diag = {
            **diag,
            "ladder_extra": extra.detach(),
            "ladder_levels": k.float().mean(),
            "ladder2_active": act.detach(),
        }
        return loss + extra, diag


def create_ladder_loss(cfg: LossConfig, adaptive: bool = False) -> LadderLoss:
    """`ladder` (fixed thresholds, or per-row percentile ones with `ladder_percentile`) or, `adaptive`,
    `ladder_auto` (silhouette-chosen k-means levels) from a LossConfig (each registration says which)."""
    return LadderLoss(
        margins=cfg.ladder_margins,
        weights=cfg.ladder_weights,
        thresholds=cfg.ladder_thresholds,
        cumulative=cfg.ladder_cumulative,
        adaptive=adaptive,
        levels_min=cfg.ladder_levels_min,
        levels_max=cfg.ladder_levels_max,
        max_violation=cfg.max_violation,
        mask_same_image=cfg.mask_same_image,
        variant=cfg.ladder_variant,
        percentile=cfg.ladder_percentile,
        threshold_share=cfg.ladder_threshold_share,
    )
