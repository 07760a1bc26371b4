"""`vse index` / `vse search`: a model trained on features indexes raw pictures, resumes, adds, re-ranks.

Float comparisons: embeddings and scores of the same model through other paths (raw pixels vs stored features,
FAISS vs the evaluation's matmul, other batches) are float32 cosines of unit vectors, <= (d + 4) eps apart per
path (d <= 64: atol 1e-5; 1e-4 through the CNN extractor); FAISS top-k id sets / recall 1.0 are compared
exactly only behind `assert_topk_well_separated`, and ranks only where no score is within the paths' difference
of the caption's own picture's.
"""

import json
import shutil

import numpy as np
import pytest
import torch

from conftest import (
    assert_topk_well_separated,
    brute_force_topk,
    interrupt_on_call,
    recall_vs,
    spy_search_ids,
)
from vsekit.cli import main
from vsekit.data.precomp import DataFormatError
from vsekit.search.engine import SearchEngine
from vsekit.search.index import (
    FaissParams,
    IndexFormatError,
    SearchIndex,
    append_segment,
    build_faiss,
    build_index,
)
from vsekit_lab.datasets.shapes import COLORS, SHAPES

pytest.importorskip("faiss")
pytest.importorskip("efficientnet_lite_pytorch")


@pytest.fixture(scope="module")
def split_index(shapes_model, tmp_path_factory):
    data, run = shapes_model
    out = tmp_path_factory.mktemp("idx") / "test"
    assert main(["index", str(run), f"{data}:test", "--out", str(out), "--quiet", "--device", "cpu"]) == 0
    return out


def quiet(*_):
    pass


@pytest.mark.slow
def test_index_split_and_search_text(shapes_model, split_index, capsys):
    meta = json.loads((split_index / "index.json").read_text())
    assert meta["counts"] == {"pictures": 24, "captions": 48}
    assert meta["segments"][0]["embedded_from"]["mode"] == "features"
    capsys.readouterr()
    assert main(["search", str(split_index), "a red circle", "-k", "2", "--json", "--device", "cpu"]) == 0
    hits = json.loads(capsys.readouterr().out)
    assert [set(h) for h in hits] == [{"path", "score", "caption"}] * 2
    assert [h["caption"] for h in hits] == ["a red circle", "a red circle"]
    assert hits[0]["score"] >= hits[1]["score"]
    assert all("red_circle" in h["path"] for h in hits)
    engine = SearchEngine.open(split_index)
    right = sum(
        engine.search_text(f"a {c} {s}", 1)[0].caption == f"a {c} {s}" for c in COLORS for s in SHAPES
    )
    assert right >= 10, f"only {right}/12 colour-shape queries found a matching picture first"


@pytest.mark.slow
def test_image_query_finds_its_captions(shapes_model, split_index, capsys):
    data, _ = shapes_model
    capsys.readouterr()
    pic = data / "images" / "test_blue_square_0.png"
    assert (
        main(["search", str(split_index), "--image", str(pic), "-k", "3", "--json", "--device", "cpu"]) == 0
    )
    hits = json.loads(capsys.readouterr().out)
    assert len(hits) == 3 and len({h["caption"] for h in hits}) == 3  # distinct caption texts
    assert "blue square" in hits[0]["caption"]


@pytest.mark.slow
def test_raw_pictures_embed_like_the_training_features(shapes_model, split_index, tmp_path):
    """The run records the dataset's extractor; raw PNGs through it must give the features' embeddings."""
    data, run = shapes_model
    meta = build_index(run, f"{data}:test", tmp_path / "px", pixels=True, progress=False, log=quiet)
    assert meta["segments"][0]["embedded_from"]["mode"] == "extractor"
    a, b = SearchIndex(split_index), SearchIndex(tmp_path / "px")
    np.testing.assert_allclose(a.all_image_emb(), b.all_image_emb(), atol=1e-4)


@pytest.mark.slow
def test_incremental_add_skips_known_pictures(shapes_model, tmp_path):
    data, run = shapes_model
    out = tmp_path / "idx"
    build_index(run, f"{data}:test", out, progress=False, log=quiet)
    msgs = []
    assert build_index(run, f"{data}:test", out, progress=False, log=msgs.append)["generation"] == 1
    assert any("24 of 24 pictures are already in the index" in m for m in msgs)
    meta = build_index(run, f"{data}:dev", out, progress=False, log=quiet)
    idx = SearchIndex(out)
    assert idx.n_pictures == 36 and len({p["path"] for p in idx.pictures}) == 36
    assert idx.image_faiss.ntotal == 36 and idx.caption_faiss.ntotal == 72 and meta["generation"] == 2
    assert sorted(p.name for p in out.glob("*.faiss")) == ["captions.g2.faiss", "images.g2.faiss"]
    # the added pictures embed exactly as in an index of their own, and their captions point at them
    build_index(run, f"{data}:dev", tmp_path / "dev", progress=False, log=quiet)
    # the same pictures in the same batches (`chunk_batches`): the same ops on the same shapes, identical
    np.testing.assert_allclose(
        idx.all_image_emb()[24:], SearchIndex(tmp_path / "dev").all_image_emb(), atol=1e-6
    )
    assert all(idx.pictures[c["image"]]["path"].startswith("images/dev_") for c in idx.captions[48:])
    hits = SearchEngine.open(out).search_text("a green square", 3)
    assert "images/dev_green_square_0.png" in {h.path for h in hits}  # an added picture is found


@pytest.mark.slow
def test_interrupted_indexing_resumes_from_finished_chunks(shapes_model, tmp_path, monkeypatch):
    import vsekit.search.build as build_mod

    data, run = shapes_model
    real = build_mod.embed_features
    calls = interrupt_on_call(monkeypatch, build_mod, "embed_features", 3)
    kw = {"chunk_size": 4, "batch_size": 4, "progress": False, "log": quiet}
    with pytest.raises(KeyboardInterrupt):
        build_index(run, f"{data}:test", tmp_path / "idx", **kw)
    assert not (tmp_path / "idx" / "index.json").exists()
    assert len(list((tmp_path / "idx" / ".work").glob("*/chunk_*.npz"))) == 2
    calls["n"] = 100
    build_index(run, f"{data}:test", tmp_path / "idx", **kw)
    assert calls["n"] == 100 + 6 - 2  # 24 pictures / 4 per chunk, 2 chunks reused
    assert not (tmp_path / "idx" / ".work").exists()
    monkeypatch.setattr(build_mod, "embed_features", real)
    build_index(run, f"{data}:test", tmp_path / "ref", **kw)
    # reused chunks keep their batches (`chunk_batches`): the same ops on the same shapes as a fresh build
    np.testing.assert_allclose(
        SearchIndex(tmp_path / "idx").all_image_emb(),
        SearchIndex(tmp_path / "ref").all_image_emb(),
        atol=1e-6,
    )


@pytest.mark.slow
def test_unreadable_pictures_are_named(shapes_model, tmp_path, capsys):
    data, run = shapes_model
    folder = tmp_path / "pics"
    folder.mkdir()
    shutil.copy(data / "images" / "test_red_circle_0.png", folder / "good.png")
    (folder / "good.txt").write_text("my own caption\n")
    (folder / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    msgs = []
    build_index(run, str(folder), tmp_path / "idx", progress=False, log=msgs.append)
    idx = SearchIndex(tmp_path / "idx")
    assert [(p["path"], p["caption"]) for p in idx.pictures] == [("good.png", "my own caption")]
    assert idx.captions == [{"text": "my own caption", "image": 0}]
    assert any("broken.png" in m and "cannot read image" in m for m in msgs)
    capsys.readouterr()
    assert (
        main(["index", str(run), str(folder), "--out", str(tmp_path / "strict"), "--strict", "--quiet"]) == 2
    )
    assert "broken.png" in capsys.readouterr().err


@pytest.mark.slow
def test_clear_errors(shapes_model, split_index, tmp_path, capsys):
    data, run = shapes_model
    with pytest.raises(IndexFormatError, match="not a vsekit index"):
        SearchIndex(tmp_path)
    with pytest.raises(DataFormatError, match="does not exist"):
        build_index(run, str(tmp_path / "nope"), tmp_path / "o", progress=False, log=quiet)
    with pytest.raises(DataFormatError, match="name a split"):
        (tmp_path / "ds").mkdir()
        (tmp_path / "ds" / "train_caps.txt").write_text("x\n")
        build_index(run, str(tmp_path / "ds"), tmp_path / "o", progress=False, log=quiet)
    capsys.readouterr()
    assert main(["search", str(split_index), "a red circle", "-k", "0"]) == 2
    assert "-k must be at least 1" in capsys.readouterr().err
    broken = tmp_path / "broken"
    shutil.copytree(split_index, broken)
    (broken / "index.json").write_text('{"format": "vsekit-index/1", ')
    with pytest.raises(IndexFormatError, match="index.json: not valid JSON"):
        SearchIndex(broken)
    # another model's weights: the index refuses to mix embeddings, and refuses to answer with changed weights
    other = tmp_path / "run2"
    shutil.copytree(run, other)
    w = other / "best.safetensors"
    from safetensors.torch import load_file, save_file

    t = load_file(w)
    name = next(iter(t))
    t[name] = t[name] + 0.01
    save_file(t, w)
    with pytest.raises(IndexFormatError, match="cannot share an index"):
        build_index(other, f"{data}:test", split_index, progress=False, log=quiet)
    with pytest.raises(IndexFormatError, match="differs from the weights"):
        SearchEngine.open(split_index, run_dir=other)


def _search_json(index_dir, *extra, k=24):
    return ["search", str(index_dir), "a red circle", "-k", str(k), "--json", "--device", "cpu", *extra]


def test_ivf_index_and_nprobe_from_the_cli(shapes_model, split_index, tmp_path, capsys):
    """`vse index --index ivf` stores an IVF index with the given lists; `vse search --nprobe` overrides the
    lists visited for that query only. With 4 lists over 24 pictures, one probed list cannot hold them all."""
    data, run = shapes_model
    ivf = tmp_path / "ivf"
    assert (
        main(
            [
                "index",
                str(run),
                f"{data}:test",
                "--out",
                str(ivf),
                "--quiet",
                "--device",
                "cpu",
                "--index",
                "ivf",
                "--nlist",
                "4",
                "--nprobe",
                "1",
            ]
        )
        == 0
    )
    meta = json.loads((ivf / "index.json").read_text())
    assert (meta["faiss"]["kind"], meta["faiss"]["nlist"], meta["faiss"]["nprobe"]) == ("ivf", 4, 1)
    index = SearchIndex(ivf)
    assert type(index.image_faiss).__name__ == "IndexIVFFlat" and index.image_faiss.nlist == 4
    assert index.image_faiss.nprobe == 1
    capsys.readouterr()
    assert main(_search_json(split_index)) == 0
    exact = {h["path"]: h["score"] for h in json.loads(capsys.readouterr().out)}  # the flat index: all 24
    assert len(exact) == 24
    assert main(_search_json(ivf)) == 0
    one_list = json.loads(capsys.readouterr().out)
    assert 0 < len(one_list) < 24  # only the pictures of the one list visited
    assert all(h["score"] == pytest.approx(exact[h["path"]], abs=1e-5) for h in one_list)
    assert main(_search_json(ivf, "--nprobe", "4")) == 0
    all_lists = json.loads(capsys.readouterr().out)
    assert [h["path"] for h in all_lists] == list(exact)  # every list visited: the exact ranking
    assert json.loads((ivf / "index.json").read_text())["faiss"]["nprobe"] == 1  # the override is not stored
    assert main(_search_json(ivf, "--nprobe", "0")) == 2
    assert "vse search: error: --nprobe must be at least 1, got 0" in capsys.readouterr().err  # while parsing


def test_hnsw_index_and_ef_search_from_the_cli(shapes_model, split_index, tmp_path, capsys, monkeypatch):
    data, run = shapes_model
    hnsw = tmp_path / "hnsw"
    assert (
        main(
            [
                "index",
                str(run),
                f"{data}:test",
                "--out",
                str(hnsw),
                "--quiet",
                "--device",
                "cpu",
                "--index",
                "hnsw",
                "--hnsw-m",
                "8",
                "--ef-construction",
                "20",
                "--ef-search",
                "5",
            ]
        )
        == 0
    )
    meta = json.loads((hnsw / "index.json").read_text())
    assert (meta["faiss"]["kind"], meta["faiss"]["hnsw_m"], meta["faiss"]["ef_construction"]) == (
        "hnsw",
        8,
        20,
    )
    index = SearchIndex(hnsw)
    assert type(index.image_faiss).__name__ == "IndexHNSWFlat" and index.image_faiss.hnsw.efSearch == 5
    opened = []
    real_open = SearchEngine.open

    def spy_open(*args, **kwargs):
        opened.append(real_open(*args, **kwargs))
        return opened[-1]

    monkeypatch.setattr(SearchEngine, "open", spy_open)
    capsys.readouterr()
    assert main(_search_json(hnsw, k=5)) == 0
    assert opened[-1].index.image_faiss.hnsw.efSearch == 5  # the stored beam
    stored = json.loads(capsys.readouterr().out)
    assert main(_search_json(hnsw, "--ef-search", "40", k=5)) == 0
    assert opened[-1].index.image_faiss.hnsw.efSearch == 40  # the override reached FAISS
    wide = json.loads(capsys.readouterr().out)
    assert main(_search_json(split_index, k=5)) == 0
    exact = json.loads(capsys.readouterr().out)
    assert [h["path"] for h in wide] == [h["path"] for h in exact]  # a 40-wide beam over 24 pictures is exact
    assert len(stored) == 5 and all(h["caption"] for h in stored)
    assert json.loads((hnsw / "index.json").read_text())["faiss"]["ef_search"] == 5


def clustered(n, d, centers, rng, noise=0.3):
    c = rng.normal(size=(centers, d)).astype(np.float32)
    x = c[rng.integers(0, centers, n)] + noise * rng.normal(size=(n, d)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def test_faiss_kinds_recall_against_exact():
    rng = np.random.default_rng(0)
    x, q = clustered(4000, 32, 64, rng), clustered(100, 32, 64, rng)
    exact = build_faiss(x, FaissParams("flat"))
    _, truth = exact.search(q, 10)
    brute = np.argsort(-(q @ x.T), axis=1)[:, :10]
    assert (np.sort(truth, 1) == np.sort(brute, 1)).mean() > 0.99

    def recall(index):
        _, ids = index.search(q, 10)
        return np.mean([len(set(a) & set(b)) / 10 for a, b in zip(ids, truth)])

    ivf_all = build_faiss(x, FaissParams("ivf", nlist=64, nprobe=64))
    assert_topk_well_separated(q, x, 10)  # so IVF over every list and the flat index agree on any CPU
    assert recall(ivf_all) == 1.0  # visiting every list is exact
    ivf_one = build_faiss(x, FaissParams("ivf", nlist=64, nprobe=1))
    assert recall(ivf_one) < recall(build_faiss(x, FaissParams("ivf", nlist=64, nprobe=8)))
    hnsw_narrow = recall(build_faiss(x, FaissParams("hnsw", hnsw_m=16, ef_search=16)))
    hnsw_wide = recall(build_faiss(x, FaissParams("hnsw", hnsw_m=16, ef_search=128)))
    assert hnsw_narrow < hnsw_wide and hnsw_wide >= 0.97
    with pytest.raises(ValueError, match="choose one of flat, ivf, hnsw"):
        build_faiss(x, FaissParams("annoy"))
    with pytest.raises(ValueError, match="needs at least 64 vectors"):
        build_faiss(x[:10], FaissParams("ivf", nlist=64))


class MaxOverViews(torch.nn.Module):
    """An AEOM stand-in: the best of an image's views, which no single inner product reproduces."""

    def forward(self, image_emb, text_emb):
        return torch.einsum("ivd,td->ivt", image_emb, text_emb).amax(1)


def test_non_inner_product_similarity_is_reranked_exactly(tmp_path):
    from vsekit.config import load_recipe
    from vsekit.data.text import Vocabulary
    from vsekit.models.vse import DataSpec, VSEModel

    recipe = load_recipe("vsepp", ["model.embed_dim=16", "model.text.word_dim=8"])
    model = VSEModel(recipe, DataSpec(img_dim=8, vocab_words=Vocabulary.build(["a b"]).idx2word)).eval()
    model.recipe.model.similarity.name = "aeom"  # what the engine keys the re-rank on
    model.sim = MaxOverViews()
    rng = np.random.default_rng(1)
    n, views, d = 300, 2, 16
    emb = rng.normal(size=(n, views, d)).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=2, keepdims=True)
    from vsekit.search.encode import proxy_vectors

    proxies = proxy_vectors(model, torch.from_numpy(emb)).numpy()
    pictures = [{"root": 0, "path": f"p{i}.png", "caption": None, "id": str(i)} for i in range(n)]
    append_segment(
        tmp_path,
        None,
        fingerprint={"similarity": "aeom"},
        params=FaissParams("flat"),
        roots=[str(tmp_path)],
        pictures=pictures,
        image_emb=emb.reshape(n, -1),
        emb_shape=[views, d],
        proxies=proxies,
        captions=[],
        caption_emb=np.zeros((0, d), np.float32),
        segment={"source": "test"},
    )
    index = SearchIndex(tmp_path)
    q = torch.from_numpy(rng.normal(size=(20, d)).astype(np.float32))
    exact = MaxOverViews()(torch.from_numpy(emb), q).T.numpy()  # [Q, N]
    full = SearchEngine(index, model, {}, rerank_factor=1, rerank_min=n)  # shortlist = everything
    for qi, hits in enumerate(full.search_text_vectors(q, 5)):
        assert [i for i, _ in hits] == list(np.argsort(-exact[qi], kind="stable")[:5])
        np.testing.assert_allclose([s for _, s in hits], np.sort(exact[qi])[::-1][:5], rtol=1e-5)
    proxy_only = np.argsort(-(q.numpy() @ proxies.T), axis=1)[:, :5]
    assert (
        proxy_only != np.argsort(-exact, axis=1)[:, :5]
    ).any()  # without re-ranking the order would be wrong
    shallow = SearchEngine(index, model, {}, rerank_factor=10, rerank_min=50)
    agree = np.mean(
        [
            len({i for i, _ in h} & set(np.argsort(-exact[qi])[:5])) / 5
            for qi, h in enumerate(shallow.search_text_vectors(q, 5))
        ]
    )
    assert agree >= 0.9


def test_bench_search_measures_recall_against_exact(monkeypatch):
    """The ANN benchmark on a small set: IVF visiting every list is exact, one list is not; same seed, same data.
    Every row's recall is checked against a brute-force numpy top-k of the same data, not FAISS's flat index."""
    from vsekit_lab.bench.search import ClusteredVectors, bench_search, format_search_table

    a, b = ClusteredVectors(16, 8, 1.0, seed=3), ClusteredVectors(16, 8, 1.0, seed=3)
    np.testing.assert_array_equal(
        np.concatenate(list(a.chunks(250, 100))), np.concatenate(list(b.chunks(250, 100)))
    )
    np.testing.assert_allclose(np.linalg.norm(a.draw(5, 0), axis=1), 1.0, rtol=1e-5)
    seen = spy_search_ids(monkeypatch)
    res = bench_search(
        n=3000,
        dim=32,
        queries=40,
        exact_queries=10,
        clusters=60,
        nlist=32,
        nprobes=(1, 32),
        sq8=True,
        hnsw_m=8,
        ef_searches=(4, 64),
        train_size=2000,
        chunk=700,
        log=quiet,
    )
    data = ClusteredVectors(32, 60, 1.0, seed=0)
    truth = brute_force_topk(data.queries(40), np.concatenate(list(data.chunks(3000, 700))), 10)
    assert len(seen) == len(res["rows"]) == 7
    assert_topk_well_separated(data.queries(40), np.concatenate(list(data.chunks(3000, 700))), 10)
    assert [set(r) for r in seen[0]] == [set(t) for t in truth[:10]]  # the flat index is exact
    for row, ids in zip(res["rows"], seen):
        assert row["recall_at_k"] == pytest.approx(recall_vs(ids, truth[: len(ids)]), abs=1e-4), row
    rows = {(r["index"], r["params"]): r for r in res["rows"]}
    assert rows[("flat (exact)", "")]["recall_at_k"] == 1.0
    assert rows[("IVF-Flat", "nlist=32 nprobe=32")]["recall_at_k"] == 1.0
    assert rows[("IVF-Flat", "nlist=32 nprobe=1")]["recall_at_k"] < 1.0
    assert rows[("IVF-SQ8", "nlist=32 nprobe=32")]["recall_at_k"] >= 0.9  # 8-bit codes: close, not exact
    assert (
        rows[("HNSW-Flat", "M=8 efSearch=4")]["recall_at_k"]
        <= rows[("HNSW-Flat", "M=8 efSearch=64")]["recall_at_k"]
    )
    assert all(0 < r["p50_ms"] <= r["p99_ms"] for r in res["rows"])
    assert "| IVF-Flat | nlist=32 nprobe=1 |" in format_search_table(res)
    auto = bench_search(
        n=3000, dim=16, queries=5, exact_queries=2, clusters=60, nprobes=(2,), sq8=False, log=quiet
    )
    from vsekit.search.index import auto_nlist

    assert (
        auto["setup"]["nlist"] == auto_nlist(3000) and auto["setup"]["train_size"] == 3000
    )  # as `vse index` picks
    with pytest.raises(ValueError, match="must be positive"):
        bench_search(n=0, log=quiet)


def test_second_writer_is_refused_while_one_holds_the_index(tmp_path):
    pytest.importorskip("fcntl")
    from vsekit.search.index import writer_lock

    out = tmp_path / "idx"
    with writer_lock(out):
        with pytest.raises(IndexFormatError, match="another `vse index` is writing"):
            build_index(tmp_path / "no-run", "x", out, progress=False, log=quiet)
    from vsekit.runs import CheckpointError

    with pytest.raises(
        CheckpointError, match="not a vsekit run"
    ):  # released: the next writer gets past the lock
        build_index(tmp_path / "no-run", "x", out, progress=False, log=quiet)


def test_run_keeps_the_extractor_a_manifest_records_under_features(synthetic_dir, tmp_path):
    """openclipart's manifest names its extractor `features`; the run must keep it so `vse index` can embed pixels."""
    from vsekit.config import load_recipe
    from vsekit.search.encode import run_extractor_spec
    from vsekit.training.trainer import Trainer

    data = tmp_path / "data"
    shutil.copytree(synthetic_dir, data)
    spec = {
        "name": "efficientnet_lite0_grid",
        "weights_sha256": "0123456789abcdef",
        "image_size": 224,
        "dim": 32,
    }
    (data / "manifest.json").write_text(json.dumps({"format": "vsekit-precomp/1", "features": spec}))
    recipe = load_recipe(
        "vsepp",
        [
            "model.embed_dim=16",
            "model.text.word_dim=8",
            "train.epochs=1",
            "train.batch_size=64",
            "train.log_every=0",
            "data.val_max_images=20",
        ],
    )
    Trainer(recipe, data, tmp_path / "run", progress=False, log=quiet).fit()
    cfg = json.loads((tmp_path / "run" / "config.json").read_text())
    assert cfg["extractor"] == spec
    shutil.rmtree(data)  # the run alone must know it, without its dataset
    assert run_extractor_spec(cfg) == spec


@pytest.mark.slow
def test_index_scores_equal_the_evaluation_similarities(shapes_model, split_index):
    """Searching the index with every test caption reproduces `vse eval`'s similarity matrix, hence its recalls."""
    from vsekit.data.precomp import load_precomp_split
    from vsekit.evaluation import split_similarities
    from vsekit.metrics.retrieval import ranks_t2i

    data, _ = shapes_model
    engine = SearchEngine.open(split_index)
    split = load_precomp_split(data, "test", engine.model.recipe.data.captions_per_image)
    sims = split_similarities(engine.model, split)  # [images, captions], the evaluation's own path
    n = engine.index.n_pictures
    found = np.full_like(sims, np.nan)
    for c, hits in enumerate(engine.search_text_vectors(engine.text.embed(split.captions), n)):
        assert len(hits) == n and [s for _, s in hits] == sorted((s for _, s in hits), reverse=True)
        for pid, score in hits:
            found[pid, c] = score
    np.testing.assert_allclose(found, sims, atol=1e-5)
    # a rank counts pictures scoring >= the caption's own picture: the two paths (<= 1e-5 apart) can only
    # disagree where another picture scores within 2e-5 of it, so ranks are compared at every other caption
    own = sims[split.cap2img, np.arange(sims.shape[1])]
    near_tie = (np.abs(sims - own[None, :]) <= 2e-5).sum(0) > 1  # the own picture counts once
    assert near_tie.mean() < 0.1, near_tie.mean()
    np.testing.assert_array_equal(
        ranks_t2i(found, split.cap2img)[~near_tie], ranks_t2i(sims, split.cap2img)[~near_tie]
    )


def test_ivfpq_parameters_follow_the_documented_rule():
    from vsekit.search.index import auto_nlist, auto_pq, ivfpq_train_size

    assert auto_pq(512, 1_000_000) == (64, 8)  # 8 dims per sub-quantizer, 8-bit codes: 64 bytes per vector
    assert auto_pq(1024, 10**6) == (128, 8) and auto_pq(100, 10**6) == (10, 8)  # 12 does not divide 100
    assert auto_pq(64, 3000) == (8, 6)  # too few vectors for 256 centroids of 39 vectors each
    assert auto_nlist(1_000_000) == 4096 and ivfpq_train_size(1_000_000, 4096) == 163_840
    assert ivfpq_train_size(5000, 64) == 5000


def test_ivfpq_recall_against_brute_force():
    rng = np.random.default_rng(0)
    x, q = clustered(12000, 64, 100, rng), clustered(100, 64, 100, rng)
    truth = brute_force_topk(q, x, 10)
    params = FaissParams("ivfpq", nprobe=64)
    index = build_faiss(x, params)
    assert type(index).__name__ == "IndexIVFPQ" and index.pq.M == 8 and params.trained_on == 12000
    _, ids = index.search(q, 10)
    assert recall_vs(ids, truth) >= 0.5  # 8-byte codes of 64-d vectors (1/32 of float32): approximate
    params.nprobe = 1
    narrow = build_faiss(x, params)
    assert recall_vs(narrow.search(q, 10)[1], truth) < recall_vs(ids, truth)
    with pytest.raises(ValueError, match="--pq-m 7 must divide the vector dimension 64"):
        build_faiss(x, FaissParams("ivfpq", pq_m=7))


def _synthetic_segment(out, old, x, start, params):
    n, d = x.shape
    pictures = [
        {"root": 0, "path": f"p{start + i}.png", "caption": None, "id": str(start + i)} for i in range(n)
    ]
    return append_segment(
        out,
        old,
        fingerprint={"similarity": "cosine", "weights_sha256": "x"},
        params=params,
        roots=[str(out)],
        pictures=pictures,
        image_emb=x,
        emb_shape=[d],
        proxies=x,
        captions=[],
        caption_emb=np.zeros((0, d), np.float32),
        segment={"source": "test"},
    )


@pytest.mark.parametrize("kind", ["ivf", "ivfpq"])
def test_ivf_lists_are_retrained_when_the_index_outgrows_them(tmp_path, kind):
    """The first segment's lists are fitted to its own clusters; later segments bring clusters it never saw.
    Appending to stale lists piles the new vectors into a few lists; past RETRAIN_GROWTH x the trained count the
    index is rebuilt on a fresh sample (nlist re-chosen), and recall against numpy brute force holds up."""
    from vsekit.search.index import RETRAIN_GROWTH, auto_nlist

    rng = np.random.default_rng(0)
    d = 32 if kind == "ivf" else 64  # ivfpq: 8-byte codes
    first = clustered(2000, d, 20, rng)
    params = FaissParams(kind, nprobe=4)
    meta = _synthetic_segment(tmp_path, None, first, 0, params)
    assert meta["faiss"]["trained_on"] == 2000
    nlist0 = SearchIndex(tmp_path).image_faiss.nlist
    grown = [first]
    added = clustered(1500, d, 40, np.random.default_rng(1))  # 3,500 <= 2 x 2,000: appended, lists kept
    meta = _synthetic_segment(
        tmp_path, SearchIndex(tmp_path), added, 2000, params := FaissParams(**meta["faiss"])
    )
    grown.append(added)
    assert meta["faiss"]["trained_on"] == 2000 and SearchIndex(tmp_path).image_faiss.nlist == nlist0
    more = clustered(6000, d, 60, np.random.default_rng(2))  # 9,500 > 2 x 2,000: re-trained
    old = SearchIndex(tmp_path)
    meta = _synthetic_segment(tmp_path, old, more, 3500, FaissParams(**meta["faiss"]))
    grown.append(more)
    x = np.concatenate(grown)
    assert 9500 > RETRAIN_GROWTH * 2000 and meta["faiss"]["trained_on"] == 9500
    index = SearchIndex(tmp_path)
    assert index.image_faiss.ntotal == 9500 and index.image_faiss.nlist == auto_nlist(9500) > nlist0
    q = np.concatenate([clustered(50, d, 60, np.random.default_rng(3)), first[:50]])
    truth = brute_force_topk(q, x, 10)
    retrained = recall_vs(index.image_faiss.search(q, 10)[1], truth)
    stale = getattr(
        old.image_faiss, "base", old.image_faiss
    )  # lists trained on the first segment, all appended
    stale.add(more)
    if kind == "ivfpq":  # the same exact re-scoring of the shortlist as the re-trained index
        from vsekit.search.index import RefinedIndex

        stale = RefinedIndex(stale, lambda ids: x[ids], old.params.refine)
    stale_recall = recall_vs(stale.search(q, 10)[1], truth)
    # measured: ivf 0.936 re-trained vs 0.70 stale; ivfpq (with its exact re-scoring) 0.941 vs 0.65
    assert retrained >= 0.85 and retrained >= stale_recall + 0.1, (retrained, stale_recall)
    hits = sum(1 for i in index.image_faiss.search(q, 1)[1][:, 0] if i >= 0)
    assert hits == len(q)


def test_ivfpq_index_rescores_its_shortlist_with_the_stored_embeddings(tmp_path):
    """PQ codes rank near neighbours coarsely; the index re-scores the top refine*k exactly from the segments'
    float32 embeddings, so recall against numpy brute force climbs and the scores are exact inner products."""
    rng = np.random.default_rng(0)
    x, q = clustered(12000, 64, 100, rng), clustered(100, 64, 100, rng)
    truth = brute_force_topk(q, x, 10)
    _synthetic_segment(tmp_path / "plain", None, x, 0, FaissParams("ivfpq", nprobe=16, refine=0))
    _synthetic_segment(
        tmp_path / "refined", None, x, 0, FaissParams("ivfpq", nprobe=16)
    )  # refine=10 by default
    plain = SearchIndex(tmp_path / "plain").image_faiss
    refined = SearchIndex(tmp_path / "refined").image_faiss
    assert type(plain).__name__ == "IndexIVFPQ" and refined.nprobe == 16 and refined.ntotal == 12000
    plain_recall = recall_vs(plain.search(q, 10)[1], truth)
    scores, ids = refined.search(q, 10)
    assert recall_vs(ids, truth) >= 0.9 > plain_recall, plain_recall
    np.testing.assert_allclose(scores, np.einsum("qkd,qd->qk", x[ids], q), rtol=1e-5, atol=1e-6)
    # adding to a refined index writes the FAISS index underneath and keeps the wrapper on reopening
    more = clustered(500, 64, 100, np.random.default_rng(5))
    _synthetic_segment(
        tmp_path / "refined",
        SearchIndex(tmp_path / "refined"),
        more,
        12000,
        FaissParams(**json.loads((tmp_path / "refined" / "index.json").read_text())["faiss"]),
    )
    again = SearchIndex(tmp_path / "refined")
    assert again.image_faiss.ntotal == 12500 and again.image_faiss.search(more[:1], 1)[1][0, 0] == 12000
