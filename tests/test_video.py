"""Video–text retrieval: the protocol with 20 captions a clip, the moving-shapes generator, and training,
evaluation, ensembles and search over clips (the frames layout) end to end.

Float comparisons: recalls are counts (exact, or pytest.approx for thirds); an ensemble is the float32 mean
of two runs' identically recomputed similarities (<= 1/2 ulp of values <= 1 from the float64 mean: atol 1e-6).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from vsekit.cli import main
from vsekit.config import load_recipe
from vsekit.data.frames import load_frames
from vsekit.data.precomp import load_precomp_split
from vsekit.errors import VseInputError
from vsekit.metrics import evaluate_sims
from vsekit_lab.datasets.moving_shapes import SHAPE_WORDS, VERBS, build_moving_shapes

CHEAP = "random-projection"


@pytest.fixture(autouse=True)
def _one_thread():
    """One torch thread (after conftest's two): these small models run faster so on a shared 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


TINY = [
    "model.embed_dim=32",
    "model.text.word_dim=16",
    "model.text.vocab_min_count=1",
    "model.image.mlp_hidden=32",
    "train.batch_size=32",
    "train.log_every=0",
    "train.epochs=1",
    "optim.lr=1.0e-3",
]


# --------------------------------------------------------------------------------------------- protocol


def twenty_caption_sims() -> tuple[np.ndarray, np.ndarray]:
    """3 clips x 60 captions (20 a clip, grouped). Built so the ranks are known by construction:
    clip 0's best own caption (5, at 0.9) is above everything in its row: rank 0;
    clip 1's own captions sit at 0.5 with captions 0, 1, 2 of clip 0 above them (0.6, 0.7, 0.8): rank 3;
    clip 2's own captions sit at 0.4 with captions 20..31 of clip 1 above them (0.45): rank 12.
    Columns: captions 0, 1, 2 have clip 1 (0.6-0.8) above their own clip 0 (0.5): rank 1; every other caption's
    own clip is the highest in its column (clip 1's captions 20..31: 0.5 against 0.45 and 0.1): rank 0."""
    sims = np.full((3, 60), 0.1, dtype=np.float32)
    sims[0, 0:20] = 0.5
    sims[0, 5] = 0.9
    sims[1, 20:40] = 0.5
    sims[1, 0:3] = (0.6, 0.7, 0.8)
    sims[2, 40:60] = 0.4
    sims[2, 20:32] = 0.45
    return sims, np.repeat(np.arange(3), 20)


def test_protocol_with_twenty_captions_per_clip_matches_hand_computed_ranks():
    sims, cap2img = twenty_caption_sims()
    m = evaluate_sims(sims, cap2img)
    # video->text ranks (0-based) [0, 3, 12]: R@1 1/3, R@5 and R@10 2/3, medr = 3 + 1, meanr = (0+3+12)/3 + 1
    assert m["i2t_r1"] == pytest.approx(100 / 3)
    assert m["i2t_r5"] == pytest.approx(200 / 3) and m["i2t_r10"] == pytest.approx(200 / 3)
    assert m["i2t_medr"] == 4 and m["i2t_meanr"] == pytest.approx(6.0)
    # text->video: 57 of 60 captions at rank 0, 3 at rank 1
    assert m["t2i_r1"] == pytest.approx(95.0) and m["t2i_r5"] == 100 and m["t2i_r10"] == 100
    assert m["t2i_medr"] == 1 and m["t2i_meanr"] == pytest.approx(1.05)
    assert m["rsum"] == pytest.approx(100 / 3 + 400 / 3 + 95 + 200)


def test_protocol_does_not_need_a_clips_captions_to_be_adjacent():
    """MSR-VTT caption files are not grouped by clip: the same matrix with its columns shuffled (and the
    caption->clip map shuffled alike) scores the same."""
    sims, cap2img = twenty_caption_sims()
    perm = np.random.default_rng(0).permutation(60)
    assert evaluate_sims(sims[:, perm], cap2img[perm]) == pytest.approx(evaluate_sims(sims, cap2img))


def test_protocol_counts_a_tied_negative_above_the_positive():
    """Two clips x 20 captions; own scores 0.5, other scores 0.1, except clip 1 also scores caption 0 (of clip 0)
    at 0.5, a tie. Video->text: clip 0 has nothing at or above 0.5 but its own captions: rank 0; clip 1's best own
    caption (0.5) ties with caption 0, a negative, which counts above it: rank 1. Text->video: caption 0's two
    clips tie: rank 1; the other 39 captions: rank 0."""
    sims = np.full((2, 40), 0.1, dtype=np.float32)
    sims[0, 0:20] = 0.5
    sims[1, 20:40] = 0.5
    sims[1, 0] = 0.5
    m = evaluate_sims(sims, np.repeat(np.arange(2), 20))
    assert (m["i2t_r1"], m["i2t_r5"], m["i2t_medr"], m["i2t_meanr"]) == (50.0, 100.0, 1.0, 1.5)
    assert (m["t2i_r1"], m["t2i_r5"], m["t2i_medr"]) == (97.5, 100.0, 1.0)
    assert m["t2i_meanr"] == pytest.approx(1.025)


# --------------------------------------------------------------------------------------------- generator


def _files(root: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(root.iterdir()) if p.name != "manifest.json"}


def test_generator_is_deterministic_under_a_seed(tmp_path):
    kw = dict(clips={"train": 6, "dev": 3, "test": 3}, features=CHEAP, progress=False)
    build_moving_shapes(tmp_path / "a", seed=3, **kw)
    build_moving_shapes(tmp_path / "b", seed=3, **kw)
    build_moving_shapes(tmp_path / "c", seed=4, **kw)
    assert _files(tmp_path / "a") == _files(tmp_path / "b")
    assert (tmp_path / "a" / "train_caps.txt").read_text() != (tmp_path / "c" / "train_caps.txt").read_text()
    # a split is the same whatever else is built with it
    build_moving_shapes(tmp_path / "t", seed=3, clips={"test": 3}, features=CHEAP, progress=False)
    assert {k: v for k, v in _files(tmp_path / "a").items() if k.startswith("test")} == _files(tmp_path / "t")


def test_frame_count_variants_hold_the_same_clips_and_captions(tmp_path):
    kw = dict(clips={"test": 8}, features=CHEAP, progress=False, seed=1)
    short = build_moving_shapes(tmp_path / "short", frames=(2, 3), **kw)
    long_ = build_moving_shapes(tmp_path / "long", frames=(20, 24), **kw)
    assert short["frames_per_clip"] == [2, 3] and long_["frames_per_clip"] == [20, 24]
    for name in ("test_caps.txt", "test_cap2img.txt", "test_ids.txt"):
        assert (tmp_path / "short" / name).read_text() == (tmp_path / "long" / name).read_text()
    for root, (lo, hi) in ((tmp_path / "short", (2, 3)), (tmp_path / "long", (20, 24))):
        frames = load_frames(root, "test")
        assert lo <= frames.lengths.min() and frames.lengths.max() <= hi
        scripts = [json.loads(line) for line in (root / "test_clips.jsonl").read_text().splitlines()]
        assert [s["frames"] for s in scripts] == frames.lengths.tolist()
    events = [
        [json.loads(line)["events"] for line in (tmp_path / d / "test_clips.jsonl").read_text().splitlines()]
        for d in ("short", "long")
    ]
    assert events[0] == events[1]


def _position(caption: str, event: dict) -> int:
    """Where the caption names this event's shape ("red circle", "red disc", ...); -1 if it does not."""
    found = [caption.find(f"{event['color']} {w}") for w in SHAPE_WORDS[event["shape"]]]
    found = [i for i in found if i >= 0]
    return min(found) if found else -1


def test_captions_name_every_event_in_its_order(tmp_path):
    build_moving_shapes(
        tmp_path, clips={"train": 40}, captions=(5, 10), features=CHEAP, progress=False, seed=2
    )
    split = load_precomp_split(tmp_path, "train")
    scripts = [json.loads(line) for line in (tmp_path / "train_clips.jsonl").read_text().splitlines()]
    assert split.n_images == 40 and len(scripts) == 40
    per_clip = np.bincount(split.cap2img, minlength=40)
    assert per_clip.min() >= 5 and per_clip.max() <= 10
    two = 0
    for clip, script in enumerate(scripts):
        caps = [split.captions[c] for c in np.nonzero(split.cap2img == clip)[0]]
        assert len(set(caps)) == len(caps), f"clip {clip}: repeated caption"
        events = script["events"]
        assert split.features[clip].shape[0] == script["frames"]
        for cap in caps:
            where = [_position(cap, e) for e in events]
            assert min(where) >= 0, f"clip {clip}: {cap!r} does not name {events}"
            for e in events:
                assert any(v in cap for v in VERBS[e["action"]]), f"{cap!r} lacks a verb for {e['action']}"
            if len(events) == 2:
                two += 1
                reversed_form = " after a" in cap  # "B ... after A ...": the later event named first
                assert (where[0] > where[1]) == reversed_form, f"clip {clip}: {cap!r} misstates the order"
    assert two > 0


@pytest.mark.slow
def test_efficientnet_features_are_one_1280_vector_per_frame(tmp_path):
    pytest.importorskip("efficientnet_lite_pytorch")
    m = build_moving_shapes(tmp_path, clips={"test": 2}, frames=(3, 4), progress=False)
    frames = load_frames(tmp_path, "test")
    assert frames.shape[2] == 1280 and len(frames) == 2 and all(3 <= n <= 4 for n in frames.lengths)
    assert np.isfinite(np.asarray(frames.frames, dtype=np.float32)).all()
    assert m["extractor"]["name"] == "efficientnet_lite0_grid_mean" and m["extractor"]["image_size"] == 112


def test_cli_refuses_to_overwrite_without_the_flag(tmp_path, capsys):
    out = tmp_path / "ms"
    args = [
        "data",
        "moving-shapes",
        "--out",
        str(out),
        "--clips",
        "4",
        "2",
        "2",
        "--features",
        CHEAP,
        "--no-progress",
    ]
    assert main(args) == 0
    assert json.loads((out / "manifest.json").read_text())["splits"]["train"]["clips"] == 4
    before = (out / "train_caps.txt").read_bytes()
    assert main(args + ["--seed", "9"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert (out / "train_caps.txt").read_bytes() == before
    assert main(args + ["--seed", "9", "--overwrite"]) == 0
    assert (out / "train_caps.txt").read_bytes() != before
    with pytest.raises(VseInputError, match="MIN <= MAX"):
        build_moving_shapes(tmp_path / "bad", frames=(5, 2), features=CHEAP, progress=False)


# --------------------------------------------------------------------------------------------- pipeline


def test_video_recipes_follow_the_paper_appendix():
    for name, pool in (("vse_infty_video", "gpo"), ("vsepp_video", "avg")):
        r = load_recipe(name)
        assert r.model.image.pooling.name == pool and r.model.text.pooling.name == pool
        assert (
            r.model.image.kind == "precomp"
            and r.model.image.feature_type == "region"
            and r.model.text.kind == "bigru"
        )
        assert (r.model.embed_dim, r.loss.margin, r.train.epochs, r.train.batch_size) == (1024, 0.2, 35, 128)
        assert r.optim.lr == 1e-4 and r.optim.lr_decay_epochs == [25] and r.optim.lr_decay == 0.1
        assert r.data.size_augment and r.data.region_keep_prob == 0.8


@pytest.fixture(scope="module")
def tiny_clips(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("clips") / "ms"
    build_moving_shapes(out, clips={"train": 48, "dev": 12, "test": 12}, features=CHEAP, progress=False)
    return out


@pytest.fixture(scope="module")
def two_video_runs(tiny_clips, tmp_path_factory) -> list[Path]:
    base = tmp_path_factory.mktemp("video_runs")
    runs = []
    for seed in (0, 1):
        run = base / f"seed{seed}"
        assert (
            main(
                [
                    "train",
                    "--data",
                    str(tiny_clips),
                    "--out",
                    str(run),
                    "--recipe",
                    "vse_infty_video",
                    "--no-progress",
                    "--device",
                    "cpu",
                    "--seed",
                    str(seed),
                    *sum((["--set", s] for s in TINY), []),
                ]
            )
            == 0
        )
        runs.append(run)
    return runs


def test_eval_and_ensemble_over_clips(tiny_clips, two_video_runs, tmp_path):
    singles = []
    for i, run in enumerate(two_video_runs):
        out = tmp_path / f"{i}.json"
        assert (
            main(
                [
                    "eval",
                    str(run),
                    "--split",
                    "test",
                    "--device",
                    "cpu",
                    "--save-sims",
                    str(tmp_path / f"{i}.npy"),
                    "--json-out",
                    str(out),
                ]
            )
            == 0
        )
        singles.append(np.load(tmp_path / f"{i}.npy"))
        split = load_precomp_split(tiny_clips, "test")
        assert singles[-1].shape == (12, split.n_captions)
        assert json.loads(out.read_text())["rsum"] == pytest.approx(
            evaluate_sims(singles[-1], split.cap2img)["rsum"]
        )
    out = tmp_path / "ens.json"
    assert (
        main(
            [
                "eval",
                *map(str, two_video_runs),
                "--split",
                "test",
                "--device",
                "cpu",
                "--save-sims",
                str(tmp_path / "ens.npy"),
                "--json-out",
                str(out),
            ]
        )
        == 0
    )
    np.testing.assert_allclose(
        np.load(tmp_path / "ens.npy"), (singles[0].astype(np.float64) + singles[1]) / 2, atol=1e-6
    )
    assert json.loads(out.read_text())["ensemble_of"] == [str(r) for r in two_video_runs]


def test_index_and_search_over_clips(tiny_clips, two_video_runs, tmp_path, capsys):
    pytest.importorskip("faiss")
    run = two_video_runs[0]
    index = tmp_path / "idx"
    assert (
        main(["index", str(run), f"{tiny_clips}:test", "--out", str(index), "--quiet", "--device", "cpu"])
        == 0
    )
    split = load_precomp_split(tiny_clips, "test")
    meta = json.loads((index / "index.json").read_text())
    assert meta["counts"] == {"pictures": 12, "captions": split.n_captions}
    assert meta["segments"][0]["embedded_from"]["mode"] == "features"
    assert (
        main(["eval", str(run), "--split", "test", "--device", "cpu", "--save-sims", str(tmp_path / "s.npy")])
        == 0
    )
    sims = np.load(tmp_path / "s.npy")
    for col in (0, split.n_captions - 1):  # search ranks the clips as evaluation scores them
        capsys.readouterr()
        assert main(["search", str(index), split.captions[col], "-k", "3", "--json", "--device", "cpu"]) == 0
        hits = json.loads(capsys.readouterr().out)
        assert len(hits) == 3 and hits[0]["score"] >= hits[1]["score"] >= hits[2]["score"]
        assert hits[0]["path"] == f"test:{int(np.argmax(sims[:, col]))}"


# Chance level for the slow test's split (40 test clips x 5 captions = 200 captions), by hand:
# text->video: R@K = K/40 -> 2.5 + 12.5 + 25 = 40.0;
# video->text: P(one of a clip's 5 captions in the top K of 200) = 1 - C(195, K)/C(200, K) = 1 - prod_{j<K}
#   (195-j)/(200-j): K=1 2.5 %, K=5 1 - .975*.9749*.9747*.9746*.9745 = 12.0 %, K=10 (five more factors
#   .9744 .9742 .9741 .9740 .9738) 22.8 % -> 37.3; rsum at chance ~ 77.3.
CHANCE_RSUM = 77.3


@pytest.mark.slow
def test_video_training_learns_on_moving_shapes(tmp_path):
    data = tmp_path / "ms"
    build_moving_shapes(
        data, clips={"train": 200, "dev": 40, "test": 40}, captions=(5, 5), features=CHEAP, progress=False
    )
    run = tmp_path / "run"
    sets = [
        "model.embed_dim=64",
        "model.text.word_dim=32",
        "model.text.vocab_min_count=1",
        "model.image.mlp_hidden=64",
        "train.log_every=0",
        "optim.lr=1.0e-3",
        "optim.lr_decay_epochs=[10]",
    ]
    assert (
        main(
            [
                "train",
                "--data",
                str(data),
                "--out",
                str(run),
                "--recipe",
                "vse_infty_video",
                "--epochs",
                "12",
                "--batch-size",
                "32",
                "--no-progress",
                "--device",
                "cpu",
                *sum((["--set", s] for s in sets), []),
            ]
        )
        == 0
    )
    out = tmp_path / "m.json"
    assert main(["eval", str(run), "--split", "test", "--device", "cpu", "--json-out", str(out)]) == 0
    m = json.loads(out.read_text())
    assert m["rsum"] > 2 * CHANCE_RSUM, m  # measured 200.0 (seed 0, one thread)
    assert m["t2i_r10"] > 40 and m["i2t_r10"] > 40, m  # chance: 25.0 and 22.8
