"""The training data path (`vsekit.training.data_path`): batches made on the device from a resident set vs
the DataLoader — the same batches without augmentation, the augmentation's invariants and determinism, exact
resume, the choice and its errors, persistent workers, `vse bench data`, and the per-epoch samples/s.

Everything runs on the CPU, where the "device" path gathers from the memory-mapped array itself; on CUDA the
same code runs on a device copy (not exercised here: no GPU in the test environment)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import vsekit.training.data_path as data_path
from vsekit.cli import main
from vsekit.config import ConfigError, load_recipe
from vsekit.data.datasets import AugmentConfig, Collate, FeatureSource, augment_token_batch, set_keep_mask
from vsekit.data.precomp import load_precomp_split
from vsekit.data.text import END, MASK, START
from vsekit.distributed import DistContext
from vsekit.errors import SetupError
from vsekit.training.data_path import DeviceBatches, device_path_blocker
from vsekit.training.trainer import Trainer
from vsekit_lab.datasets.synthetic import make_synthetic_precomp

QUIET = {"progress": False, "log": lambda *_: None}
SMALL = ["model.embed_dim=32", "model.text.word_dim=16", "model.image.mlp_hidden=16", "train.log_every=0"]


@pytest.fixture(scope="module")
def ragged_data(tmp_path_factory):
    """Synthetic precomp whose training images hold 1..10 regions (`train_ims_lengths.txt`, zeros after)."""
    root = make_synthetic_precomp(
        tmp_path_factory.mktemp("ragged"), n_train=60, n_dev=12, n_test=12, regions=10, dim=16
    )
    feats = np.load(root / "train_ims.npy")
    sizes = np.random.default_rng(5).integers(1, 11, size=len(feats))
    sizes[0] = 10
    feats[np.arange(10)[None, :] >= sizes[:, None]] = 0.0
    np.save(root / "train_ims.npy", feats)
    (root / "train_ims_lengths.txt").write_text("".join(f"{s}\n" for s in sizes))
    return root


def _trainer(data: Path, run: Path, *sets: str, recipe: str = "vse_infty") -> Trainer:
    return Trainer(load_recipe(recipe, SMALL + list(sets)), data, run, **QUIET)


def _first(trainer: Trainer, epoch: int, n: int) -> list[dict]:
    out = []
    for batch in trainer.data.epoch(epoch):
        out.append(batch)
        if len(out) == n:
            break
    return out


# ----------------------------------------------------------------------------- the same batches, the same loss
@pytest.mark.parametrize("buckets", [4, 1, 0])
def test_device_and_loader_paths_give_the_same_batches_and_losses_without_augmentation(
    ragged_data, tmp_path, buckets
):
    """With the size augmentation off, both paths give batch for batch the same captions, images and values.
    With caption buckets (N >= 1) both pad to the same fixed widths: feature sets to the set's largest (10),
    captions to the same bucket; with 0 each DataLoader batch is padded to its own longest set and caption, the
    device path's feature sets to 10 and its captions to the batch's longest (chosen from host lengths)."""
    sets = ("train.batch_size=4", "data.size_augment=false", f"train.caption_buckets={buckets}")
    dev, ldr = (
        _trainer(ragged_data, tmp_path / "d", *sets, "train.data_on_device=true"),
        _trainer(ragged_data, tmp_path / "l", *sets, "train.data_on_device=false"),
    )
    assert dev.data.path == "device:cpu" and ldr.data.path == "loader"
    longest = int(dev.data.loader.data.caption_lengths.max())
    assert dev.data.caption_widths == ldr.data.caption_widths
    assert len(dev.data.caption_widths) == min(
        buckets, 3 if buckets else 0
    )  # repeats dropped (few distinct lengths)
    assert dev.data.caption_widths[-1:] == ((longest,) if buckets else ())
    for a, b in zip(_first(dev, 0, 8), _first(ldr, 0, 8)):
        for key in ("caption_index", "image_index", "image_lengths", "token_lengths"):
            assert torch.equal(a[key].cpu(), b[key]), key
        assert a["images"].dtype == b["images"].dtype == torch.float32
        own = int(
            b["token_lengths"].max()
        )  # no augmentation: the un-augmented longest is the batch's longest
        want = min(w for w in dev.data.caption_widths if w >= own) if buckets else own
        assert a["tokens"].shape[1] == b["tokens"].shape[1] == want
        assert torch.equal(a["tokens"], b["tokens"])
        width = b["images"].shape[1]
        assert a["images"].shape[1] == 10 and (width == 10 if buckets else width <= 10)
        assert torch.equal(a["images"][:, :width], b["images"]) and not a["images"][:, width:].any()
    if buckets == 0:
        assert any(b["images"].shape[1] < 10 for b in _first(ldr, 0, 8))  # the widths really differ
    elif buckets > 1:
        assert len({b["tokens"].shape[1] for b in _first(dev, 0, 15)}) > 1  # several buckets in use
    # the same model (same seed) trained on them: the same losses. Tolerance: the batches are equal, only padded
    # to other widths, which the encoders mask; what can differ is float rounding of reductions over tensors of
    # another shape (a matmul over B x L rows blocks differently). Measured: bit-identical here (native, default
    # and avx2 kernels); allowed 1e-5 relative (~80 float32 eps of an O(1) loss) over 8 AdamW steps.
    assert all(torch.equal(v, ldr.model.state_dict()[k]) for k, v in dev.model.state_dict().items())
    losses = {}
    for name, t in (("device", dev), ("loader", ldr)):
        losses[name] = [
            float(t.train_step(batch, 1, i, 15, False)["loss"]) for i, batch in enumerate(_first(t, 1, 8))
        ]
    np.testing.assert_allclose(losses["device"], losses["loader"], rtol=1e-5)


# ------------------------------------------------------------------------------------------ augmentation
@pytest.mark.parametrize("feature_type", ["region", "grid"])
def test_device_augmentation_keeps_a_subset_in_order_padded_with_zeros(ragged_data, tmp_path, feature_type):
    t = _trainer(
        ragged_data,
        tmp_path / "r",
        "train.batch_size=16",
        "train.data_on_device=true",
        f"model.image.feature_type={feature_type}",
    )
    split = load_precomp_split(ragged_data, "train")
    sizes = np.loadtxt(ragged_data / "train_ims_lengths.txt", dtype=np.int64)
    kept = total = 0
    for batch in _first(t, 0, 12):
        images, n = batch["images"], batch["image_lengths"]
        assert images.shape[1] == 10 and images.dtype == torch.float32
        for b, img in enumerate(batch["image_index"].tolist()):
            src = torch.from_numpy(np.asarray(split.features[img][: sizes[img]], dtype=np.float32))
            k = int(n[b])
            assert 1 <= k <= sizes[img]  # at least one region kept, never more than the image has
            match = (images[b, :k, None, :] == src[None]).all(
                -1
            )  # [kept, size]: which stored row each one is
            assert (match.sum(1) == 1).all()
            pos = match.float().argmax(1)
            assert (pos[1:] > pos[:-1]).all()  # a subset of the image's rows, in their order
            assert not images[b, k:].any()  # zeros after the kept rows
            kept, total = kept + k, total + int(sizes[img])
    if feature_type == "region":  # each region kept with p = 0.8 (plus the at-least-one rule): about 80 %
        assert 0.7 < kept / total < 0.92


def test_device_augmentation_is_a_function_of_seed_epoch_and_step(tiny_data, tmp_path):
    t = _trainer(tiny_data, tmp_path / "r", "train.batch_size=16", "train.data_on_device=true")
    loader: DeviceBatches = t.data.loader
    captions = torch.arange(16)

    def batch(epoch, step):
        return loader.batch(captions, epoch, step)

    a, again = batch(0, 3), batch(0, 3)
    for key in a:
        assert torch.equal(a[key], again[key]), key
    for other in (batch(0, 4), batch(1, 3)):
        assert not (
            torch.equal(a["image_lengths"], other["image_lengths"])
            and torch.equal(a["tokens"], other["tokens"])
        )
    # the epoch as the trainer iterates it: batch k of epoch e is batch(e, k) of the sampler's order
    t.data.sampler.epoch = 2
    order = t.data.sampler.batches()
    got = _first(t, 2, 3)
    for k, b in enumerate(got):
        want = loader.batch(torch.tensor(order[k]), 2, k)
        assert all(torch.equal(b[key], want[key]) for key in b)


def test_token_augmentation_rules():
    g = torch.Generator().manual_seed(0)
    start, end, mask, lo, hi = 1, 2, 4, 5, 50
    lengths = torch.randint(3, 12, (4000,), generator=g)
    width = int(lengths.max())
    tokens = torch.randint(lo, hi, (4000, width), generator=g)
    tokens[:, 0] = start
    tokens[torch.arange(4000), lengths - 1] = end
    tokens[torch.arange(width)[None, :] >= lengths[:, None]] = 0
    out, n = augment_token_batch(
        tokens, lengths, torch.Generator().manual_seed(1), 0.2, mask, (lo, hi), start, end
    )
    assert out.shape == tokens.shape and (n >= 1).all() and (n <= lengths).all()
    assert not out[torch.arange(width)[None, :] >= n[:, None]].any()  # pad after each caption
    assert ((out >= 0) & (out < hi)).all()
    # the released rule's rates: 20 % of tokens picked, 40 % of those deleted, 50 % masked
    assert abs(float(n.sum() / lengths.sum()) - 0.92) < 0.01
    assert abs(float((out == mask).sum() / lengths.sum()) - 0.10) < 0.01
    same, again = (
        augment_token_batch(
            tokens, lengths, torch.Generator().manual_seed(1), 0.2, mask, (lo, hi), start, end
        )
        for _ in range(2)
    )
    assert torch.equal(same[0], out) and torch.equal(again[1], n)
    # keep_ends: only the words are augmented, so every caption keeps <start> ... <end> (at least 2 tokens)
    out, n = augment_token_batch(
        tokens, lengths, torch.Generator().manual_seed(1), 0.9, mask, (lo, hi), start, end, keep_ends=True
    )
    assert (n >= 2).all() and (out[:, 0] == start).all() and (out[torch.arange(4000), n - 1] == end).all()
    # everything deleted: <start> <end>, as Vocabulary.encode
    short = torch.tensor([[start, 7, end]])
    for seed in range(200):
        o, k = augment_token_batch(
            short, torch.tensor([3]), torch.Generator().manual_seed(seed), 1.0, mask, (lo, hi), start, end
        )
        if int(k) == 2 and o[0, :2].tolist() == [start, end] and o[0, 2] == 0:
            break
    else:
        pytest.fail("no draw deleted every token")


def test_device_and_loader_augmentation_draw_from_the_same_distribution(tiny_data, tmp_path):
    """The two paths draw from different generators, with the same rules: same rates of kept regions and tokens."""
    stats = {}
    for setting in ("true", "false"):
        t = _trainer(tiny_data, tmp_path / setting, "train.batch_size=48", f"train.data_on_device={setting}")
        regions = tokens = 0
        for epoch in range(6):
            for b in t.data.epoch(epoch):
                regions += int(b["image_lengths"].sum())
                tokens += int(b["token_lengths"].sum())
        stats[setting] = (regions, tokens)
    n_regions = 6 * 240 * 4  # 6 epochs x 240 captions x 4 regions
    for setting, (regions, _) in stats.items():
        assert abs(regions / n_regions - 0.8) < 0.03, setting
    assert abs(stats["true"][1] / stats["false"][1] - 1) < 0.02


def test_set_keep_mask_keeps_one_when_every_draw_drops():
    lengths = torch.tensor([1, 3, 7])
    keep = set_keep_mask(lengths, 7, torch.Generator().manual_seed(0), AugmentConfig(True, "region", 1e-9))
    assert keep.sum(1).tolist() == [1, 1, 1]
    assert bool((torch.arange(7)[None, :] < lengths[:, None])[keep].all())  # only an image's own slots


def test_shards_of_a_device_batch_are_the_single_process_batch(tiny_data, tmp_path):
    """Under torchrun each rank keeps its shard of draws made for the global batch: the shards concatenated are
    the single-process batch, whatever the world size."""
    t = _trainer(tiny_data, tmp_path / "r", "train.batch_size=16", "train.data_on_device=true")
    whole = t.data.loader
    captions = torch.arange(20, 36)
    full = whole.batch(captions, 1, 5)
    for world in (2, 3):
        parts = [
            DeviceBatches(
                whole.data,
                whole.sampler,
                t.train_split.cap2img,
                t.recipe.train.seed,
                whole.image_aug,
                whole.text_prob,
                DistContext(rank=r, world_size=world),
            ).batch(captions, 1, 5)
            for r in range(world)
        ]
        for key in full:
            assert torch.equal(torch.cat([p[key] for p in parts]), full[key]), (world, key)


# ------------------------------------------------------------------------------------- resume, the choice
def test_vse_train_stopped_mid_epoch_and_resumed_on_the_device_path_is_bit_exact(tiny_data, tmp_path, capsys):
    sets = SMALL + ["train.batch_size=16", "train.log_every=4", "train.data_on_device=true"]
    args = ["--data", str(tiny_data), "--recipe", "vse_infty", "--epochs", "2", "--no-progress"]
    args += [x for s in sets for x in ("--set", s)]
    assert main(["train", "--out", str(tmp_path / "ref"), *args]) == 0
    out = capsys.readouterr().out
    assert out.count("samples/s]") == 2  # the epoch lines say the epoch's training throughput
    stopped = Trainer(
        load_recipe("vse_infty", sets + ["train.epochs=2"]), tiny_data, tmp_path / "run", **QUIET
    )
    assert stopped.fit(max_steps=20) == {"stopped_at_step": 20}  # 15 steps an epoch: 5 into the second
    state = json.loads((tmp_path / "run" / "last_state.json").read_text())["train_state"]
    assert state["data_path"] == "device:cpu" and state["step_in_epoch"] == 5
    assert main(["train", "--resume", str(tmp_path / "run"), "--no-progress"]) == 0
    a, b = load_file(tmp_path / "ref" / "last.safetensors"), load_file(tmp_path / "run" / "last.safetensors")
    assert a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) for k in a
    )  # same ops, shapes, threads: bit-exact

    def records(run: Path, kind: str) -> list[dict]:  # without the timings
        recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        timings = ("train_time_s", "samples_per_s", "data_time", "step_time")
        return [{k: v for k, v in r.items() if k not in timings} for r in recs if r["kind"] == kind]

    assert records(tmp_path / "run", "val") == records(tmp_path / "ref", "val")
    assert records(tmp_path / "run", "train") == records(
        tmp_path / "ref", "train"
    )  # the same losses, replayed once
    epochs = records(tmp_path / "ref", "epoch")
    assert [(r["epoch"], r["samples"], r["data_path"]) for r in epochs] == [
        (1, 240, "device:cpu"),
        (2, 240, "device:cpu"),
    ]
    full = [json.loads(x) for x in (tmp_path / "ref" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["samples_per_s"] > 0 for r in full if r["kind"] == "epoch")
    resumed = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["samples"] for r in resumed if r["kind"] == "epoch"] == [240, 160]  # counted from the resume on


def test_data_on_device_true_with_a_set_too_large_is_an_error(
    tiny_data, tmp_path, monkeypatch, capsys, caplog
):
    monkeypatch.setattr(data_path, "free_memory", lambda device: 1000)
    with pytest.raises(
        SetupError, match=r"train.data_on_device=true: the training set needs .* but only 0.0 MiB is free"
    ):
        _trainer(tiny_data, tmp_path / "a", "train.data_on_device=true")
    assert not (tmp_path / "a").exists()  # refused before the run folder was made
    args = [
        "train",
        "--data",
        str(tiny_data),
        "--out",
        str(tmp_path / "b"),
        "--set",
        "train.data_on_device=true",
    ]
    assert main(args) == 2
    assert "train.data_on_device=auto" in capsys.readouterr().err
    # auto: the DataLoader, and the log says why
    with caplog.at_level(logging.INFO, logger="vsekit"):
        t = _trainer(tiny_data, tmp_path / "c")
    assert t.data.path == "loader" and "of the free memory" in t.data.reason
    assert any(
        "training batches: DataLoader" in r.getMessage() and "free" in r.getMessage() for r in caplog.records
    )


def test_a_resumed_auto_run_keeps_the_path_it_was_trained_with(tiny_data, tmp_path, monkeypatch):
    sets = ("train.batch_size=16", "train.epochs=1")
    with monkeypatch.context() as m:
        m.setattr(data_path, "free_memory", lambda device: 1000)  # too small: auto takes the DataLoader
        first = _trainer(tiny_data, tmp_path / "run", *sets)
        assert first.data.path == "loader"
        first.fit(max_steps=3)
    r = load_recipe("vse_infty", SMALL + list(sets))
    resumed = Trainer(r, tiny_data, tmp_path / "run", resume=True, **QUIET)  # memory is plenty now
    assert resumed.data.path == "loader" and "trained with the DataLoader" in resumed.data.reason
    # and a run made on the device that no longer fits goes on with the DataLoader, saying what that costs
    _trainer(tiny_data, tmp_path / "dev", *sets).fit(max_steps=3)
    said: list[str] = []
    monkeypatch.setattr(data_path, "free_memory", lambda device: 1000)
    moved = Trainer(r, tiny_data, tmp_path / "dev", resume=True, progress=False, log=said.append)
    assert moved.data.path == "loader" and any("other augmentation draws" in s for s in said)


def test_recipes_the_device_path_cannot_take(tiny_data):
    split = load_precomp_split(tiny_data, "train")
    pixels = type("P", (), {"images": type("S", (), {"kind": "pixels"})(), "text": None})()
    assert "pixel" in device_path_blocker(pixels, split)
    words = type("P", (), {"images": FeatureSource(split), "text": object()})()
    assert "transformer text" in device_path_blocker(words, split)
    with pytest.raises(ConfigError, match="choose one of auto, true, false"):
        load_recipe("vse_infty", ["train.data_on_device=sometimes"])


# ------------------------------------------------------------------------------------------- the DataLoader
def test_persistent_workers_draw_each_epochs_augmentation(tiny_data, tmp_path):
    """`persistent_workers` keeps the dataset copy a worker started with: the epoch travels with each index, so a
    worker gives epoch 1 the augmentation of epoch 1 (the batches of 0 workers)."""
    ref = _trainer(tiny_data, tmp_path / "a", "train.batch_size=16", "train.data_on_device=false")
    pw = _trainer(
        tiny_data, tmp_path / "b", "train.batch_size=16", "train.data_on_device=false", "data.num_workers=1"
    )
    assert pw.data.loader.persistent_workers and not ref.data.loader.persistent_workers
    for epoch in (0, 1):
        for a, b in zip(_first(ref, epoch, 3), _first(pw, epoch, 3)):
            assert all(torch.equal(a[k], b[k]) for k in a)


def test_float16_sets_stay_float16_until_the_device(tmp_path):
    from vsekit_lab.bench.data_path import write_coco_like

    root = write_coco_like(tmp_path / "d", 6, regions=3, img_dim=4, min_words=2, max_words=3)
    split = load_precomp_split(root, "train")
    assert split.features.dtype == np.float16
    src = FeatureSource(split, keep_dtype=True)
    one = src.load(2, None)
    assert one.dtype == torch.float16 and torch.equal(one, torch.from_numpy(np.asarray(split.features[2])))
    assert FeatureSource(split).load(2, None).dtype == torch.float32  # evaluation's default is unchanged
    items = [(src.load(i, None), torch.tensor([1, 5, 2]), i, i) for i in range(3)]
    assert Collate().pairs(items)["images"].dtype == torch.float16  # CUDA: converted after the copy
    assert Collate(float32=True).pairs(items)["images"].dtype == torch.float32  # CPU: in the collate function


# ------------------------------------------------------------------------------------------------ the bench
def test_bench_data_writes_its_json(tmp_path, capsys, monkeypatch):
    import tempfile

    monkeypatch.setattr(
        tempfile, "tempdir", str(tmp_path)
    )  # where the synthetic set is written (and removed)
    out = tmp_path / "data.json"
    args = [
        "bench",
        "data",
        "--n",
        "40",
        "--regions",
        "4",
        "--img-dim",
        "8",
        "--batch",
        "8",
        "--steps",
        "2",
        "--rounds",
        "1",
        "--warmup",
        "1",
        "--paths",
        "auto",
        "false",
        "--json-out",
        str(out),
    ]
    assert main(args) == 0
    res = json.loads(out.read_text())
    assert res["samples_per_s"] > 0 and res["bare_gather_samples_per_s"] > 0 and res["ratio"] > 0
    assert [r["path"] for r in res["rows"]] == ["device:cpu", "loader"]
    assert "| device:cpu (data_on_device=auto) |" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.json"]  # the synthetic set is gone


def test_mask_and_ends_of_the_vocabulary_are_what_the_device_path_uses(tiny_data, tmp_path):
    t = _trainer(tiny_data, tmp_path / "r", "train.data_on_device=true")
    d = t.data.loader.data
    w = t.text.word2idx
    assert (d.start_id, d.end_id, d.mask_id, d.pad_id) == (w[START], w[END], w[MASK], 0)
    assert d.random_range == t.text.random_word_range()
    caps = t.train_split.captions
    for i in (0, 7, 100):
        ids = t.text.encode(caps[i])
        assert d.tokens[i, : len(ids)].tolist() == ids and int(d.token_lengths[i]) == len(ids)


def test_coco_like_features_are_the_same_for_any_thread_count(tmp_path):
    from vsekit_lab.bench.data_path import write_coco_like

    small = 4 * 3 * 8 * 4  # chunk_bytes of 4 images: 30 images in 8 chunks, drawn by 1 and by 3 threads
    one = write_coco_like(tmp_path / "a", 30, regions=3, img_dim=8, chunk_bytes=small, threads=1)
    three = write_coco_like(
        tmp_path / "b", 30, regions=3, img_dim=8, chunk_bytes=small, threads=3, split="dev"
    )
    a, b = np.load(one / "train_ims.npy"), np.load(three / "dev_ims.npy")
    assert a.shape == (30, 3, 8) and a.dtype == np.float16 and np.array_equal(a, b)
    assert len(np.unique(a.reshape(30, -1), axis=0)) == 30  # no chunk repeats another's draws
    caps = (three / "dev_caps.txt").read_text().splitlines()
    assert len(caps) == 150 and all(8 <= len(c.split()) <= 25 for c in caps)


def test_bench_epoch_times_one_whole_epoch_of_vse_train(tmp_path, capsys, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where the set and the run go (then removed)
    out = tmp_path / "epoch.json"
    tiny = ["--n", "30", "--dev-images", "10", "--regions", "4", "--img-dim", "8", "--batch", "8"]
    tiny += ["--set", "model.embed_dim=16", "--set", "model.text.word_dim=8"]
    assert main(["bench", "epoch", *tiny, "--json-out", str(out)]) == 0
    res = json.loads(out.read_text())
    # every caption once: 30 images x 5 captions in batches of 8 (the last one of 6)
    assert res["images"] == 30 and res["captions"] == 150 and res["data_path"] == "device:cpu"
    assert 0 < res["train_s"] < res["wall_s"]
    assert res["outside_epoch_s"] == pytest.approx(res["wall_s"] - res["train_s"])
    assert res["samples_per_s"] > res["wall_samples_per_s"] == pytest.approx(150 / res["wall_s"])
    # the run's peak RSS, in GiB: a process that imported torch holds more than 0.1 GiB (KiB taken for bytes
    # would give 1e-4), and less than this machine has
    assert 0.1 < res["peak_memory_gib"] < 64
    assert "| vse_infty model.embed_dim=16 model.text.word_dim=8 |" in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch.json"]  # set and run removed
    # bad input to vse train: its own one line, exit 2, nothing left behind
    assert main(["bench", "epoch", *tiny, "--set", "train.no_such_key=1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "no_such_key" in err and "\n" not in err
    assert main(["bench", "epoch", "--data", str(tmp_path / "none"), "--n", "30"]) == 2
    assert "none" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch.json"]


def test_the_epoch_bench_keeps_the_runs_last_lines_and_kills_it_at_its_limit():
    import sys
    import time

    from vsekit_lab.bench.epoch import TAIL_LINES, EpochRunError, run_process

    code, tail = run_process(
        [sys.executable, "-c", "import sys; [print(i) for i in range(100)]; sys.exit(3)"], 30
    )
    assert code == 3 and tail == [str(i) for i in range(100 - TAIL_LINES, 100)]
    t0, seen = time.monotonic(), []
    sleeper = [sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"]
    with pytest.raises(EpochRunError, match="time limit"):
        run_process(sleeper, 1.0, seen.append)
    assert time.monotonic() - t0 < 30  # killed, not waited for
    assert seen == ["up"]  # each line handed on as it came
