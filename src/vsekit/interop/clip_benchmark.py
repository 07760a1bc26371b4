"""A vsekit run as the (model, transform, tokenizer) triple that CLIP_benchmark and open_clip code expect.

    from clip_benchmark.metrics import zeroshot_retrieval
    from vsekit.interop.clip_benchmark import load_for_clip_benchmark, retrieval_dataloader

    model, transform, tokenizer = load_for_clip_benchmark("runs/x")
    loader = retrieval_dataloader("data/shapes", "test", transform)          # or any CLIP_benchmark loader
    metrics = zeroshot_retrieval.evaluate(model, loader, tokenizer, "cpu", recall_k_list=[1, 5, 10])

What CLIP_benchmark's zero-shot retrieval (`clip_benchmark.metrics.zeroshot_retrieval.evaluate`, 1.6.2) does
with the three: for each batch (pictures [B, 3, S, S], a list of caption lists) it calls
`tokenizer(list_of_strings).to(device)`, then, under `torch.autocast(device, enabled=amp)`,
`F.normalize(model.encode_image(pixels))` and `F.normalize(model.encode_text(tokens))`, scores every caption
against every picture by inner product and counts a query as a hit when any of its positives is in its top k.

- `model.encode_image(pixels)`: pixel runs (backbone / ViT recipes) take the pictures directly; runs trained
  on precomputed features take them through the feature extractor their dataset recorded (as `vse index`
  does: EfficientNet-Lite0 grid features, rounded to float16 like the stored ones). A feature run that
  records no extractor cannot take pictures: `load_for_clip_benchmark` raises VseInputError saying so.
- `model.encode_text(tokens)`: tokens are what `tokenizer` returns, a LongTensor [B, L] right-padded with the
  run's pad id (0 for the BiGRU/bag-of-words vocabulary, the tokenizer's `pad_token_id` for transformers,
  0 for BERT/MiniLM); the lengths the BiGRU needs are recovered from the padding.
- Both run in float32 whatever autocast CLIP_benchmark opened (`amp=True` is its default; on a CPU that is
  bfloat16), so the embeddings are those of `vse eval`; `autocast=True` lets a caller's autocast apply.
- AVSE runs (several image views scored by AEOM) have no single image vector to compare by cosine: refused.

Key correspondence (CLIP_benchmark fractions in [0, 1], vsekit percentages; `to_vsekit_keys` converts):
`image_retrieval_recall@k` (per caption: its picture in the caption's top k pictures) = `t2i_r{k}` / 100;
`text_retrieval_recall@k` (per picture: any of its captions in the top k captions) = `i2t_r{k}` / 100.
They agree exactly except where a query's scores tie across the top-k boundary: vsekit counts a tie
against the query, CLIP_benchmark's `torch.topk` breaks it by position.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from vsekit.errors import VseInputError

if TYPE_CHECKING:
    from PIL import Image

    from vsekit.models.vse import VSEModel

logger = logging.getLogger(__name__)

CLIP_BENCHMARK_KEYS = {"image_retrieval_recall@{k}": "t2i_r{k}", "text_retrieval_recall@{k}": "i2t_r{k}"}
"""CLIP_benchmark's retrieval keys -> vsekit's metric keys (values: fraction vs percent)."""


def to_vsekit_keys(metrics: dict[str, float]) -> dict[str, float]:
    """CLIP_benchmark retrieval metrics as vsekit keys and units (`t2i_r5`, `i2t_r5` in %), to compare with
    `vse eval --json`; other keys are left out."""
    out = {}
    for name, value in metrics.items():
        for theirs, ours in CLIP_BENCHMARK_KEYS.items():
            prefix = theirs.split("{")[0]
            if name.startswith(prefix) and name[len(prefix) :].isdigit():
                out[ours.format(k=name[len(prefix) :])] = 100.0 * float(value)
    return out


class VseTokenizer:
    """list[str] -> LongTensor [B, L] of the run's own token ids, right-padded with `pad_id` (what
    CLIP_benchmark passes on to `model.encode_text`)."""

    def __init__(self, model: VSEModel) -> None:
        from vsekit.evaluation import pad_id_for, text_processor_for

        self.processor = text_processor_for(model)
        self.pad_id = int(pad_id_for(self.processor))

    def __call__(self, texts: str | Sequence[str]) -> torch.Tensor:
        from vsekit.data.datasets import pad_tokens

        if isinstance(texts, str):
            texts = [texts]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise VseInputError("tokenizer: expected a non-empty list of strings")
        ids = [torch.tensor(self.processor.encode(t), dtype=torch.long) for t in texts]
        tokens, _ = pad_tokens(ids, self.pad_id)
        return tokens


def lengths_from_padding(tokens: torch.Tensor, pad_id: int) -> torch.Tensor:
    """Lengths of right-padded rows: 1 + the position of the last non-pad id (at least 1)."""
    real = tokens != pad_id
    positions = torch.arange(1, tokens.shape[1] + 1, device=tokens.device)
    return (real * positions).amax(1).clamp(min=1)


class ClipBenchmarkModel(nn.Module):
    """A vsekit run with open_clip's `encode_image(pixels)` / `encode_text(tokens)`, one [B, D] vector per
    picture and per caption (see the module docstring for what each accepts)."""

    def __init__(
        self, model: VSEModel, run_config: dict, device: str | torch.device = "cpu", autocast: bool = False
    ) -> None:
        super().__init__()
        from vsekit.models.image_parts import reads_pixels
        from vsekit.search.encode import ImageEmbedder, needs_rerank, run_extractor_spec

        if needs_rerank(model):
            raise VseInputError(
                f"this run scores by {model.recipe.model.similarity.name} over several image views, not "
                "by cosine of one vector per picture, so CLIP_benchmark's retrieval cannot score it; "
                "use `vse eval` for it"
            )
        kind = model.recipe.model.image.kind
        if not reads_pixels(kind) and run_extractor_spec(run_config) is None:
            raise VseInputError(
                "this run was trained on precomputed features and records no feature extractor (no 'extractor' in "
                "its config.json nor in its dataset's manifest.json), so it cannot take pictures, and CLIP_benchmark "
                "feeds pictures; use a pixel run (a backbone recipe) or a run trained on a dataset whose manifest names "
                "its extractor, or evaluate this one with `vse eval`"
            )
        if not model.recipe.model.normalize:
            logger.warning(
                "this run does not L2-normalise its embeddings (model.normalize=false): CLIP_benchmark "
                "scores by cosine, `vse eval` by inner product, so their recalls can differ"
            )
        self.vse = model
        self.device = torch.device(device)
        self.embedder = ImageEmbedder(model, run_config, self.device)
        self.tokenizer = VseTokenizer(model)
        self.autocast = autocast

    def transform(self, image: Image.Image | str | Path) -> torch.Tensor:
        """A PIL picture (or a path) -> the [3, S, S] tensor `encode_image` takes: the run's own preprocessing."""
        if isinstance(image, (str, Path)):
            return self.embedder.load(image)
        return self.embedder.prepare(image)

    def _precision(self, device: torch.device) -> contextlib.AbstractContextManager:
        """float32 inside, whatever autocast the caller opened (unless built with autocast=True)."""
        return (
            contextlib.nullcontext()
            if self.autocast
            else torch.autocast(device_type=device.type, enabled=False)
        )

    @torch.no_grad()
    def encode_image(self, image: torch.Tensor, normalize: bool = False) -> torch.Tensor:
        """Pictures [B, 3, S, S] (from `transform`) -> image embeddings [B, D] on the pictures' device."""
        if not isinstance(image, torch.Tensor) or image.ndim != 4 or image.shape[1] != 3:
            got = tuple(image.shape) if isinstance(image, torch.Tensor) else type(image).__name__
            raise VseInputError(
                f"encode_image: expected pixels [batch, 3, height, width] from the transform, got {got}"
            )
        with self._precision(image.device):
            emb = self.embedder.embed(image.float()).to(image.device)
        return nn.functional.normalize(emb, dim=-1) if normalize else emb

    @torch.no_grad()
    def encode_text(self, text: torch.Tensor | Sequence[str], normalize: bool = False) -> torch.Tensor:
        """Token ids [B, L] from the tokenizer (padding recovered as lengths), or strings -> [B, D]."""
        if isinstance(text, str) or (isinstance(text, (list, tuple)) and text and isinstance(text[0], str)):
            text = self.tokenizer(list(text) if not isinstance(text, str) else [text])
        if not isinstance(text, torch.Tensor) or text.ndim != 2 or text.dtype not in (torch.long, torch.int):
            got = tuple(text.shape) if isinstance(text, torch.Tensor) else type(text).__name__
            raise VseInputError(
                f"encode_text: expected token ids [batch, length] from the tokenizer, got {got}"
            )
        tokens = text.to(self.device, torch.long)
        lengths = lengths_from_padding(tokens, self.tokenizer.pad_id)
        with self._precision(tokens.device):
            emb = self.vse.encode_texts(tokens, lengths).float()
        emb = emb.to(text.device)
        return nn.functional.normalize(emb, dim=-1) if normalize else emb

    def forward(self, image: torch.Tensor, text: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(image embeddings, text embeddings), like open_clip's CLIP.forward without the logit scale."""
        return self.encode_image(image), self.encode_text(text)


def load_for_clip_benchmark(
    run: str | Path, device: str | torch.device = "cpu", checkpoint: str = "best", autocast: bool = False
) -> tuple[ClipBenchmarkModel, Callable, VseTokenizer]:
    """(model, transform, tokenizer) of a run, as `clip_benchmark.models.load_clip` returns them: the triple
    that `clip_benchmark.metrics.zeroshot_retrieval.evaluate(model, loader, tokenizer, device)` takes."""
    import vsekit

    vse = vsekit.load(run, device=device, checkpoint=checkpoint)
    model = ClipBenchmarkModel(vse, getattr(vse, "run_config", {}) or {}, model_device(vse), autocast).eval()
    return model, model.transform, model.tokenizer


def model_device(model: nn.Module) -> torch.device:
    return next(model.parameters()).device


class CaptionedPictures(torch.utils.data.Dataset):
    """The pictures of a vsekit dataset split (`{split}_images.txt`) with their captions: item i is
    (transform(picture i), [its captions in file order]), the items CLIP_benchmark's retrieval sets yield."""

    def __init__(
        self, data_dir: str | Path, split: str, transform: Callable, captions_per_image: int = 5
    ) -> None:
        from vsekit.data.precomp import load_precomp_split

        self.split = load_precomp_split(data_dir, split, captions_per_image)
        if self.split.image_paths is None:
            raise VseInputError(
                f"{data_dir}: split {split!r} lists no pictures ({split}_images.txt), only features; "
                "CLIP_benchmark needs the pictures"
            )
        self.transform = transform
        self.captions: list[list[str]] = [[] for _ in range(self.split.n_images)]
        for caption, image in zip(self.split.captions, self.split.cap2img.tolist()):
            self.captions[image].append(caption)

    def __len__(self) -> int:
        return self.split.n_images

    def __getitem__(self, index: int) -> tuple[torch.Tensor, list[str]]:
        from vsekit.search.encode import open_image

        return self.transform(open_image(self.split.abs_image_path(index))), self.captions[index]


def collate_pictures_captions(
    batch: list[tuple[torch.Tensor, list[str]]],
) -> tuple[torch.Tensor, list[list[str]]]:
    """Stack the pictures, keep the caption lists (CLIP_benchmark's `image_captions_collate_fn`)."""
    return torch.stack([b[0] for b in batch]), [b[1] for b in batch]


def retrieval_dataloader(
    data_dir: str | Path,
    split: str,
    transform: Callable,
    batch_size: int = 64,
    captions_per_image: int = 5,
    num_workers: int = 0,
) -> torch.utils.data.DataLoader:
    """A loader of (pictures, caption lists) over a vsekit split with pictures, in image order, for
    `zeroshot_retrieval.evaluate` (CLIP_benchmark's own dataset builder imports torchvision)."""
    return torch.utils.data.DataLoader(
        CaptionedPictures(data_dir, split, transform, captions_per_image),
        batch_size=batch_size,
        shuffle=False,
        num_workers=num_workers,
        collate_fn=collate_pictures_captions,
    )
