"""Number-for-number parity of vsekit's noisy-correspondence parts with the released NCR, RCL and IN2R code.

Fixtures: `reference_fixture_dir()` items `ncr/`, `rcl/`, `in2r/` (their README section "Noisy-correspondence
(NC) items"). Every value is recomputed from the fixture's inputs through `vsekit.losses.noisy_*` with the
options of `meta.json`, gradients through torch autograd, and compared at atol = rtol = 1e-5; index and bool
arrays (GMM iterations, splits, queue pointers) exactly. The GMM's EM starts from the recorded k-means labels
(`dbg_gmm_*_init_labels`). No size is hard-coded, so a held-out fixture set runs unchanged.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import reference_fixture_dir
from vsekit.losses import noisy_in2r, noisy_ncr, noisy_rcl
from vsekit.losses.noisy_split import (
    centred_l2norm,
    fit_gmm,
    min_max,
    pair_losses,
    split_clean,
    split_losses,
)

TOL = {"atol": 1e-5, "rtol": 1e-5}
NETS = ("A", "B")


def load(name: str) -> tuple[dict, dict, dict]:
    """(inputs, outputs, meta) of one fixture folder; skips when the fixtures are absent."""
    folder = reference_fixture_dir(name)
    with np.load(folder / "inputs.npz") as f:
        inputs = {k: f[k] for k in f.files}
    with np.load(folder / "outputs.npz") as f:
        outputs = {k: f[k] for k in f.files}
    return inputs, outputs, json.loads((folder / "meta.json").read_text())


def close(actual, expected, what: str) -> None:
    actual = torch.as_tensor(np.asarray(actual.detach() if torch.is_tensor(actual) else actual))
    expected = torch.as_tensor(np.asarray(expected)).reshape(actual.shape).to(actual.dtype)
    torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"{what}: {m}")


def leaf(array: np.ndarray) -> torch.Tensor:
    return torch.tensor(array).requires_grad_(True)


def check_split(inputs: dict, out: dict, margin: float, emb: str, centre: bool) -> None:
    """Per-sample losses, their normalisation, the GMM from the recorded labels, the split."""
    for net in NETS:
        losses = split_losses(
            torch.tensor(inputs[f"img_{emb}_{net}"]),
            torch.tensor(inputs[f"cap_{emb}_{net}"]),
            inputs["noisy_t2i"],
            inputs["split_order"],
            int(inputs["split_batch_size"]),
            margin,
            centre=centre,
        )
        close(losses, out[f"split_loss_{net}"], f"split_loss_{net}")
        norm = min_max(losses)
        close(norm, out[f"split_loss_norm_{net}"], f"split_loss_norm_{net}")
        gmm = fit_gmm(out[f"split_loss_norm_{net}"], out[f"dbg_gmm_{net}_init_labels"])
        close(gmm.clean_prob, out[f"prob_{net}"], f"prob_{net}")
        close(gmm.means, out[f"gmm_{net}_means"], "means")
        close(gmm.variances, out[f"gmm_{net}_covariances"], "covariances")
        close(gmm.weights, out[f"gmm_{net}_weights"], "weights")
        close(gmm.lower_bound, out[f"gmm_{net}_lower_bound"], "lower_bound")
        assert gmm.n_iter == int(out[f"gmm_{net}_n_iter"]) and gmm.converged == bool(
            out[f"gmm_{net}_converged"]
        )
        pred, _ = split_clean(gmm.clean_prob)
        np.testing.assert_array_equal(pred, out[f"pred_{net}"])


# ---------------------------------------------------------------- NCR


def test_ncr_split_gmm_and_fallback():
    inputs, out, meta = load("ncr")
    check_split(inputs, out, meta["options"]["margin"], "emb", centre=False)
    pred, threshold = split_clean(inputs["fallback_prob"], meta["options"]["p_threshold"])
    np.testing.assert_array_equal(pred, out["fallback_pred"])
    assert threshold == np.sort(inputs["fallback_prob"])[len(inputs["fallback_prob"]) // 100]


def _ncr_batch(inputs: dict, net: str, ids: np.ndarray):
    img = leaf(inputs[f"img_emb_{net}"][inputs["noisy_t2i"][ids]])
    cap = leaf(inputs[f"cap_emb_{net}"][ids])
    return img, cap, img @ cap.T


def test_ncr_training_step_co_rectified_soft_margin():
    """Net A's step on B's split: predictions, co-rectified labels (the release's [b, b] broadcasting), the
    soft-margin losses of the labeled and unlabeled batches and their gradients w.r.t. the batch rows."""
    inputs, out, meta = load("ncr")
    opt = meta["options"]
    m, kind = opt["margin"], opt["soft_margin"]
    img_l, cap_l, sims_l = _ncr_batch(inputs, "A", inputs["train_ids_l"])
    close(sims_l, out["dbg_sims_l"], "dbg_sims_l")
    with torch.no_grad():
        pred_l = noisy_ncr.predict(sims_l, m)
    close(pred_l, out["pred_l"], "pred_l")
    targets_l = noisy_ncr.rectified_targets(
        torch.tensor(inputs["train_prob_l"]), torch.tensor(inputs["train_labels_l"]).float(), pred_l
    )
    assert targets_l.shape == out["targets_l"].shape
    close(targets_l, out["targets_l"], "targets_l")
    sims_l.retain_grad()
    loss_l = noisy_ncr.soft_margin_loss(sims_l, targets_l, m, kind)
    close(loss_l, out["loss_l"], "loss_l")
    loss_l.backward()
    close(sims_l.grad, out["grad_sims_l"], "grad_sims_l")
    close(img_l.grad, out["grad_img_emb_l"], "grad_img_emb_l")
    close(cap_l.grad, out["grad_cap_emb_l"], "grad_cap_emb_l")

    img_u, cap_u, sims_u = _ncr_batch(inputs, "A", inputs["train_ids_u"])
    _, _, sims_u_b = _ncr_batch(inputs, "B", inputs["train_ids_u"])
    close(sims_u, out["dbg_sims_u_A"], "dbg_sims_u_A")
    close(sims_u_b, out["dbg_sims_u_B"], "dbg_sims_u_B")
    with torch.no_grad():
        pred_a, pred_b = noisy_ncr.predict(sims_u, m), noisy_ncr.predict(sims_u_b, m)
    close(pred_a, out["pred_u_A"], "pred_u_A")
    close(pred_b, out["pred_u_B"], "pred_u_B")
    targets_u = noisy_ncr.unlabeled_targets(pred_a, pred_b)
    close(targets_u, out["targets_u"], "targets_u")
    sims_u.retain_grad()
    loss_u = noisy_ncr.soft_margin_loss(sims_u, targets_u, m, kind)
    close(loss_u, out["loss_u"], "loss_u")
    loss_u.backward()
    close(sims_u.grad, out["grad_sims_u"], "grad_sims_u")
    close(img_u.grad, out["grad_img_emb_u"], "grad_img_emb_u")
    close(cap_u.grad, out["grad_cap_emb_u"], "grad_cap_emb_u")


@pytest.mark.parametrize("kind", noisy_ncr.SOFT_MARGINS)
def test_ncr_soft_margin_functions(kind):
    inputs, out, meta = load("ncr")
    sims = leaf(out["dbg_sims_l"])
    loss = noisy_ncr.soft_margin_loss(sims, torch.tensor(out["targets_l"]), meta["options"]["margin"], kind)
    close(loss, out[f"loss_soft_{kind}"], f"loss_soft_{kind}")
    loss.backward()
    close(sims.grad, out[f"grad_sims_soft_{kind}"], f"grad_sims_soft_{kind}")


@pytest.mark.parametrize(
    ("key", "fn"),
    [
        ("warmup", noisy_ncr.warmup_loss),
        ("sum_nolabel", noisy_ncr.warmup_loss),
        ("hard_nolabel", noisy_ncr.hard_loss),
    ],
)
def test_ncr_warmup_and_plain_losses(key, fn):
    inputs, out, meta = load("ncr")
    m = meta["options"]["margin"]
    sims = leaf(out["dbg_sims_l"])
    loss = fn(sims, m)
    close(loss, out[f"loss_{key}"], f"loss_{key}")
    loss.backward()
    close(sims.grad, out[f"grad_sims_{key}"], f"grad_sims_{key}")
    close(pair_losses(torch.tensor(out["dbg_sims_l"]), m), out["eval_loss_sims_l"], "eval_loss_sims_l")
    close(noisy_ncr.predict_raw(torch.tensor(out["dbg_sims_l"]), m), out["predict_sims_l"], "predict_sims_l")


# ---------------------------------------------------------------- RCL


def test_rcl_every_ccl_variant():
    inputs, out, meta = load("rcl")
    opt = meta["options"]
    for method in opt["methods"]:
        sims = leaf(inputs["sims"])
        loss = noisy_rcl.ccl_loss(sims, opt["tau"], method, opt["q"])
        close(loss, out[f"loss_ccl_{method}"], f"loss_ccl_{method}")
        loss.backward()
        close(sims.grad, out[f"grad_sims_ccl_{method}"], f"grad_sims_ccl_{method}")


def test_rcl_script_configuration():
    """The training script's options as the repo's opts.py parsed them: CCL(tau, method=loss, q=margin, ratio)."""
    inputs, out, meta = load("rcl")
    so = meta["script_opt"]
    sims = leaf(inputs["sims"])
    if "max-margin" in so["loss"]:
        loss = noisy_rcl.max_margin_loss(sims, so["margin"], so["max_violation"])
    else:
        loss = noisy_rcl.ccl_loss(sims, so["tau"], so["loss"], so["margin"], so["ratio"])
    close(loss, out["loss_script"], "loss_script")
    loss.backward()
    close(sims.grad, out["grad_sims_script"], "grad_sims_script")


def test_rcl_subsets_of_recorded_negatives():
    inputs, out, meta = load("rcl")
    opt = meta["options"]
    methods = [
        k[len("loss_ccl_") : -len("_subset")]
        for k in out
        if k.startswith("loss_ccl_") and k.endswith("_subset")
    ]
    assert methods
    n = inputs["sims"].shape[0]
    for method in methods:
        uniforms = torch.tensor(inputs[f"subset_rand_{method}"])
        mask = noisy_rcl.negative_mask(n, opt["ratio_subset"], uniforms)
        np.testing.assert_array_equal(mask.numpy(), out[f"dbg_subset_mask_{method}"])
        sims = leaf(inputs["sims"])
        loss = noisy_rcl.ccl_loss(sims, opt["tau"], method, opt["q"], opt["ratio_subset"], uniforms)
        close(loss, out[f"loss_ccl_{method}_subset"], f"loss_ccl_{method}_subset")
        loss.backward()
        close(sims.grad, out[f"grad_sims_ccl_{method}_subset"], f"grad_sims_ccl_{method}_subset")


@pytest.mark.parametrize(("suffix", "max_violation"), [("vsepp", True), ("sum", False)])
def test_rcl_max_margin(suffix, max_violation):
    inputs, out, meta = load("rcl")
    sims = leaf(inputs["sims"])
    loss = noisy_rcl.max_margin_loss(sims, meta["options"]["max_margin_margin"], max_violation)
    close(loss, out[f"loss_max_margin_{suffix}"], suffix)
    loss.backward()
    close(sims.grad, out[f"grad_sims_max_margin_{suffix}"], f"grad_sims_max_margin_{suffix}")


# ---------------------------------------------------------------- IN2R


def test_in2r_split_with_centring():
    inputs, out, meta = load("in2r")
    check_split(inputs, out, meta["options"]["margin"], "raw", centre=True)
    for net in NETS:
        avg = noisy_in2r.average_clean_prob(out[f"prob_{net}"], out[f"pred_{net}"])
        close(avg, out[f"avg_clean_prob_{net}"], f"avg_clean_prob_{net}")


def test_in2r_warmup_and_infonce():
    inputs, out, _ = load("in2r")
    names = ("warm_img_raw1", "warm_img_raw2", "warm_cap_raw1", "warm_cap_raw2")
    raws = [leaf(inputs[k]) for k in names]
    loss = noisy_in2r.warmup_loss(*raws)
    close(loss, out["loss_warmup"], "loss_warmup")
    loss.backward()
    for name, t in zip(names, raws):
        close(t.grad, out[f"grad_{name}"], f"grad_{name}")
    sims = leaf(out["dbg_sims_l"])
    loss = noisy_in2r.infonce(sims)
    close(loss, out["loss_infonce_sims_l"], "loss_infonce_sims_l")
    loss.backward()
    close(sims.grad, out["grad_sims_infonce_sims_l"], "grad_sims_infonce_sims_l")


def _refiner(inputs: dict, name: str, dim: int) -> noisy_in2r.GraphRefiner:
    prefix = f"{name}_refiner."
    refiner = noisy_in2r.GraphRefiner(dim, edge_hidden=inputs[f"{prefix}edge_nn.0.weight"].shape[0])
    refiner.load_state_dict(
        {k.removeprefix(prefix): torch.tensor(v) for k, v in inputs.items() if k.startswith(prefix)}
    )
    return refiner.eval()


def test_in2r_training_step_queue_and_refiner():
    """Net A's step: the labeled hinges, A's queue after the confident rows, the peer queue's neighbours through
    A's refiners, both unlabeled InfoNCE terms, and the gradients of the total w.r.t. raw inputs and refiners."""
    inputs, out, meta = load("in2r")
    opt = meta["options"]
    names = ("img_raw_l1", "img_raw_l2", "img_raw_u", "cap_raw_l1", "cap_raw_l2", "cap_raw_u")
    raws = {k: leaf(inputs[f"train_{k}"]) for k in names}
    i_l1, i_l2, i_u, c_l1, c_l2, c_u = (centred_l2norm(raws[k]) for k in names)
    close(i_l1 @ c_l1.T, out["dbg_sims_l"], "dbg_sims_l")
    close(i_l1 @ i_l2.T, out["dbg_img_sims_l"], "dbg_img_sims_l")
    close(c_l1 @ c_l2.T, out["dbg_cap_sims_l"], "dbg_cap_sims_l")
    loss_1, loss_2, loss_3 = noisy_in2r.labeled_loss(i_l1, i_l2, c_l1, c_l2, opt["margin"])
    for i, loss in enumerate((loss_1, loss_2, loss_3), 1):
        close(loss, out[f"loss_{i}"], f"loss_{i}")

    dim = inputs["img_raw_A"].shape[1]
    own = noisy_in2r.MemoryQueue(int(opt["queue_size"]), dim)
    rows = noisy_in2r.confident_rows(torch.tensor(inputs["train_prob_l"]), float(inputs["avg_clean_prob"]))
    own.enqueue(i_l1[rows], c_l1[rows])
    close(own.img, out["queue_after_img"], "queue_after_img")
    close(own.txt, out["queue_after_txt"], "queue_after_txt")
    assert own.ptr == int(out["queue_after_ptr"]) and own.is_full == bool(out["queue_after_is_full"])

    peer = noisy_in2r.MemoryQueue(int(opt["queue_size"]), dim)
    peer.load_state(
        {
            "img": torch.tensor(inputs["peer_queue_img"]),
            "txt": torch.tensor(inputs["peer_queue_txt"]),
            "ptr": int(inputs["peer_queue_ptr"]),
            "is_full": bool(inputs["peer_queue_is_full"]),
        }
    )
    peer_img, peer_txt = peer.used()
    refiners = {name: _refiner(inputs, name, dim) for name in ("i2t", "t2i")}
    k = int(opt["k"])
    nb_txt, txt_hat = noisy_in2r.refined_partners(i_u, peer_img, peer_txt, k, refiners["i2t"])
    nb_img, img_hat = noisy_in2r.refined_partners(c_u, peer_txt, peer_img, k, refiners["t2i"])
    close(nb_txt, out["dbg_i2t_neighbors"], "dbg_i2t_neighbors")
    close(txt_hat, out["dbg_corrected_txt_emb"], "dbg_corrected_txt_emb")
    close(nb_img, out["dbg_t2i_neighbors"], "dbg_t2i_neighbors")
    close(img_hat, out["dbg_corrected_img_emb"], "dbg_corrected_img_emb")
    sims_i2t, sims_t2i = i_u @ txt_hat.T, c_u @ img_hat.T
    close(sims_i2t, out["dbg_sims_u_i2t"], "dbg_sims_u_i2t")
    close(sims_t2i, out["dbg_sims_u_t2i"], "dbg_sims_u_t2i")
    u_i2t, u_t2i = noisy_in2r.infonce(sims_i2t), noisy_in2r.infonce(sims_t2i)
    close(u_i2t, out["infonce_u_i2t"], "infonce_u_i2t")
    close(u_t2i, out["infonce_u_t2i"], "infonce_u_t2i")
    (loss_1 + loss_2 + loss_3 + 0.5 * u_i2t + 0.5 * u_t2i).backward()
    for name, t in raws.items():
        close(t.grad, out[f"grad_train_{name}"], f"grad_train_{name}")
    for name, refiner in refiners.items():
        for key, p in refiner.named_parameters():
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            close(grad, out[f"grad_param.{name}_refiner.{key}"], f"grad {name}_refiner.{key}")
    assert set(meta["params_with_no_grad"]) == {
        f"{n}_refiner.{k}" for n, r in refiners.items() for k, p in r.named_parameters() if p.grad is None
    }


def test_in2r_evaluation_of_both_networks():
    inputs, out, _ = load("in2r")
    sims = {}
    for net in NETS:
        img_raw, cap_raw = (
            torch.tensor(inputs[f"eval_img_raw_{net}"]),
            torch.tensor(inputs[f"eval_cap_raw_{net}"]),
        )
        img, cap = noisy_in2r.eval_embeddings(
            img_raw, cap_raw, int(inputs["eval_batch_size"]), cap_raw.shape[0] // img_raw.shape[0]
        )
        close(img, out[f"eval_img_emb_{net}"], f"eval_img_emb_{net}")
        close(cap, out[f"eval_cap_emb_{net}"], f"eval_cap_emb_{net}")
        sims[net] = img @ cap.T
        close(sims[net], out[f"eval_sims_{net}"], f"eval_sims_{net}")
    close((sims["A"] + sims["B"]) / 2, out["eval_sims"], "eval_sims")
