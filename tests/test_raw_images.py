"""Raw pictures + Karpathy JSON: conversion to the split files, the pixel transforms, clear errors."""

from __future__ import annotations

import json

import numpy as np
import pytest

from vsekit.cli import main
from vsekit.data.precomp import DataFormatError, load_precomp_split
from vsekit.data.raw_images import PixelSource, load_karpathy_split, load_pixels

PIL = pytest.importorskip("PIL.Image")


@pytest.fixture
def karpathy(tmp_path):
    img_root = tmp_path / "pics"
    (img_root / "sub").mkdir(parents=True)
    images = []
    for i, split in enumerate(["train", "train", "restval", "val", "test", "test"]):
        name = f"im{i}.png"
        ramp = np.linspace(0, 255, 40 + 10 * i, dtype=np.uint8)[None, :, None] * np.ones((30, 1, 3), np.uint8)
        PIL.fromarray(ramp).save(img_root / "sub" / name)  # a ramp, so crops and flips change the pixels
        sents = [{"raw": f"picture number {i} caption {j}", "tokens": []} for j in range(1 + i % 3)]
        images.append({"filepath": "sub", "filename": name, "split": split, "imgid": i, "sentences": sents})
    js = tmp_path / "dataset_test.json"
    js.write_text(json.dumps({"images": images}))
    return js, img_root


def test_karpathy_split_aliases_and_caption_map(karpathy):
    js, root = karpathy
    train = load_karpathy_split(js, "train", root)
    assert train.n_images == 3  # train + restval, as the usual 113K COCO train
    assert train.cap2img.tolist() == [0, 1, 1, 2, 2, 2]
    assert load_karpathy_split(js, "dev", root).image_ids == ["3"]


def test_convert_then_read_pixels_with_train_and_eval_transforms(karpathy, tmp_path):
    js, root = karpathy
    out = tmp_path / "layout"
    assert main(["data", "karpathy", str(js), "--images", str(root), "--out", str(out)]) == 0
    split = load_precomp_split(out, "train")
    assert split.n_images == 3 and split.n_captions == 6 and not split.has_features
    src_eval = PixelSource(split, image_size=32, augment=False)
    x = src_eval.load(1, None)
    assert x.shape == (3, 32, 32)
    assert np.allclose(x.numpy(), src_eval.load(1, None).numpy())  # eval: deterministic resize (the same ops)
    src_train = PixelSource(split, image_size=32, augment=True)
    a = src_train.load(1, np.random.default_rng(0))
    b = src_train.load(1, np.random.default_rng(0))
    c = src_train.load(1, np.random.default_rng(5))
    assert np.allclose(a.numpy(), b.numpy()) and not np.allclose(a.numpy(), c.numpy())  # seeded crop/flip
    with pytest.raises(DataFormatError, match="train_ims.npy: missing; this split has pictures only"):
        from vsekit.data.datasets import FeatureSource

        FeatureSource(split)


def test_missing_picture_is_named_and_nothing_written(karpathy, tmp_path):
    js, root = karpathy
    (root / "sub" / "im4.png").unlink()
    out = tmp_path / "layout"
    with pytest.raises(DataFormatError, match="im4.png"):
        from vsekit.data.raw_images import convert_karpathy

        convert_karpathy(js, out, root)
    assert not out.exists()


def test_unreadable_picture_error_names_the_file(tmp_path):
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not a png")
    with pytest.raises(DataFormatError, match="bad.png: cannot read image"):
        load_pixels(bad, 32, None)
