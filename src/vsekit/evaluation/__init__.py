"""Encode a split with a model and score it with the shared metrics module."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader

from vsekit.data.datasets import CaptionDataset, Collate, FeatureSource, ImageDataset
from vsekit.data.precomp import load_precomp_split
from vsekit.data.raw_images import PixelSource
from vsekit.features.backbones import pixel_transform_of
from vsekit.metrics import evaluate_sims
from vsekit.models.image_parts import reads_pixels
from vsekit.models.tokenizers import pad_id_for, text_processor_for  # noqa: F401  (public here too)
from vsekit.models.vse import VSEModel
from vsekit.similarity import all_pairs
from vsekit.utils.progress import progress_bar


def image_source_for(model: VSEModel, split):
    if reads_pixels(model.recipe.model.image.kind):  # pixels: a CNN backbone or the ViT of imported AVSE
        return PixelSource(
            split, model.recipe.model.image.image_size, augment=False, transform=pixel_transform_of(model)
        )
    split.require_width(model.spec.img_dim)  # a clear error naming the file, not a matmul shape error
    from vsekit.data.validate import check_split_features

    check_split_features(split)  # NaN/inf features: name the file and row, not "NaN in the similarity matrix"
    return FeatureSource(split, aug=None)


@torch.no_grad()
def encode_images(
    model: VSEModel,
    source,
    batch_size: int = 256,
    device: str | torch.device = "cpu",
    progress: bool = False,
    num_workers: int = 0,
) -> torch.Tensor:
    loader = DataLoader(
        ImageDataset(source),
        batch_size=batch_size,
        shuffle=False,
        collate_fn=Collate().images,
        num_workers=num_workers,
    )
    model.eval()
    out = []
    for batch in progress_bar(loader, desc="encode images", enabled=progress, leave=False):
        out.append(model.encode_images(batch.images.to(device), batch.image_lengths.to(device)).float().cpu())
    return cat_embeddings(out)


@torch.no_grad()
def encode_captions(
    model: VSEModel,
    captions: list[str],
    text,
    batch_size: int = 256,
    device: str | torch.device = "cpu",
    progress: bool = False,
) -> torch.Tensor:
    loader = DataLoader(
        CaptionDataset(captions, text),
        batch_size=batch_size,
        shuffle=False,
        collate_fn=Collate(pad_id_for(text)).captions,
    )
    model.eval()
    out = []
    for batch in progress_bar(loader, desc="encode captions", enabled=progress, leave=False):
        out.append(model.encode_texts(batch.tokens.to(device), batch.token_lengths.to(device)).float().cpu())
    return cat_embeddings(out)


def cat_embeddings(batches: list[torch.Tensor]) -> torch.Tensor:
    """The batches' embeddings in one tensor. Vectors [b, D] stack; sets [b, S, D] (late interaction), each
    batch padded to its own largest set, are padded with zero rows (a set's padding) to the widest."""
    if batches and batches[0].ndim == 3:
        width = max(b.shape[1] for b in batches)
        batches = [torch.nn.functional.pad(b, (0, 0, 0, width - b.shape[1])) for b in batches]
    return torch.cat(batches)


def split_similarities(
    model: VSEModel,
    split,
    batch_size: int = 256,
    device: str | torch.device = "cpu",
    progress: bool = False,
    text=None,
    source=None,
) -> np.ndarray:
    """[n_images, n_captions] similarity matrix of a split under `model`. `text` and `source`: the model's
    text processor and the split's image source when the caller holds them (the trainer validates every
    epoch: the vocabulary is not rebuilt, the features not checked again, each time)."""
    text = text_processor_for(model) if text is None else text
    source = image_source_for(model, split) if source is None else source
    img = encode_images(model, source, batch_size, device, progress)
    txt = encode_captions(model, split.captions, text, batch_size, device, progress)
    return all_pairs(model.sim, img, txt, device)


def evaluate_model(
    model: VSEModel,
    data_dir: str | Path,
    split_name: str,
    fold5: bool = False,
    batch_size: int = 256,
    device: str | torch.device = "cpu",
    progress: bool = True,
    max_images: int = 0,
) -> tuple[dict, np.ndarray, np.ndarray]:
    """Metrics, similarity matrix and caption->image map of a model on a split."""
    split = load_precomp_split(data_dir, split_name, model.recipe.data.captions_per_image).truncate(
        max_images
    )
    sims = split_similarities(model, split, batch_size, device, progress)
    return evaluate_sims(sims, split.cap2img, fold5=fold5), sims, split.cap2img
