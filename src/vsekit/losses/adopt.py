"""ADOPT, the adaptive objective of VSE+2AD (Zhang et al., arXiv 2210.02206, §3.3), and plain InfoNCE.

ADOPT is InfoNCE with temperature tau over the positive and the K hardest in-batch negatives, in both
directions, where K follows how mature the embedding is: many negatives early (fast convergence), few
late (fine-grained ranking). On the in-batch matrix `sims[i, j] = s(image_i, caption_j)` (diagonal =
positives), with B = |batch|:

paper variant (default; Eq. 6 and the two definitions above it)
    gamma_align   = mean_i sims[i, i]                                  (mean positive cosine)
    gamma_uniform = log( mean_{i,j} exp(sims[i, j]) )                   (all B^2 pairs)
    each gamma clipped to [0, 1], the range the paper states for it
    K' = floor( B * cos((gamma_align + gamma_uniform) * pi / 4) ),  K = max(1, min(K', B - 1))
    L  = L_i2t + L_t2i,  L_i2t = -mean_i log( e^{s_ii/tau} / (e^{s_ii/tau} + sum_{k<=K} e^{s_i,n_k/tau}) )
    (the printed denominator lists only the K negatives; we keep the positive in it, as InfoNCE — which
    the paper names — and the released code do; without it the loss has no lower bound.)

reference variant (`adopt_variant: reference`, the released code `losses.py` `ContrastiveLoss.ADCTO`)
    gamma_uniform = mean_{i,j} exp(-sims'[i, j]) with the diagonal of sims' set to 0
    t = gamma_align + gamma_uniform (clipped at 0),  K = min(max(trunc(cos(t ** scale) * B) + 1, 1), B - 1)
    every selected negative logit gets + margin (additive-margin InfoNCE); L = (L_i2t + L_t2i) / 2
    (The released code fills the diagonal with 0 before picking negatives, so the positive itself can be
    picked as a "negative" when fewer than K off-diagonal similarities are above 0; by default we do not
    copy that — the positive is never a negative. `zero_fill_negatives=True` (reference variant only)
    reproduces it, for number-for-number parity checks against that code.)

K is computed from detached similarities (it is a count, not a differentiable quantity). Both directions
see the same B x B matrix, so K_i2t == K_t2i (also true of the released code); both are logged. With
`mask_same_image` other captions of the anchor's image are never negatives; a row with fewer valid
negatives than K uses all it has.
"""

from __future__ import annotations

import math

import torch

from vsekit.config import LossConfig
from vsekit.losses.base import InBatchLoss
from vsekit.losses.triplet import positive_mask

ADOPT_VARIANTS = ("paper", "reference")


def adopt_gammas(sims: torch.Tensor, variant: str = "paper") -> tuple[float, float]:
    """(gamma_align, gamma_uniform) of a square in-batch similarity matrix, as floats."""
    s = sims.detach().float()
    align = float(s.diagonal().mean())
    if variant == "paper":
        uniform = float(torch.logsumexp(s.flatten(), 0) - math.log(s.numel()))
        return min(max(align, 0.0), 1.0), min(max(uniform, 0.0), 1.0)
    off = s - torch.diag_embed(s.diagonal())
    return align, float(torch.exp(-off).mean())


def adopt_k(align: float, uniform: float, batch: int, variant: str = "paper", scale: float = 1.25) -> int:
    """Number of hardest negatives per anchor from the model's maturity (Eq. 6 or the released rule)."""
    if batch < 2:
        raise ValueError(f"ADOPT needs at least 2 pairs in a batch, got {batch}")
    if variant == "paper":
        k = math.floor(batch * math.cos((align + uniform) * math.pi / 4))
    elif variant == "reference":
        t = max(align + uniform, 0.0)
        k = max(math.trunc(math.cos(t**scale) * batch) + 1, 1)
    else:
        raise ValueError(f"ADOPT variant {variant!r}; choose one of {', '.join(ADOPT_VARIANTS)}")
    return max(1, min(k, batch - 1))


def adopt_gammas_tensor(sims: torch.Tensor, variant: str = "paper") -> tuple[torch.Tensor, torch.Tensor]:
    """`adopt_gammas` as 0-d float64 tensors on the device (no host read; on the CPU for MPS, which has no
    float64): the same numbers, computed in float32 and widened to float64 as `float()` does, clipped in float64."""
    s = sims.detach().float()
    if s.device.type == "mps":  # no float64 there
        s = s.cpu()
    align = s.diagonal().mean().double()
    if variant == "paper":
        uniform = (torch.logsumexp(s.flatten(), 0) - math.log(s.numel())).double()
        return align.clamp(0.0, 1.0), uniform.clamp(0.0, 1.0)
    off = s - torch.diag_embed(s.diagonal())
    return align, torch.exp(-off).mean().double()


def adopt_k_tensor(
    align: torch.Tensor, uniform: torch.Tensor, batch: int, variant: str = "paper", scale: float = 1.25
) -> torch.Tensor:
    """`adopt_k` on 0-d float64 tensors -> a 0-d int64 tensor, the same rule in the same float64 operations
    (one ulp of cos can differ between the host's libm and a GPU's: K changes only if B·cos lands within
    ~1e-16 of an integer)."""
    if batch < 2:
        raise ValueError(f"ADOPT needs at least 2 pairs in a batch, got {batch}")
    if variant == "paper":
        k = torch.floor(batch * torch.cos((align + uniform) * math.pi / 4))
    elif variant == "reference":
        t = (align + uniform).clamp_min(0.0)
        k = (torch.trunc(torch.cos(t**scale) * batch) + 1).clamp_min(1)
    else:
        raise ValueError(f"ADOPT variant {variant!r}; choose one of {', '.join(ADOPT_VARIANTS)}")
    return k.clamp(1, batch - 1).to(torch.int64)


def zero_filled_topk(sims: torch.Tensor, negatives: torch.Tensor, k: int) -> torch.Tensor:
    """[B, k] similarities at the k largest entries of each row once non-negatives are set to 0 — the
    released code's selection, which can pick the positive itself when few negatives are above 0."""
    idx = sims.detach().masked_fill(~negatives, 0.0).topk(k, dim=1).indices
    return sims.gather(1, idx)


def infonce_terms(
    sims: torch.Tensor,
    negatives: torch.Tensor,
    k: int | torch.Tensor | None,
    temperature: float,
    margin: float = 0.0,
    zero_fill: bool = False,
) -> torch.Tensor:
    """[B] per-row terms: -log softmax of the positive (diagonal) against the row's k hardest valid
    negatives (`k=None`: all of them); `negatives[i, j]` says whether column j may be a negative of row i.
    `k` may be a 0-d tensor (ADOPT's adaptive K, kept on the device). `zero_fill`: pick them as
    `zero_filled_topk` does (the released code; needs a k below the width)."""
    pos = sims.diagonal().unsqueeze(1)
    if torch.is_tensor(k) and zero_fill:
        k = int(k)  # the released selection's tie order is topk's: a host read of K (parity mode only)
    if torch.is_tensor(k):
        # K on the device: every negative, sorted, and the ranks past K masked out (-inf adds nothing to the
        # softmax); the same loss and gradient as topk(K) with a fixed shape and no host read of K
        masked = sims.masked_fill(~negatives, float("-inf")).sort(dim=1, descending=True).values
        ranks = torch.arange(masked.shape[1], device=masked.device)
        masked = masked.masked_fill(ranks >= k.to(masked.device), float("-inf"))
    elif zero_fill and k is not None and k < sims.shape[1]:
        masked = zero_filled_topk(sims, negatives, k)
    else:
        masked = sims.masked_fill(~negatives, float("-inf"))
        if k is not None and k < sims.shape[1]:
            masked = masked.topk(k, dim=1).values
    logits = torch.cat([pos, masked + margin], dim=1) / temperature
    return -torch.log_softmax(logits, dim=1)[:, 0]


def reduce_rows(terms: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """The one reduction of per-query terms [B]: their mean over the B queries; `weights` [B] multiply each
    query's term first (weight 0 removes it; the divisor stays B). None and all ones agree bit for bit."""
    if weights is None:
        return terms.mean()
    return (terms * weights.to(terms.dtype)).mean()


def topk_infonce(
    sims: torch.Tensor,
    negatives: torch.Tensor,
    k: int | torch.Tensor | None,
    temperature: float,
    margin: float = 0.0,
    zero_fill: bool = False,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean over rows of -log softmax of the positive (diagonal) against the row's k hardest valid
    negatives: `infonce_terms` reduced by `reduce_rows` (`weights` [B]: per-query weights)."""
    return reduce_rows(infonce_terms(sims, negatives, k, temperature, margin, zero_fill), weights)


class ADOPTLoss(InBatchLoss):
    """ADOPT (adaptive K) or, with `adaptive=False` and `fixed_k=None`, InfoNCE over all in-batch negatives.

    `fixed_k` pins K (the released code's `constant` mode; used to compare with a hardest-negative loss).
    The trainer records `step_log_keys` at every iteration (JSONL kind "step" + TensorBoard `step/K_i2t`),
    independent of `train.log_every`, so the K curve of the paper's appendix can be drawn from any run.
    """

    step_log_keys: tuple[str, ...] = ("K_i2t", "K_t2i", "align", "uniform")
    # the logged K / gammas as Python floats (one host read per call); False: 0-d device tensors, so the
    # loss has no host sync at all (compiled whole / CUDA graphs; read them when logging)
    host_diag: bool = True
    takes_weights = True

    def __init__(
        self,
        temperature: float = 0.05,
        variant: str = "paper",
        scale: float = 1.25,
        margin: float = 0.2,
        mask_same_image: bool = True,
        adaptive: bool = True,
        fixed_k: int | None = None,
        zero_fill_negatives: bool = False,
    ) -> None:
        super().__init__()
        if variant not in ADOPT_VARIANTS:
            raise ValueError(f"ADOPT variant {variant!r}; choose one of {', '.join(ADOPT_VARIANTS)}")
        if zero_fill_negatives and variant != "reference":
            raise ValueError("zero_fill_negatives reproduces the released code; it needs variant='reference'")
        if temperature <= 0:
            raise ValueError(f"temperature must be positive, got {temperature}")
        if fixed_k is not None and fixed_k < 1:
            raise ValueError(f"fixed_k must be >= 1, got {fixed_k}")
        self.temperature = temperature
        self.variant = variant
        self.scale = scale
        self.margin = margin if variant == "reference" else 0.0
        self.mask_same_image = mask_same_image
        self.adaptive = adaptive
        self.fixed_k = fixed_k
        self.zero_fill_negatives = zero_fill_negatives  # off by default: the positive is never a negative

    def forward(
        self,
        sims: torch.Tensor,
        image_ids: torch.Tensor | None = None,
        *,
        weights: torch.Tensor | None = None,
        **_: object,
    ) -> tuple[torch.Tensor, dict]:
        """`weights` [B]: per-sample weights of both directions' terms (`reduce_rows`); no warm-up form."""
        if sims.ndim != 2 or sims.shape[0] != sims.shape[1]:
            raise ValueError(
                f"ADOPT/InfoNCE needs a square in-batch similarity matrix, got {tuple(sims.shape)}"
            )
        b = sims.shape[0]
        if b < 2:
            raise ValueError(f"ADOPT needs at least 2 pairs in a batch, got {b}")
        sims = sims.float()
        positives = positive_mask(image_ids if self.mask_same_image else None, b, sims.device)
        # K, gamma_align and gamma_uniform stay on the device: no host read inside the loss
        align, uniform = adopt_gammas_tensor(sims, self.variant)
        if self.fixed_k is not None:
            k: int | torch.Tensor | None = min(self.fixed_k, b - 1)
        elif self.adaptive:
            k = adopt_k_tensor(align, uniform, b, self.variant, self.scale)
        else:
            k = None
        zf = self.zero_fill_negatives
        loss_i2t = topk_infonce(sims, ~positives, k, self.temperature, self.margin, zf, weights)
        loss_t2i = topk_infonce(sims.t(), ~positives.t(), k, self.temperature, self.margin, zf, weights)
        loss = loss_i2t + loss_t2i
        if self.variant == "reference":
            loss = loss / 2
        if torch.is_tensor(k):
            k_used = k.to(torch.float64)
        else:  # a fill, not a copy from the host
            k_used = torch.full(
                (), float(b - 1 if k is None else k), dtype=torch.float64, device=align.device
            )
        logged = torch.stack([k_used, align, uniform])
        if self.host_diag:  # one host read for the three numbers
            k_f, align_f, uniform_f = logged.tolist()
            logged_out: tuple = (k_f, k_f, align_f, uniform_f)
        else:
            logged_out = (logged[0], logged[0], logged[1], logged[2])
        diag = dict(zip(("K_i2t", "K_t2i", "align", "uniform"), logged_out, strict=True))
        diag.update({"loss_i2t": loss_i2t.detach(), "loss_t2i": loss_t2i.detach()})
        return loss, diag


def create_adopt_loss(cfg: LossConfig, adaptive: bool = True) -> ADOPTLoss:
    """The adaptive-K objective (`adopt`); `adaptive=False`: InfoNCE over every in-batch negative with the same
    temperature (`infonce`). Each loss's registration (losses/parts.py) says which it builds."""
    if not adaptive:
        return ADOPTLoss(cfg.temperature, "paper", mask_same_image=cfg.mask_same_image, adaptive=False)
    return ADOPTLoss(
        cfg.temperature,
        cfg.adopt_variant,
        cfg.adopt_scale,
        cfg.margin,
        cfg.mask_same_image,
        zero_fill_negatives=cfg.adopt_zero_fill_negatives,
    )
