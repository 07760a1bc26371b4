"""Picture -> pictures: `vse search INDEX --image q.png --images`, `SearchEngine.search_image_to_images`,
`POST /search/image?target=images` and the web page's drop zone.

The score is the cosine of the picture vectors (engine module docstring): the checks below recompute it in
float64 numpy straight from the segments' image_emb.npy, never through the engine. Float comparisons: a query
given as a stored embedding is scored by FAISS in float32 over unit vectors of d <= 64 values: <= (d + 4) eps
from the float64 value (atol 1e-5). A query given as a picture goes through the CNN extractor alone instead of in
a batch of 16: its embedding differs from the stored one by <= 1e-4 per value (tests/test_search_index.py), so its
scores are compared with atol 1e-4; the query itself scores 1 within that, and the runner-up of every test
picture scores <= 0.99 (asserted), far below.
"""

import base64
import json
import logging
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from vsekit.cli import main
from vsekit.errors import VseInputError
from vsekit.search.engine import SearchEngine
from vsekit.search.index import FaissParams, SearchIndex, append_segment, build_index

pytest.importorskip("faiss")


def quiet(*_):
    pass


@pytest.fixture(scope="module")
def folder_index(shapes_model, tmp_path_factory):
    """The 24 shapes test pictures as a folder (x.png + x.txt) and its index, embedded from the pictures."""
    pytest.importorskip("efficientnet_lite_pytorch")
    data, run = shapes_model
    base = tmp_path_factory.mktemp("i2i")
    folder = base / "pics"
    folder.mkdir()
    for p in sorted((data / "images").glob("test_*.png")):
        shutil.copy(p, folder / p.name)
        (folder / p.name).with_suffix(".txt").write_text(f"a {p.stem[5:-2].replace('_', ' ')}\n")
    build_index(run, str(folder), base / "idx", progress=False, log=quiet)
    return folder, base / "idx"


def stored_unit_vectors(index_dir: Path) -> tuple[list[str], np.ndarray]:
    """(paths, unit image vectors float64) read from the index's files with json and numpy only."""
    meta = json.loads((index_dir / "index.json").read_text())
    paths, embs = [], []
    for seg in meta["segments"]:
        d = index_dir / seg["dir"]
        paths += [json.loads(line)["path"] for line in (d / "pictures.jsonl").read_text().splitlines()]
        embs.append(np.load(d / "image_emb.npy").astype(np.float64))
    x = np.concatenate(embs)
    return paths, x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.mark.slow
def test_query_picture_comes_first_and_the_ranking_is_numpys(folder_index):
    folder, out = folder_index
    paths, x = stored_unit_vectors(out)
    cos = x @ x.T  # [24, 24] float64: the score of every pair
    runner_up = np.sort(cos, axis=1)[:, -2]
    assert runner_up.max() < 0.99, (
        runner_up.max()
    )  # no near-duplicate: "first" is decided well beyond tolerances
    engine = SearchEngine.open(out)
    n = len(paths)
    for q, path in enumerate(paths):
        # the stored embedding as the query (the open_clip habit: a tensor from encode_image)
        hits = engine.search_image_to_images(torch.from_numpy(engine.index.image_emb([q])), n)
        ids = [paths.index(h.path) for h in hits]
        assert ids[0] == q and sorted(ids) == list(range(n))
        np.testing.assert_allclose([h.score for h in hits], np.sort(cos[q])[::-1], atol=1e-5)  # best first
        np.testing.assert_allclose(
            [h.score for h in hits], cos[q, ids], atol=1e-5
        )  # each id has its own score
        if q % 4:
            continue
        # the picture file as the query (every fourth: each is a CNN forward): embedded again, alone
        by_file = engine.search_image_to_images(folder / path, 3)
        assert by_file[0].path == path and by_file[0].score == pytest.approx(1.0, abs=1e-4)
        np.testing.assert_allclose(
            [h.score for h in by_file], cos[q, [paths.index(h.path) for h in by_file]], atol=1e-4
        )


@pytest.mark.slow
def test_a_new_picture_finds_its_colour_and_shape(shapes_model, folder_index):
    """Dev pictures (not in the index): the nearest indexed picture has the same colour and shape (12 of 12
    measured on the shapes model)."""
    data, _ = shapes_model
    engine = SearchEngine.open(folder_index[1])
    devs = sorted((data / "images").glob("dev_*.png"))
    right = sum(engine.search_image_to_images(p, 1)[0].path.startswith(f"test_{p.stem[4:-2]}_") for p in devs)
    assert len(devs) == 12 and right >= 10, right


@pytest.mark.slow
def test_cli_images_json_and_errors(folder_index, capsys):
    folder, out = folder_index
    pic = folder / "test_green_square_1.png"
    capsys.readouterr()
    assert (
        main(["search", str(out), "--image", str(pic), "--images", "-k", "3", "--json", "--device", "cpu"])
        == 0
    )
    hits = json.loads(capsys.readouterr().out)
    assert [set(h) for h in hits] == [{"path", "score", "caption"}] * 3  # the shape of text -> picture hits
    assert hits[0]["path"] == str(pic.resolve()) and hits[0]["caption"] == "a green square"
    assert hits[0]["score"] >= hits[1]["score"] >= hits[2]["score"]
    assert main(["search", str(out), "--image", str(pic), "--images", "-k", "2", "--device", "cpu"]) == 0
    table = capsys.readouterr().out.splitlines()
    assert len(table) == 2 and table[0].split()[0] == "1" and str(pic.resolve()) in table[0]
    assert main(["search", str(out), "--images", "--device", "cpu"]) == 2
    assert "give a text query, or --image PATH" in capsys.readouterr().err
    assert main(["search", str(out), "a red circle", "--images", "--device", "cpu"]) == 2
    assert "--images finds the indexed pictures most like a picture" in capsys.readouterr().err
    assert main(["search", str(out), "--image", str(folder / "nope.png"), "--images", "--device", "cpu"]) == 2
    assert "nope.png" in capsys.readouterr().err


@pytest.mark.slow
def test_python_api_embedding_and_input_checks(folder_index):
    folder, out = folder_index
    engine = SearchEngine.open(out)
    emb = engine.embed_picture(folder / "test_red_triangle_0.png")
    assert list(emb.shape) == [1, *engine.emb_shape]
    by_tensor = engine.search_image_to_images(emb, 5)
    by_path = engine.search_image_to_images(str(folder / "test_red_triangle_0.png"), 5)
    assert [(h.path, h.score) for h in by_tensor] == [(h.path, h.score) for h in by_path]
    assert [(h.path, h.score) for h in engine.search_image_to_images(emb[0], 5)] == [
        (h.path, h.score) for h in by_tensor
    ]
    with pytest.raises(VseInputError, match=r"image embedding of shape \[5\]"):
        engine.search_image_to_images(torch.zeros(5))
    with pytest.raises(VseInputError, match="give one picture's"):
        engine.search_image_to_images(torch.cat([emb, emb]))
    with pytest.raises(VseInputError, match="NaN or infinite"):
        engine.search_image_to_images(torch.full_like(emb, float("nan")))
    assert len(engine.search_image_to_images(emb, 100)) == 24  # k beyond the index: all of it


def _synthetic_engine(tmp_path: Path, emb: np.ndarray, shape: list[int], *, similarity: str, normalize: bool):
    """An index of `emb` (written as `vse index` writes one) and a small model whose settings say what the
    embeddings are; the model's weights play no part in picture -> picture scores."""
    from vsekit.config import load_recipe
    from vsekit.data.text import Vocabulary
    from vsekit.models.vse import DataSpec, VSEModel
    from vsekit.search.encode import proxy_vectors

    d = shape[-1]
    recipe = load_recipe("vsepp", [f"model.embed_dim={d}", "model.text.word_dim=8"])
    model = VSEModel(recipe, DataSpec(img_dim=8, vocab_words=Vocabulary.build(["a b"]).idx2word)).eval()
    model.recipe.model.similarity.name = similarity
    model.recipe.model.normalize = normalize
    n = len(emb)
    pictures = [{"root": 0, "path": f"p{i}.png", "caption": None, "id": str(i)} for i in range(n)]
    proxies = proxy_vectors(model, torch.from_numpy(emb)).numpy()
    append_segment(
        tmp_path,
        None,
        fingerprint={"similarity": similarity},
        params=FaissParams("flat"),
        roots=[str(tmp_path)],
        pictures=pictures,
        image_emb=emb.reshape(n, -1),
        emb_shape=shape,
        proxies=proxies,
        captions=[],
        caption_emb=np.zeros((0, d), np.float32),
        segment={"source": "t"},
    )
    return SearchEngine(SearchIndex(tmp_path), model, {})


def _ranked(engine: SearchEngine, query: np.ndarray, k: int) -> tuple[list[int], list[float]]:
    hits = engine.search_image_vectors_to_images(torch.from_numpy(query), k)[0]
    return [i for i, _ in hits], [s for _, s in hits]


def test_multi_view_pictures_compare_by_their_mean_view(tmp_path):
    """AVSE-style [views, D] embeddings: two pictures score the cosine of their L2-normalised mean views, the
    same whatever the order of the query's views; the picture itself comes first with 1."""
    rng = np.random.default_rng(0)
    n, views, d = 300, 3, 16
    emb = rng.normal(size=(n, views, d)).astype(np.float32)
    emb /= np.linalg.norm(emb, axis=2, keepdims=True)
    engine = _synthetic_engine(tmp_path, emb, [views, d], similarity="aeom", normalize=True)
    m = emb.astype(np.float64).mean(1)
    m /= np.linalg.norm(m, axis=1, keepdims=True)
    for q in (0, 17, 299):
        truth = m @ m[q]
        assert (
            -np.diff(np.sort(truth)[::-1][:11])
        ).min() > 2e-5  # no near-tie in the top 10: ids compared exactly
        ids, scores = _ranked(engine, emb[q][None], 10)
        assert ids == list(np.argsort(-truth, kind="stable")[:10]) and ids[0] == q
        np.testing.assert_allclose(scores, truth[ids], atol=1e-5)
        assert _ranked(engine, emb[q][::-1].copy()[None], 10)[0] == ids  # views in another order: same answer
    flat_first = np.argsort(-(emb.reshape(n, -1) @ emb[5].reshape(-1)), kind="stable")[:10]
    assert (
        list(flat_first) != _ranked(engine, emb[5][None], 10)[0]
    )  # the view-by-view score would rank otherwise


def test_unnormalised_embeddings_are_ranked_by_cosine_not_inner_product(tmp_path):
    """A model that does not L2-normalise its embeddings: the FAISS inner product is no cosine, so the engine
    scores the stored vectors exactly, and a long vector does not outrank the query's own picture."""
    rng = np.random.default_rng(1)
    n, d = 200, 16
    emb = (rng.normal(size=(n, d)) * rng.uniform(0.1, 10.0, size=(n, 1))).astype(np.float32)
    engine = _synthetic_engine(tmp_path, emb, [d], similarity="cosine", normalize=False)
    assert not engine.unit_picture_vectors
    x = emb.astype(np.float64) / np.linalg.norm(emb, axis=1, keepdims=True)
    for q in np.argsort(np.linalg.norm(emb, axis=1), kind="stable")[
        :2
    ]:  # short queries: long vectors outrank them
        truth = x @ x[q]
        assert (-np.diff(np.sort(truth)[::-1][:11])).min() > 2e-5  # no near-tie in the top 10
        ids, scores = _ranked(engine, emb[q][None], 10)
        assert ids == list(np.argsort(-truth, kind="stable")[:10]) and ids[0] == q
        np.testing.assert_allclose(scores, truth[ids], atol=1e-5)
        assert np.argmax(emb @ emb[q]) != q  # by inner product a longer vector would come first


# ------------------------------------------------------------------------------------------ the server


@pytest.fixture(scope="module")
def client(folder_index):
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    from fastapi.testclient import TestClient

    from vsekit.search.server import ServerLimits, create_app

    app = create_app(folder_index[1], limits=ServerLimits(max_k=20, max_body_bytes=200_000))
    with TestClient(app, base_url="http://127.0.0.1") as c:
        yield c


@pytest.mark.slow
def test_endpoint_target_images(client, folder_index):
    folder, _ = folder_index
    png = (folder / "test_yellow_circle_0.png").read_bytes()
    r = client.post("/search/image?k=3&target=images", content=png, headers={"content-type": "image/png"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["target"] == "images" and body["k"] == 3 and len(body["results"]) == 3
    first = body["results"][0]
    assert first["path"] == "test_yellow_circle_0.png" and first["caption"] == "a yellow circle"
    assert first["thumb"] == f"/thumb/{first['picture']}" and first["id"] == first["picture"]
    assert first["score"] == pytest.approx(1.0, abs=1e-4)
    assert client.get(first["thumb"]).status_code == 200
    captions = client.post("/search/image?k=2", content=png, headers={"content-type": "image/png"}).json()
    assert captions["target"] == "captions" and captions["results"][0]["caption"] == "a yellow circle"
    r = client.post("/search/image?target=faces", content=png, headers={"content-type": "image/png"})
    assert r.status_code == 422 and "target must be 'captions' or 'images'" in r.json()["detail"]
    r = client.post(
        "/search/image?target=images", content=b"\x89PNG garbage", headers={"content-type": "image/png"}
    )
    assert r.status_code == 400 and "not a readable picture" in r.json()["detail"]
    r = client.post(
        "/search/image?target=images", content=b"x" * 200_001, headers={"content-type": "image/png"}
    )
    assert r.status_code == 413


def test_endpoint_target_images_answers_501_before_reading_the_upload():
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    from fastapi.testclient import TestClient

    from vsekit.search.server import create_app

    class NoPictures(SearchEngine):
        def __init__(self) -> None:  # no model, no index: only what the server reads
            self.index = SimpleNamespace(n_pictures=0, pictures=[], picture_file=lambda i: None)
            self.text = SimpleNamespace(unknown_words=lambda q: [])

        def picture_query_problem(self):
            return "its model was trained on precomputed features and its run records no feature extractor"

        def search_image_to_images(self, image, k=10):
            raise AssertionError("must not be reached")

        def info(self) -> dict:
            return {"pictures": 0}

    app = create_app(NoPictures(), logger=logging.getLogger("vsekit.test.i2i"))
    with TestClient(app, base_url="http://127.0.0.1") as c:
        r = c.post("/search/image?target=images", content=b"\x89PNG not even read")
    assert r.status_code == 501 and "records no feature extractor" in r.json()["detail"]


# ------------------------------------------------------------------------------------------ the page


@pytest.mark.slow
def test_page_drop_a_picture_shows_similar_pictures(folder_index, tmp_path):
    """Headless Chromium: a picture dropped on the page's drop zone (with "similar pictures" chosen) shows the
    indexed pictures most like it, itself first; "captions" lists captions instead."""
    from test_search_browser import CHROMIUM, CHROMIUM_ARGS, _require_browser, serving

    _require_browser()
    from playwright.sync_api import sync_playwright

    folder, out = folder_index
    png = base64.b64encode((folder / "test_blue_triangle_1.png").read_bytes()).decode()
    with serving(out) as base, sync_playwright() as p:
        url = base + "/"
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport={"width": 1100, "height": 900})
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto(url)
            page.wait_for_function(
                "() => document.getElementById('info').textContent.includes('24 pictures')"
            )
            page.click("#image-search summary")
            page.select_option("#k", "5")
            dt = page.evaluate_handle(
                """(b64) => {
                    const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
                    const dt = new DataTransfer();
                    dt.items.add(new File([bytes], "query.png", { type: "image/png" }));
                    return dt;
                }""",
                png,
            )
            page.dispatch_event("#drop", "drop", {"dataTransfer": dt})
            page.wait_for_function("() => document.querySelectorAll('#results li.result').length === 5")
            page.wait_for_function(
                "() => [...document.querySelectorAll('#results img')].every(i => i.complete && i.naturalWidth > 0)"
            )
            captions = page.locator("#results .caption").all_text_contents()
            assert captions[0] == "a blue triangle", captions
            assert "5 similar pictures in" in page.text_content("#status")
            assert page.get_attribute("#query-preview", "src").startswith("data:image/png;base64,")
            shot = tmp_path / "drop.png"
            page.screenshot(path=str(shot), full_page=True)
            assert shot.stat().st_size > 10_000
            # the same picture (now the chosen file) with "captions"
            page.check("input[name=target][value=captions]")
            page.click("#image-form button[type=submit]")
            page.wait_for_selector("#captions li.caption-result")
            assert page.locator("#captions .caption").all_text_contents()[0] == "a blue triangle"
            assert page.locator("#results li").count() == 0
            assert not errors, errors
        finally:
            browser.close()


@pytest.mark.slow
def test_open_clip_style_encode_image_of_a_pixel_run(tmp_path, capsys):
    """The docs' snippet on a pixel (backbone) run: `model.encode_image([path])` gives the embedding the index
    stores for that picture, and searching with it finds the picture first."""
    from PIL import Image

    from test_karpathy_paths import TINY_E2E, _karpathy

    pics = tmp_path / "pics"
    data, run = tmp_path / "data", tmp_path / "run"
    assert (
        main(["data", "karpathy", str(_karpathy(tmp_path, pics)), "--images", str(pics), "--out", str(data)])
        == 0
    )
    assert main(["train", "--data", str(data), "--out", str(run), *TINY_E2E]) == 0, capsys.readouterr().err
    folder = tmp_path / "folder"
    folder.mkdir()
    rng = np.random.default_rng(7)
    for i in range(8):  # blocky random pictures, far apart from each other
        Image.fromarray((rng.random((4, 4, 3)) * 255).astype(np.uint8)).resize((40, 40), Image.NEAREST).save(
            folder / f"p{i}.png"
        )
    build_index(run, str(folder), tmp_path / "idx", progress=False, log=quiet)
    engine = SearchEngine.open(tmp_path / "idx")
    assert engine.model.recipe.model.image.kind == "backbone"
    paths, x = stored_unit_vectors(tmp_path / "idx")
    emb = engine.model.encode_image(
        [str(folder / "p5.png")]
    )  # the open_clip habit: pictures in, embeddings out
    # the run's own transform on the same picture: the stored embedding, up to the batch shape (8 vs 1: <= 1e-5)
    np.testing.assert_allclose(
        emb.detach().numpy()[0], engine.index.image_emb([paths.index("p5.png")])[0], atol=1e-5
    )
    hits = engine.search_image_to_images(emb, 8)
    cos = x @ x[paths.index("p5.png")]
    assert (
        hits[0].path == "p5.png" and np.sort(cos)[-2] < 0.99
    )  # itself first; the runner-up far below (0.84 measured)
    np.testing.assert_allclose([h.score for h in hits], cos[[paths.index(h.path) for h in hits]], atol=1e-5)
