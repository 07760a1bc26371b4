"""Number-for-number parity of vsekit's losses with the released research code, given the embeddings.

Fixtures: `reference_fixture_dir()` (see its README). Every loss is recomputed from the fixture's
`img_emb` / `cap_emb` (leaf tensors, so gradients stop at the embeddings, as in the fixtures) through
vsekit's public API with the option values of `meta.json`, and compared — value and both gradients —
at atol = rtol = 1e-5 (the same float32 formulas summed in other orders / kernels: a few eps relative, at
most log2(terms) eps for the batch reductions; measured <= 0.06 of it); integer outputs (ADOPT's K) exactly. No size is hard-coded: widths, batch, views
and block size come from the arrays and `meta.json`, so a held-out fixture set runs unchanged.
"""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest
import torch

from conftest import reference_fixture_dir
from vsekit.config import LossConfig, SimilarityConfig
from vsekit.losses import create_loss
from vsekit.losses.adopt import ADOPTLoss
from vsekit.losses.view_reg import view_regulariser
from vsekit.similarity import CosineSimilarity
from vsekit.similarity.aeom import AEOMSimilarity, block_affinity, log_sinkhorn_dustbin, max_sum

TOL = {"atol": 1e-5, "rtol": 1e-5}
HINGE_MODES = [("vsepp", True), ("sum", False)]  # output suffix, max violation
OT_ITERS = 20  # the released Sinkhorn call (README, avse: `sims_ot_variant`)


def load(name: str) -> tuple[dict[str, np.ndarray], dict]:
    """(outputs, meta) of one fixture folder; skips when the fixtures are absent."""
    folder = reference_fixture_dir(name)
    with np.load(folder / "outputs.npz") as f:
        outputs = {k: f[k] for k in f.files}
    return outputs, json.loads((folder / "meta.json").read_text())


def leaves(out: dict[str, np.ndarray]) -> tuple[torch.Tensor, torch.Tensor]:
    """The fixture's embeddings as leaf tensors that collect gradients."""
    return (
        torch.tensor(out["img_emb"]).requires_grad_(True),
        torch.tensor(out["cap_emb"]).requires_grad_(True),
    )


def close(actual, expected, what: str) -> None:
    actual = torch.as_tensor(actual).detach().float()
    torch.testing.assert_close(
        actual, torch.as_tensor(expected).reshape(actual.shape), **TOL, msg=lambda m: f"{what}: {m}"
    )


def check_loss_and_grads(loss, img, cap, out, loss_key: str, suffix: str) -> None:
    close(loss, out[loss_key], loss_key)
    loss.backward()
    close(img.grad, out[f"grad_img_emb_{suffix}"], f"grad_img_emb_{suffix}")
    close(cap.grad, out[f"grad_cap_emb_{suffix}"], f"grad_cap_emb_{suffix}")


# ---- VSE∞ (both branches): VSE++ / VSE0 hinge on img_emb @ cap_emb.T ----


@pytest.mark.parametrize("suffix,hardest", HINGE_MODES)
@pytest.mark.parametrize("item", ["vse_infty_bigru", "vse_infty_bert"])
def test_vse_infty_hinge_matches_released(item, suffix, hardest):
    out, meta = load(item)
    img, cap = leaves(out)
    sims = CosineSimilarity()(img, cap)
    close(sims, out["sims"], "sims")
    loss_fn = create_loss(LossConfig(name="triplet", margin=meta["opt"]["margin"], max_violation=hardest))
    loss, _ = loss_fn(sims)
    check_loss_and_grads(loss, img, cap, out, f"loss_{suffix}", suffix)


# ---- VSE+2AD: ADOPT, reference variant ----


def adopt_options(meta: dict) -> dict:
    """tau / scale / margin of the released loss, from the pickled args recorded in meta.json."""
    opt = meta["opt"]
    return {"temperature": opt["tau"], "scale": opt["scale"], "margin": opt["margin"]}


def released_can_pick_positive(sims: torch.Tensor, k: int) -> bool:
    """True when some row (either direction) has fewer than k off-diagonal similarities above 0, i.e. the
    released zero-filled top-k would take the positive itself as a negative (README, vse_2ad)."""
    off = sims.detach().masked_fill(torch.eye(sims.shape[0], dtype=torch.bool), float("-inf")) > 0
    return bool((off.sum(1) < k).any() or (off.sum(0) < k).any())


def test_adopt_matches_released():
    out, meta = load("vse_2ad")
    img, cap = leaves(out)
    sims = CosineSimilarity()(img, cap)
    close(sims, out["sims"], "sims")
    released = ADOPTLoss(variant="reference", zero_fill_negatives=True, **adopt_options(meta))
    loss, diag = released(sims)
    assert (int(diag["K_t2i"]), int(diag["K_i2t"])) == (int(out["K_t2i"]), int(out["K_i2t"]))
    for direction in ("t2i", "i2t"):  # both directions see the same matrix up to transposition
        close(diag["align"], out[f"dbg_align_{direction}"], f"dbg_align_{direction}")
        close(diag["uniform"], out[f"dbg_uniform_{direction}"], f"dbg_uniform_{direction}")
    check_loss_and_grads(loss, img, cap, out, "loss_adopt", "adopt")


def test_adopt_default_selection_matches_released_when_positive_is_not_picked():
    """vsekit's default never takes the positive as a negative; where the released code does not either,
    the two agree number for number."""
    out, meta = load("vse_2ad")
    img, cap = leaves(out)
    sims = CosineSimilarity()(img, cap)
    loss, diag = ADOPTLoss(variant="reference", **adopt_options(meta))(sims)
    if released_can_pick_positive(sims, int(diag["K_i2t"])):
        pytest.skip("the released rule picks a positive as a negative here; see test_adopt_matches_released")
    check_loss_and_grads(loss, img, cap, out, "loss_adopt", "adopt")


def readme_adopt(d: torch.Tensor, tau: float, scale: float, margin: float) -> torch.Tensor:
    """One direction of the README's description of the released ADOPT (queries = rows of d)."""
    b = d.shape[0]
    eye = torch.eye(b, dtype=torch.bool)
    align = float(d.detach().diagonal().mean())
    uniform = float(torch.exp(-d.detach().masked_fill(eye, 0.0)).mean())
    k = min(max(int(math.cos((align + uniform) ** scale) * b) + 1, 1), b - 1)
    idx = d.detach().masked_fill(eye, 0.0).sort(dim=1, descending=True).indices[:, :k]
    logits = torch.cat([d.diagonal().unsqueeze(1), d.gather(1, idx) + margin], dim=1) / tau
    return torch.nn.functional.cross_entropy(logits, torch.zeros(b, dtype=torch.long))


def test_adopt_zero_fill_reproduces_positive_picked_as_negative():
    """Off-diagonal similarities below 0: the released selection takes the positive among the K
    "negatives"; `zero_fill_negatives` reproduces that, the default does not."""
    g = torch.Generator().manual_seed(0)
    sims = (-0.5 - 0.3 * torch.rand(7, 7, generator=g)).fill_diagonal_(0.6).requires_grad_(True)
    opts = {"temperature": 0.05, "scale": 1.25, "margin": 0.2}
    loss, diag = ADOPTLoss(variant="reference", zero_fill_negatives=True, **opts)(sims)
    assert released_can_pick_positive(sims, int(diag["K_i2t"]))
    expected = (
        readme_adopt(sims.t(), opts["temperature"], opts["scale"], opts["margin"])
        + readme_adopt(sims, opts["temperature"], opts["scale"], opts["margin"])
    ) / 2
    close(loss, expected, "loss")
    (g_vse,) = torch.autograd.grad(loss, sims)
    (g_ref,) = torch.autograd.grad(expected, sims)
    close(g_vse, g_ref, "grad")
    safe, _ = ADOPTLoss(variant="reference", **opts)(sims)
    assert abs(float(safe.detach()) - float(loss.detach())) > 1e-3
    with pytest.raises(ValueError):
        ADOPTLoss(variant="paper", zero_fill_negatives=True)


# ---- AVSE: AEOM block max-sum + hinge + the view (barlow) regulariser ----


def avse_sizes(out: dict[str, np.ndarray], meta: dict) -> tuple[int, int, int]:
    """(embed width E, number of views, block width) from the arrays and meta.json."""
    embed = out["cap_emb"].shape[1]
    views = out["img_emb"].shape[1] // embed
    assert views * embed == out["img_emb"].shape[1] and views == meta.get("n_views", views)
    block = meta["block_dim"]
    if isinstance(block, list):
        assert len(block) == 1, f"one block width expected, meta.json has {block}"
        block = block[0]
    return embed, views, int(block)


def avse_similarity(out, meta) -> AEOMSimilarity:
    embed, views, block = avse_sizes(out, meta)
    return AEOMSimilarity(embed, views, SimilarityConfig(name="aeom", block_dim=block, use_sinkhorn=False))


def test_avse_aeom_similarity_matches_released():
    out, meta = load("avse")
    _, _, block = avse_sizes(out, meta)
    img, cap = leaves(out)  # cap_emb is not L2-normalised in the fixture: only the blocks are
    close(block_affinity(img, cap, block), out["dbg_block_logits"], "dbg_block_logits")
    sim = avse_similarity(out, meta)
    close(sim(img, cap), out["sims"], "sims (autograd path)")
    close(sim(img.detach(), cap.detach()), out["sims"], "sims (no-grad chunked path)")


def test_avse_sinkhorn_variant_matches_released():
    """The commented-out released line: log-domain dustbin Sinkhorn on the block logits, dustbins
    dropped, then max/sum of the *log* plan (vsekit: `model.similarity.readout: log_plan`, the default)."""
    out, meta = load("avse")
    _, _, block = avse_sizes(out, meta)
    torch.serialization.add_safe_globals([argparse.Namespace])
    ckpt = torch.load(reference_fixture_dir("avse") / "model_best.pth", map_location="cpu", weights_only=True)
    dustbin = ckpt["model"]["sim_enc.bin_score"].float()
    logits = block_affinity(torch.tensor(out["img_emb"]), torch.tensor(out["cap_emb"]), block)
    plan = log_sinkhorn_dustbin(logits, dustbin, OT_ITERS)[..., :-1, :-1]
    close(plan, out["dbg_ot_logits"], "dbg_ot_logits")
    close(max_sum(plan), out["sims_ot_variant"], "sims_ot_variant")


@pytest.mark.parametrize("suffix,hardest", HINGE_MODES)
def test_avse_loss_matches_released(suffix, hardest):
    out, meta = load("avse")
    _, views, _ = avse_sizes(out, meta)
    img, cap = leaves(out)
    sims = avse_similarity(out, meta)(img, cap)
    margin = meta["opt"]["margin"]
    rank, _ = create_loss(LossConfig(name="triplet", margin=margin, max_violation=hardest))(sims)
    close(rank, out[f"loss_rank_{suffix}"], f"loss_rank_{suffix}")
    barlow = view_regulariser(img.reshape(img.shape[0], views, -1), variant="reference")
    close(barlow, out["loss_barlow"], "loss_barlow")
    cfg = LossConfig(
        name="triplet",
        margin=margin,
        max_violation=hardest,
        view_reg_weight=1.0,
        view_reg_variant="reference",
    )
    total, _ = create_loss(cfg, image_views=views)(sims, image_emb=img)
    check_loss_and_grads(total, img, cap, out, f"loss_total_{suffix}", suffix)
