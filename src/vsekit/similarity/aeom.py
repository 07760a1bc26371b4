"""AEOM: AVSE's Asymmetric Embedding Optimal Matching (AVSE paper §3.2, Eq. 1–2).

An image embedding of `views * d` dims and a caption embedding of `d` dims are each cut into blocks of
`d2` dims (p = views*d/d2 image blocks, q = d/d2 caption blocks). A[i, j] is the cosine of image block i
and caption block j (Eq. 1). The p×q matrix gets one dustbin row and column, every dustbin cell holding
one learnable score z; `c` Sinkhorn iterations in log space on A / ε (entropic temperature ε, `temperature`; 1 by default: the
paper names none and the released code divides by nothing) push it towards the paper's marginals
a = [1_p, q] (rows) and b = [1_q, p] (columns); the dustbins are dropped and S(I, T) = Σ_j max_i A*_ij
(Eq. 2). What A* is, is the `readout`:

- "log_plan" (default): A* = the log of the plan, as the released code's Sinkhorn line reads it
  (`log_optimal_transport(...)[:, :-1, :-1]` then max/sum; with our unnormalised marginals the log plan
  equals that function's output, tested on the released-code fixtures). On random embeddings
  (d1 = 1024, d2 = 512, 2 views) its scores have a standard deviation of ~0.03;
- "plan": A* = the plan's probabilities exp(log plan) — Eq. 2 read literally. With ε = 1 and cosines in
  [−1, 1] the plan is nearly uniform, and the scores barely vary (std ~0.004 on the same embeddings);
- "maxsum" (= `use_sinkhorn=False`): no Sinkhorn, the block max-sum of the raw cosines
  S = Σ_j max_i A_ij — the released code's active line (its Sinkhorn call is commented out); std ~0.04.

The optimal transport is written from the mathematics (reference notes §8), not from SuperGlue's code.
Two implementations of the same iteration are kept on purpose:

- `log_sinkhorn_dustbin`: log space, differentiable, used whenever gradients are needed (training);
- `_scaled_scores`: the same updates in the scaling form u = a / (K v), v = b / (Kᵀ u) with K = exp(Z),
  exploiting that the dustbin row and column are constant (so each update costs O(p·q) per pair), in
  bounded-memory chunks without autograd. Evaluation of 1,000 × 5,000 pairs goes through it. The two
  agree to float32 rounding (tested); the scaling form falls back to log space when |z| is so large that
  exp() would leave float32's range.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from vsekit.config import SimilarityConfig

# past this spread of (scaled) scores and dustbin score the scaling form could under/overflow in float32; use log
# space instead (with temperature 1: |z| up to ~30)
_SCALED_MAX_SPREAD = 32.0
READOUTS = ("log_plan", "plan", "maxsum")


def split_blocks(x: torch.Tensor, block_dim: int) -> torch.Tensor:
    """[N, k*block_dim] -> [N, k, block_dim] with every block L2-normalised (Eq. 1's denominators)."""
    if x.shape[-1] % block_dim:
        raise ValueError(f"embedding size {x.shape[-1]} is not a multiple of the block size {block_dim}")
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // block_dim, block_dim)
    return nn.functional.normalize(blocks, dim=-1)


def block_affinity(image_emb: torch.Tensor, text_emb: torch.Tensor, block_dim: int) -> torch.Tensor:
    """Eq. 1 for all pairs: A[n_img, n_txt, p, q] = cosine(image block i, caption block j)."""
    ib = split_blocks(image_emb, block_dim)  # [Ni, p, d2]
    tb = split_blocks(text_emb, block_dim)  # [Nt, q, d2]
    return torch.einsum("apd,bqd->abpq", ib, tb)


def augment_with_dustbin(scores: torch.Tensor, dustbin: torch.Tensor) -> torch.Tensor:
    """[..., p, q] -> [..., p+1, q+1]: a last row and column filled with the one dustbin score."""
    *batch, p, q = scores.shape
    z = dustbin.to(scores.dtype)
    col = z.expand(*batch, p, 1)
    row = z.expand(*batch, 1, q + 1)
    return torch.cat([torch.cat([scores, col], dim=-1), row], dim=-2)


def dustbin_log_marginals(
    p: int, q: int, device: torch.device, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """log a = log [1_p, q] and log b = log [1_q, p] (AVSE §3.2; unnormalised: both sum to p + q)."""
    log_a = torch.zeros(p + 1, device=device, dtype=dtype)
    log_b = torch.zeros(q + 1, device=device, dtype=dtype)
    log_a[p] = math.log(q)
    log_b[q] = math.log(p)
    return log_a, log_b


def log_sinkhorn_dustbin(scores: torch.Tensor, dustbin: torch.Tensor, iters: int) -> torch.Tensor:
    """Log transport plan [..., p+1, q+1] after `iters` log-space Sinkhorn iterations (rows first).

    u ← log a − logsumexp_j(Z_ij + v_j), v ← log b − logsumexp_i(Z_ij + u_i), starting from v = 0;
    returns Z_ij + u_i + v_j. Adding one constant to every score and to the dustbin is absorbed by u.
    """
    if iters < 1:
        raise ValueError(f"Sinkhorn needs at least one iteration, got {iters}")
    *batch, p, q = scores.shape
    z = augment_with_dustbin(scores, dustbin)
    log_a, log_b = dustbin_log_marginals(p, q, scores.device, z.dtype)
    u = z.new_zeros(*batch, p + 1)
    v = z.new_zeros(*batch, q + 1)
    for _ in range(iters):
        u = log_a - torch.logsumexp(z + v.unsqueeze(-2), dim=-1)
        v = log_b - torch.logsumexp(z + u.unsqueeze(-1), dim=-2)
    return z + u.unsqueeze(-1) + v.unsqueeze(-2)


def max_sum(a: torch.Tensor) -> torch.Tensor:
    """Eq. 2: [..., p, q] -> [...]: for every caption block its best image block, summed."""
    return a.amax(dim=-2).sum(dim=-1)


def _scaled_sinkhorn_scores(
    k: torch.Tensor, e: float, p: int, q: int, iters: int, tol: float = 0.0, log: bool = False
) -> torch.Tensor:
    """Eq. 2 after Sinkhorn in scaling form on K = exp(A) laid out [p, q, n] (n pairs), dustbin cells = e;
    `log`: read the log plan (Σ_j log max_i P_ij) instead of the plan.

    Same iteration as `log_sinkhorn_dustbin` with u = exp(u_log), v = exp(v_log): the dustbin row/column
    being constant, the real rows update as u_i = 1 / (Σ_j K_ij v_j + e·v_d) and the dustbin row as
    u_d = q / (e·(Σ_j v_j + v_d)); columns likewise with p. All p rows (q columns) update in one op each.

    With `tol` > 0 the loop stops before `iters` once an iteration changes no column scaling by more than
    `tol` (relative): from there on the iteration is at its fixed point to float32 precision, so the
    remaining updates would not move the scores beyond rounding (checked against `tol=0` in the tests).
    """
    n = k.shape[-1]
    kt = k.transpose(0, 1)  # [q, p, n] view
    v, vd = k.new_ones(q, n), k.new_ones(n)
    u, row, col = k.new_empty(p, n), k.new_empty(p, n), k.new_empty(q, n)
    for it in range(iters):
        torch.mul(k[:, 0], v[0], out=row)
        for j in range(1, q):
            row.addcmul_(k[:, j], v[j])
        torch.reciprocal(row.add_(vd, alpha=e), out=u)
        ud = v.sum(0).add_(vd).mul_(e / q).reciprocal_()
        torch.mul(kt[:, 0], u[0], out=col)
        for i in range(1, p):
            col.addcmul_(kt[:, i], u[i])
        v_old = v.clone() if tol > 0 and it % 2 == 1 else None
        torch.reciprocal(col.add_(ud, alpha=e), out=v)
        vd = u.sum(0).add_(ud).mul_(e / p).reciprocal_()
        if v_old is not None and float((v_old.div_(v).sub_(1.0)).abs_().max()) <= tol:
            break
    # max_i u_i K_ij v_j = v_j · max_i u_i K_ij (v_j > 0); log is monotone, so max_i log P_ij = log max_i P_ij
    best = k.mul_(u.unsqueeze(1)).amax(0).mul_(v)
    return (best.log_() if log else best).sum(0)


class AEOMSimilarity(nn.Module):
    """Block-wise optimal-matching similarity of a multi-view image and a caption embedding."""

    def __init__(self, embed_dim: int, views: int, cfg: SimilarityConfig) -> None:
        super().__init__()
        if cfg.block_dim < 1 or embed_dim % cfg.block_dim:
            raise ValueError(
                f"model.embed_dim={embed_dim} must be a multiple of model.similarity.block_dim={cfg.block_dim}"
            )
        readout = getattr(cfg, "readout", "log_plan")
        if readout not in READOUTS:
            raise ValueError(f"model.similarity.readout={readout!r}; choose one of {', '.join(READOUTS)}")
        temperature = float(getattr(cfg, "temperature", 1.0))
        if not temperature > 0:
            raise ValueError(f"model.similarity.temperature must be positive, got {temperature}")
        self.readout = readout if cfg.use_sinkhorn else "maxsum"  # use_sinkhorn=False: the block max-sum
        self.use_sinkhorn = self.readout != "maxsum"
        if self.use_sinkhorn and cfg.sinkhorn_iters < 1:
            raise ValueError(f"model.similarity.sinkhorn_iters must be >= 1, got {cfg.sinkhorn_iters}")
        self.embed_dim, self.views = embed_dim, views
        self.block_dim = cfg.block_dim
        self.p = views * embed_dim // cfg.block_dim  # image blocks
        self.q = embed_dim // cfg.block_dim  # caption blocks
        self.iters = cfg.sinkhorn_iters
        self.temperature = temperature
        self.dustbin = nn.Parameter(torch.tensor(float(cfg.dustbin_init)))  # z; unused without Sinkhorn
        # p·q·pairs per no-grad chunk: 1 MiB of K on CPU (stays in cache); large on GPUs (few launches)
        self.chunk_elems: int | None = None
        # no-grad scoring stops iterating once the scalings reach their fixed point (see _scaled_sinkhorn_scores);
        # 0 runs exactly `iters` iterations. Training (log space, with gradients) always runs all of them.
        self.converged_tol = 1e-6

    def extra_repr(self) -> str:
        return (
            f"p={self.p}, q={self.q}, block_dim={self.block_dim}, readout={self.readout}, iters={self.iters}, "
            f"temperature={self.temperature}"
        )

    def _check(self, image_emb: torch.Tensor, text_emb: torch.Tensor) -> None:
        if image_emb.ndim != 2 or image_emb.shape[1] != self.views * self.embed_dim:
            raise ValueError(
                f"AEOM expects image embeddings [N, {self.views * self.embed_dim}] "
                f"({self.views} views x {self.embed_dim}), got {tuple(image_emb.shape)}"
            )
        if text_emb.ndim != 2 or text_emb.shape[1] != self.embed_dim:
            raise ValueError(
                f"AEOM expects caption embeddings [N, {self.embed_dim}], got {tuple(text_emb.shape)}"
            )

    def _read(self, log_plan: torch.Tensor) -> torch.Tensor:
        """A* from the log plan without dustbins, as the readout says."""
        return log_plan if self.readout == "log_plan" else log_plan.exp()

    def matched_affinity(self, image_emb: torch.Tensor, text_emb: torch.Tensor) -> torch.Tensor:
        """A* [Ni, Nt, p, q]: the Sinkhorn (log) plan without dustbins, or the raw cosines without Sinkhorn."""
        self._check(image_emb, text_emb)
        a = block_affinity(image_emb.float(), text_emb.float(), self.block_dim)
        if not self.use_sinkhorn:
            return a
        return self._read(
            log_sinkhorn_dustbin(a / self.temperature, self.dustbin, self.iters)[..., : self.p, : self.q]
        )

    def forward(self, image_emb: torch.Tensor, text_emb: torch.Tensor) -> torch.Tensor:
        """S [Ni, Nt] (Eq. 2). Differentiable when gradients are on; chunked and allocation-light when not."""
        self._check(image_emb, text_emb)
        needs_grad = torch.is_grad_enabled() and (
            image_emb.requires_grad or text_emb.requires_grad or self.dustbin.requires_grad
        )
        if needs_grad:
            return max_sum(self.matched_affinity(image_emb, text_emb))
        with torch.no_grad():
            return self.score_no_grad(image_emb, text_emb)

    @torch.no_grad()
    def score_no_grad(
        self, image_emb: torch.Tensor, text_emb: torch.Tensor, chunk_elems: int | None = None
    ) -> torch.Tensor:
        """S [Ni, Nt] in image chunks holding at most `chunk_elems` block scores (bounded memory)."""
        self._check(image_emb, text_emb)
        p, q, d2 = self.p, self.q, self.block_dim
        ni, nt = image_emb.shape[0], text_emb.shape[0]
        ib = split_blocks(image_emb.float(), d2)  # [Ni, p, d2]
        # caption blocks as one [d2, q*Nt] matrix: one GEMM per chunk gives all block cosines
        tb = split_blocks(text_emb.float(), d2).permute(2, 1, 0).reshape(d2, q * nt)
        out = torch.empty(ni, nt, device=image_emb.device, dtype=torch.float32)
        z, inv_t = float(self.dustbin), 1.0 / self.temperature
        # the Sinkhorn sees cosines / temperature in [-inv_t, inv_t] and the dustbin score z
        scaled = max(z, inv_t) - min(z, -inv_t) <= _SCALED_MAX_SPREAD
        # shift every score by m (the plan is invariant to it) so exp() stays in range
        m = max(z, inv_t)
        e = math.exp(z - m)
        budget = chunk_elems or self.chunk_elems or (1 << 25 if image_emb.device.type == "cuda" else 1 << 18)
        # on CPU the GEMM gets 16x larger chunks (small GEMMs are slow); the Sinkhorn then walks them in
        # cache-sized slices of `budget` block scores
        gemm_budget = budget * (16 if image_emb.device.type == "cpu" else 1)
        rows = max(1, gemm_budget // max(1, p * q * nt))
        pairs = max(1, budget // (p * q))
        for s in range(0, ni, rows):
            c = min(rows, ni - s)
            a = (ib[s : s + c].transpose(0, 1).reshape(p * c, d2) @ tb).view(p, c, q, nt)
            if not self.use_sinkhorn:
                out[s : s + c] = a.amax(0).sum(1)
                continue
            if not scaled:
                a = a.permute(1, 3, 0, 2).mul(inv_t)  # [c, Nt, p, q]
                out[s : s + c] = max_sum(
                    self._read(log_sinkhorn_dustbin(a, self.dustbin.detach(), self.iters)[..., :p, :q])
                )
                continue
            k = a.permute(0, 2, 1, 3).reshape(p, q, c * nt).mul_(inv_t).sub_(m).exp_()
            flat = out[s : s + c].view(-1)
            log = self.readout == "log_plan"
            for t in range(0, c * nt, pairs):
                flat[t : t + pairs] = _scaled_sinkhorn_scores(
                    k[:, :, t : t + pairs], e, p, q, self.iters, self.converged_tol, log
                )
        return out
