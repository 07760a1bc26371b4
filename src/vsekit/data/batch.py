"""The batches the data paths make and the training step, gradient caching, CUDA graphs and evaluation read.

One typed record per kind instead of a dict whose keys every reader spells again: `Batch` (pairs, for
training), `ImageBatch` and `CaptionBatch` (one side, for encoding a split). Each field is a tensor; a batch
moves as a whole (`to`, `pin_memory`, which the DataLoader calls on a custom batch) and is sliced by rows
(`rows`). Reading a field by name (`batch["tokens"]`, `batch.items()`) still works: a batch is a read-only
mapping of its fields, so code written against the dicts of earlier versions keeps running. `Batch.weights`
(per-sample weights of the loss's reduction) defaults to ones, so a mapping without it still makes a batch; it
moves and slices with the batch but is not one of the mapping's keys.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

T = TypeVar("T", bound="TensorRecord")


class TensorRecord(Mapping[str, torch.Tensor]):
    """Methods shared by the batch dataclasses below (each field a tensor)."""

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        """The fields the mapping shows, in order (the order a CUDA graph's shape key follows)."""
        return tuple(
            f.name
            for f in dataclasses.fields(cls)  # type: ignore[arg-type]
            if f.metadata.get("mapped", True)
        )

    @classmethod
    def tensor_names(cls) -> tuple[str, ...]:
        """Every tensor field, the mapping's and those it leaves out (`Batch.weights`): what moves with the batch
        (`map`, `to`, `rows`) and what a CUDA graph holds a static buffer of."""
        return tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[arg-type]

    @classmethod
    def of(cls: type[T], batch: T | Mapping[str, Any]) -> T:
        """`batch` itself, or the record built from a mapping that holds its fields (other keys are ignored)."""
        if isinstance(batch, cls):
            return batch
        missing = [k for k in cls.required_names() if k not in batch]
        if missing:
            raise KeyError(
                f"a {cls.__name__} needs {', '.join(cls.required_names())}; missing: {', '.join(missing)}"
            )
        return cls(**{k: batch[k] for k in cls.tensor_names() if k in batch})

    @classmethod
    def required_names(cls) -> tuple[str, ...]:
        """The fields without a default (a mapping must hold these; the others are filled in)."""
        return tuple(
            f.name
            for f in dataclasses.fields(cls)  # type: ignore[arg-type]
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        )

    def map(self: T, fn: Callable[[torch.Tensor], torch.Tensor]) -> T:
        """The record with `fn` applied to every field."""
        return type(self)(**{k: fn(getattr(self, k)) for k in self.tensor_names()})

    def to(self: T, device: torch.device | str, non_blocking: bool = False) -> T:
        return self.map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self: T) -> T:
        """Page-locked copies (the DataLoader's `pin_memory=True` calls this on a custom batch type)."""
        return self.map(lambda t: t.pin_memory())

    def rows(self: T, start: int, end: int) -> T:
        """Rows `start:end` of every field (views, no copy)."""
        return self.map(lambda t: t[start:end])

    def replace(self: T, **changes: torch.Tensor) -> T:
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]

    # the read-only mapping of the fields (batch["tokens"], batch.items(), dict(batch))
    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self.field_names():
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.field_names())

    def __len__(self) -> int:
        return len(self.field_names())

    # identity, not a field-by-field comparison of tensors (whose `==` is element-wise)
    __eq__ = object.__eq__
    __hash__ = object.__hash__


@dataclass(eq=False)
class Batch(TensorRecord):
    """A training batch of B (image, caption) pairs."""

    images: torch.Tensor  # [B, n, D] feature sets padded with zeros, or [B, 3, H, W] pixels
    image_lengths: torch.Tensor  # [B] real rows of each set (-1 for pixels)
    tokens: torch.Tensor  # [B, L] token ids, padded with the text's pad id
    token_lengths: torch.Tensor  # [B]
    image_index: torch.Tensor  # [B] row of each pair's image in its split (captions of one image share it)
    caption_index: torch.Tensor  # [B] row of each pair's caption in its split
    # [B] float32 per-sample weights of the loss's reduction (a sample policy's plan); ones when not given. A
    # tensor like the other fields, so a CUDA graph reads it from a static buffer of fixed shape.
    # Not in the mapping (keys, len, batch["..."]): the dict view stays the six fields of earlier versions.
    weights: torch.Tensor = dataclasses.field(default=None, metadata={"mapped": False})  # type: ignore[assignment]

    def __post_init__(self) -> None:
        b = self.image_index.shape[0]
        if self.weights is None:
            self.weights = torch.ones(b, dtype=torch.float32, device=self.image_index.device)
        elif tuple(self.weights.shape) != (b,) or not self.weights.is_floating_point():
            raise ValueError(
                f"Batch.weights must be a float tensor of shape [{b}] (one per pair), got "
                f"{self.weights.dtype} {tuple(self.weights.shape)}"
            )


@dataclass(eq=False)
class ImageBatch(TensorRecord):
    """Images of a split, for encoding it."""

    images: torch.Tensor
    image_lengths: torch.Tensor
    image_index: torch.Tensor


@dataclass(eq=False)
class CaptionBatch(TensorRecord):
    """Captions of a split, for encoding it."""

    tokens: torch.Tensor
    token_lengths: torch.Tensor
    caption_index: torch.Tensor
