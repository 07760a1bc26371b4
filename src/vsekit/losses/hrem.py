"""HREM's training loss (Fu et al., CVPR 2023, released `graph_lib.GraphLoss`): the instance-level relation graph.

The graph exists only here: evaluation is the encoders' embeddings and one matrix product. After `warmup` calls
the loss builds, from the batch's normalised embeddings and the encoders' (detached) local sets:

- connections (no gradient): i2i, t2t from the in-batch inner products, i2t / t2i from the mean region–word
  relation, each entry kept when it reaches the k-th largest of its row (k = int(B · threshold));
- relevances: exp(−‖x − y‖) within a modality; across modalities the region–word relation (`region_word`):
  a learned MLP over the top-K word→region (t2i) or region→word (i2t) maxima plus their mean;
- a KL regulariser pulling exp(−cdist(img, cap)) towards the learned relation (the release's argument order:
  the learned relation is the "target" distribution and carries the gradient);
- one transformer layer over the 2B embeddings with the attention bias mask_weight · relevance, −inf where not
  connected; its output halves, normalised, are the relation-enhanced embeddings;
- distance-weighted triplet terms (`DistanceWeightedTriplet`) on (img, cap), (img, cap_gnn), (img_gnn, cap),
  (img_gnn, cap_gnn), plus reg_weight · the regulariser. Before the warm-up ends only the first term counts.

The release's quirks are kept (docs/hrem.md): the region–word relation includes padded positions (all regions;
a caption's first K positions when it is shorter than K), and the warm-up counts calls, not epochs. Where the
release would fail (a caption width or a region count below K) the sets are padded with zero vectors.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vsekit.losses.base import InBatchLoss, StepContext
from vsekit.pooling.basic import length_mask

WEIGHT_DIM = 512.0  # the release's `self.d`: a constant of the distance weighting, not the embedding width
MIN_DIST = 0.5  # the release's `cut_off`: distances are clamped below at this value


class DistanceWeightedTriplet(nn.Module):
    """The release's `TripletLoss` ('trip'): per positive pair one negative drawn with distance weights
    ("Sampling matters in deep embedding learning", Wu et al. 2017), hinge on the drawn negative."""

    def __init__(self, margin: float = 0.2, cutoff: float = 1.7) -> None:
        super().__init__()
        self.margin, self.cutoff = margin, cutoff

    def weights(self, sims: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
        """[B, B] sampling weights of each anchor row (rows sum to 1, or are all 0: no negative in reach)."""
        with torch.no_grad():
            dist = (2 - 2 * sims).sqrt().clamp(min=MIN_DIST)
            log_w = (2.0 - WEIGHT_DIM) * dist.log() - ((WEIGHT_DIM - 3.0) / 2.0) * (
                1.0 - 0.25 * dist * dist
            ).log()
            bad = ~torch.isfinite(log_w)
            log_w = (log_w * neg).masked_fill(bad, 0.0)
            w = (log_w - log_w.max(dim=1, keepdim=True).values).exp()
            w = w * (neg & (dist < self.cutoff)).to(w.dtype)
            return w / (w.sum(dim=1, keepdim=True) + 1e-20)

    def direction(
        self,
        sims: torch.Tensor,
        pos: torch.Tensor,
        generator: torch.Generator | None,
        drawn: torch.Tensor | None,
        record: list | None,
    ) -> torch.Tensor:
        """One anchored direction: rows of `sims` are anchors. `drawn`: the negatives to use (a replay of the
        release's draws) instead of drawing them."""
        pairs = pos.nonzero()
        anchor, positive = pairs[:, 0], pairs[:, 1]
        rows = self.weights(sims, ~pos)[anchor]
        if record is not None:
            record.append(rows)
        if drawn is None:
            if not bool((rows.sum(1) > 0).all()):  # the release's multinomial fails: the direction counts 0
                return sims.new_zeros(())
            drawn = torch.multinomial(rows, 1, generator=generator).squeeze(1)
        drawn = drawn.to(sims.device)
        return F.relu(self.margin + sims[anchor, drawn] - sims[anchor, positive]).sum()

    def forward(
        self,
        im: torch.Tensor,
        s: torch.Tensor,
        pos: torch.Tensor,
        generator: torch.Generator | None = None,
        drawn: list[torch.Tensor] | None = None,
        record: list | None = None,
    ) -> torch.Tensor:
        """Image-anchored then caption-anchored, the order the release draws in; `drawn` holds two draws."""
        sims = im @ s.t()
        first = self.direction(sims, pos, generator, drawn[0] if drawn else None, record)
        second = self.direction(sims.t(), pos.t(), generator, drawn[1] if drawn else None, record)
        return first + second


def kl_target(guide: torch.Tensor, learned: torch.Tensor) -> torch.Tensor:
    """The release's `kl_div(A, B)`: Σ softmax(B) (log softmax(B) − log softmax(A)) / rows, B the learned one."""
    return F.kl_div(F.log_softmax(guide, dim=-1), F.softmax(learned, dim=-1), reduction="batchmean")


def row_topk_connect(values: torch.Tensor, k: int) -> torch.Tensor:
    """Entries reaching the k-th largest value of their row (ties included)."""
    kth = values.topk(k=max(1, min(k, values.shape[1])), dim=1).values[:, -1:]
    return values - kth >= 0


def pad_to(x: torch.Tensor, width: int) -> torch.Tensor:
    """[B, N, D] with zero rows appended up to `width` positions (when N is smaller)."""
    return F.pad(x, (0, 0, 0, width - x.shape[1])) if x.shape[1] < width else x


def region_word(
    regions: torch.Tensor, words: torch.Tensor, word_lengths: torch.Tensor, topk: int
) -> tuple[torch.Tensor, ...]:
    """The release's `AdjacencyLearning` inputs, all captions at once: (t2i_topk [C, I, K], t2i_mean [C, I],
    i2t_topk [I, C, K], i2t_mean [I, C]). Every region position counts (padding included); caption c uses
    its first max(n_c, K) positions."""
    regions = F.normalize(pad_to(regions, topk), dim=-1)
    words = pad_to(words, topk)
    n = word_lengths.to(words.device)
    width = words.shape[1]
    selected = length_mask(n.clamp(min=topk), width)  # [C, L]
    real = length_mask(n, width)
    words = F.normalize(words, dim=-1) * selected.unsqueeze(-1)
    a = F.leaky_relu(torch.einsum("cld,ird->cilr", words, regions), negative_slope=0.1)  # [C, I, L, R]
    sel = selected[:, None, :, None]
    # t2i: normalised over the selected words, best region per word
    a_w = a / (a.square() * sel).sum(2, keepdim=True).sqrt().clamp_min(1e-12)
    row = a_w.amax(3)  # [C, I, L]
    t2i_mean = (row * real[:, None, :]).sum(2) / n.clamp(min=1)[:, None].to(row.dtype)
    t2i_topk = row.masked_fill(~selected[:, None, :], float("-inf")).topk(topk, dim=2).values
    # i2t: normalised over the regions, best real word per region
    a_r = F.normalize(a, dim=3)
    column = a_r.masked_fill(~real[:, None, :, None], float("-inf")).amax(2)  # [C, I, R]
    i2t_mean = column.mean(2).t()
    i2t_topk = column.topk(topk, dim=2).values.transpose(0, 1)
    return t2i_topk, t2i_mean, i2t_topk, i2t_mean


def relation_mlp(k: int) -> nn.Sequential:
    """Linear K -> K, ReLU, Dropout(0), Linear K -> 1: the release's `mlp_t2i` / `mlp_i2t` (keys 0.*, 3.*)."""
    return nn.Sequential(nn.Linear(k, k), nn.ReLU(), nn.Dropout(0.0), nn.Linear(k, 1))


class HREMLoss(InBatchLoss):
    """HREM's loss (module docstring). Its own parameters (the graph layer, the relation MLPs) and its call
    counter are in its state dict: the trainer trains and checkpoints them."""

    needs_sets = True
    needs_generator = True

    def __init__(
        self,
        embed_dim: int,
        heads: int = 16,
        margin: float = 0.2,
        cutoff: float = 1.7,
        threshold: float = 0.5,
        topk: int = 10,
        mask_weight: float = 1.0,
        reg_weight: float = 10.0,
        warmup: int = 8000,
        cross_terms: bool = True,
        dropout: float = 0.1,
    ) -> None:
        super().__init__()
        if embed_dim % heads:
            raise ValueError(f"HREM loss: embed size {embed_dim} is not divisible by {heads} attention heads")
        layer = nn.TransformerEncoderLayer(
            d_model=embed_dim, nhead=heads, dim_feedforward=embed_dim, dropout=dropout
        )
        self.gnn = nn.TransformerEncoder(layer, num_layers=1, enable_nested_tensor=False)
        self.mlp_t2i = relation_mlp(topk)
        self.mlp_i2t = relation_mlp(topk)
        self.triplet = DistanceWeightedTriplet(margin, cutoff)
        self.threshold, self.topk, self.mask_weight = threshold, topk, mask_weight
        self.reg_weight, self.warmup, self.cross_terms = reg_weight, warmup, cross_terms
        self.register_buffer(
            "iter_count", torch.zeros((), dtype=torch.long)
        )  # the release's iteration counter

    def relations(self, img: torch.Tensor, cap: torch.Tensor, image_set, text_set) -> dict[str, torch.Tensor]:
        """Connections, relevances and the regulariser of one batch (the release's `AdjacencyModel`)."""
        b = img.shape[0]
        k = int(b * self.threshold)
        with torch.no_grad():
            connect_i2i = row_topk_connect(img @ img.t(), k)
            connect_t2t = row_topk_connect(cap @ cap.t(), k)
        t2i_topk, t2i_mean, i2t_topk, i2t_mean = region_word(
            image_set[0].detach().float(), text_set[0].detach().float(), text_set[1], self.topk
        )
        t2i = self.mlp_t2i(t2i_topk).squeeze(-1) + t2i_mean
        i2t = self.mlp_i2t(i2t_topk).squeeze(-1) + i2t_mean
        guide = torch.exp(-torch.cdist(img, cap)).detach()
        return {
            "connect_i2i": connect_i2i,
            "connect_t2t": connect_t2t,
            "connect_t2i": row_topk_connect(t2i_mean, k),
            "connect_i2t": row_topk_connect(i2t_mean, k),
            "relation_i2i": torch.exp(-torch.cdist(img, img)),
            "relation_t2t": torch.exp(-torch.cdist(cap, cap)),
            "relation_t2i": t2i,
            "relation_i2t": i2t,
            "t2i_topk": t2i_topk,
            "i2t_topk": i2t_topk,
            "t2i_mean": t2i_mean,
            "i2t_mean": i2t_mean,
            "reg": kl_target(guide, i2t) + kl_target(guide.t(), t2i),
        }

    def graph(self, img: torch.Tensor, cap: torch.Tensor, r: dict[str, torch.Tensor]) -> torch.Tensor:
        """The 2B embeddings [img; cap] through the graph layer under the relation bias: [2B, D]."""
        connect = torch.cat(
            [
                torch.cat([r["connect_i2i"], r["connect_i2t"]], 1),
                torch.cat([r["connect_t2i"], r["connect_t2t"]], 1),
            ]
        )
        relation = torch.cat(
            [
                torch.cat([r["relation_i2i"], r["relation_i2t"]], 1),
                torch.cat([r["relation_t2i"], r["relation_t2t"]], 1),
            ]
        )
        bias = self.mask_weight * relation.masked_fill(~connect, float("-inf"))
        return self.gnn(torch.cat([img, cap]).unsqueeze(1), bias).squeeze(1)

    def forward(
        self,
        sims: torch.Tensor,
        image_ids: torch.Tensor | None = None,
        caption_ids=None,
        warmup: bool = False,
        image_emb: torch.Tensor | None = None,
        text_emb: torch.Tensor | None = None,
        image_set: tuple | None = None,
        text_set: tuple | None = None,
        generator: torch.Generator | None = None,
        drawn: torch.Tensor | None = None,
        record: dict | None = None,
        context: StepContext | None = None,
        weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict]:
        """`image_emb` / `text_emb`: the normalised embeddings [B, D]; `image_set` / `text_set`: (local features
        [B, N, D], lengths) the encoders pooled; `image_ids`: the image of each row (equal ids are positives).
        `drawn` [8, P]: replay these negatives instead of drawing them (parity with recorded draws); `record`:
        a dict that receives the intermediate values. `context` (the step's) and `weights` are not read: the
        sampled triplet has no per-sample reduction yet. The trainer's `warmup` flag has no meaning here (the
        release's triplet has no all-negatives form); the graph's own warm-up counts calls."""
        if image_emb is None or text_emb is None or image_set is None or text_set is None:
            raise ValueError("the HREM loss needs the embeddings and the encoders' local sets")
        img, cap = image_emb.float(), text_emb.float()
        b = img.shape[0]
        ids = image_ids if image_ids is not None else torch.arange(b, device=img.device)
        ids = ids.to(img.device)
        pos = ids.unsqueeze(0) == ids.unsqueeze(1)
        draws = list(drawn) if drawn is not None else None
        weights: list | None = [] if record is not None else None
        calls = iter(range(0, 8, 2))  # each triplet term draws twice (image-, then caption-anchored)

        def triplet(a: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
            call = next(calls)
            return self.triplet(a, c, pos, generator, draws[call : call + 2] if draws else None, weights)

        base = triplet(img, cap)
        diag: dict[str, torch.Tensor] = {"loss_base": base.detach()}
        loss = base
        if int(self.iter_count) >= self.warmup:
            r = self.relations(img, cap, image_set, text_set)
            out = self.graph(img, cap, r)
            img_gnn, cap_gnn = F.normalize(out[:b], dim=-1), F.normalize(out[b:], dim=-1)
            terms = [triplet(img, cap_gnn), triplet(img_gnn, cap)] if self.cross_terms else []
            terms.append(triplet(img_gnn, cap_gnn))
            names = ["loss_gnn1", "loss_gnn2", "loss_gnn3"][-len(terms) :]
            diag.update(
                {name: t.detach() for name, t in zip(names, terms, strict=True)}, loss_reg=r["reg"].detach()
            )
            loss = base + sum(terms) + self.reg_weight * r["reg"]
            if record is not None:
                record.update(r, gnn_out=out)
        if record is not None:
            record["triplet_weights"] = weights
        self.iter_count += 1
        return loss, diag
