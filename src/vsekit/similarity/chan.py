"""CHAN's late-interaction similarity (Pan et al., CVPR 2023): an image is its set of region vectors, a caption
its set of word vectors, not one vector each.

For image i and caption j: cos[r, w] = <region r of i, word w of j> (both L2-normalised); VHA coding keeps,
per word, its best region: code[w] = max over r (the released `VHACoding`); a pooling head over the words
gives the score:

- `lse` (the BiGRU configurations): log(sum_w exp(code[w] / temperature)), *not* multiplied back by the
  temperature: scores are on a ~1/temperature scale, and the loss's margin applies on that scale;
- `max`, `mean` (the BERT configurations), `sum`: the largest, the mean and the sum of the codes.

Padding: a set marks its padded rows as zero vectors (what the encoders give with the `none` pooling); padded
regions never win a word, padded words are left out of the pooling. The release fills padded entries with -1
and drops the codes equal to -1, which differs only for a genuine best cosine of exactly -1.

Every image is scored against every caption at once: [images x captions x regions x words] values, so
callers bound the shard sizes (`vsekit.similarity.pairs.all_pairs` does, from `pair_cost`).
"""

from __future__ import annotations

import torch
from torch import nn

WORD_POOLINGS = ("lse", "max", "mean", "sum")


def set_mask(emb: torch.Tensor) -> torch.Tensor:
    """[N, S] True for the rows of a set embedding [N, S, D] that hold an element (padding is a zero row)."""
    return emb.ne(0).any(-1)


def vha_codes(image_emb: torch.Tensor, text_emb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [Ni, Nt, L]: per caption word its best cosine over the image's regions; word mask [Nt, L])."""
    img_mask, txt_mask = set_mask(image_emb), set_mask(text_emb)
    cos = torch.einsum("ird,jwd->ijwr", image_emb, text_emb)  # [Ni, Nt, L, R]
    cos = cos.masked_fill(~img_mask[:, None, None, :], float("-inf"))
    codes = cos.amax(-1)  # every image has a region, so the max is finite
    return codes, txt_mask


def pool_codes(
    codes: torch.Tensor, word_mask: torch.Tensor, pooling: str, temperature: float
) -> torch.Tensor:
    """[Ni, Nt] scores from the codes [Ni, Nt, L] of the valid words (`word_mask` [Nt, L])."""
    valid = word_mask.unsqueeze(0)
    if pooling == "lse":
        return torch.logsumexp((codes / temperature).masked_fill(~valid, float("-inf")), dim=-1)
    if pooling == "max":
        return codes.masked_fill(~valid, float("-inf")).amax(-1)
    summed = codes.masked_fill(~valid, 0.0).sum(-1)
    if pooling == "sum":
        return summed
    if pooling == "mean":
        return summed / word_mask.sum(-1).clamp_min(1).to(summed.dtype).unsqueeze(0)
    raise ValueError(f"unknown CHAN word pooling {pooling!r}; choose one of {', '.join(WORD_POOLINGS)}")


class ChanSimilarity(nn.Module):
    """`sim(image_sets[Ni, R, D], caption_sets[Nt, L, D]) -> [Ni, Nt]` (module docstring)."""

    def __init__(self, pooling: str = "lse", temperature: float = 0.1) -> None:
        super().__init__()
        if pooling not in WORD_POOLINGS:
            raise ValueError(
                f"unknown CHAN word pooling {pooling!r}; choose one of {', '.join(WORD_POOLINGS)}"
            )
        self.pooling, self.temperature = pooling, float(temperature)

    def forward(self, image_emb: torch.Tensor, text_emb: torch.Tensor) -> torch.Tensor:
        if image_emb.ndim != 3 or text_emb.ndim != 3 or image_emb.shape[-1] != text_emb.shape[-1]:
            raise ValueError(
                f"CHAN scores sets [N, S, D]: got images {tuple(image_emb.shape)} and captions "
                f"{tuple(text_emb.shape)}"
            )
        codes, word_mask = vha_codes(image_emb, text_emb)
        return pool_codes(codes, word_mask, self.pooling, self.temperature)
