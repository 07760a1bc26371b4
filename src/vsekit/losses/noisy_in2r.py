"""IN2R's parts (ICML'26, released code at 909e532): NCR's split on a dual encoder whose embeddings are
centred per batch, a warm-up over two dropout passes, intra-modal hinges, a memory queue of confidently clean
pairs per network and an attention refiner that rebuilds a partner for each unlabeled sample from the *peer's*
queue. Pure functions and two small modules; the split itself is `vsekit.losses.noisy_split`
(`split_losses(..., centre=True)`).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from vsekit.losses.noisy_split import centred_l2norm, hardest_hinge
from vsekit.utils.dropout import seeded_dropout

INFONCE_TAU = 0.05
INTRA_MARGIN = 0.3  # the hinge between the two forward passes of one modality
MASK_EPS = 1e-7


def infonce(sims: torch.Tensor, tau: float = INFONCE_TAU) -> torch.Tensor:
    """IN2R's symmetric cross-entropy of a square batch: with `L = log(eye + 1e-7)`,
    `0.5 * (-(L * i2t).sum(1).mean() - (L * t2i).sum(1).mean() - log diag(i2t).mean() - log diag(t2i).mean())`."""
    n = sims.shape[0]
    p = torch.exp(sims / tau)
    i2t = p / p.sum(1, keepdim=True)
    t2i = p.t() / p.t().sum(1, keepdim=True)
    log_mask = torch.log(torch.eye(n, dtype=sims.dtype, device=sims.device) + MASK_EPS)
    return 0.5 * (
        -(log_mask * i2t).sum(1).mean()
        - (log_mask * t2i).sum(1).mean()
        - torch.log(i2t.diagonal()).mean()
        - torch.log(t2i.diagonal()).mean()
    )


def warmup_loss(
    img1: torch.Tensor, img2: torch.Tensor, cap1: torch.Tensor, cap2: torch.Tensor
) -> torch.Tensor:
    """Warm-up on two forward passes (raw encoder outputs): `infonce(i1 c1^T) + infonce(i1 i2^T) + infonce(c1 c2^T)`
    of the centred, normalised embeddings."""
    return warmup_terms(*(centred_l2norm(x) for x in (img1, img2, cap1, cap2)))


def warmup_terms(
    i1: torch.Tensor, i2: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor, tau: float = INFONCE_TAU
) -> torch.Tensor:
    """`warmup_loss` on embeddings already centred and normalised (what a `model.centre: batch` model gives)."""
    return infonce(i1 @ c1.t(), tau) + infonce(i1 @ i2.t(), tau) + infonce(c1 @ c2.t(), tau)


def labeled_loss(
    img1: torch.Tensor,
    img2: torch.Tensor,
    cap1: torch.Tensor,
    cap2: torch.Tensor,
    margin: float,
    intra_margin: float = INTRA_MARGIN,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(cross-modal hinge, image hinge, caption hinge) of the labeled batch's two passes (normalised embeddings):
    hardest-negative hinges with margin `margin` and `intra_margin`; IN2R uses no soft margin here."""
    return (
        hardest_hinge(img1 @ cap1.t(), margin),
        hardest_hinge(img1 @ img2.t(), intra_margin),
        hardest_hinge(cap1 @ cap2.t(), intra_margin),
    )


class MemoryQueue(nn.Module):
    """A circular store of (image, caption) embeddings of pairs a network deems clean; `ptr` is the next row
    to write and `is_full` says it has wrapped (then every row is in use). Its rows and cursor are buffers,
    so they are saved with the run's loss state (`cursor` = [ptr, is_full])."""

    def __init__(self, size: int, dim: int) -> None:
        super().__init__()
        self.register_buffer("img", torch.zeros(size, dim))
        self.register_buffer("txt", torch.zeros(size, dim))
        self.register_buffer("cursor", torch.zeros(2, dtype=torch.long))
        self.ptr = 0
        self.is_full = False
        self.register_load_state_dict_post_hook(lambda module, _: module._read_cursor())

    def _read_cursor(self) -> None:
        ptr, full = self.cursor.tolist()
        self.ptr, self.is_full = int(ptr), bool(full)

    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        """Only the rows in use are saved: until the queue wraps, the rows from `ptr` on were never written
        (zeros), and a small set's queue of 65,536 rows is mostly those (hundreds of MB a checkpoint)."""
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if not self.is_full:
            for name in ("img", "txt"):
                destination[prefix + name] = destination[prefix + name][: self.ptr]

    def _load_from_state_dict(self, state_dict, prefix, *args) -> None:
        """A saved queue of fewer rows than `size` is its used rows: padded back with the zeros it left out."""
        for name in ("img", "txt"):
            saved = state_dict.get(prefix + name)
            full = getattr(self, name)
            if saved is not None and saved.ndim == 2 and saved.shape[0] < full.shape[0]:
                padded = torch.zeros_like(full)
                padded[: saved.shape[0]] = saved.to(full.dtype)
                state_dict[prefix + name] = padded
        super()._load_from_state_dict(state_dict, prefix, *args)

    @property
    def size(self) -> int:
        return int(self.img.shape[0])

    def used(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows in use: all when full, else the first `ptr`."""
        n = self.size if self.is_full else self.ptr
        return self.img[:n], self.txt[:n]

    @torch.no_grad()
    def enqueue(self, img: torch.Tensor, txt: torch.Tensor) -> None:
        """Append rows (detached), wrapping around at the end, as the release's chunked writes do."""
        for start in range(0, img.shape[0], self.size):  # more rows than the queue holds: in turns
            i, t = img[start : start + self.size].detach(), txt[start : start + self.size].detach()
            n = i.shape[0]
            rows = (self.ptr + torch.arange(n, device=self.img.device)) % self.size
            self.img[rows] = i.to(self.img.dtype)
            self.txt[rows] = t.to(self.txt.dtype)
            self.is_full = self.is_full or self.ptr + n >= self.size
            self.ptr = (self.ptr + n) % self.size
        self.cursor.copy_(torch.tensor([self.ptr, int(self.is_full)]))

    def state(self) -> dict:
        """Everything needed to resume bit-exactly."""
        return {"img": self.img.clone(), "txt": self.txt.clone(), "ptr": self.ptr, "is_full": self.is_full}

    @torch.no_grad()
    def load_state(self, state: dict) -> None:
        self.img.copy_(state["img"])
        self.txt.copy_(state["txt"])
        self.cursor.copy_(torch.tensor([int(state["ptr"]), int(bool(state["is_full"]))]))
        self._read_cursor()


def confident_rows(prob: torch.Tensor, avg_clean_prob: float) -> torch.Tensor:
    """Rows of the labeled batch that enter the queue: `prob > avg_clean_prob`, compared in float32 as released
    (prob = the peer's probabilities, avg = the network's own mean over its predicted-clean set)."""
    prob = torch.as_tensor(prob, dtype=torch.float32).reshape(-1)
    return prob > torch.tensor(avg_clean_prob, dtype=torch.float32, device=prob.device)


def average_clean_prob(prob: np.ndarray, pred: np.ndarray) -> float:
    """Mean clean probability over the predicted-clean set (the queue's threshold)."""
    prob, pred = np.asarray(prob), np.asarray(pred, dtype=bool)
    return float(prob[pred].mean()) if pred.any() else 1.0


class GraphRefiner(nn.Module):
    """IN2R's refiner: multi-head attention among the k neighbours, a residual LayerNorm, the mean over them,
    l2-normalised. `edge_nn` exists for checkpoint compatibility; the release never uses it."""

    def __init__(
        self, dim: int, heads: int = 4, dropout: float = 0.1, edge_hidden: int | None = None
    ) -> None:
        super().__init__()
        if dim % heads:
            raise ValueError(f"embedding size {dim} is not divisible by {heads} heads")
        self.heads = heads
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        hidden = edge_hidden or dim // 2
        self.edge_nn = nn.Sequential(nn.Linear(2 * dim, hidden), nn.ReLU(), nn.Linear(hidden, 1))
        self.output_layer = nn.Linear(dim, dim)
        self.layer_norm = nn.LayerNorm(dim, eps=1e-5)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        """`x [b, k, E]` -> `[b, E]` unit rows (the attention output's dropout, in training, from `generator`)."""
        b, k, dim = x.shape
        hd = dim // self.heads

        def split(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, k, self.heads, hd).transpose(1, 2)

        q, kk, v = split(self.q_proj(x)), split(self.k_proj(x)), split(self.v_proj(x))
        attn = torch.softmax(q @ kk.transpose(-1, -2) / math.sqrt(hd), dim=-1)
        context = (attn @ v).transpose(1, 2).reshape(b, k, dim)
        # the release applies its dropout after output_layer
        out = self.layer_norm(
            x + seeded_dropout(self.output_layer(context), self.dropout.p, self.training, generator)
        )
        return nn.functional.normalize(out.mean(1), dim=-1)


def refined_partners(
    queries: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    k: int,
    refiner: nn.Module,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(neighbours `[b, k, E]`, refined partner `[b, E]`): the `k` queue rows whose `keys` are most similar
    to each query, their `values` gathered and refined."""
    idx = (queries @ keys.t()).topk(min(k, keys.shape[0]), dim=1)[1]
    neighbours = values[idx]
    return neighbours, refiner(neighbours, generator)


def eval_embeddings(img_raw: torch.Tensor, cap_raw: torch.Tensor, batch_size: int, per_image: int = 5):
    """(image, caption) embeddings as IN2R's `encode_data`: consecutive batches of captions, the image of
    caption c being `img_raw[c // per_image]`, each batch centred and normalised; image i = row of caption
    `per_image * i`."""
    n_cap = cap_raw.shape[0]
    img_rows = torch.as_tensor(np.arange(n_cap) // per_image)
    img_out, cap_out = torch.empty_like(cap_raw), torch.empty_like(cap_raw)
    for start in range(0, n_cap, batch_size):
        sl = slice(start, start + batch_size)
        img_out[sl] = centred_l2norm(img_raw[img_rows[sl]])
        cap_out[sl] = centred_l2norm(cap_raw[sl])
    return img_out[::per_image], cap_out
