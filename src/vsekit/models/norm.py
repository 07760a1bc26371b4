"""L2 normalisation in the two forms that exist in the field.

`clamp` is torch's `F.normalize` (x / max(|x|, 1e-12)); `add_eps` is x / (|x| + 1e-8), the form every
released VSE∞ / VSE+2AD / AVSE model was trained with. The two differ by ~1e-8 relative on unit-scale
vectors; imported runs use `add_eps` so they compute what the released code computes.
"""

from __future__ import annotations

import torch
from torch import nn

L2_FORMS = ("clamp", "add_eps")


def l2_normalize(x: torch.Tensor, form: str = "clamp", dim: int = -1) -> torch.Tensor:
    """Unit vectors along `dim` in the given form (see the module docstring)."""
    if form == "clamp":
        return nn.functional.normalize(x, dim=dim)
    if form == "add_eps":
        return x / (x.pow(2).sum(dim=dim, keepdim=True).sqrt() + 1e-8)
    raise ValueError(f"unknown L2 normalisation form {form!r}; choose one of {', '.join(L2_FORMS)}")


def l2_normalize_views(x: torch.Tensor, form: str = "clamp", views: int = 1) -> torch.Tensor:
    """Each view of `x` [B, views x D] unit on its own (views > 1), else each vector along the last dimension
    ([B, D], or sets [B, S, D]): a model's final normalisation (`VSEModel`)."""
    if views > 1 and x.ndim == 2:
        return l2_normalize(x.reshape(x.shape[0], views, -1), form).reshape(x.shape[0], -1)
    return l2_normalize(x, form)


class MaskedBatchNorm1d(nn.BatchNorm1d):
    """BatchNorm1d over the valid rows of a padded, channel-last batch, without boolean indexing.

    `bn(x[..., C], mask[...])` normalises every row of `x` with statistics of the rows where `mask` is True,
    exactly what `nn.BatchNorm1d` computes on `x[mask]` (biased variance to normalise, unbiased variance
    and torch's momentum rule for the running update, running statistics in eval mode), but on the full
    padded tensor: the shapes never depend on the data and nothing is read back to the host, so it can be
    compiled whole or captured in a CUDA graph. Padded rows are read as zeros and come out normalised with
    the valid rows' statistics (finite values for the caller to zero, with zero gradient); their content
    never reaches the statistics or the gradients, even NaN. A subclass of `nn.BatchNorm1d`: parameters,
    buffers and state-dict keys are the same, so checkpoints load either way, and `mask=None` is plain
    `nn.BatchNorm1d` on `[N, C]` / `[N, C, L]`.

    One difference: `nn.BatchNorm1d` refuses a training batch with a single valid row; here (no host sync
    to check it) that row is normalised to `bias`, and the running variance update uses 0 for it.
    """

    @staticmethod
    def reduce_sum(t: torch.Tensor) -> torch.Tensor:
        """Sum of `t` over the processes that share the batch: one process here (see `convert_batchnorm`)."""
        return t

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:  # type: ignore[override]
        if mask is None:
            return super().forward(x)
        c = x.shape[-1]
        if c != self.num_features:
            raise ValueError(f"MaskedBatchNorm1d({self.num_features}) got {c} channels (channel-last input)")
        use_batch_stats = self.training or self.running_mean is None or self.running_var is None
        if not use_batch_stats:
            # rows are independent with running statistics: torch's own kernel, bit for bit the unpadded result
            out = nn.functional.batch_norm(
                x.reshape(-1, c),
                self.running_mean,
                self.running_var,
                self.weight,
                self.bias,
                False,
                0.0,
                self.eps,
            )
            return out.reshape(x.shape)
        xf = x.to(
            torch.promote_types(x.dtype, torch.float32)
        )  # bf16/fp16: float32 statistics, as torch keeps
        valid = mask.reshape(-1, 1)
        rows = torch.where(valid, xf.reshape(-1, c), 0.0)  # padding as zeros: finite values and gradients
        # sums over the valid rows, reduced across ranks under torchrun (`reduce_sum`, set by
        # vsekit.distributed.convert_batchnorm: the global batch's statistics); identity otherwise
        first = self.reduce_sum(torch.cat([rows.sum(0), valid.sum().to(xf.dtype).reshape(1)]))
        count = first[c].detach()  # valid rows, a device scalar
        mean = first[:c] / count.clamp_min(1.0)
        centred = rows - mean
        var_sum = self.reduce_sum(torch.where(valid, centred, 0.0).square().sum(0))
        var = var_sum / count.clamp_min(1.0)
        out = centred * torch.rsqrt(var + self.eps)
        if self.weight is not None:
            out = out * self.weight + self.bias
        if self.training and self.track_running_stats and self.running_mean is not None:
            self._update_running_stats(mean.detach(), (var_sum / (count - 1).clamp_min(1.0)).detach())
        return out.reshape(x.shape).to(x.dtype)

    @torch.no_grad()
    def _update_running_stats(self, mean: torch.Tensor, unbiased_var: torch.Tensor) -> None:
        """torch's rule: r <- (1 - m) r + m stat, m = momentum, or 1 / batches seen (cumulative) when None."""
        assert self.running_mean is not None and self.running_var is not None
        if self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
        if self.momentum is None:
            assert self.num_batches_tracked is not None
            m = 1.0 / self.num_batches_tracked.to(mean.dtype)  # a device tensor: no host read of the count
        else:
            m = self.momentum
        self.running_mean.copy_(m * mean + (1 - m) * self.running_mean)
        self.running_var.copy_(m * unbiased_var + (1 - m) * self.running_var)
