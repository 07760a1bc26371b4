"""ADPOOL, the adaptive pooling of VSE+2AD (Zhang et al., arXiv 2210.02206, §3.2).

Two simple poolings whose mixture is learned, for one set `x[B, N, D]` with `lengths[B]`:

- token level (Eq. 3): sort every dimension over the set (largest first, as GPO does), score each sorted
  row `u_m` with a learned vector, `theta = softmax_m(u_m · w_tok)`, and return `sum_m theta_m u_m`.
  One weight per rank: uniform weights are mean pooling, one-hot on rank 0 is max pooling, uniform
  over the first k ranks is k-max pooling — the model picks its point on that family.
- embedding level (Eq. 4): per dimension j, `delta_ij = softmax_i(x_ij)` over the set and the output is
  `sum_i delta_ij x_ij`, a parameter-free "soft max pooling" (temperature 1, as written).
- balance (Eq. 5): `omega = softmax([tok · w_bal, emb · w_bal])` per sample; output
  `omega_1 tok + omega_2 emb`.

`variant="reference"` swaps the token-level scorer for the one in the released code
(`modules/adcap.py` cls `AP`): `theta = softmax_m(ReLU(u W + b))` with `W` a D×D layer, i.e. a separate
weight per rank *and per dimension*. Both variants mask padding in every softmax by default; `mask_padding=False` reproduces the released
code, whose token-level softmax also runs over the batch's padded ranks (their features are 0, their
weights relu(b) are not), so an embedding there depends on how far its batch was padded.
The scorers have no bias in the paper variant because a bias is constant over the softmax axis and
cancels; the balance layer likewise. The reference variant keeps the released layer shapes, balance bias
included (it cancels too), so a released checkpoint loads strictly.
"""

from __future__ import annotations

import torch
from torch import nn

from vsekit.pooling.basic import length_mask, sort_desc_per_dim

ADPOOL_VARIANTS = ("paper", "reference")


class ADPool(nn.Module):
    """Learned mix of a sorted-rank weighted sum and a per-dimension softmax pooling.

    `pool(features[B,N,D], lengths[B]) -> [B,D]`; `return_weights=True` also returns a dict with the
    balance weights `balance[B, 2]` (columns: token, embedding; a disabled branch gets weight 0) and the
    token-level weights `token[B, N]` (`[B, N, D]` for the reference variant; None when disabled).
    """

    def __init__(
        self,
        dim: int,
        token_level: bool = True,
        embedding_level: bool = True,
        variant: str = "paper",
        mask_padding: bool = True,
    ) -> None:
        super().__init__()
        if not (token_level or embedding_level):
            raise ValueError(
                "ADPool needs at least one branch: token_level and embedding_level are both False"
            )
        if variant not in ADPOOL_VARIANTS:
            raise ValueError(f"ADPool variant {variant!r}; choose one of {', '.join(ADPOOL_VARIANTS)}")
        if dim < 1:
            raise ValueError(f"ADPool dim must be positive, got {dim}")
        self.dim = dim
        self.token_level = token_level
        self.embedding_level = embedding_level
        self.variant = variant
        self.mask_padding = mask_padding
        self.token_scorer: nn.Linear | None = None
        self.balance: nn.Linear | None = None
        if token_level:
            if variant == "paper":
                self.token_scorer = nn.Linear(dim, 1, bias=False)  # W_tok in R^{d x 1}
            else:
                self.token_scorer = nn.Linear(dim, dim)  # released code: Linear(D, D), Xavier, bias 0
                nn.init.xavier_uniform_(self.token_scorer.weight)
                nn.init.zeros_(self.token_scorer.bias)
        if token_level and embedding_level:
            self.balance = nn.Linear(dim, 1, bias=variant == "reference")  # W_bal in R^{d x 1}

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):  # type: ignore[override]
        """Runs saved before the reference variant kept the released balance bias load with bias 0 (it cancels)."""
        key = f"{prefix}balance.bias"
        if (
            self.balance is not None
            and self.balance.bias is not None
            and key not in state_dict
            and f"{prefix}balance.weight" in state_dict
        ):
            state_dict[key] = torch.zeros_like(self.balance.bias)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        return f"dim={self.dim}, token_level={self.token_level}, embedding_level={self.embedding_level}, variant={self.variant}"

    def _token_pool(
        self, x: torch.Tensor, lengths: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Eq. 3: sorted ranks weighted by a softmax over ranks (padding ranks sit at the end, masked)."""
        assert self.token_scorer is not None
        ordered = sort_desc_per_dim(x, lengths)  # [B, N, D], padded ranks are zeros at the end
        if self.variant == "paper":
            scores = self.token_scorer(ordered).squeeze(-1)  # [B, N]
            if self.mask_padding:
                scores = scores.masked_fill(~mask, float("-inf"))
            theta = torch.softmax(scores, dim=1)
            return (theta.unsqueeze(-1) * ordered).sum(1), theta
        scores = torch.relu(self.token_scorer(ordered))  # [B, N, D]
        if self.mask_padding:
            scores = scores.masked_fill(~mask.unsqueeze(-1), float("-inf"))
        theta = torch.softmax(scores, dim=1)
        return (theta * ordered).sum(1), theta

    @staticmethod
    def _embedding_pool(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Eq. 4: per-dimension softmax over the set of the values themselves (a soft max pooling)."""
        delta = torch.softmax(x.masked_fill(~mask.unsqueeze(-1), float("-inf")), dim=1)
        return (delta * x).sum(1)

    def forward(
        self, features: torch.Tensor, lengths: torch.Tensor, return_weights: bool = False
    ) -> torch.Tensor | tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
        if features.ndim != 3 or features.shape[-1] != self.dim:
            raise ValueError(
                f"ADPool(dim={self.dim}) expects features [B, N, {self.dim}], got {tuple(features.shape)}"
            )
        if lengths.shape != features.shape[:1]:
            raise ValueError(f"lengths must be [B]={features.shape[0]}, got {tuple(lengths.shape)}")
        # checked where it is free (CPU lengths, eager): on a GPU it would read the lengths back every call
        if lengths.device.type == "cpu" and not torch.compiler.is_compiling() and bool((lengths < 1).any()):
            raise ValueError("ADPool: every set needs at least one element (a length is 0)")
        lengths = lengths.to(features.device, non_blocking=True)
        # the full padded width (a fixed shape): masked padding gets softmax weight 0, so with mask_padding
        # the result does not depend on it; the released code's softmax (mask_padding=False) sees it all
        max_len = features.shape[1]
        mask = length_mask(lengths, max_len)
        x = features.masked_fill(~mask.unsqueeze(-1), 0.0)  # padding content (even NaN) can never leak
        tok = theta = emb = None
        if self.token_level:
            tok, theta = self._token_pool(x, lengths, mask)
        if self.embedding_level:
            emb = self._embedding_pool(x, mask)
        if tok is not None and emb is not None:
            assert self.balance is not None
            logits = torch.cat([self.balance(tok), self.balance(emb)], dim=1)  # [B, 2]
            omega = torch.softmax(logits, dim=1)
            pooled = omega[:, :1] * tok + omega[:, 1:] * emb
        else:
            pooled = tok if tok is not None else emb
            assert pooled is not None
            omega = pooled.new_zeros(pooled.shape[0], 2)
            omega[:, 0 if tok is not None else 1] = 1.0
        if return_weights:
            return pooled, {"balance": omega, "token": theta}
        return pooled
