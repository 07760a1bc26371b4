"""RCL as a vsekit loss (`loss.name: rcl`, recipe `rcl`): the loss object the trainer builds equals the released
code's values (the `rcl/` fixtures, atol = rtol = 1e-5), its equal-score value is the closed form, and the
recipe trains."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from test_parity_noisy import TOL, load
from vsekit.config import load_recipe
from vsekit.losses import create_loss
from vsekit.training.collapse import collapse_value, negatives_per_row


def rcl_loss(method: str, **settings):
    sets = [f"loss.rcl_method={method}"] + [f"loss.{k}={v}" for k, v in settings.items()]
    recipe = load_recipe("rcl", sets)
    return create_loss(recipe.loss), recipe


@pytest.mark.parametrize("method", ["log", "tan", "abs", "exp", "gce", "infoNCE"])
def test_registered_rcl_loss_equals_the_release(method):
    inputs, out, meta = load("rcl")
    opt = meta["options"]
    loss_fn, _ = rcl_loss(method, temperature=opt["tau"], rcl_q=opt["q"])
    sims = torch.tensor(inputs["sims"], requires_grad=True)
    ids = torch.arange(sims.shape[0])  # the fixture's batch: one caption per image
    loss, _ = loss_fn(sims, image_ids=ids, caption_ids=ids)
    loss.backward()
    torch.testing.assert_close(loss.detach(), torch.tensor(out[f"loss_ccl_{method}"]).reshape(()), **TOL)
    torch.testing.assert_close(sims.grad, torch.tensor(out[f"grad_sims_ccl_{method}"]), **TOL)


def test_same_image_captions_left_out_of_the_negatives_by_hand():
    # two captions of image 0 and one of image 1; with mask_same_image only (0 -> 2), (1 -> 2) and (2 -> 0/1)
    sims = torch.tensor([[0.9, 0.5, 0.1], [0.4, 0.8, 0.2], [0.3, 0.1, 0.7]])
    ids = torch.tensor([0, 0, 1])
    tau = 0.5
    loss_fn, _ = rcl_loss("abs", temperature=tau, mask_same_image="true")
    loss, _ = loss_fn(sims, image_ids=ids, caption_ids=torch.arange(3))
    p = np.exp(sims.numpy().astype(np.float64) / tau)
    i2t = p / p.sum(1, keepdims=True)
    t2i = p.T / p.T.sum(1, keepdims=True)
    negatives = np.array([[0, 0, 1], [0, 0, 1], [1, 1, 0]], dtype=np.float64)
    expected = (i2t * negatives).sum(1).mean() + (t2i * negatives).sum(1).mean()
    assert loss.item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("method", ["log", "tan", "abs", "exp", "gce", "infoNCE"])
def test_equal_score_value_is_the_loss_on_a_constant_matrix(method):
    loss_fn, recipe = rcl_loss(method)
    b = 6
    loss, _ = loss_fn(torch.full((b, b), 0.3), image_ids=torch.arange(b), caption_ids=torch.arange(b))
    value = collapse_value(recipe.loss, negatives_per_row(torch.arange(b), b, False))
    # the release's 1e-10 beside each probability moves the loss by ~1e-9 relative
    assert float(value) == pytest.approx(loss.item(), rel=1e-6)


def test_subset_negatives_follow_the_step_generator():
    loss_fn, _ = rcl_loss("log", rcl_negative_ratio=0.5)
    sims = torch.randn(8, 8, generator=torch.Generator().manual_seed(1))
    ids = torch.arange(8)
    a = loss_fn(sims, image_ids=ids, generator=torch.Generator().manual_seed(7))[0]
    b = loss_fn(sims, image_ids=ids, generator=torch.Generator().manual_seed(7))[0]
    c = loss_fn(sims, image_ids=ids, generator=torch.Generator().manual_seed(8))[0]
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    # int(0.5 * 8) = 4 of the 7 negatives per row: below the loss over all of them (every term is positive)
    every, _ = rcl_loss("log")[0](sims, image_ids=ids)
    assert a.item() < every.item()
    assert math.isfinite(a.item())


def test_rcl_recipe_trains(tiny_data, tmp_path):
    from vsekit.training.trainer import Trainer

    recipe = load_recipe(
        "rcl",
        [
            "train.epochs=2",
            "train.batch_size=16",
            "model.embed_dim=32",
            "model.text.word_dim=16",
            "model.text.vocab_min_count=1",
            "model.text.tokenizer=regex",
        ],
    )
    result = Trainer(recipe, tiny_data, tmp_path / "run", progress=False, log=lambda *_: None).fit()
    assert len(result["history"]) == 2
    assert all(math.isfinite(r["rsum"]) for r in result["history"])
