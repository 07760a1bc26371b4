"""The index store's one writing protocol and the one picture proxy: multi-view (AVSE) indexes, whose embeddings
are stored flat ([views x D] per picture, as the model's encode_image gives them), keep D-wide proxies when an
index is extended, re-trained or re-scored; every index.json is written by `search.store.commit_generation`."""

import ast
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from vsekit.search.faiss_index import FaissParams
from vsekit.search.proxies import picture_proxies, view_width
from vsekit.search.store import RETRAIN_GROWTH, SearchIndex, append_segment

ROOT = Path(__file__).resolve().parents[1]


def hand_view_mean(emb: np.ndarray, d: int) -> np.ndarray:
    """The mean of each picture's views, divided by its length (numpy, float64, independent of the code)."""
    v = emb.astype(np.float64).reshape(len(emb), -1, d).mean(1)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


def test_the_proxy_is_the_embedding_or_the_normalised_mean_of_its_views():
    rng = np.random.default_rng(0)
    emb = rng.normal(size=(7, 3 * 4)).astype(np.float32)
    np.testing.assert_array_equal(picture_proxies(emb, None), emb)
    np.testing.assert_allclose(picture_proxies(emb, 4), hand_view_mean(emb, 4), rtol=1e-6)
    np.testing.assert_allclose(picture_proxies(torch.from_numpy(emb), 4), hand_view_mean(emb, 4), rtol=1e-6)
    assert picture_proxies(emb, 4).dtype == np.float32 and picture_proxies(emb, 4).flags.c_contiguous
    assert picture_proxies(np.zeros((0, 12), np.float32), 4).shape == (0, 4)
    # which width is a view: [V, D] says so; a flat shape only when the index's model is multi-view
    assert view_width([3, 4]) == 4 and view_width([12]) is None and view_width([12], 4, multi_view=True) == 4
    assert view_width([4], 4, multi_view=False) is None


def _multi_view_segment(out, old, emb, start, params, d):
    n = len(emb)
    pictures = [
        {"root": 0, "path": f"p{start + i}.png", "caption": None, "id": str(start + i)} for i in range(n)
    ]
    fingerprint = {"similarity": "aeom", "weights_sha256": "x", "embed_dim": d, "rerank": True}
    return append_segment(
        out,
        old,
        fingerprint=fingerprint,
        params=params,
        roots=[str(out)],
        pictures=pictures,
        image_emb=emb,
        emb_shape=[emb.shape[1]],
        proxies=hand_view_mean(emb, d).astype(np.float32),
        captions=[],
        caption_emb=np.zeros((0, d), np.float32),
        segment={"source": "test"},
    )


@pytest.mark.parametrize("kind", ["ivf", "ivfpq"])
def test_a_multi_view_index_stored_flat_keeps_d_wide_proxies(tmp_path, kind):
    """An AVSE run's pictures are recorded as [views*D]: re-training the IVF lists after the index outgrew them
    (append) and IVF-PQ's exact re-check both take the views' mean, D wide, like the vectors already in FAISS
    (before, they took the flat V*D embeddings and failed on the mismatched width)."""
    pytest.importorskip("faiss")
    rng = np.random.default_rng(0)
    views, d = 3, 16
    first = rng.normal(size=(400, views * d)).astype(np.float32)
    meta = _multi_view_segment(
        tmp_path, None, first, 0, FaissParams(kind, nlist=4, nprobe=4, refine=900), d
    )  # a shortlist of all
    more = rng.normal(size=(500, views * d)).astype(np.float32)
    assert 900 > RETRAIN_GROWTH * 400
    meta = _multi_view_segment(tmp_path, SearchIndex(tmp_path), more, 400, FaissParams(**meta["faiss"]), d)
    assert meta["faiss"]["trained_on"] == 900  # re-trained on every stored picture's proxy
    index = SearchIndex(tmp_path)
    emb = np.concatenate([first, more])
    np.testing.assert_allclose(index.proxies(emb), hand_view_mean(emb, d), rtol=1e-5, atol=1e-6)
    assert index.image_faiss.d == d and index.image_faiss.ntotal == 900
    q = hand_view_mean(emb[[5, 450]], d).astype(np.float32)
    scores, ids = index.image_faiss.search(
        q, 1
    )  # each picture's own proxy is its nearest (IVF-PQ: re-checked)
    assert ids[:, 0].tolist() == [5, 450]
    if kind == "ivfpq":  # the re-check's scores are exact inner products of the stored proxies
        np.testing.assert_allclose(scores[:, 0], 1.0, rtol=1e-5)


def test_one_module_writes_index_json():
    """The generation / index.json writing protocol has one owner: no other module of the library names
    index.json in a write (a call of an atomic_write_* helper or open(..., "w") on a path naming it)."""
    writers = []
    for path in sorted((ROOT / "src" / "vsekit").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and "index.json" in ast.unparse(node):
                name = ast.unparse(node.func)
                if name.startswith("atomic_write") or name in ("open", "write_text", "json.dump"):
                    writers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert [w.split(":")[0] for w in writers] == ["src/vsekit/search/store.py"], writers


def test_a_refresh_and_an_append_write_index_json_alike(tmp_path):
    """Both go through commit_generation: the same keys, in the same order, and the generation counts up."""
    pytest.importorskip("faiss")
    rng = np.random.default_rng(0)
    d = 8
    x = rng.normal(size=(50, d)).astype(np.float32)
    pictures = [{"root": 0, "path": f"p{i}.png", "caption": None, "id": str(i)} for i in range(50)]
    kw = {
        "fingerprint": {"similarity": "cosine", "weights_sha256": "x"},
        "params": FaissParams("flat"),
        "roots": [str(tmp_path)],
        "emb_shape": [d],
        "captions": [],
        "caption_emb": np.zeros((0, d), np.float32),
        "segment": {"source": "test"},
    }
    first = append_segment(tmp_path, None, pictures=pictures[:20], image_emb=x[:20], proxies=x[:20], **kw)
    second = append_segment(
        tmp_path, SearchIndex(tmp_path), pictures=pictures[20:], image_emb=x[20:], proxies=x[20:], **kw
    )
    keys = [
        "format",
        "generation",
        "created",
        "updated",
        "model",
        "image_emb_shape",
        "faiss",
        "roots",
        "segments",
        "files",
        "counts",
    ]
    assert list(first) == keys and list(second) == keys
    assert (first["generation"], second["generation"]) == (1, 2) and second["counts"]["pictures"] == 50
    on_disk = json.loads((tmp_path / "index.json").read_text())
    assert on_disk["files"] == {"images": "images.g2.faiss", "captions": None}
    assert sorted(p.name for p in tmp_path.glob("*.faiss")) == ["images.g2.faiss"]  # generation 1 deleted


def test_the_weights_an_index_records_are_the_ones_load_run_loads(shapes_model, tmp_path):
    """One rule for which weights file a run's checkpoint is (`runs.weights_path`): with the best set committed
    (best.manifest.json) but its convenience name gone, load_run loads the best set, and the fingerprint an index
    records names and hashes that set, not last.safetensors; without any best set, both take last."""
    import hashlib
    import shutil

    from vsekit.runs import checkpoint_tag, load_run, weights_path
    from vsekit.search.build import model_fingerprint

    _, run = shapes_model
    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    committed = copy / json.loads((copy / "best.manifest.json").read_text())["files"][".safetensors"]["path"]
    (copy / "best.safetensors").unlink()
    assert weights_path(copy, "best") == copy / "best.safetensors" and checkpoint_tag(copy, "best") == "best"
    model, _ = load_run(copy, "best")
    fingerprint = model_fingerprint(copy, "best", model)
    assert fingerprint["weights"] == "best.safetensors"
    assert fingerprint["weights_sha256"] == hashlib.sha256(committed.read_bytes()).hexdigest()
    for path in copy.glob("best*"):
        path.unlink()
    assert weights_path(copy, "best") == copy / "last.safetensors" and checkpoint_tag(copy, "last") == "last"
