"""The one vector per picture that an inner-product index holds (its *proxy*).

A cosine model's image embedding is one vector [D]: the proxy is the embedding itself, and the index is exact.
A multi-view (AVSE / AEOM) model embeds a picture as several views [V, D] (stored flat, V*D values), which no
single inner product can score; its proxy is the mean of the views, L2-normalised: the key a shortlist is drawn
by before the model's own similarity re-scores it, and the picture vector that picture -> picture search
compares. Building, extending, refreshing and searching an index all take their proxies from `picture_proxies`,
so the vectors of a refreshed index are the ones a fresh build writes, bit for bit.

A late-interaction (CHAN) model embeds a picture as its *set* of region vectors [S, D] (padding rows zero) and a
query as its set of word vectors [L, D]; its score takes per word the best region. No one vector per side gives
that score; the proxy of a set is the L2-normalised mean of its elements, on both sides (`query_proxies`), so the
first stage ranks pictures by the cosine of their mean region vector with the query's mean word vector, and the
model's own similarity re-scores the shortlist. Padding rows are zero, so the mean over all S rows points where
the mean of the real elements points: the one rule of multi-view pictures (`picture_proxies` with D values per
element) is the set rule too, whatever width a set was padded to.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def view_width(
    emb_shape: Sequence[int], embed_dim: int | None = None, multi_view: bool = False
) -> int | None:
    """The width D of one view when pictures of `emb_shape` (one picture's stored embedding shape) are multi-view,
    else None (the embedding is its own proxy): [V, D] -> D; a flat shape of a multi-view model (`multi_view`, as
    an index records it: its model's similarity is not an inner product) -> the model's `embed_dim`."""
    shape = [int(v) for v in emb_shape]
    if len(shape) > 1:
        return shape[-1]
    if multi_view and embed_dim:
        return int(embed_dim)
    return None


def picture_proxies(image_emb: np.ndarray | torch.Tensor, views_of: int | None) -> np.ndarray:
    """Image embeddings [N, ...] -> the proxies [N, D] as contiguous float32: the embeddings themselves
    (`views_of` None), or the mean of each picture's views of `views_of` values, L2-normalised (x / max(|x|, 1e-12))."""
    if views_of is None:
        x = image_emb.detach().float().cpu().numpy() if torch.is_tensor(image_emb) else np.asarray(image_emb)
        return np.ascontiguousarray(x.reshape(len(x), -1) if x.ndim != 2 else x, dtype=np.float32)
    if torch.is_tensor(image_emb):
        x = image_emb.detach().float().cpu()
    else:
        x = torch.from_numpy(
            np.array(image_emb, dtype=np.float32)
        )  # a writable copy (the stored ones are mapped)
    if x.shape[0] == 0:
        return np.zeros((0, views_of), dtype=np.float32)
    v = x.reshape(x.shape[0], -1, views_of).mean(1)
    return np.ascontiguousarray(torch.nn.functional.normalize(v, dim=-1).numpy(), dtype=np.float32)


def query_proxies(text_emb: np.ndarray | torch.Tensor, embed_dim: int, sets: bool) -> np.ndarray:
    """Query (caption) embeddings -> the [Q, D] float32 vectors a first stage searches with: the embeddings
    themselves ([Q, D]), or for a model that scores sets ([Q, L, D], padding rows zero) the L2-normalised mean of
    each query's word vectors (`picture_proxies`' rule, module docstring)."""
    if sets:
        x = text_emb.detach().float().cpu() if torch.is_tensor(text_emb) else torch.as_tensor(text_emb)
        return picture_proxies(x.reshape(x.shape[0], -1), embed_dim)
    return picture_proxies(text_emb, None)
