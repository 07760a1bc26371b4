"""HREM (CrossmodalGroup/HREM) against its released code: `vse import hrem` + `vsekit.load`, and the training path.

The fixture folder `reference_fixture_dir("hrem")` holds a checkpoint in the release's layout, the loss module's
weights (`criterion_state.pth`, which the release never saves), inputs with the negatives the release drew,
and what the release computed (its README). Compared at atol = rtol = 1e-5: both sides are the same float32
ops (BERT, transformer layers, the graph layer, a few matrix products) in other summation orders, which moves
O(1) values by a few float32 eps per layer (measured here: <= 2.4e-6 on gradients, 1e-6 on the loss);
`dbg_triplet_weights`, exponentials of log-weights of size ~1000, are compared with rtol 1e-5 of values <= 1.
Connections are masks and must match exactly. Sizes and options come from the checkpoint and meta.json, so the
held-out set (VSE_REFERENCE_FIXTURES) runs unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import vsekit
from conftest import reference_fixture_dir
from vsekit.cli import main
from vsekit.config import ConfigError, load_recipe
from vsekit.data.batch import Batch
from vsekit.interop.hrem import CRITERION_RULES, IMAGE_RULES, TEXT_RULES, criterion_state
from vsekit.losses import create_loss
from vsekit.training.step_parts import StepParts
from vsekit.training.trainer import Trainer
from vsekit_lab.datasets.synthetic import make_synthetic_precomp

TOL = {"atol": 1e-5, "rtol": 1e-5}
TERMS = ("base", "gnn1", "gnn2", "gnn3", "reg")
RELATIONS = (
    "t2i_topk",
    "i2t_topk",
    "t2i_mean",
    "i2t_mean",
    "relation_i2i",
    "relation_t2t",
    "relation_i2t",
    "relation_t2i",
    "gnn_out",
)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    folder = reference_fixture_dir("hrem")
    tmp = tmp_path_factory.mktemp("hrem")
    meta = json.loads((folder / "meta.json").read_text())
    (tmp / "bert.json").write_text(json.dumps(meta["bert_config"]))
    out = tmp / "run"
    args = [
        "import",
        "hrem",
        str(folder / "model_best.pth"),
        "--text-config",
        str(tmp / "bert.json"),
        "--out",
        str(out),
    ]
    assert main(args) == 0
    inputs = {k: torch.from_numpy(v) for k, v in np.load(folder / "inputs.npz").items()}
    outputs = dict(np.load(folder / "outputs.npz"))
    return vsekit.load(out).eval(), inputs, outputs, folder


def close(actual: torch.Tensor, expected: np.ndarray, what: str) -> None:
    torch.testing.assert_close(
        actual.detach().float(),
        torch.from_numpy(np.asarray(expected)).float(),
        **TOL,
        msg=lambda m: f"{what}: {m}",
    )


def released_loss(model, folder: Path):
    """The recipe's hrem loss with the fixture's loss weights, past its warm-up, in eval mode (as recorded)."""
    loss_fn = create_loss(model.recipe.loss)
    state = criterion_state(folder / "criterion_state.pth")
    loss_fn.load_state_dict({**state, "iter_count": torch.tensor(loss_fn.warmup)})
    return loss_fn.eval()


def test_embeddings_sets_and_similarities(imported):
    model, x, out, _ = imported
    with torch.no_grad(), model.capture_sets() as sets:
        img = model.encode_image(x["images"], x["image_lengths"])
        txt = model.encode_text(x["captions"], x["caption_lengths"])
    close(img, out["img_emb"], "img_emb")
    close(txt, out["cap_emb"], "cap_emb")
    close(model.similarity(img, txt), out["sims"], "sims")
    # the local sets the loss reads, padded positions included (the release's values there)
    close(sets["image"][0], out["dbg_img_local"], "image local features")
    close(sets["text"][0], out["dbg_cap_local"], "caption local features")


def check_loss(loss, diag, record, out) -> None:
    close(loss, out["loss"], "loss")
    for term in TERMS:
        close(diag[f"loss_{term}"], out[f"dbg_loss_{term}"], f"loss term {term}")
    for name in RELATIONS:
        close(record[name], out[f"dbg_{name}"], name)
    for side in ("i2i", "i2t", "t2i", "t2t"):
        np.testing.assert_array_equal(
            record[f"connect_{side}"].numpy(), out[f"dbg_connect_{side}"], f"connect {side}"
        )
    close(torch.stack(record["triplet_weights"]), out["dbg_triplet_weights"], "triplet sampling weights")


def check_param_grads(model, loss_fn, out) -> None:
    """Every `grad_param.<enc>.<released key>` against the gradient of its vsekit home (zero where unreached)."""
    homes = {
        "img_enc": (IMAGE_RULES, dict(model.named_parameters())),
        "txt_enc": (TEXT_RULES, dict(model.named_parameters())),
        "criterion": (CRITERION_RULES, dict(loss_fn.named_parameters())),
    }
    checked = 0
    for key in (k for k in out if k.startswith("grad_param.")):
        _, enc, name = key.split(".", 2)
        rules, params = homes[enc]
        src, dst = next((s, d) for s, d in rules if name.startswith(s))
        if dst is None:  # stored, never applied: the release's gradient is zero
            assert not np.abs(out[key]).any(), key
            continue
        p = params[dst + name[len(src) :]]
        close(p.grad if p.grad is not None else torch.zeros_like(p), out[key], key)
        checked += 1
    assert checked > 0


def test_loss_terms_and_gradients_through_the_imported_run(imported):
    """Every loss term, intermediate and gradient with the release's draws replayed."""
    model, x, out, folder = imported
    loss_fn = released_loss(model, folder)
    model.zero_grad()
    images = x["images"].clone().requires_grad_(True)
    with model.capture_sets() as sets:
        img = model.encode_images(images, x["image_lengths"])
        txt = model.encode_texts(x["captions"], x["caption_lengths"])
    record: dict = {}
    loss, diag = loss_fn(
        model.similarity(img, txt),
        image_ids=x["img_ids"],
        image_emb=img,
        text_emb=txt,
        image_set=sets["image"],
        text_set=sets["text"],
        drawn=x["triplet_negatives"],
        record=record,
    )
    check_loss(loss, diag, record, out)
    loss.backward()
    close(images.grad, out["grad_images"], "grad_images")
    check_param_grads(model, loss_fn, out)


def test_training_step_parts_give_the_release_loss_and_gradients(imported):
    """The trainer's own encode / score (sets captured, loss inputs handed over) with the recorded draws."""
    model, x, out, folder = imported
    loss_fn = released_loss(model, folder)
    model.zero_grad()
    optimizer = torch.optim.AdamW([*model.parameters(), *loss_fn.parameters()])
    parts = StepParts(model, loss_fn, optimizer, torch.device("cpu"))
    ids = x["img_ids"]
    batch = Batch(
        x["images"], x["image_lengths"], x["captions"], x["caption_lengths"], ids, torch.arange(len(ids))
    )
    img, txt = parts.encode(batch, torch.Generator().manual_seed(0))
    assert set(parts.loss_inputs) == {"image_set", "text_set", "generator"}
    record: dict = {}
    parts.loss_inputs.update(drawn=x["triplet_negatives"], record=record)
    loss, diag = parts.score(img, txt, ids, batch.caption_index, warmup=False)
    check_loss(loss, diag, record, out)
    loss.backward()
    check_param_grads(model, loss_fn, out)
    assert int(loss_fn.iter_count) == loss_fn.warmup + 1  # the release's counter advanced once


def test_gradients_are_clipped_with_the_loss_parameters(imported):
    """The release clips the encoders' and the loss's gradients as one set (`clip_grad_norm_(self.params)`)."""
    model, x, out, folder = imported
    loss_fn = released_loss(model, folder)
    params = [*model.parameters(), *loss_fn.parameters()]
    for i, p in enumerate(params):
        p.grad = torch.full_like(p, 1.0 + i % 3)
    parts = StepParts(model, loss_fn, torch.optim.SGD(params, lr=0.0), torch.device("cpu"), grad_clip=2.0)
    parts.update()
    total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in params]))
    torch.testing.assert_close(total, torch.tensor(2.0), atol=1e-4, rtol=1e-4)
    model.zero_grad()


def test_drawn_negatives_follow_the_weights(imported):
    """Without a replay the loss draws with the step's generator: only negatives of non-zero weight, the same
    ones for the same seed."""
    model, x, out, folder = imported
    loss_fn = released_loss(model, folder)
    with torch.no_grad(), model.capture_sets() as sets:
        img = model.encode_images(x["images"], x["image_lengths"])
        txt = model.encode_texts(x["captions"], x["caption_lengths"])
    draws = []
    for _ in range(2):
        record: dict = {}
        gen = torch.Generator().manual_seed(3)
        loss_fn(
            None,
            image_ids=x["img_ids"],
            image_emb=img,
            text_emb=txt,
            image_set=sets["image"],
            text_set=sets["text"],
            generator=gen,
            record=record,
        )
        weights = torch.stack(record["triplet_weights"])  # [8, P, B]
        drawn = weights.new_zeros(weights.shape[:2], dtype=torch.long)
        gen = torch.Generator().manual_seed(3)
        for c in range(weights.shape[0]):
            drawn[c] = torch.multinomial(weights[c], 1, generator=gen).squeeze(1)
        assert (weights.gather(2, drawn.unsqueeze(-1)) > 0).all()
        draws.append(drawn)
    assert torch.equal(draws[0], draws[1])


def test_graph_waits_for_the_warmup(imported):
    model, x, out, folder = imported
    loss_fn = released_loss(model, folder)
    loss_fn.iter_count.zero_()
    with torch.no_grad(), model.capture_sets() as sets:
        img = model.encode_images(x["images"], x["image_lengths"])
        txt = model.encode_texts(x["captions"], x["caption_lengths"])
    loss, diag = loss_fn(
        None,
        image_ids=x["img_ids"],
        image_emb=img,
        text_emb=txt,
        image_set=sets["image"],
        text_set=sets["text"],
        drawn=x["triplet_negatives"],
    )
    close(loss, out["dbg_loss_base"], "loss before the warm-up ends = the base term")
    assert set(diag) == {"loss_base"}


def test_recipe_refuses_what_the_step_cannot_run():
    with pytest.raises(ConfigError, match="grad_cache_chunk"):
        load_recipe("hrem", ["train.grad_cache_chunk=8"])
    with pytest.raises(ConfigError, match="hrem_embed_dim"):
        load_recipe("hrem", ["model.embed_dim=64", "loss.hrem_embed_dim=32"])


def test_graph_width_left_null_is_the_models():
    """`loss.hrem_embed_dim` left null (the recipe's default) is model.embed_dim: the graph layer is built
    that wide from the recipe alone."""
    from vsekit.losses import create_loss

    recipe = load_recipe("hrem", ["model.embed_dim=64", "loss.hrem_heads=4"])
    assert recipe.loss.hrem_embed_dim is None
    loss = create_loss(recipe.loss, embed_dim=recipe.model.embed_dim)
    assert loss.gnn.layers[0].self_attn.embed_dim == 64
    assert recipe.loss.hrem_embed_dim is None  # the recipe is left as it was


HREM_SMALL = [
    "model.embed_dim=32",
    "loss.hrem_embed_dim=32",
    "loss.hrem_heads=4",
    "model.image.pooling.hrem_heads=4",
    "model.text.pooling.hrem_heads=4",
    "model.image.mlp_hidden=16",
    "loss.hrem_topk=3",
    "loss.hrem_warmup_iters=2",
    "model.text.freeze=true",
    "train.batch_size=20",
    "train.log_every=0",
    "train.epochs=2",
]


@pytest.mark.slow
def test_train_resume_exactly_and_eval(tmp_path):
    """`vse train --recipe hrem` on a tiny synthetic set (MiniLM body frozen for speed; the graph joins after 2
    steps): a run stopped mid-epoch and resumed equals the uninterrupted one bit for bit (model, optimizer and
    the loss's own state), and `vse eval` scores it."""
    data = make_synthetic_precomp(tmp_path / "data", n_train=16, n_dev=8, n_test=8, regions=4, dim=8)
    settings = [arg for key in HREM_SMALL for arg in ("--set", key)]
    assert (
        main(
            [
                "train",
                "--recipe",
                "hrem",
                "--data",
                str(data),
                "--out",
                str(tmp_path / "a"),
                "--no-progress",
                "--device",
                "cpu",
                *settings,
            ]
        )
        == 0
    )
    r = load_recipe("hrem", [*HREM_SMALL, "train.device=cpu"])
    Trainer(r, data, tmp_path / "b", progress=False, log=lambda *_: None).fit(
        max_steps=3
    )  # stops mid-epoch 0
    assert main(["train", "--resume", str(tmp_path / "b"), "--no-progress"]) == 0
    for name in ("last.safetensors", "last_optim.safetensors"):
        a, b = load_file(tmp_path / "a" / name), load_file(tmp_path / "b" / name)
        assert a.keys() == b.keys(), name
        for k in a:
            assert torch.equal(a[k], b[k]), (name, k)
    loss_state = load_file(tmp_path / "a" / "last_optim.safetensors")
    assert int(loss_state["__loss__.iter_count"]) == 8  # 80 pairs / 20 x 2 epochs: the counter was saved
    assert any(k.startswith("__loss__.gnn.") for k in loss_state)
    assert main(["eval", str(tmp_path / "a"), "--split", "test", "--json", str(tmp_path / "m.json")]) == 0
    assert json.loads((tmp_path / "m.json").read_text())["rsum"] >= 0
