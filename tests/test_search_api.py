"""`vse serve`'s API: answers, and bad input answered with a 4xx and a message that says what is wrong."""

import io
import json
import logging
import shutil

import pytest
from PIL import Image

from vsekit.search.index import build_index

pytest.importorskip("faiss")
pytest.importorskip("fastapi")
pytest.importorskip("efficientnet_lite_pytorch")
from fastapi.testclient import TestClient  # noqa: E402

from vsekit.search.server import ServerLimits, create_app  # noqa: E402

BASE = "http://127.0.0.1"


@pytest.fixture(scope="module")
def index_dir(shapes_model, tmp_path_factory):
    data, run = shapes_model
    out = tmp_path_factory.mktemp("api") / "idx"
    build_index(run, f"{data}:test", out, progress=False, log=lambda *_: None)
    return out


@pytest.fixture(scope="module")
def client(index_dir):
    app = create_app(index_dir, limits=ServerLimits(max_k=20, max_query_chars=64, max_body_bytes=200_000))
    with TestClient(app, base_url=BASE) as c:
        yield c


@pytest.mark.slow
def test_search_answers_with_matching_pictures(client):
    r = client.get("/search", params={"q": "a red circle", "k": 2})
    assert r.status_code == 200
    body = r.json()
    assert body["query"] == "a red circle" and body["k"] == 2 and body["took_ms"] >= 0
    assert [h["caption"] for h in body["results"]] == ["a red circle", "a red circle"]
    assert body["results"][0]["score"] >= body["results"][1]["score"]
    assert all(h["path"].startswith("images/test_red_circle_") for h in body["results"])
    thumb = client.get(body["results"][0]["thumb"])
    assert thumb.status_code == 200 and thumb.headers["content-type"] == "image/png"
    assert max(Image.open(io.BytesIO(thumb.content)).size) <= 256
    post = client.post("/search", json={"q": "a red circle", "k": 2})
    assert post.status_code == 200 and post.json()["results"] == body["results"]
    unknown = client.get("/search", params={"q": "a purple circle"}).json()
    assert unknown["unknown_words"] == ["purple"] and len(unknown["results"]) == 10


@pytest.mark.slow
def test_health_page_and_image_query(client, index_dir):
    h = client.get("/healthz").json()
    assert h["status"] == "ok" and h["pictures"] == 24 and h["captions"] == 48
    assert h["limits"] == {"max_k": 20, "max_query_chars": 64}
    page = client.get("/")
    assert page.status_code == 200 and 'id="q"' in page.text and "/static/app.js" in page.text
    assert client.get("/static/app.js").headers["content-type"].startswith("text/javascript")
    png = (index_dir.parent.parent / "shapes" / "data" / "images" / "test_yellow_triangle_1.png").read_bytes()
    r = client.post("/search/image?k=2", content=png, headers={"content-type": "image/png"})
    assert r.status_code == 200
    assert all("yellow triangle" in hit["caption"] for hit in r.json()["results"])


@pytest.mark.slow
@pytest.mark.parametrize(
    ("params", "status", "message"),
    [
        ({"q": ""}, 422, "the query is empty"),
        ({"q": "   "}, 422, "the query is empty"),
        ({}, 422, "q (the text query) is required"),
        ({"q": "x" * 65}, 422, "the limit is 64"),
        ({"q": "a\x00b"}, 422, "control characters"),
        ({"q": "red", "k": 0}, 422, "k must be between 1 and 20, got 0"),
        ({"q": "red", "k": 10**12}, 422, "k must be between 1 and 20"),
        ({"q": "red", "k": -3}, 422, "k must be between 1 and 20"),
        ({"q": "red", "k": "ten"}, 422, "k must be an integer"),
        ({"q": "red", "k": "2.5"}, 422, "k must be an integer"),
    ],
)
def test_bad_queries_get_clear_4xx(client, params, status, message):
    r = client.get("/search", params=params)
    assert r.status_code == status
    assert message in r.json()["detail"]


@pytest.mark.slow
def test_bad_bodies(client):
    assert client.post("/search", content=b"{not json").status_code == 400
    r = client.post("/search", json=["a red circle"])
    assert r.status_code == 400 and "JSON object" in r.json()["detail"]
    r = client.post("/search", json={"q": "red", "k": 2.5})
    assert r.status_code == 422 and "k must be an integer" in r.json()["detail"]
    r = client.post("/search", json={"q": "red", "k": True})
    assert r.status_code == 422
    r = client.post("/search/image", content=b"\x89PNG garbage", headers={"content-type": "image/png"})
    assert r.status_code == 400 and "not a readable picture" in r.json()["detail"]
    r = client.post("/search/image", content=b"")
    assert r.status_code == 422 and "body is empty" in r.json()["detail"]
    big = b"x" * 200_001
    r = client.post("/search/image", content=big, headers={"content-type": "image/png"})
    assert r.status_code == 413 and "200000 byte limit" in r.json()["detail"]

    def chunks():  # no Content-Length: the cap must hold on the streamed body too
        for _ in range(30):
            yield b"y" * 10_000

    r = client.post("/search/image", content=chunks(), headers={"content-type": "image/png"})
    assert r.status_code == 413


@pytest.mark.slow
@pytest.mark.parametrize(
    "path",
    [
        "/thumb/-1",
        "/thumb/24",
        "/thumb/99999999999999999999",
        "/thumb/abc",
        "/thumb/1.0",
        "/thumb/../../etc/passwd",
        "/thumb/%2e%2e%2f%2e%2e%2fetc%2fpasswd",
        "/thumb/..%2findex.json",
        "/static/../index.json",
        "/static/%2e%2e%2fserver.py",
        "/static/..%2f..%2fsearch%2fserver.py",
        "/static/index.json",
        "/static/",
        "/index.json",
        "/segments/0000/pictures.jsonl",
        "/etc/passwd",
    ],
)
def test_no_path_reaches_files_outside_the_index(client, path):
    r = client.get(path)
    assert r.status_code == 404, (path, r.status_code, r.text[:200])
    assert "root:" not in r.text and "import" not in r.text


@pytest.mark.slow
def test_tampered_metadata_cannot_escape_the_picture_root(index_dir, tmp_path):
    """Even a pictures.jsonl edited to point outside the root (or a symlink out of it) serves nothing."""
    copy = tmp_path / "idx"
    shutil.copytree(index_dir, copy)
    secret = tmp_path / "secret.png"
    Image.new("RGB", (8, 8), (1, 2, 3)).save(secret)
    meta = json.loads((copy / "index.json").read_text())
    root = tmp_path / "root"
    (root / "images").mkdir(parents=True)
    (root / "images" / "link.png").symlink_to(secret)
    meta["roots"] = [str(root)]
    (copy / "index.json").write_text(json.dumps(meta))
    pics = (copy / "segments" / "0000" / "pictures.jsonl").read_text().splitlines()
    pics[0] = json.dumps({"root": 0, "path": "../secret.png", "caption": "x", "id": "x"})
    pics[1] = json.dumps({"root": 0, "path": "images/link.png", "caption": "x", "id": "x"})
    pics[2] = json.dumps({"root": 0, "path": str(secret), "caption": "x", "id": "x"})
    (copy / "segments" / "0000" / "pictures.jsonl").write_text("\n".join(pics) + "\n")
    with TestClient(create_app(copy), base_url=BASE) as c:
        for i in range(3):
            r = c.get(f"/thumb/{i}")
            assert r.status_code == 404 and "no file on this server" in r.json()["detail"]


@pytest.mark.slow
def test_cors_off_by_default_hosts_checked_headers_and_logs(index_dir, caplog):
    logger = logging.getLogger("vsekit.test.search")
    with TestClient(create_app(index_dir, logger=logger), base_url=BASE) as c:
        with caplog.at_level(logging.INFO, logger="vsekit.test.search"):
            r = c.get(
                "/search",
                params={"q": "a secret red circle", "k": 1},
                headers={"origin": "http://evil.example"},
            )
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers  # another site's page
        assert (
            r.headers["x-content-type-options"] == "nosniff"
            and "frame-ancestors 'none'" in r.headers["content-security-policy"]
        )
        pre = c.options(
            "/search", headers={"origin": "http://evil.example", "access-control-request-method": "GET"}
        )
        assert "access-control-allow-origin" not in pre.headers
        assert c.get("/healthz", headers={"host": "evil.example"}).status_code == 400  # DNS rebinding
    lines = [json.loads(rec.getMessage()) for rec in caplog.records if rec.name == "vsekit.test.search"]
    assert (
        lines and lines[0]["path"] == "/search" and lines[0]["status"] == 403 and lines[0]["method"] == "GET"
    )
    assert "secret" not in caplog.text  # queries are not logged
    with TestClient(create_app(index_dir, cors_origins=["http://ok.example"]), base_url=BASE) as c:
        r = c.get("/healthz", headers={"origin": "http://ok.example"})
        assert r.headers["access-control-allow-origin"] == "http://ok.example"
        assert (
            "access-control-allow-origin"
            not in c.get("/healthz", headers={"origin": "http://evil.example"}).headers
        )


@pytest.mark.slow
def test_bench_serve_runs_a_bounded_load_test_against_vse_serve(index_dir):
    """`vse serve` in a child process on a free loopback port: every request answered, then it is stopped."""
    pytest.importorskip("uvicorn")
    from vsekit_lab.bench.search import bench_serve

    res = bench_serve(
        index_dir, requests=40, concurrency=2, max_seconds=60, queries=["a red circle", "a blue square"]
    )
    assert res["requests"] == 40 and res["errors"] == 0, res["first_errors"]
    assert res["requests_per_s"] > 0 and res["p50_ms"] <= res["p99_ms"]
    with pytest.raises(ValueError, match="must be positive"):
        bench_serve(index_dir, requests=0)


@pytest.mark.slow
def test_vse_bench_serve_prints_a_row_with_zero_errors(index_dir, capsys):
    pytest.importorskip("uvicorn")
    from vsekit.cli import main

    assert main(["bench", "serve", str(index_dir), "--requests", "30", "--concurrency", "3"]) == 0
    row = [line for line in capsys.readouterr().out.splitlines() if line.startswith(f"| {index_dir} |")]
    assert len(row) == 1 and row[0].split(" | ")[1:4] == ["30", "3", "0"]  # requests, concurrency, errors
    assert f"`vse bench serve {index_dir} --requests 30 --concurrency 3`" in row[0]
