"""Caption length buckets (`train.caption_buckets`, vsekit.training.data_path): the widths, the choice of a
batch's bucket on the host, and that padding a caption wider than its length changes nothing but rounding —
for every text encoder kind (BiGRU packed and unpacked, bag of words, a transformer with its attention mask)
and every text pooling the recipes use (GPO, average, ADPOOL).

Tolerances: the same captions padded to another width give the same sums over the same valid tokens, only
blocked differently (a GEMM over B x L rows, a GRU batch of another width, attention over more masked keys), so
values differ by float rounding: rtol 1e-5 / atol 1e-6 on unit-scale embeddings and the O(1) loss (~80 float32
eps), rtol 1e-4 / atol 1e-5 on gradients, which sum such differences over the batch (as tests/test_fixed_shape.py
argues); the transformer goes through two attention layers whose softmax sees the masked keys as exp(-inf) = 0
but whose kernels block differently: the tolerances of tests/test_text_encoder.py (atol 2e-5 / rtol 1e-4 on
values, atol 2e-4 / rtol 1e-3 on gradients). Differences seen are far below them (most are bit-identical).
"""

from __future__ import annotations

import copy
import shutil

import numpy as np
import pytest
import torch
from torch import nn

from vsekit.config import load_recipe
from vsekit.losses import create_loss
from vsekit.models.vse import DataSpec, VSEModel
from vsekit.pooling import length_mask
from vsekit.training.data_path import bucket_width, caption_widths
from vsekit.training.trainer import Trainer

VALUES = {"rtol": 1e-5, "atol": 1e-6}
GRADS = {"rtol": 1e-4, "atol": 1e-5}
TRANSFORMER_VALUES = {"rtol": 1e-4, "atol": 2e-5}
TRANSFORMER_GRADS = {"rtol": 1e-3, "atol": 2e-4}
SMALL = ["model.embed_dim=32", "model.text.word_dim=16", "model.image.mlp_hidden=16", "loss.warmup_epochs=0"]
IMG_DIM, VOCAB = 12, 40
QUIET = {"progress": False, "log": lambda *_: None}


# ------------------------------------------------------------------------------------------------ widths
def test_caption_widths_are_length_quantiles_and_the_longest():
    # 40 captions: ten each of 3, 5, 9 and 12 tokens. Sorted, the quartiles' "higher" neighbours are at
    # positions ceil(0.25*39)=10 (a 5), ceil(0.5*39)=20 (a 9) and ceil(0.75*39)=30 (a 12)
    lengths = np.repeat([12, 3, 9, 5], 10)
    assert caption_widths(lengths, 4) == (5, 9, 12)  # the 0.75 quantile is the longest: one width fewer
    assert caption_widths(lengths, 2) == (9, 12)
    assert caption_widths(lengths, 1) == (12,)
    assert caption_widths(lengths, 0) == ()
    assert caption_widths(np.array([7, 7, 7]), 8) == (7,)
    with pytest.raises(ValueError, match=">= 0"):
        caption_widths(lengths, -1)


def test_a_batch_takes_the_smallest_width_that_holds_its_longest_caption():
    widths = (5, 9, 12)
    assert [bucket_width(widths, n) for n in (2, 5, 6, 9, 10, 12)] == [5, 5, 9, 9, 12, 12]
    assert bucket_width((), 7) == 7  # no buckets: the batch's own longest
    with pytest.raises(ValueError, match="longer than every bucket width"):
        bucket_width(widths, 13)


# ------------------------------------------------------------------------- padding changes nothing but rounding
def _tiny_bert(tmp_path_factory) -> str:
    from vsekit_lab.bench.train_step import random_bert_dir

    path = random_bert_dir("tiny", vocab=VOCAB + 10)
    dest = tmp_path_factory.mktemp("bert") / "tiny"
    shutil.move(path, dest)
    return str(dest)


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory) -> str:
    return _tiny_bert(tmp_path_factory)


def _model(recipe: str, sets: list[str], bert: str | None = None) -> tuple[VSEModel, nn.Module]:
    r = load_recipe(recipe, SMALL + sets)
    spec = DataSpec(img_dim=IMG_DIM, vocab_words=[f"w{i}" for i in range(VOCAB)], text_model_path=bert or "")
    torch.manual_seed(0)
    model = VSEModel(r, spec)
    loss_fn = create_loss(r.loss, r.model.image.views)
    if hasattr(loss_fn, "host_diag"):
        loss_fn.host_diag = False
    return model, loss_fn


def _batch(b: int = 10, seed: int = 3) -> dict:
    g = torch.Generator().manual_seed(seed)
    img_len = torch.randint(2, 7, (b,), generator=g)
    images = torch.randn(b, 6, IMG_DIM, generator=g).masked_fill(~length_mask(img_len, 6).unsqueeze(-1), 0.0)
    tok_len = torch.randint(3, 10, (b,), generator=g)
    tok_len[1] = 9
    tokens = torch.randint(5, VOCAB, (b, 9), generator=g).masked_fill(~length_mask(tok_len, 9), 0)
    return {
        "images": images,
        "image_lengths": img_len,
        "tokens": tokens,
        "token_lengths": tok_len,
        "ids": torch.arange(b) // 2,
    }


def _loss_and_grads(model: VSEModel, loss_fn: nn.Module, batch: dict, pad: int) -> tuple[torch.Tensor, ...]:
    model.zero_grad(set_to_none=True)
    tokens = torch.cat([batch["tokens"], batch["tokens"].new_zeros(len(batch["tokens"]), pad)], 1)
    img = model.encode_images(batch["images"], batch["image_lengths"])
    txt = model.encode_texts(tokens, batch["token_lengths"])
    loss, _ = loss_fn(
        model.similarity(img, txt).float(), image_ids=batch["ids"], warmup=False, image_emb=img, text_emb=txt
    )
    loss.backward()
    # every parameter but the transformer's unused pooler head gets a gradient
    grads = [(n, p.grad) for n, p in model.named_parameters() if p.requires_grad]
    assert all(g is not None for n, g in grads if ".pooler." not in n)
    return (loss.detach(), txt.detach(), *(g.clone() if g is not None else None for _, g in grads))


TEXT_KINDS = [
    ("vse_infty", [], "packed"),  # BiGRU + GPO; eager CPU: packed sequences
    ("vse_infty", [], "unpacked"),  # the same BiGRU as it runs on accelerators and under compile
    ("vsepp", [], "packed"),  # BiGRU + average pooling
    ("vse_2ad", [], "unpacked"),  # BiGRU + ADPOOL, ADOPT loss
    ("bow", [], "-"),  # bag of words + average pooling
    ("vse_infty", ["model.text.kind=transformer"], "-"),  # transformer + GPO, attention mask from the lengths
]


@pytest.mark.parametrize(
    "recipe,sets,gru",
    TEXT_KINDS,
    ids=[f"{r}-{s[0].split('=')[1] if s else ''}-{g}" for r, s, g in TEXT_KINDS],
)
def test_a_wider_caption_bucket_gives_the_same_loss_and_gradients(recipe, sets, gru, tiny_bert, monkeypatch):
    """The batch at its own width (9) and cut into buckets 4 and 13 wider (as the data path pads): the same
    loss, caption embeddings and gradients of every parameter (running statistics too)."""
    transformer = "model.text.kind=transformer" in sets
    model, loss_fn = _model(recipe, sets, tiny_bert if transformer else None)
    if gru == "unpacked":  # the path taken on accelerators and when compiling: force it on the CPU
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    values, grads = (TRANSFORMER_VALUES, TRANSFORMER_GRADS) if transformer else (VALUES, GRADS)
    batch = _batch()
    ref_model = copy.deepcopy(model)
    want = _loss_and_grads(ref_model, loss_fn, batch, 0)
    for pad in (4, 13):
        wide = copy.deepcopy(model)
        got = _loss_and_grads(wide, loss_fn, batch, pad)
        torch.testing.assert_close(got[0], want[0], **values)
        torch.testing.assert_close(got[1], want[1], **values)
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        assert len(names) == len(got) - 2 == len(want) - 2
        for name, a, b in zip(names, got[2:], want[2:]):
            assert (a is None) == (b is None), name
            if a is not None:
                torch.testing.assert_close(a, b, **grads, msg=name)
        for (k, a), b in zip(wide.state_dict().items(), ref_model.state_dict().values()):
            torch.testing.assert_close(a, b, **values, msg=k)


# ------------------------------------------------------------------------------------- the device data path
def _trainer(data, run, *sets: str, recipe: str = "vse_infty") -> Trainer:
    return Trainer(load_recipe(recipe, SMALL + ["train.log_every=0", *sets]), data, run, **QUIET)


def test_device_batches_are_cut_at_the_bucket_after_augmenting_at_full_width(synthetic_dir, tmp_path):
    """With augmentation on, a bucketed batch is the full-width batch of the same (seed, epoch, step) cut to
    its bucket: the same draws, and nothing but padding lies past the cut."""
    t = _trainer(
        synthetic_dir,
        tmp_path / "r",
        "train.batch_size=16",
        "train.data_on_device=true",
        "train.length_bucketing=true",
    )
    loader = t.data.loader
    widths, full = loader.widths, loader.data.tokens.shape[1]
    assert len(widths) > 1 and widths[-1] == full == int(loader.data.caption_lengths.max())
    t.data.sampler.epoch = 1
    seen = set()
    for step, ids in enumerate(t.data.sampler.batches()[:12]):
        captions = torch.tensor(ids)
        width = loader.width_for(ids)
        assert width == min(w for w in widths if w >= int(loader.data.caption_lengths[ids].max()))
        cut, whole = loader.batch(captions, 1, step, width), loader.batch(captions, 1, step)
        assert whole["tokens"].shape[1] == full and cut["tokens"].shape[1] == width
        assert torch.equal(cut["tokens"], whole["tokens"][:, :width]) and not whole["tokens"][:, width:].any()
        for key in ("images", "image_lengths", "token_lengths", "image_index", "caption_index"):
            assert torch.equal(cut[key], whole[key]), key
        assert int(cut["token_lengths"].max()) <= width
        seen.add(width)
    assert len(seen) > 1  # several buckets among these batches


class _NoReadTensor(torch.Tensor):
    """A tensor that counts reads of its values back to the host (what would sync with a GPU); what is computed
    from it is one too (torch's default `__torch_function__` wraps the results), so a read anywhere downstream
    counts. (`nonzero`, whose output shape depends on the data, is not counted: only the CPU gather uses it, to
    zero just the padding slots; on CUDA the padding slots read a zero row.)"""

    reads = 0
    _READS = {
        torch.Tensor.__float__,
        torch.Tensor.__int__,
        torch.Tensor.__bool__,
        torch.Tensor.item,
        torch.Tensor.tolist,
        torch.Tensor.numpy,
        torch.Tensor.__format__,
        torch.Tensor.__index__,
    }

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in cls._READS:
            cls.reads += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def test_the_bucket_is_chosen_without_reading_the_device(synthetic_dir, tmp_path):
    """Every tensor the device path holds is replaced by one that counts host reads: iterating an epoch with
    buckets (and augmentation) reads none of them; the widths come from the host copy of the lengths."""
    t = _trainer(
        synthetic_dir,
        tmp_path / "r",
        "train.batch_size=16",
        "train.data_on_device=true",
        "train.length_bucketing=true",
    )
    loader, d = t.data.loader, t.data.loader.data
    for name in ("tokens", "token_lengths", "sizes", "starts", "flat"):
        setattr(d, name, getattr(d, name).as_subclass(_NoReadTensor))
    loader.cap2img = loader.cap2img.as_subclass(_NoReadTensor)
    _NoReadTensor.reads = 0
    widths = [b["tokens"].shape[1] for b in t.data.epoch(0)]
    assert _NoReadTensor.reads == 0
    assert len(widths) == len(t.data.sampler.batches()) and set(widths) <= set(loader.widths)
    int(d.token_lengths.max())  # what choosing the width from the device lengths would do: counted
    assert _NoReadTensor.reads == 1


def test_length_bucketing_puts_batches_in_small_buckets(synthetic_dir, tmp_path):
    """The sampler's length bucketing (similar lengths per batch) makes most batches take a width below the
    longest caption; without it a random batch of 16 nearly always holds a caption of the top bucket."""
    mean = {}
    for lb in (True, False):
        t = _trainer(
            synthetic_dir,
            tmp_path / str(lb),
            "train.batch_size=16",
            "train.data_on_device=true",
            f"train.length_bucketing={str(lb).lower()}",
        )
        mean[lb] = np.mean([b["tokens"].shape[1] for b in t.data.epoch(0)])
        full = t.data.caption_widths[-1]
    assert mean[True] < mean[False] <= full
    assert mean[True] < 0.9 * full


# ----------------------------------------------------------------------------------------------- the bench
def test_train_step_bench_times_variants_in_one_run(monkeypatch):
    """`vse bench train-step --caption-buckets 1 4 --length-bucketing`: one row per variant, the same batches
    (hence a smaller mean caption width with 4 buckets), and the speed-up of each row over the first from
    alternated rounds: known step durations give the medians and the ratio by hand."""
    import vsekit_lab.bench.train_step as module
    from conftest import StepClock

    tiny = dict(regions=5, img_dim=12, embed_dim=16, vocab=60, min_tokens=3, max_tokens=12, steps=2, warmup=1)
    sets = ["model.text.word_dim=8", "train.length_bucketing=true"]
    variants = [["train.caption_buckets=1"], ["train.caption_buckets=4"]]
    # calls: warm-up A, warm-up B, then per round A, A, B, B. A: 100, 300, 500, 100 ms (median 200);
    # B: 100, 100, 100, 300 ms (median 100): B is 2x faster
    clock = StepClock([9.0, 9.0, 0.1, 0.3, 0.1, 0.1, 0.5, 0.1, 0.1, 0.3]).install(monkeypatch, module)
    rows = module.bench_train_step_variants(
        "vse_infty", batch=8, overrides=sets, variants=variants, rounds=2, **tiny
    )
    assert clock.calls == 20
    a, b = rows
    assert (a["variant"], b["variant"]) == ("train.caption_buckets=1", "train.caption_buckets=4")
    assert a["ms_median"] == pytest.approx(200.0) and b["ms_median"] == pytest.approx(100.0)
    assert a["speedup"] == pytest.approx(1.0) and b["speedup"] == pytest.approx(2.0)
    assert len(a["caption_widths"]) == 1 and len(b["caption_widths"]) > 1
    assert a["caption_widths"][-1] == b["caption_widths"][-1] == a["mean_caption_width"]
    assert b["mean_caption_width"] < a["mean_caption_width"]  # length-bucketed batches in smaller buckets


def test_bench_commands_write_their_rows(tmp_path, capsys, monkeypatch):
    import json
    import tempfile

    from vsekit.cli import main

    monkeypatch.setattr(
        tempfile, "tempdir", str(tmp_path)
    )  # the synthetic set is written there (and removed)
    out = tmp_path / "step.json"
    args = [
        "bench",
        "train-step",
        "--batch",
        "6",
        "--regions",
        "4",
        "--img-dim",
        "8",
        "--embed-dim",
        "16",
        "--vocab",
        "60",
        "--steps",
        "1",
        "--warmup",
        "1",
        "--length-bucketing",
        "--caption-buckets",
        "1",
        "3",
        "--json-out",
        str(out),
        "--set",
        "model.text.word_dim=8",
    ]
    assert main(args) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["caption_buckets"] for r in rows] == [1, 3] and all(r["length_bucketing"] for r in rows)
    assert "| speed-up vs first row |" in capsys.readouterr().out
    amp = tmp_path / "amp.json"
    assert (
        main(
            [
                "bench",
                "amp",
                "--recipe",
                "vsepp",
                "--batch",
                "8",
                "--img-dim",
                "16",
                "--embed-dim",
                "16",
                "--vocab",
                "50",
                "--seeds",
                "1",
                "--json-out",
                str(amp),
            ]
        )
        == 0
    )
    kinds = [r["loss_kind"] for r in json.loads(amp.read_text())["rows"]]
    assert len(kinds) == 2 and kinds[0] != kinds[1]  # the recipe's loss, then the warm-up's sum
    assert "vsepp: bf16 outputs:" in capsys.readouterr().out
    assert not [
        p.name for p in tmp_path.iterdir() if p.name.startswith("vsekit-")
    ]  # the synthetic set is gone
