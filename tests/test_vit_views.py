"""Parity of `ViTMultiViewImageEncoder` with the released AVSE image encoder (fixtures: README "avse").

Everything is sized from meta.json and the checkpoint's tensor shapes, so the held-out fixture set
(other widths, layer counts, resolutions) runs through the same tests via VSE_REFERENCE_FIXTURES.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import pytest
import torch

from conftest import reference_fixture_dir
from vsekit.config import PoolingConfig
from vsekit.interop.avse import convert_released_image_state, released_vit_key
from vsekit.models.norm import l2_normalize_views
from vsekit.models.vit_views import ViTMultiViewImageEncoder, kept_patches, nearest_patches

ATOL = RTOL = 1e-5  # parity: the same float32 ViT ops in other orders / kernels (measured <= 0.02 of it)


def _load(folder):
    meta = json.loads((folder / "meta.json").read_text())
    torch.serialization.add_safe_globals([argparse.Namespace])
    ckpt = torch.load(folder / "model_best.pth", map_location="cpu", weights_only=True)
    return meta, ckpt


def _build(meta: dict, state: dict) -> ViTMultiViewImageEncoder:
    """Encoder at the fixture's sizes; GPO sizes read off the checkpoint's GRU shapes."""
    w_ih = state["img_enc.image_encoder.gpool.gru.weight_ih_l0"]
    pooling = PoolingConfig(name="gpo", d_pe=w_ih.shape[1], d_hidden=w_ih.shape[0] // 3)
    embed = state["img_enc.image_encoder.fc.weight"].shape[0]
    assert embed == meta.get("opt", {}).get("embed_size", embed)
    return ViTMultiViewImageEncoder(
        meta["vit_config"],
        embed,
        views=meta["n_views"],
        pooling=pooling,
    )


@pytest.fixture(scope="module")
def avse():
    folder = reference_fixture_dir("avse")
    meta, ckpt = _load(folder)
    state = ckpt["model"]
    enc = _build(meta, state)
    mapped, rest = convert_released_image_state(state, enc.state_dict().keys())
    # nothing of the image part left over, every module key filled (strict)
    assert not [k for k in rest if k.startswith("img_enc.")]
    enc.load_state_dict(mapped, strict=True)
    enc.eval()
    inputs = dict(np.load(folder / "inputs.npz"))
    outputs = dict(np.load(folder / "outputs.npz"))
    return meta, enc, inputs, outputs


def _close(name: str, got: torch.Tensor, want: np.ndarray) -> None:
    want_t = torch.from_numpy(want)
    assert tuple(got.shape) == tuple(want_t.shape), name
    err = (got.detach().double() - want_t.double()).abs().max().item()
    assert torch.allclose(got.detach(), want_t, atol=ATOL, rtol=RTOL), f"{name}: max abs err {err:.3g}"


def test_released_image_embeddings_match(avse):
    meta, enc, inputs, outputs = avse
    with torch.no_grad():
        out = enc.encode(
            torch.from_numpy(inputs["images"]), view_indices=torch.from_numpy(inputs["view_sampled_indices"])
        )
    _close("dbg_vit_embeddings", out.embeddings, outputs["dbg_vit_embeddings"])
    _close("dbg_view_tokens", out.view_tokens, outputs["dbg_view_tokens"])
    _close("dbg_view_gpo_local", out.local, outputs["dbg_view_gpo_local"])
    _close("dbg_view_gpo_pooled", out.pooled, outputs["dbg_view_gpo_pooled"])
    _close("dbg_view_gpo_weights", out.weights.unsqueeze(-1), outputs["dbg_view_gpo_weights"])
    # the release normalises each view as x / (|x| + 1e-8): the model's l2_form add_eps, which imports set
    _close("img_emb", l2_normalize_views(out.emb, "add_eps", enc.views), outputs["img_emb"])
    # forward() is the same embedding
    with torch.no_grad():
        emb = enc(
            torch.from_numpy(inputs["images"]), view_indices=torch.from_numpy(inputs["view_sampled_indices"])
        )
    _close("img_emb (forward)", l2_normalize_views(emb, "add_eps", enc.views), outputs["img_emb"])


def test_count_rule_and_recorded_centres(avse):
    meta, enc, inputs, _ = avse
    images = inputs["images"]
    p = meta["vit_config"]["patch_size"]
    grid = (images.shape[2] // p, images.shape[3] // p)
    n_patches = grid[0] * grid[1]
    recorded = inputs["view_sampled_indices"]
    assert kept_patches(n_patches, enc.keep_test) == meta["new_n_eval"] == recorded.shape[-1]
    # the recorded views are the patches nearest to the recorded centres (up to equidistant ties)
    centres = torch.from_numpy(inputs["view_center_indices"])
    mine = nearest_patches(centres, grid, recorded.shape[-1]).numpy()
    ys, xs = np.arange(n_patches) // grid[1], np.arange(n_patches) % grid[1]
    cy, cx = ys[inputs["view_center_indices"]][..., None], xs[inputs["view_center_indices"]][..., None]

    def d2(idx: np.ndarray) -> np.ndarray:
        return np.sort((ys[idx] - cy) ** 2 + (xs[idx] - cx) ** 2, axis=-1)

    np.testing.assert_array_equal(d2(mine), d2(recorded))


def test_eval_sampling_is_repeatable(avse):
    meta, enc, inputs, _ = avse
    images = torch.from_numpy(inputs["images"])
    with torch.no_grad():
        a = enc.encode(images)
        b = enc.encode(images)
    assert torch.equal(a.view_indices, b.view_indices)
    assert torch.equal(a.emb, b.emb)
    assert a.view_indices.shape == (images.shape[0], enc.views, meta["new_n_eval"])
    assert a.emb.shape == (images.shape[0], enc.views * enc.embed_dim)
    assert torch.isfinite(a.emb).all()


def test_training_sampling_count_and_generator(avse):
    _, enc, inputs, _ = avse
    images = torch.from_numpy(inputs["images"])
    p = enc.patch_size[0]
    n_patches = (images.shape[2] // p) * (images.shape[3] // p)
    enc.train()
    try:
        with torch.no_grad():
            a = enc.encode(images, generator=torch.Generator().manual_seed(3))
            b = enc.encode(images, generator=torch.Generator().manual_seed(3))
    finally:
        enc.eval()
    n = int((1 + n_patches) * enc.keep_train)
    assert a.view_indices.shape == (images.shape[0], enc.views, n)
    assert a.view_tokens.shape[2] == n + 1
    # size augmentation only ever drops tokens
    assert int(a.lengths.max()) <= n + 1 and int(a.lengths.min()) >= 1
    assert torch.equal(a.view_indices, b.view_indices) and torch.equal(a.emb, b.emb)
    # every view is a set of distinct patches
    idx = a.view_indices.reshape(-1, n)
    assert all(len(set(row.tolist())) == n for row in idx)


def test_key_mapping_follows_module_layout(avse):
    _, enc, _, _ = avse
    own = enc.state_dict().keys()
    assert released_vit_key("img_enc.image_encoder.fc.weight", own) == "fc.weight"
    assert released_vit_key("img_enc.image_encoder.gpool.linear.weight", own) == "pool.linear.weight"
    assert released_vit_key("module.img_enc.visual_encoder.pooler.dense.bias", own) == "vit.pooler.dense.bias"
    q = released_vit_key("img_enc.visual_encoder.encoder.layer.0.attention.attention.query.weight", own)
    assert q in own
    # a 4.x-style key set maps to itself
    legacy = {"vit.encoder.layer.0.attention.attention.query.weight"}
    assert (
        released_vit_key("img_enc.visual_encoder.encoder.layer.0.attention.attention.query.weight", legacy)
        in legacy
    )
    with pytest.raises(KeyError):
        released_vit_key("txt_enc.fc.weight", own)
    # without the target keys: the installed transformers' layout, any block index
    last = enc.vit.config.num_hidden_layers - 1
    for sub in ("attention.attention.key.bias", "attention.output.dense.weight", "output.dense.weight"):
        name = f"img_enc.visual_encoder.encoder.layer.{last}.{sub}"
        assert released_vit_key(name) == released_vit_key(name, own)
