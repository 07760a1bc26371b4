"""NCR's co-teaching through vsekit's trainer: the step of one network on its peer's split equals the released
code's numbers (the `ncr/` fixtures: targets, labeled and unlabeled losses, gradients w.r.t. the embeddings),
the split pass of the trainer equals the fixtures' per-pair losses, a two-network run is scored as the mean of
both similarity matrices, resumes bit for bit, and is refused where it cannot run."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest
import torch
from torch import nn

from test_parity_noisy import TOL, load
from vsekit.config import ConfigError, load_recipe
from vsekit.data.batch import Batch
from vsekit.losses.co_divide import MemberSplit
from vsekit.training.trainer import Trainer

SMALL = [
    "model.text.word_dim=16",
    "model.text.vocab_min_count=1",
    "model.text.tokenizer=regex",
    "train.batch_size=16",
]


class Table(nn.Module):
    """A stand-in encoder: row `x[:, 0, 0]` (images) or `x[:, 0]` (captions) of a given embedding table."""

    def __init__(self, rows: np.ndarray) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.tensor(rows))

    def forward(self, x, lengths=None, generator=None):
        ids = x[:, 0, 0] if x.ndim == 3 else x[:, 0]
        return self.weight[ids.long()]


def fixture_trainer(tiny_data, tmp_path, inputs, meta) -> Trainer:
    """A two-network trainer whose networks are the fixture's embedding tables, with the release's options
    (margin, soft margin, p_threshold) read from the fixture."""
    e = inputs["img_emb_A"].shape[1]
    opt = meta["options"]
    recipe = load_recipe(
        "ncr",
        SMALL
        + [f"model.embed_dim={e}", "train.epochs=2", "optim.grad_clip=0", "loss.warmup_epochs=1"]
        # the stand-in encoders return the fixture's final embeddings: the model's L2 is theirs
        + ["model.normalize=false"]
        + [f"loss.margin={opt['margin']}", f"loss.ncr_soft_margin={opt['soft_margin']}"]
        + [f"train.sample_policy.p_threshold={opt['p_threshold']}"],
    )
    t = Trainer(recipe, tiny_data, tmp_path / "run", progress=False, log=lambda *_: None)
    for k, name in enumerate("AB"):
        member = t.model.members[k]
        member.image_encoder = Table(inputs[f"img_emb_{name}"])
        member.text_encoder = Table(inputs[f"cap_emb_{name}"])
    return t


def fixture_batch(inputs, ids: np.ndarray) -> Batch:
    images = inputs["noisy_t2i"][ids]
    return Batch(
        images=torch.tensor(images, dtype=torch.float32).view(-1, 1, 1),
        image_lengths=torch.ones(len(ids), dtype=torch.long),
        tokens=torch.tensor(ids).view(-1, 1),
        token_lengths=torch.ones(len(ids), dtype=torch.long),
        image_index=torch.tensor(images),
        caption_index=torch.tensor(ids),
    )


def table_grad(rows: np.ndarray, n: int, grad_rows: np.ndarray) -> torch.Tensor:
    """The gradient on a table from per-row gradients of a batch (repeated rows add up)."""
    return torch.zeros(n, grad_rows.shape[1]).index_add(0, torch.tensor(rows), torch.tensor(grad_rows))


def test_network_step_on_its_peers_split_equals_the_release(tiny_data, tmp_path):
    inputs, out, meta = load("ncr")
    t = fixture_trainer(tiny_data, tmp_path, inputs, meta)
    ids_l, ids_u = inputs["train_ids_l"], inputs["train_ids_u"]
    n_caps = len(inputs["noisy_t2i"])
    prob_b = np.full(n_caps, 0.5)
    prob_b[ids_l] = inputs["train_prob_l"][:, 0]  # network A trains on B's split: B's probabilities
    split_b = MemberSplit(prob_b, np.ones(n_caps, dtype=bool), 0.5, None)
    t.co.splits = [MemberSplit(np.full(n_caps, 0.5), np.ones(n_caps, dtype=bool), 0.5, None), split_b]
    a = t.model.members[0]
    batch_l, batch_u = fixture_batch(inputs, ids_l), fixture_batch(inputs, ids_u)

    got = t.co.step(0, batch_l, None, 1, 0, 1, warm=False)  # the labeled step alone
    torch.testing.assert_close(got["loss_labeled"], torch.tensor(out["loss_l"]).reshape(()), **TOL)
    n_img = inputs["img_emb_A"].shape[0]
    torch.testing.assert_close(
        a.image_encoder.weight.grad,
        table_grad(inputs["noisy_t2i"][ids_l], n_img, out["grad_img_emb_l"]),
        **TOL,
    )
    torch.testing.assert_close(
        a.text_encoder.weight.grad, table_grad(ids_l, n_caps, out["grad_cap_emb_l"]), **TOL
    )
    assert t.model.members[1].image_encoder.weight.grad is None  # the peer is not trained by A's step

    # labeled then unlabeled step; the stand-in tables are outside the optimizer, so nothing resets their
    # gradients between the two steps: they hold the sum of both
    a.image_encoder.weight.grad = a.text_encoder.weight.grad = None
    got = t.co.step(0, batch_l, batch_u, 1, 0, 1, warm=False)
    torch.testing.assert_close(got["loss_labeled"], torch.tensor(out["loss_l"]).reshape(()), **TOL)
    torch.testing.assert_close(got["loss_unlabeled"], torch.tensor(out["loss_u"]).reshape(()), **TOL)
    img_rows = np.concatenate([inputs["noisy_t2i"][ids_l], inputs["noisy_t2i"][ids_u]])
    img_grads = np.concatenate([out["grad_img_emb_l"], out["grad_img_emb_u"]])
    torch.testing.assert_close(a.image_encoder.weight.grad, table_grad(img_rows, n_img, img_grads), **TOL)
    cap_grads = np.concatenate([out["grad_cap_emb_l"], out["grad_cap_emb_u"]])
    torch.testing.assert_close(
        a.text_encoder.weight.grad, table_grad(np.concatenate([ids_l, ids_u]), n_caps, cap_grads), **TOL
    )


def test_split_pass_of_the_trainer_equals_the_release(tiny_data, tmp_path):
    inputs, out, meta = load("ncr")
    t = fixture_trainer(tiny_data, tmp_path, inputs, meta)

    class FixtureSplit:  # the fixture's pairs in place of the run's train split
        cap2img = inputs["noisy_t2i"]
        captions = [str(i) for i in range(len(inputs["noisy_t2i"]))]

    t.train_split = FixtureSplit()
    t.co.split_batch = int(inputs["split_batch_size"])
    for k, name in enumerate("AB"):
        member = t.model.members[k]
        # the pass encodes every image and caption once: the stand-ins return the fixture's rows
        member_losses = _losses_with_tables(t, k, inputs, name)
        np.testing.assert_allclose(member_losses, out[f"split_loss_{name}"], **{"atol": 1e-5, "rtol": 1e-5})
        assert member.training  # its mode is restored


def _losses_with_tables(t, k, inputs, name):
    import vsekit.training.co_teaching as co

    img = torch.tensor(inputs[f"img_emb_{name}"])
    cap = torch.tensor(inputs[f"cap_emb_{name}"])
    saved = co.encode_images, co.encode_captions, co.image_source_for
    co.encode_images = lambda *a, **kw: img
    co.encode_captions = lambda *a, **kw: cap
    co.image_source_for = lambda *a, **kw: None
    try:
        return t.co.member_losses(k, inputs["split_order"])
    finally:
        co.encode_images, co.encode_captions, co.image_source_for = saved


def ncr_recipe(extra=()):
    return load_recipe(
        "ncr",
        SMALL + ["model.embed_dim=16", "train.epochs=3", "loss.warmup_epochs=1", "train.seed=3", *extra],
    )


def test_pair_scores_the_mean_of_both_networks(tiny_data, tmp_path):
    from vsekit.evaluation import split_similarities

    t = Trainer(
        ncr_recipe(["train.epochs=1"]), tiny_data, tmp_path / "run", progress=False, log=lambda *_: None
    )
    t.fit()
    t.model.eval()
    pair = split_similarities(t.model, t.val_split, 64)
    each = [split_similarities(m, t.val_split, 64) for m in t.model.members]
    np.testing.assert_allclose(pair, (each[0] + each[1]) / 2, rtol=0, atol=1e-6)  # float32 dot products
    assert not np.allclose(each[0], each[1])  # two different networks


def records(run) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_resume_inside_a_split_epoch_is_bit_exact(tiny_data, tmp_path):
    full = tmp_path / "full"
    Trainer(ncr_recipe(), tiny_data, full, progress=False, log=lambda *_: None).fit()
    part = tmp_path / "part"
    # stop inside the first split epoch (epoch 2), in its second network's phase
    ends = [r["step"] for r in records(full) if r["kind"] == "val"]
    stop = ends[0] + (ends[1] - ends[0]) * 3 // 4
    Trainer(ncr_recipe(), tiny_data, part, progress=False, log=lambda *_: None).fit(max_steps=stop)
    saved = json.loads((part / "last_state.json").read_text())
    assert saved["train_state"]["epoch"] == 1 and saved["train_state"]["step_in_epoch"] > 0
    assert saved["sample_policy"]["digest"]  # the split of the epoch in progress is in the checkpoint
    Trainer(ncr_recipe(), tiny_data, part, resume=True, progress=False, log=lambda *_: None).fit()
    from safetensors.torch import load_file

    a, b = load_file(full / "last.safetensors"), load_file(part / "last.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    vals = lambda run: [r for r in records(run) if r["kind"] in ("val", "split")]  # noqa: E731

    def strip(r):  # the seconds differ from run to run
        return {
            k: strip(v) if isinstance(v, dict) else v
            for k, v in r.items()
            if not k.endswith(("time_s", "pass_s"))
        }

    assert [strip(r) for r in vals(full)] == [strip(r) for r in vals(part)]
    assert sum(r["kind"] == "split" for r in records(full)) == 2  # epochs 2 and 3 split, epoch 1 warms up


def test_split_file_and_audit_of_a_pair(tiny_data, tmp_path):
    """The split file records the sha256 of the weights that made it; the audit reads it for the checkpoint
    of those weights only (hashes compared with the checkpoint files' own, computed here)."""
    run = tmp_path / "run"
    Trainer(ncr_recipe(["train.epochs=2"]), tiny_data, run, progress=False, log=lambda *_: None).fit()
    n = len((tiny_data / "train_caps.txt").read_text().splitlines())
    with np.load(run / "noisy_split.npz") as z:
        assert set(z.files) == {"prob_A", "prob_B", "weights_sha256"}
        assert z["prob_A"].shape == (n,)
        mean = (z["prob_A"] + z["prob_B"]) / 2
        made_from = str(z["weights_sha256"][()])
    split = [r for r in records(run) if r["kind"] == "split"][-1]
    assert split["A"]["pairs"] == n and 2 <= split["A"]["labeled"] <= n
    # the one split (epoch 2's start) is made from epoch 1's weights, the best checkpoint then (a first dev
    # evaluation is always an improvement): it is also the best checkpoint's split
    assert (run / "noisy_split_best.npz").read_bytes() == (run / "noisy_split.npz").read_bytes()
    sha = {
        tag: hashlib.sha256((run / f"{tag}.safetensors").read_bytes()).hexdigest() for tag in ("best", "last")
    }
    assert made_from != sha["last"]  # the last checkpoint holds epoch 2's weights
    from vsekit.api import load
    from vsekit.evaluation.audit import audit_split

    audit = audit_split(load(run), run, tiny_data, "train")
    if json.loads((run / "best.json").read_text())["epoch"] == 1:
        assert made_from == sha["best"]
        assert audit.source.startswith("ncr")
        np.testing.assert_array_equal(audit.prob, mean)
    else:  # epoch 2 improved: the best weights are not the split's
        assert made_from != sha["best"]
        assert audit.source == "per-pair loss"
    last = audit_split(load(run, checkpoint="last"), run, tiny_data, "train", checkpoint="last")
    assert last.source == "per-pair loss"


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["loss.name=triplet"], "does not read"),
        (["train.grad_cache_chunk=8"], "grad_cache_chunk"),
        (["model.similarity.name=aeom", "model.image.views=2"], None),
    ],
)
def test_refused_settings(tiny_data, tmp_path, extra, needle):
    with pytest.raises(ConfigError) as e:
        Trainer(ncr_recipe(extra), tiny_data, tmp_path / "run", progress=False, log=lambda *_: None)
    if needle:
        assert needle in str(e.value)
    assert not (tmp_path / "run").exists()


def test_member_of_a_one_network_run_is_one_line_exit_2(tiny_data, tmp_path):
    import subprocess
    import sys

    from vsekit.api import load
    from vsekit.models.inputs import ModelInputError

    run = tmp_path / "one"
    recipe = load_recipe("rcl", SMALL + ["model.embed_dim=16", "train.epochs=1"])
    Trainer(recipe, tiny_data, run, progress=False, log=lambda *_: None).fit()
    vse = [sys.executable, "-m", "vsekit.cli"]
    p = subprocess.run([*vse, "eval", str(run), "--member", "A"], capture_output=True, text=True)
    assert p.returncode == 2
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "trains one network" in lines[0] and str(run) in lines[0]
    with pytest.raises(ModelInputError, match="member"):
        load(run, member="C")


def test_member_of_a_pair_is_that_network(tiny_data, tmp_path):
    from vsekit.api import load

    run = tmp_path / "pair"
    Trainer(ncr_recipe(["train.epochs=1"]), tiny_data, run, progress=False, log=lambda *_: None).fit()
    pair, a, b = load(run), load(run, member="A"), load(run, member="B")
    captions = ["a small red square", "two blue circles"]
    both = pair.encode_text(captions)
    ea, eb = a.encode_text(captions), b.encode_text(captions)
    assert both.shape[1] == 2 * ea.shape[1]
    # the pair's embedding is both networks' side by side, each scaled by 1/sqrt(2)
    torch.testing.assert_close(both, torch.cat([ea, eb], dim=1) / 2**0.5, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_index_of_a_pair_scores_the_mean_of_both_networks(shapes_model, tmp_path):
    pytest.importorskip("faiss")
    from vsekit.api import load
    from vsekit.data.precomp import load_precomp_split
    from vsekit.search.engine import SearchEngine
    from vsekit.search.index import SearchIndex, build_index
    from vsekit_lab.datasets.shapes import SHAPES_RECIPE_OVERRIDES

    data, _ = shapes_model
    run = tmp_path / "pair"
    recipe = load_recipe("ncr", SHAPES_RECIPE_OVERRIDES + ["train.epochs=3", "loss.warmup_epochs=1"])
    Trainer(recipe, data, run, progress=False, log=lambda *_: None).fit()
    out = tmp_path / "idx"
    build_index(run, f"{data}:test", out, progress=False, log=lambda *_: None)
    index = SearchIndex(out)
    engine = SearchEngine(index, load(run), {})
    query = "a red circle"
    hits = engine.search_text(query, k=5)
    # each network alone, on the test split's own stored features (the pictures the index holds, in order)
    split = load_precomp_split(data, "test", recipe.data.captions_per_image)
    feats = torch.as_tensor(np.asarray(split.features, dtype=np.float32)[split.image_rows])
    means = []
    for member in ("A", "B"):
        m = load(run, member=member)
        means.append(m.similarity(m.encode_image(feats), m.encode_text([query]))[:, 0])
    expected = ((means[0] + means[1]) / 2).numpy()
    assert index.all_image_emb().shape[1] == 2 * recipe.model.embed_dim
    for h in hits:
        assert h.score == pytest.approx(float(expected[h.id]), abs=1e-5)


def test_pooling_weights_of_a_pair_name_each_network(tiny_data, tmp_path):
    from vsekit.pooling.inspect import gpo_profiles
    from vsekit.runs import load_run

    run = tmp_path / "pair"
    Trainer(ncr_recipe(["train.epochs=1"]), tiny_data, run, progress=False, log=lambda *_: None).fit()
    model, _ = load_run(run)
    names = [p.encoder for p in gpo_profiles(model, {"image": 4, "text": 6})]
    assert sorted(names) == sorted(
        f"{side}_encoder (network {n})" for side in ("image", "text") for n in ("A", "B")
    )
