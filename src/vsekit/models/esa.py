"""ESA (Zhu et al., TCSVT 2023; the released code KevinLight831/ESA, `ESA_BIGRU/`): the aggregator and
its two encoders.

The aggregator (`ESAPool`, the pooling a recipe names `esa`) weighs a set of vectors h [B, N, D] per channel:
e = linear1(h), w = softmax over the N positions of e, separately for each of the D channels, and the set's
vector is sum_n w[n, d] h[n, d]. The released image encoder runs the softmax over **every** padded position
(its padded rows are the residual MLP of a zero vector); the caption encoder masks past each caption's length.
`esa_mask_padding` chooses between the two on the image side (docs/esa.md).

In training the encoders make two views of every item, drawn from the training step's generator:
- `ESAImageEncoder`: two random region masks per image (each region kept when U >= `esa_region_drop`, 0.2), each
  a softmax over its kept regions only: [2B, D], rows (image 0 view 1, image 0 view 2, image 1 view 1, ...);
- `ESATextEncoder`: two augmented copies of each caption (mask / replace / delete, the data path's rule
  `augment_token_batch`) with dropout on the word embeddings (p = `esa_word_dropout`, 0.1): [2B, D], the same
  order. The SEL loss (`vsekit.losses.esa`) groups consecutive rows.
The draws are separate functions (`draw_region_keep`, `draw_caption_copies`, `draw_word_keep`) so the views can
also be given explicitly (`embed_views`), as the parity tests do with the draws the release recorded.
At evaluation there is one vector per item, as for every other encoder.
"""

from __future__ import annotations

import torch
from torch import nn

from vsekit.config import ImageEncoderConfig, TextEncoderConfig
from vsekit.data.datasets import augment_token_batch
from vsekit.data.text import END, MASK, PAD, START, Vocabulary
from vsekit.models.image import ResidualMLP, generator_device, to_device_async, xavier_linear
from vsekit.models.text import BiGRUTextEncoder
from vsekit.pooling import create_pooling, length_mask

TRAIN_VIEWS = 2  # the release makes exactly two views of each image and each caption (its loss's hardnum)
MASKED_SCORE = -10000.0  # the release's fill for left-out positions (exp underflows to 0 in float32)


def esa_aggregate(local: torch.Tensor, scores: torch.Tensor, keep: torch.Tensor | None) -> torch.Tensor:
    """sum_n softmax_n(scores)[n, d] * local[n, d]: [B, N, D] -> [B, D]. `keep` [B, N] (None: every position):
    a left-out position scores MASKED_SCORE and gets weight 0 (a set with nothing kept pools to 0)."""
    if keep is None:
        return (torch.softmax(scores, dim=1) * local).sum(1)
    k = keep.unsqueeze(-1)
    weights = torch.softmax(scores.masked_fill(~k, MASKED_SCORE), dim=1).masked_fill(~k, 0.0)
    return (weights * local).sum(1)


class ESAPool(nn.Module):
    """ESA's per-channel softmax aggregator (module docstring); `pool(features, lengths, keep=None)`.

    `mask_padding`: the softmax runs over each set's own positions; False: over all N positions (the released
    image encoder). `keep` [B, N], when given, says which positions count (a training view)."""

    def __init__(self, dim: int, mask_padding: bool = True) -> None:
        super().__init__()
        self.linear1 = nn.Linear(dim, dim)
        self.mask_padding = mask_padding

    def forward(
        self, features: torch.Tensor, lengths: torch.Tensor, keep: torch.Tensor | None = None
    ) -> torch.Tensor:
        if keep is None and self.mask_padding:
            keep = length_mask(lengths.to(features.device, non_blocking=True), features.shape[1])
        return esa_aggregate(features, self.linear1(features), keep)


def draw_region_keep(
    lengths: torch.Tensor, width: int, drop: float, within_lengths: bool, generator: torch.Generator | None
) -> torch.Tensor:
    """[B, TRAIN_VIEWS, width] bool: each position of each view kept when its uniform draw is >= `drop`.

    `within_lengths=False` is the release (every padded position drawn like a region, nothing guaranteed);
    True draws among each set's own positions only, and a view that drew none keeps its set's first region."""
    dev = lengths.device
    b = lengths.shape[0]
    u = to_device_async(
        torch.rand(b, TRAIN_VIEWS, width, generator=generator, device=generator_device(generator)), dev
    )
    keep = u >= drop
    if within_lengths:
        valid = length_mask(lengths, width).unsqueeze(1)
        keep = keep & valid
        first = (torch.arange(width, device=dev) == 0).view(1, 1, width)
        keep = keep | (first & ~keep.any(-1, keepdim=True))
    return keep


def draw_word_keep(
    shape: tuple[int, ...], drop: float, generator: torch.Generator | None, device: torch.device
) -> torch.Tensor:
    """Dropout's keep mask (each entry kept with probability 1 - `drop`) of the given shape."""
    u = torch.rand(shape, generator=generator, device=generator_device(generator))
    return to_device_async(u >= drop, device)


class ESAImageEncoder(nn.Module):
    """Region features -> fc + residual MLP -> ESA aggregator (two views in training); the model L2-normalises."""

    def __init__(
        self,
        img_dim: int,
        embed_dim: int,
        cfg: ImageEncoderConfig,
    ) -> None:
        super().__init__()
        self.fc = xavier_linear(img_dim, embed_dim)
        self.mlp = ResidualMLP(img_dim, cfg.mlp_hidden, embed_dim)
        self.pool = create_pooling(cfg.pooling, embed_dim)
        if not isinstance(self.pool, ESAPool):
            raise ValueError("the ESA image encoder needs model.image.pooling.name=esa")
        self.train_drop = cfg.pooling.esa_region_drop

    def local_features(self, feats: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """fc(x) + mlp(x) [B, N, D]. Released form (`mask_padding` off): every padded row is a row of the batch,
        in the BatchNorm statistics and in the output (the MLP of a zero vector)."""
        valid = length_mask(lengths, feats.shape[1])
        rows = valid if self.pool.mask_padding else torch.ones_like(valid)
        return self.fc(feats) + self.mlp(feats, rows)

    def embed_views(self, feats: torch.Tensor, lengths: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        """[B*V, D]: view v of image b (row b*V + v) pools the positions `keep[b, v]` [B, V, N] keeps."""
        lengths = lengths.to(feats.device, non_blocking=True)
        local = self.local_features(feats, lengths)
        b, v, n = keep.shape
        flat = local.unsqueeze(1).expand(b, v, n, local.shape[-1]).reshape(b * v, n, local.shape[-1])
        return self.pool(flat, lengths.repeat_interleave(v), keep=keep.reshape(b * v, n))

    def forward(
        self, feats: torch.Tensor, lengths: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        lengths = lengths.to(feats.device, non_blocking=True)
        if self.training:
            keep = draw_region_keep(
                lengths, feats.shape[1], self.train_drop, self.pool.mask_padding, generator
            )
            return self.embed_views(feats, lengths, keep)
        return self.pool(self.local_features(feats, lengths), lengths)


class ESATextEncoder(BiGRUTextEncoder):
    """Word embeddings -> BiGRU (directions averaged) -> ESA aggregator (masked by length); in training two
    augmented copies of each caption with dropout on the word embeddings."""

    draws_in_training = True  # VSEModel.encode_texts gives it the training step's generator

    def __init__(
        self,
        vocab_words: list[str],
        embed_dim: int,
        cfg: TextEncoderConfig,
    ) -> None:
        super().__init__(len(vocab_words), embed_dim, cfg)
        if not isinstance(self.pool, ESAPool):
            raise ValueError("the ESA text encoder needs model.text.pooling.name=esa")
        vocab = Vocabulary(vocab_words)
        w = vocab.word2idx
        self.ids = {
            "mask_id": w[MASK],
            "random_range": vocab.random_word_range(),
            "start_id": w[START],
            "end_id": w[END],
            "pad_id": w[PAD],
        }
        self.augment_prob = cfg.pooling.esa_caption_augment
        self.train_drop = cfg.pooling.esa_word_dropout

    def draw_caption_copies(
        self, tokens: torch.Tensor, lengths: torch.Tensor, generator: torch.Generator | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """TRAIN_VIEWS augmented copies of each caption: ([B*V, L], [B*V]), copy v of caption b at row b*V + v."""
        dev = generator_device(generator)
        t, n = tokens.to(dev), lengths.to(dev)
        copies = [
            augment_token_batch(t, n, generator, self.augment_prob, **self.ids) for _ in range(TRAIN_VIEWS)
        ]
        out_t = torch.stack([c[0] for c in copies], 1).reshape(-1, tokens.shape[1])
        out_n = torch.stack([c[1] for c in copies], 1).reshape(-1)
        return to_device_async(out_t, tokens.device), to_device_async(out_n, tokens.device)

    def embed_views(
        self, tokens: torch.Tensor, lengths: torch.Tensor, word_keep: torch.Tensor | None
    ) -> torch.Tensor:
        """[N, D] of the given captions (copies), the word embeddings times `word_keep` / (1 - p) when given."""
        lengths = lengths.to(tokens.device, non_blocking=True)
        x = self.embed(tokens)
        if word_keep is not None:
            x = x * word_keep.to(x.dtype) / (1.0 - self.train_drop)
        h = self.recurrent(x, lengths)
        return self.pool(h, lengths)

    def forward(
        self, tokens: torch.Tensor, lengths: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        if not self.training:
            return super().forward(tokens, lengths)
        copies, copy_lengths = self.draw_caption_copies(tokens, lengths.to(tokens.device), generator)
        keep = None
        if self.train_drop > 0:
            keep = draw_word_keep(
                (*copies.shape, self.embed.embedding_dim), self.train_drop, generator, tokens.device
            )
        return self.embed_views(copies, copy_lengths, keep)
