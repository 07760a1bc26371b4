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
term [α_l − s(q, q) + max …]_+), the hardest far similarity is taken from S·mask and is therefore floored
at 0 (and 0 when N_{l:L} is empty), and the adaptive clustering runs on the whole row including the
positive (its cluster mates become level 1).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from vsekit.config import LossConfig
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

    def __init__(self, x: torch.Tensor, n_valid: torch.Tensor, k_max: int) -> None:
        q, n = x.shape
        pos = torch.arange(n, device=x.device)
        inf = float("inf")
        s1 = F.pad(x.cumsum(1), (1, 0))
        s2 = F.pad((x * x).cumsum(1), (1, 0))
        seg_sum = s1[:, 1:, None] - s1[:, None, :-1]  # [Q, b, a] = sum of x[a..b]
        seg_sq = s2[:, 1:, None] - s2[:, None, :-1]
        inv_len = 1.0 / (pos[:, None] - pos[None, :] + 1).clamp(min=1).to(x.dtype)  # [b, a]
        # a > b is no segment; b >= n_valid needs no mask: no D_k[b] past a row's last point is ever read
        no_segment = torch.zeros(n, n, dtype=x.dtype, device=x.device).masked_fill_(pos[:, None] < pos[None, :], inf)
        cost = seg_sq.sub_(seg_sum.mul_(seg_sum).mul_(inv_len)).clamp_min_(0).add_(no_segment)
        self.end = (n_valid - 1).clamp(min=0)
        cost_end = cost.gather(1, self.end[:, None, None].expand(q, 1, n)).squeeze(1)  # [Q, a]: cost(a, end)
        d = cost[:, :, 0]  # D_1[b]
        self.inertia = [d.gather(1, self.end[:, None]).squeeze(1)]
        self.arg_full: dict[int, torch.Tensor] = {}
        self.arg_end: dict[int, torch.Tensor] = {}
        for k in range(2, k_max + 1):
            prev = F.pad(d[:, :-1], (1, 0), value=inf)  # prev[a] = D_{k-1}[a - 1]
            d_end, self.arg_end[k] = (prev + cost_end).min(1)
            self.inertia.append(d_end)
            if k < k_max:
                d, self.arg_full[k] = (prev[:, None, :] + cost).min(2)
        self.n = n

    def labels(self, k: int) -> torch.Tensor:
        """Cluster labels 0..k−1 (ascending values) of the sorted positions in the optimal k-partition."""
        q = self.end.shape[0]
        device = self.end.device
        if k == 1:
            return torch.zeros(q, self.n, dtype=torch.long, device=device)
        firsts = [self.arg_end[k]]
        for kk in range(k - 1, 1, -1):
            firsts.append(self.arg_full[kk].gather(1, (firsts[-1] - 1).clamp(min=0)[:, None]).squeeze(1))
        firsts.append(torch.zeros(q, dtype=torch.long, device=device))
        seg = torch.stack(firsts[::-1], 1)  # [Q, k] first sorted position of each cluster
        pos = torch.arange(self.n, device=device)
        return (pos[None, None, :] >= seg[:, :, None]).sum(1) - 1


def _silhouette_sorted(x: torch.Tensor, labels: torch.Tensor, vmask: torch.Tensor, n_valid: torch.Tensor,
                       k: int) -> torch.Tensor:  # fmt: skip
    """Mean silhouette (Eq. 10–12, |·| distance) per row of sorted x whose clusters are contiguous.

    Distance sums to a contiguous cluster come from prefix sums in O(N k) (no N x N matrix): members
    below point i contribute x_i − x_j, members above x_j − x_i. Singletons score 0, as in sklearn.
    """
    q, n = x.shape
    lab = labels.clamp(0, k - 1).masked_fill(~vmask, 0)
    onehot = F.one_hot(lab, k) * vmask[..., None]
    cnt = onehot.sum(1)  # [Q, k]
    start = F.pad(cnt.cumsum(1)[:, :-1], (1, 0))  # [Q, k] first sorted position of each cluster
    s1 = F.pad(x.cumsum(1), (1, 0))  # [Q, N + 1]
    i = torch.arange(n, device=x.device)[None, :, None]  # [1, N, 1]
    st, ct = start[:, None, :], cnt[:, None, :]  # [Q, 1, k]
    m_lo = (i - st).clamp(min=0).minimum(ct)  # members strictly below i
    m_hi = (st + ct - 1 - i).clamp(min=0).minimum(ct)  # members strictly above i
    flat = s1[:, None, :].expand(q, n, n + 1)
    sum_lo = flat.gather(2, st + m_lo) - flat.gather(2, st.expand_as(m_lo))
    sum_hi = flat.gather(2, (st + ct).expand_as(m_hi)) - flat.gather(2, st + ct - m_hi)
    xi = x[:, :, None]
    dist_sum = xi * m_lo - sum_lo + sum_hi - xi * m_hi  # [Q, N, k]
    cntf = cnt.to(x.dtype)
    own_cnt = cntf.gather(1, lab)
    a = dist_sum.gather(2, lab[..., None]).squeeze(-1) / (own_cnt - 1).clamp(min=1)
    mean_other = (dist_sum / cntf[:, None, :].clamp(min=1)).masked_fill(
        onehot.bool() | (cnt[:, None, :] == 0), float("inf"))  # fmt: skip
    b = mean_other.amin(-1)
    den = torch.maximum(a, b)
    use = (own_cnt > 1) & torch.isfinite(b) & (den > 0) & vmask
    s = torch.where(use, (b - a) / torch.where(use, den, torch.ones_like(den)), torch.zeros_like(den))
    return s.sum(1) / n_valid.clamp(min=1).to(s.dtype)


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


def adaptive_levels(values: torch.Tensor, valid: torch.Tensor, k_min: int, k_max: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """Levels of Eq. 9: per row, k-means for k in [k_min, k_max], k of the best mean silhouette.

    Returns (levels [Q, N]: 1 = highest-centre cluster … k, 0 where invalid; chosen k [Q]; its mean
    silhouette [Q]). Ties between k go to the smallest k.
    """
    if not 1 <= k_min <= k_max <= MAX_LEVELS:
        raise ValueError(f"need 1 <= levels_min <= levels_max <= {MAX_LEVELS}, got ({k_min}, {k_max})")
    dt = _work_dtype(values)
    xs, order, n_valid, vmask = _sorted_valid(values.detach().to(dt), valid)
    q = values.shape[0]
    best_levels = vmask.long()  # one level (triplet only) unless some k >= 2 is usable
    best_k = torch.ones(q, dtype=torch.long, device=values.device)
    best_score = torch.full((q,), 0.0 if k_min == 1 else float("-inf"), dtype=dt, device=values.device)
    if k_max >= 2:
        dp = _KMeansDP(xs, n_valid, k_max)
        for k in range(max(k_min, 2), k_max + 1):
            labels = dp.labels(k)
            score = _silhouette_sorted(xs, labels, vmask, n_valid, k)
            score = score.masked_fill(n_valid < k + 1, float("-inf"))  # silhouette needs 2 <= k <= n - 1
            better = score > best_score
            best_score = torch.where(better, score, best_score)
            best_k = torch.where(better, torch.full_like(best_k, k), best_k)
            best_levels = torch.where(better[:, None], (k - labels) * vmask, best_levels)
    levels = torch.zeros_like(best_levels).scatter_(1, order, best_levels)
    return levels, best_k, best_score.to(values.dtype)


# ----------------------------------------------------------------------------------------- the loss


def fixed_levels(relevance: torch.Tensor, positives: torch.Tensor, thresholds: Sequence[float]) -> torch.Tensor:
    """Level 0 for positives, else 1 + number of thresholds the relevance falls below."""
    levels = torch.ones_like(relevance, dtype=torch.long)
    for theta in thresholds:
        levels = levels + (relevance < theta).long()
    return levels.masked_fill(positives, 0)


def ladder_terms(sims: torch.Tensor, levels: torch.Tensor, margins: Sequence[float], weights: Sequence[float],
                 n_levels: int, cumulative: bool = False, variant: str = "paper") -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Σ_{l=2..n_levels} β_l Σ_q L^l(q) for query rows of `sims` (diagonal = positives) with hard contrastive
    sampling; also returns the fraction of rows where ladder 2 has a (possibly zero-cost) term."""
    diag = sims.diagonal()
    total = sims.new_zeros(())
    active2 = sims.new_zeros(())
    for lvl in range(2, n_levels + 1):
        far = levels >= lvl
        margin = sum(margins[:lvl]) if cumulative else margins[lvl - 1]
        if variant == "reference":
            near = levels <= lvl - 1  # includes the positive (level 0)
            hn = (sims * far).amax(1)  # S·mask: floored at 0, as in the released code
            hp = diag if cumulative else sims.masked_fill(~near, float("inf")).amin(1)
            ok = torch.ones_like(diag, dtype=torch.bool)
        else:
            has_far = far.any(1)
            hn = torch.where(has_far, sims.masked_fill(~far, float("-inf")).amax(1), torch.zeros_like(diag))
            if cumulative:
                hp, ok = diag, has_far
            else:
                near = levels == lvl - 1
                has_near = near.any(1)
                hp = torch.where(has_near, sims.masked_fill(~near, float("inf")).amin(1), torch.zeros_like(diag))
                ok = has_far & has_near
        term = torch.where(ok, (margin - hp + hn).clamp_min(0), torch.zeros_like(diag))
        total = total + weights[lvl - 1] * term.sum()
        if lvl == 2:
            active2 = ok.float().mean()
    return total, active2


class LadderLoss(nn.Module):
    """CVSE++ ladder loss (fixed thresholds) or adaptive ladder loss (`adaptive=True`).

    Needs the batch's `caption_ids` (rows of the train split's captions) and a relevance source: the
    sentence embeddings loaded by `prepare` (the trainer calls it) or `set_caption_embeddings`, or an
    explicit `relevance=[B, B]` tensor passed to forward.
    """

    def __init__(self, margins: Sequence[float], weights: Sequence[float], thresholds: Sequence[float] = (0.40,),
                 cumulative: bool = False, adaptive: bool = False, levels_min: int = 2, levels_max: int = 4,
                 max_violation: bool = True, mask_same_image: bool = True, variant: str = "paper") -> None:  # fmt: skip
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(f"loss.ladder_variant={variant!r}; choose one of {', '.join(VARIANTS)}")
        if adaptive:
            if not 1 <= levels_min <= levels_max <= MAX_LEVELS:
                raise ValueError(f"loss.ladder_levels_min/max must satisfy 1 <= min <= max <= {MAX_LEVELS}, "
                                 f"got ({levels_min}, {levels_max})")  # fmt: skip
            n_levels = levels_max
        else:
            th = list(thresholds)
            if any(b >= a for a, b in zip(th, th[1:])):
                raise ValueError(f"loss.ladder_thresholds must be strictly decreasing (θ_1 > θ_2 > …), got {th}")
            n_levels = len(th) + 1
        if len(margins) < n_levels or len(weights) < n_levels:
            raise ValueError(
                f"{'adaptive' if adaptive else 'fixed'} ladder with {n_levels} levels needs {n_levels} "
                f"loss.ladder_margins and loss.ladder_weights, got {len(margins)} and {len(weights)}"
            )
        self.margins = [float(m) for m in margins[:n_levels]]
        self.weights = [float(w) for w in weights[:n_levels]]
        self.thresholds = [float(t) for t in thresholds]
        self.cumulative = cumulative
        self.adaptive = adaptive
        self.levels_min, self.levels_max = levels_min, levels_max
        self.n_levels = n_levels
        self.max_violation = max_violation
        self.mask_same_image = mask_same_image
        self.variant = variant
        self.register_buffer("caption_emb", None, persistent=False)

    # -------------------------------------------------------------------------------- relevance
    def prepare(self, data_dir: str | Path, train_split, log: Callable[[str], None] = print) -> None:
        """Load (computing and caching on first use) the train captions' sentence embeddings."""
        from vsekit.data.relevance import split_caption_embeddings

        emb = split_caption_embeddings(data_dir, train_split.split, train_split.captions, log=log)
        self.set_caption_embeddings(torch.from_numpy(emb))

    def set_caption_embeddings(self, emb: torch.Tensor) -> None:
        if emb.ndim != 2:
            raise ValueError(f"caption embeddings must be [captions, dim], got {tuple(emb.shape)}")
        device = self.caption_emb.device if self.caption_emb is not None else emb.device
        self.caption_emb = nn.functional.normalize(emb.float(), dim=-1).to(device)

    def batch_relevance(self, caption_ids: torch.Tensor) -> torch.Tensor:
        if self.caption_emb is None:
            raise RuntimeError("ladder loss has no relevance: call prepare(data_dir, split) or "
                               "set_caption_embeddings(), or pass relevance=[B, B] to the loss")  # fmt: skip
        n = self.caption_emb.shape[0]
        if caption_ids.numel() and (int(caption_ids.min()) < 0 or int(caption_ids.max()) >= n):
            raise IndexError(f"caption id out of range 0..{n - 1} (relevance embeddings of {n} captions)")
        e = self.caption_emb[caption_ids.to(self.caption_emb.device)]
        r = e @ e.T
        return (r + r.T) / 2  # exactly symmetric, so both directions share one set of levels

    def levels(self, relevance: torch.Tensor, positives: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, B] ladder level of every (query, candidate) pair and the number of levels per row."""
        if not self.adaptive:
            lv = fixed_levels(relevance, positives, self.thresholds)
            return lv, lv.amax(1)
        rel = relevance.masked_fill(positives, 1.0)
        if self.variant == "reference":  # cluster the whole row, positive included, then set it to level 0
            lv, k, _ = adaptive_levels(rel, torch.ones_like(positives), self.levels_min, self.levels_max)
        else:
            lv, k, _ = adaptive_levels(rel, ~positives, self.levels_min, self.levels_max)
        return lv.masked_fill(positives, 0), k

    # ---------------------------------------------------------------------------------- forward
    def forward(self, sims: torch.Tensor, image_ids: torch.Tensor | None = None, caption_ids: torch.Tensor | None = None,
                *, warmup: bool = False, relevance: torch.Tensor | None = None, **_: object):  # fmt: skip
        b = sims.shape[0]
        positives = positive_mask(image_ids if self.mask_same_image else None, b, sims.device)
        hardest = self.max_violation and not warmup
        loss, diag = triplet_loss(sims, self.margins[0], hardest=hardest, positives=positives)
        loss = self.weights[0] * loss
        if self.n_levels < 2 or all(w == 0 for w in self.weights[1:]):
            return loss, diag
        if relevance is None:
            if caption_ids is None:
                raise ValueError("ladder loss needs the batch's caption_ids (or an explicit relevance matrix)")
            relevance = self.batch_relevance(caption_ids)
        relevance = relevance.to(sims.device, torch.float32)
        if relevance.shape != sims.shape:
            raise ValueError(f"relevance {tuple(relevance.shape)} does not match sims {tuple(sims.shape)}")
        with torch.no_grad():
            levels, k = self.levels(relevance, positives)
        s = sims.float()
        extra_i2t, act = ladder_terms(s, levels, self.margins, self.weights, self.n_levels, self.cumulative,
                                      self.variant)  # fmt: skip
        extra_t2i, _ = ladder_terms(s.T, levels, self.margins, self.weights, self.n_levels, self.cumulative,
                                    self.variant)  # fmt: skip
        extra = extra_i2t + extra_t2i
        diag = {**diag, "ladder_extra": extra.detach(), "ladder_levels": k.float().mean(), "ladder2_active": act.detach()}
        return loss + extra, diag


def create_ladder_loss(cfg: LossConfig) -> LadderLoss:
    """`ladder` (fixed thresholds) or `ladder_auto` (silhouette-chosen k-means levels) from a LossConfig."""
    return LadderLoss(
        margins=cfg.ladder_margins, weights=cfg.ladder_weights, thresholds=cfg.ladder_thresholds,
        cumulative=cfg.ladder_cumulative, adaptive=cfg.name == "ladder_auto",
        levels_min=cfg.ladder_levels_min, levels_max=cfg.ladder_levels_max,
        max_violation=cfg.max_violation, mask_same_image=cfg.mask_same_image,
        variant=cfg.ladder_variant,
    )  # fmt: skip
