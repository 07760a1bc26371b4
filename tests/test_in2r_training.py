"""IN2R through vsekit's trainer: one network's step on its peer's split (two passes, its queue, the peer's
queue through its own refiners) and its warm-up step equal the released code's numbers (the `in2r/` fixtures:
losses, queue, gradients w.r.t. the raw encoder outputs and the refiners), the split pass centres each batch
as released, the model's centring is the release's in training and independent of the batch in eval mode, a
run resumes bit for bit (queues and refiners included), and a recipe that cannot run is refused."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from test_parity_noisy import close, load
from vsekit.config import ConfigError, load_recipe
from vsekit.data.batch import Batch
from vsekit.losses.co_divide import MemberSplit
from vsekit.training.trainer import Trainer
from vsekit.utils.dropout import seeded_dropout

SMALL = [
    "model.text.word_dim=16",
    "model.text.vocab_min_count=1",
    "model.text.tokenizer=regex",
    "train.batch_size=16",
]


class Passes(nn.Module):
    """A stand-in encoder returning the given raw outputs in call order (the release's passes differ by
    dropout, so the fixture gives each one); `used` counts the calls."""

    def __init__(self, outputs: list[torch.Tensor]) -> None:
        super().__init__()
        self.outputs, self.used = outputs, 0

    def forward(self, x, lengths=None, generator=None):
        out = self.outputs[self.used]
        self.used += 1
        return out


def fixture_trainer(tiny_data, tmp_path, meta, extra=()) -> Trainer:
    opt = meta["options"]
    e = int(meta["sizes"]["E"])
    recipe = load_recipe(
        "in2r",
        SMALL
        + [f"model.embed_dim={e}", "train.epochs=2", "optim.grad_clip=0", "loss.warmup_epochs=1"]
        # the stand-ins return the release's encoder outputs (its encoders' L2 included); the centring follows
        + ["model.normalize=false"]
        + [f"loss.margin={opt['margin']}", f"loss.in2r_queue_size={opt['queue_size']}"]
        + [f"loss.in2r_neighbours={opt['k']}", f"train.sample_policy.p_threshold={opt['p_threshold']}"]
        + list(extra),
    )
    return Trainer(recipe, tiny_data, tmp_path / "run", progress=False, log=lambda *_: None)


def batch_of(ids: np.ndarray) -> Batch:
    n = len(ids)
    return Batch(
        images=torch.zeros(n, 1, 1),
        image_lengths=torch.ones(n, dtype=torch.long),
        tokens=torch.zeros(n, 1, dtype=torch.long),
        token_lengths=torch.ones(n, dtype=torch.long),
        image_index=torch.arange(n),
        caption_index=torch.tensor(ids),
    )


def load_refiners(t: Trainer, inputs: dict, k: int) -> None:
    for d in ("i2t", "t2i"):
        prefix = f"{d}_refiner."
        state = {
            k2.removeprefix(prefix): torch.tensor(v) for k2, v in inputs.items() if k2.startswith(prefix)
        }
        t.loss_fn.refiners[k][d].load_state_dict(state)
    t.loss_fn.eval()  # the fixture ran the refiners in eval mode


def test_network_step_on_its_peers_split_equals_the_release(tiny_data, tmp_path):
    inputs, out, meta = load("in2r")
    t = fixture_trainer(tiny_data, tmp_path, meta)
    names = ("l1", "l2", "u")
    img = {n: torch.tensor(inputs[f"train_img_raw_{n}"]).requires_grad_(True) for n in names}
    cap = {n: torch.tensor(inputs[f"train_cap_raw_{n}"]).requires_grad_(True) for n in names}
    a = t.model.members[0]
    a.image_encoder, a.text_encoder = Passes([img[n] for n in names]), Passes([cap[n] for n in names])
    load_refiners(t, inputs, 0)
    t.loss_fn.queues[1].load_state(
        {
            "img": torch.tensor(inputs["peer_queue_img"]),
            "txt": torch.tensor(inputs["peer_queue_txt"]),
            "ptr": int(inputs["peer_queue_ptr"]),
            "is_full": bool(inputs["peer_queue_is_full"]),
        }
    )
    ids_l, ids_u = inputs["train_ids_l"], inputs["train_ids_u"]
    n = int(ids_l.max()) + int(ids_u.max()) + 1
    avg = float(inputs["avg_clean_prob"])
    own = MemberSplit(np.full(n, avg), np.ones(n, dtype=bool), 0.5, None)  # A's own mean is the fixture's
    peer_prob = np.full(n, 0.5)
    peer_prob[ids_l] = inputs["train_prob_l"][:, 0]  # A trains on B's split: B's probabilities
    t.co.splits = [own, MemberSplit(peer_prob, np.ones(n, dtype=bool), 0.5, None)]

    got = t.co.step(0, batch_of(ids_l), batch_of(ids_u), 1, 0, 1, warm=False)
    assert a.image_encoder.used == 3 and a.text_encoder.used == 3  # two labeled passes, one unlabeled
    close(got["loss_labeled"], out["loss_1"] + out["loss_2"] + out["loss_3"], "labeled loss")
    close(got["loss_unlabeled"], 0.5 * (out["infonce_u_i2t"] + out["infonce_u_t2i"]), "unlabeled loss")
    q = t.loss_fn.queues[0]
    close(q.img, out["queue_after_img"], "queue_after_img")
    close(q.txt, out["queue_after_txt"], "queue_after_txt")
    assert q.ptr == int(out["queue_after_ptr"]) and q.is_full == bool(out["queue_after_is_full"])
    assert got["queued"] == int(out["queue_after_ptr"])
    for n_ in names:
        close(img[n_].grad, out[f"grad_train_img_raw_{n_}"], f"grad img {n_}")
        close(cap[n_].grad, out[f"grad_train_cap_raw_{n_}"], f"grad cap {n_}")
    for d in ("i2t", "t2i"):
        for key, p in t.loss_fn.refiners[0][d].named_parameters():
            grad = p.grad if p.grad is not None else torch.zeros_like(p)
            close(grad, out[f"grad_param.{d}_refiner.{key}"], f"grad {d}_refiner.{key}")
    # the peer's refiners and queue are untouched by A's step
    assert all(p.grad is None for p in t.loss_fn.refiners[1].parameters())
    assert t.loss_fn.queues[1].ptr == int(inputs["peer_queue_ptr"])


def test_warmup_step_equals_the_release(tiny_data, tmp_path):
    inputs, out, meta = load("in2r")
    t = fixture_trainer(tiny_data, tmp_path, meta)
    img = [torch.tensor(inputs[f"warm_img_raw{i}"]).requires_grad_(True) for i in (1, 2)]
    cap = [torch.tensor(inputs[f"warm_cap_raw{i}"]).requires_grad_(True) for i in (1, 2)]
    b = t.model.members[1]
    b.image_encoder, b.text_encoder = Passes(img), Passes(cap)
    got = t.co.step(1, batch_of(np.arange(img[0].shape[0])), None, 0, 0, 1, warm=True)
    close(got["loss"], out["loss_warmup"], "loss_warmup")
    for i in (0, 1):
        close(img[i].grad, out[f"grad_warm_img_raw{i + 1}"], f"grad_warm_img_raw{i + 1}")
        close(cap[i].grad, out[f"grad_warm_cap_raw{i + 1}"], f"grad_warm_cap_raw{i + 1}")


def test_split_pass_centres_each_batch_as_released(tiny_data, tmp_path):
    import vsekit.training.co_teaching as co

    inputs, out, meta = load("in2r")
    t = fixture_trainer(tiny_data, tmp_path, meta)

    class FixtureSplit:
        cap2img = inputs["noisy_t2i"]
        captions = [str(i) for i in range(len(inputs["noisy_t2i"]))]

    t.train_split = FixtureSplit()
    t.co.split_batch = int(inputs["split_batch_size"])
    saved = co.encode_images, co.encode_captions, co.image_source_for
    try:
        for k, name in enumerate("AB"):
            img, cap = torch.tensor(inputs[f"img_raw_{name}"]), torch.tensor(inputs[f"cap_raw_{name}"])
            co.encode_images = lambda *a, _v=img, **kw: _v
            co.encode_captions = lambda *a, _v=cap, **kw: _v
            co.image_source_for = lambda *a, **kw: None
            losses = t.co.member_losses(k, inputs["split_order"])
            np.testing.assert_allclose(losses, out[f"split_loss_{name}"], atol=1e-5, rtol=1e-5)
    finally:
        co.encode_images, co.encode_captions, co.image_source_for = saved


def test_centring_in_training_and_in_eval_mode():
    from vsekit.models.centring import EmbeddingCentring

    c = EmbeddingCentring(3, momentum=0.5)
    x1 = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 2.0]])
    x2 = torch.tensor([[0.0, 4.0, 4.0], [2.0, 2.0, 0.0]])
    y = c(x1, "image")
    centred = x1 - torch.tensor([2.0, 1.0, 1.0])  # the batch mean, by hand
    torch.testing.assert_close(y, centred / (centred.norm(dim=1, keepdim=True) + 1e-8))
    c(x2, "image")
    # running mean: 0.5 * (0.5 * m1) + 0.5 * m2 with m1 = (2, 1, 1), m2 = (1, 3, 2)
    torch.testing.assert_close(c.image_mean, torch.tensor([1.0, 1.75, 1.25]))
    assert torch.equal(c.text_mean, torch.zeros(3))  # each side its own
    c.eval()
    one = c(x1[:1], "image")
    both = c(x1, "image")
    torch.testing.assert_close(one[0], both[0], rtol=0, atol=0)  # eval: independent of the batch
    assert torch.all(one.norm(dim=1) > 0.99)


def test_seeded_dropout_draws_from_its_generator():
    x = torch.ones(4000)
    g = torch.Generator().manual_seed(7)
    a = seeded_dropout(x, 0.3, True, g)
    b = seeded_dropout(x, 0.3, True, torch.Generator().manual_seed(7))
    c = seeded_dropout(x, 0.3, True, torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)
    kept = (a > 0).float().mean().item()
    assert abs(kept - 0.7) < 4 * (0.7 * 0.3 / 4000) ** 0.5  # binomial: 4 standard deviations
    torch.testing.assert_close(a[a > 0], torch.full_like(a[a > 0], 1 / 0.7))
    assert torch.equal(seeded_dropout(x, 0.3, False, g), x)


def in2r_recipe(extra=()):
    return load_recipe(
        "in2r",
        SMALL
        + ["model.embed_dim=16", "train.epochs=3", "loss.warmup_epochs=1", "train.seed=3"]
        + ["loss.in2r_queue_size=20", "loss.in2r_neighbours=2", "optim.lr_decay_epochs=[]", *extra],
    )


def records(run) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_resume_inside_a_split_epoch_is_bit_exact(tiny_data, tmp_path):
    full = tmp_path / "full"
    Trainer(in2r_recipe(), tiny_data, full, progress=False, log=lambda *_: None).fit()
    steps = [r for r in records(full) if r["kind"] == "train"]
    assert any("loss_unlabeled" in r for r in steps)  # the peer queues filled and trained the unlabeled pairs
    part = tmp_path / "part"
    ends = [r["step"] for r in records(full) if r["kind"] == "val"]
    stop = ends[0] + (ends[1] - ends[0]) * 3 // 4  # inside epoch 2, in network B's phase
    Trainer(in2r_recipe(), tiny_data, part, progress=False, log=lambda *_: None).fit(max_steps=stop)
    Trainer(in2r_recipe(), tiny_data, part, resume=True, progress=False, log=lambda *_: None).fit()
    from safetensors.torch import load_file

    a, b = load_file(full / "last.safetensors"), load_file(part / "last.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any("centring.image_mean" in k for k in a)  # the eval-mode mean is part of the model
    oa, ob = load_file(full / "last_optim.safetensors"), load_file(part / "last_optim.safetensors")
    queues = [k for k in oa if "queues" in k]
    assert queues and all(torch.equal(oa[k], ob[k]) for k in oa)  # queues and refiners too

    def strip(r):
        return {
            k: strip(v) if isinstance(v, dict) else v
            for k, v in r.items()
            if not k.endswith(("time_s", "pass_s"))
        }

    vals = lambda run: [strip(r) for r in records(run) if r["kind"] in ("val", "split")]  # noqa: E731
    assert vals(full) == vals(part)


@pytest.mark.parametrize(
    "extra, needle",
    [
        (["train.sample_policy.name=uniform"], "two-network sample policy"),
        (["model.embed_dim=18"], "attention heads"),
        (["loss.in2r_embed_dim=32"], "must equal model.embed_dim"),
        (["model.image.views=2", "model.similarity.name=aeom"], "model.centre=batch centres one embedding"),
    ],
)
def test_refused_settings(tiny_data, tmp_path, extra, needle):
    with pytest.raises(ConfigError) as e:
        Trainer(in2r_recipe(extra), tiny_data, tmp_path / "run", progress=False, log=lambda *_: None)
    assert needle in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()


def test_loaded_pair_scores_the_mean_and_a_query_alone_embeds_as_in_a_batch(tiny_data, tmp_path):
    """`vsekit.load` of an IN2R run: features and strings go through both networks (their centring in eval
    mode included), the pair's similarity is the mean of each network's own, and one caption embeds as it
    does among others (the running mean, not the batch's)."""
    from vsekit.api import load
    from vsekit.data.precomp import load_precomp_split

    run = tmp_path / "run"
    Trainer(in2r_recipe(["train.epochs=2"]), tiny_data, run, progress=False, log=lambda *_: None).fit()
    pair = load(run)
    split = load_precomp_split(tiny_data, "test")
    feats = torch.as_tensor(np.load(tiny_data / "test_ims.npy"))[:5]
    captions = split.captions[:4]
    img, txt = pair.encode_image(feats), pair.encode_text(captions)
    assert img.shape == (5, 32) and txt.shape == (4, 32)  # both networks' 16-d embeddings
    own = []
    for which in ("A", "B"):
        m = load(run, member=which)
        own.append(m.similarity(m.encode_image(feats), m.encode_text(captions)))
    torch.testing.assert_close(pair.similarity(img, txt), (own[0] + own[1]) / 2, atol=1e-6, rtol=1e-5)
    alone = pair.encode_text(captions[:1])
    torch.testing.assert_close(alone[0], txt[0], atol=1e-6, rtol=1e-5)


def test_unlabeled_terms_wait_for_k_rows_in_the_peers_queue():
    from vsekit.losses.in2r import IN2RLoss

    loss = IN2RLoss(0.2, embed_dim=8, queue_size=6, neighbours=3)
    g = torch.Generator().manual_seed(0)
    img, txt = (torch.nn.functional.normalize(torch.randn(4, 8, generator=g), dim=1) for _ in range(2))
    assert loss.unlabeled(0, img, txt) == {}  # the peer's (network 1's) queue is empty
    loss.enqueue(1, img[:2], txt[:2], torch.ones(2), 0.5)
    assert loss.unlabeled(0, img, txt) == {}  # 2 rows < 3 neighbours: the release skips the terms
    assert loss.unlabeled(1, img, txt) == {}  # network 1 reads network 0's queue, still empty
    loss.enqueue(
        1, img[2:], txt[2:], torch.tensor([1.0, 0.0]), 0.5
    )  # one more row: the other is not confident
    assert loss.queues[1].ptr == 3 and not loss.queues[1].is_full
    terms = loss.unlabeled(0, img, txt)
    assert set(terms) == {"i2t", "t2i"} and all(torch.isfinite(v) for v in terms.values())
    loss.enqueue(1, img, txt, torch.ones(4), 0.5)  # 3 + 4 rows in a queue of 6: it wraps
    assert loss.queues[1].ptr == 1 and loss.queues[1].is_full
    torch.testing.assert_close(loss.queues[1].img[0], img[3])  # the 7th row overwrote the first


def test_a_queue_saves_only_its_used_rows_and_loads_back_whole():
    from vsekit.losses.noisy_in2r import MemoryQueue

    g = torch.Generator().manual_seed(1)
    rows = torch.randn(7, 4, generator=g)
    q = MemoryQueue(6, 4)
    q.enqueue(rows[:3], -rows[:3])
    sd = q.state_dict()
    assert sd["img"].shape == (3, 4) and sd["txt"].shape == (3, 4)  # the 3 rows written, not 6
    back = MemoryQueue(6, 4)
    back.load_state_dict(sd)
    expected = torch.zeros(6, 4)
    expected[:3] = rows[:3]  # the rows never written stay zeros, as in the queue that was saved
    assert torch.equal(back.img, expected) and torch.equal(back.txt, -expected)
    assert (back.ptr, back.is_full) == (3, False)
    back.enqueue(rows[3:], -rows[3:])  # 3 + 4 rows: it wraps, and from then on every row is saved
    assert back.is_full and back.state_dict()["img"].shape == (6, 4)
    assert torch.equal(back.img[0], rows[6]) and torch.equal(back.img[1:], rows[1:6])
