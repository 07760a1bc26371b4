"""Search of a late-interaction (CHAN) run: `vse index` stores each picture's set of region vectors, a text query
is answered by a first stage over one vector per picture and an exact CHAN re-score of the shortlist.

The reference scores are computed here with numpy from the stored `image_emb.npy` files (read with numpy, not
the index reader) and the query's word vectors: per word its best region cosine, log-sum-exp over the words
at the recipe's temperature; padding rows are zero. Float tolerance: float32 products of 64-d unit vectors summed
in another order, <= (d + 4) eps per cosine, times 1/temperature = 10 through the LSE: atol 1e-4.
"""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from test_index_refresh import index_argv, make_folder
from vsekit.cli import main
from vsekit.search.engine import SearchEngine
from vsekit.search.index import SearchIndex, build_index

pytest.importorskip("faiss")
pytest.importorskip("efficientnet_lite_pytorch")

ATOL = 1e-4


@pytest.fixture(scope="module")
def chan_shapes(tmp_path_factory) -> tuple[Path, Path]:
    """(dataset dir, run dir): the shapes set (shared with `shapes_model`) and a CHAN run trained on it briefly."""
    from vsekit.config import load_recipe
    from vsekit.training.trainer import Trainer
    from vsekit_lab.datasets.shapes import SHAPES_RECIPE_OVERRIDES, make_shapes_dataset

    base = tmp_path_factory.getbasetemp() / "shapes"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        data = make_shapes_dataset(base / "data")
        run = tmp_path_factory.mktemp("chan") / "run"
        recipe = load_recipe(
            "chan",
            SHAPES_RECIPE_OVERRIDES
            + ["train.epochs=6", "model.text.vocab_min_count=1", "model.image.selfattn_heads=4"],
        )
        Trainer(recipe, data, run, overwrite=True, progress=False, log=lambda *_: None).fit()
    finally:
        torch.set_num_threads(threads)
    return data, run


@pytest.fixture(scope="module")
def chan_index(chan_shapes, tmp_path_factory) -> Path:
    data, run = chan_shapes
    out = tmp_path_factory.mktemp("chan_idx") / "idx"
    build_index(run, f"{data}:test", out, progress=False, log=lambda *_: None)
    return out


def stored_sets(index_dir: Path) -> np.ndarray:
    """Every picture's stored set [n, S, D], read with numpy from the segments index.json lists."""
    meta = json.loads((index_dir / "index.json").read_text())
    flat = np.concatenate([np.load(index_dir / s["dir"] / "image_emb.npy") for s in meta["segments"]])
    return flat.reshape(len(flat), *meta["image_emb_shape"]).astype(np.float64)


def numpy_chan(sets: np.ndarray, words: np.ndarray, temperature: float) -> np.ndarray:
    """CHAN's LSE score of each set [n, S, D] against one caption's word vectors [L, D] (zero rows: padding)."""
    words = words[np.abs(words).sum(-1) > 0].astype(np.float64)
    cos = np.einsum("nsd,ld->nls", sets, words)
    cos[np.broadcast_to((np.abs(sets).sum(-1) == 0)[:, None, :], cos.shape)] = -np.inf
    codes = cos.max(-1) / temperature  # [n, L]
    top = codes.max(-1, keepdims=True)
    return (top + np.log(np.exp(codes - top).sum(-1, keepdims=True)))[:, 0]


def unit_mean(x: np.ndarray) -> np.ndarray:
    m = x.mean(-2)
    return m / np.linalg.norm(m, axis=-1, keepdims=True)


@pytest.mark.slow
def test_two_stage_with_every_picture_shortlisted_equals_exhaustive_chan(chan_index):
    engine = SearchEngine.open(chan_index)
    sets = stored_sets(chan_index)
    n = len(sets)
    tau = engine.model.recipe.model.similarity.lse_temperature
    assert engine.rerank and engine.sets and engine.shortlist_size(10) == n  # default max(500, 50k), <= n
    for text in ["a red circle", "a blue square", "a green triangle", "yellow"]:
        words = engine.text.embed([text])[0].numpy()
        want = numpy_chan(sets, words, tau)
        hits = engine.search_text(text, k=n, shortlist=n)
        got = np.array([h.score for h in hits])
        np.testing.assert_allclose(got, want[[h.id for h in hits]], atol=ATOL)
        assert np.all(np.diff(got) <= 0)  # best first
        np.testing.assert_allclose(got, np.sort(want)[::-1], atol=ATOL)  # every picture, the exhaustive order
        # a shortlist of k: the first stage's k pictures (mean region vs mean word cosine), re-scored exactly
        first = np.argsort(-(unit_mean(sets) @ unit_mean(words[np.abs(words).sum(-1) > 0])), kind="stable")[
            :3
        ]
        short = engine.search_text(text, k=3, shortlist=3)
        assert {h.id for h in short} == set(first.tolist())
        np.testing.assert_allclose([h.score for h in short], np.sort(want[first])[::-1], atol=ATOL)


@pytest.mark.slow
def test_the_index_round_trips_the_sets(chan_shapes, chan_index):
    """The stored sets are the model's own `encode_image` of the split's features, padding rows zero."""
    from vsekit.data.precomp import load_precomp_split
    from vsekit.runs import load_run

    data, run = chan_shapes
    model, _ = load_run(run, "best", "cpu")
    split = load_precomp_split(data, "test", 2)
    feats = np.stack([np.asarray(split.image_features(i), dtype=np.float32) for i in range(split.n_images)])
    with torch.no_grad():
        want = model.encode_image(torch.from_numpy(feats)).numpy()
    meta = json.loads((chan_index / "index.json").read_text())
    assert meta["image_emb_shape"] == list(want.shape[1:]) and meta["model"]["similarity"] == "chan"
    np.testing.assert_allclose(stored_sets(chan_index), want, atol=1e-5)
    norms = np.linalg.norm(want, axis=-1)
    assert np.allclose(norms[norms > 0], 1, atol=1e-5)  # every stored element a unit region vector


@pytest.mark.slow
def test_append_and_refresh_keep_the_sets(chan_shapes, tmp_path):
    data, run = chan_shapes
    folder = make_folder(data, tmp_path / "pics", ["red_circle_0", "blue_square_0", "green_triangle_0"])
    out, fresh = tmp_path / "idx", tmp_path / "fresh"
    assert main(index_argv(run, folder, out)) == 0
    first = {p["path"]: e for p, e in zip(SearchIndex(out).pictures, stored_sets(out))}
    make_folder(data, folder, ["yellow_square_0", "blue_triangle_0"])  # new pictures: appended as a segment
    assert main(index_argv(run, folder, out)) == 0
    appended = SearchIndex(out)
    assert len(json.loads((out / "index.json").read_text())["segments"]) == 2 and appended.n_pictures == 5
    for p, e in zip(appended.pictures, stored_sets(out)):
        if p["path"] in first:
            np.testing.assert_array_equal(e, first[p["path"]])
    shutil.copy(data / "images" / "test_red_triangle_1.png", folder / "red_circle_0.png")  # one changed
    assert main(index_argv(run, folder, out, "--refresh")) == 0
    assert main(index_argv(run, folder, fresh)) == 0
    a, b = SearchIndex(out), SearchIndex(fresh)
    assert [p["path"] for p in a.pictures] == [p["path"] for p in b.pictures]
    np.testing.assert_array_equal(stored_sets(out), stored_sets(fresh))  # one picture per batch: same ops
    ea, eb = SearchEngine.open(out), SearchEngine.open(fresh)
    for text in ["a red triangle", "a blue square"]:
        ha, hb = ea.search_text(text, 5), eb.search_text(text, 5)
        assert [h.path for h in ha] == [h.path for h in hb]
        np.testing.assert_allclose([h.score for h in ha], [h.score for h in hb], atol=ATOL)


@pytest.mark.slow
def test_vse_search_and_serve_answer_a_chan_index(chan_index, capsys):
    pytest.importorskip("fastapi")
    from fastapi.testclient import TestClient

    from vsekit.search.server import create_app

    engine = SearchEngine.open(chan_index)
    hits = engine.search_text("a red circle", 4, shortlist=6)
    want = [h.public() for h in hits]
    capsys.readouterr()
    assert main(["search", str(chan_index), "a red circle", "-k", "4", "--shortlist", "6", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == want
    assert main(["search", str(chan_index), "a red circle", "--shortlist", "0"]) == 2
    assert "--shortlist" in capsys.readouterr().err
    assert main(["serve", str(chan_index), "--shortlist", "0", "--port", "0"]) == 2  # refused while parsing
    assert "--shortlist" in capsys.readouterr().err
    with TestClient(create_app(chan_index, shortlist=6), base_url="http://127.0.0.1") as client:
        r = client.get("/search", params={"q": "a red circle", "k": 4})
        assert r.status_code == 200
        body = r.json()["results"]
        assert [(h["path"], h["caption"]) for h in body] == [(h.path, h.caption) for h in hits]
        np.testing.assert_allclose([h["score"] for h in body], [w["score"] for w in want], atol=1e-5)
        h = client.get("/healthz").json()
        assert h["similarity"] == "chan" and h["rerank"] is True and h["shortlist"] == 6


@pytest.mark.slow
def test_picture_to_captions_rescored_with_the_caption_sets(chan_index):
    """Picture -> captions: the shortlisted captions' word sets are re-made from their texts and scored with the
    model's late interaction, so with every caption shortlisted the order is the exhaustive one."""
    engine = SearchEngine.open(chan_index, shortlist=10_000)
    pid = 0
    picture = torch.from_numpy(stored_sets(chan_index)[pid : pid + 1].astype(np.float32))
    got = engine.search_image_vectors(picture, engine.index.n_captions)[0]
    tau = engine.model.recipe.model.similarity.lse_temperature
    texts = [c["text"] for c in engine.index.captions]
    want = np.array([numpy_chan(picture.numpy(), engine.text.embed([t])[0].numpy(), tau)[0] for t in texts])
    np.testing.assert_allclose([s for _, s in got], want[[i for i, _ in got]], atol=ATOL)
    np.testing.assert_allclose([s for _, s in got], np.sort(want)[::-1], atol=ATOL)


def test_embeddings_folders_of_a_chan_run_are_refused_in_one_line(chan_shapes, tmp_path, capsys):
    _, run = chan_shapes
    (tmp_path / "emb").mkdir()
    argv = ["index", str(run), "--from-embeddings", str(tmp_path / "emb"), "--out", str(tmp_path / "idx")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "chan" in err and "embeddings folder" in err
    assert not (tmp_path / "idx").exists()
    data, _ = chan_shapes
    assert (
        main(["embed", str(run), f"{data}:test", "--out", str(tmp_path / "out")]) == 2
    )  # nor does `vse embed`
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "chan" in err and "embeddings folder" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_the_late_interaction_benchmark(chan_index):
    """At a shortlist of every picture the two-stage top-k is the exhaustive one (recall 1); a shortlist below k
    is raised to k."""
    from vsekit_lab.bench.late_interaction import bench_late_interaction

    n = SearchIndex(chan_index).n_pictures
    res = bench_late_interaction(chan_index, queries=8, shortlists=(1, n), k=5)
    rows = {r["shortlist"]: r for r in res["rows"]}
    assert sorted(rows) == [5, n]
    assert rows[n]["recall_at_k"] == 1.0 and rows[n]["min_recall"] == 1.0 and rows[n]["default"]
    assert 0 <= rows[5]["min_recall"] <= rows[5]["recall_at_k"] <= 1
    assert res["setup"]["pictures"] == n and res["exhaustive"]["p50_ms"] > 0


@pytest.mark.slow
def test_sets_of_different_widths_are_stored_at_the_splits_width(chan_shapes, tmp_path):
    """A split whose pictures have different region counts is encoded in batches of different widths; every set is
    stored at the split's widest, its padding rows zero, and the full shortlist still gives the exhaustive order."""
    from vsekit.data.precomp import load_precomp_split

    data, run = chan_shapes
    src = load_precomp_split(data, "test", 2)
    feats = np.stack([np.asarray(src.image_features(i), dtype=np.float32) for i in range(src.n_images)])
    lengths = [feats.shape[1] if i % 3 == 0 else 20 + i for i in range(len(feats))]
    for i, n in enumerate(lengths):
        feats[i, n:] = 0
    split = tmp_path / "split"
    split.mkdir()
    np.save(split / "test_ims.npy", feats)
    (split / "test_ims_lengths.txt").write_text("".join(f"{n}\n" for n in lengths))
    for name in ("test_caps.txt", "test_cap2img.txt"):
        shutil.copy(data / name, split / name)
    out = tmp_path / "idx"
    argv = ["index", str(run), f"{split}:test", "--out", str(out), "--quiet", "--batch-size", "2"]
    assert main(argv) == 0
    sets = stored_sets(out)
    assert sets.shape[1] == feats.shape[1]
    assert [int((np.abs(s).sum(-1) > 0).sum()) for s in sets] == lengths  # real regions, then zero rows
    engine = SearchEngine.open(out)
    words = engine.text.embed(["a red circle"])[0].numpy()
    want = numpy_chan(sets, words, engine.model.recipe.model.similarity.lse_temperature)
    got = engine.search_text("a red circle", k=len(sets), shortlist=len(sets))
    np.testing.assert_allclose([h.score for h in got], np.sort(want)[::-1], atol=ATOL)


@pytest.mark.slow
def test_default_shortlists_of_a_set_model(chan_index):
    """Text -> pictures of a CHAN index re-scores max(50k, 500) pictures by default (its one-vector proxy ranks
    worse than AVSE's, docs/benchmarks.md); picture -> captions keeps max(10k, 100), since each shortlisted
    caption is re-encoded; explicit rerank settings replace both."""
    engine = SearchEngine.open(chan_index)
    big = 1_000_000
    assert [engine._depth(k, big, engine.picture_rule) for k in (1, 10, 20)] == [500, 500, 1000]
    assert [engine._depth(k, big, engine.caption_rule) for k in (1, 10, 20)] == [100, 100, 200]
    assert engine._depth(10, 300, engine.picture_rule) == 300  # never more than the index holds
    fixed = SearchEngine(engine.index, engine.model, engine.run_cfg, rerank_factor=2, rerank_min=7)
    assert fixed._depth(10, big, fixed.picture_rule) == fixed._depth(10, big, fixed.caption_rule) == 20
