"""Hostile requests against `vse serve`: oversized bodies, path traversal, huge k, malformed JSON.

The server layer is tested over a stub engine (no model, no index), so these run in a second; the
end-to-end API over a real index is in test_search_api.py. Every answer must be a 4xx with a message,
never a 500 or a file from outside the index.
"""

import json
import logging
from types import SimpleNamespace

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
from fastapi.testclient import TestClient  # noqa: E402

from vsekit.search.engine import Hit, SearchEngine  # noqa: E402
from vsekit.search.server import ServerLimits, create_app  # noqa: E402

BASE = "http://127.0.0.1"
LIMITS = ServerLimits(max_k=20, max_query_chars=64, max_body_bytes=10_000)


class StubEngine(SearchEngine):
    """Answers like an index of 3 pictures without files; records the k it was asked for."""

    def __init__(self) -> None:  # no model, no index: only what the server reads
        self.index = SimpleNamespace(
            n_pictures=3, pictures=[{"path": f"p{i}.png"} for i in range(3)], picture_file=lambda i: None
        )
        self.text = SimpleNamespace(unknown_words=lambda q: [])
        self.asked: list[int] = []

    def search_text(self, query: str, k: int = 10) -> list[Hit]:
        self.asked.append(k)
        return [Hit(i, 1.0 - i / 10, f"p{i}.png", None, f"caption {i}", i) for i in range(min(k, 3))]

    def search_image(self, image, k: int = 10, distinct: bool = True) -> list[Hit]:
        self.asked.append(k)
        return []

    def info(self) -> dict:
        return {"pictures": 3}


@pytest.fixture
def engine():
    return StubEngine()


@pytest.fixture
def client(engine):
    app = create_app(engine, limits=LIMITS, logger=logging.getLogger("vsekit.test.hardening"))
    with TestClient(app, base_url=BASE, raise_server_exceptions=False) as c:
        yield c


def _clear_4xx(r, status: int, text: str) -> None:
    assert r.status_code == status, (r.status_code, r.text[:200])
    assert text in r.json()["detail"]


def test_oversized_bodies_are_refused_before_they_are_read(client, engine):
    _clear_4xx(
        client.post("/search", content=b"{" + b" " * 20_000 + b"}"), 413, "larger than the 10000 byte limit"
    )
    _clear_4xx(client.post("/search/image", content=b"x" * 10_001), 413, "10000 byte limit")

    def stream():  # chunked, no Content-Length: counted as it arrives
        for _ in range(50):
            yield b"z" * 1000

    _clear_4xx(client.post("/search", content=stream()), 413, "byte limit")
    r = client.post("/search", content=b'{"q": "x"}', headers={"content-length": str(10**30)})
    assert r.status_code == 413
    assert engine.asked == []  # nothing reached the engine


@pytest.mark.parametrize(
    "path",
    [
        "/thumb/../../etc/passwd",
        "/thumb/%2e%2e%2fetc%2fpasswd",
        "/thumb/..%2f..%2fetc%2fpasswd",
        "/thumb/-1",
        "/thumb/3",
        "/thumb/" + "9" * 40,
        "/thumb/0x1",
        "/thumb/1.0",
        "/thumb/%00",
        "/static/..%2fserver.py",
        "/static/%2e%2e/%2e%2e/etc/passwd",
        "/static/server.py",
        "/static/.%2fserver.py",
        "/..%2f..%2fetc%2fpasswd",
        "/index.json",
        "//etc/passwd",
    ],
)
def test_path_traversal_reaches_nothing(client, path):
    r = client.get(path)
    assert r.status_code == 404, (path, r.status_code)
    assert "root:" not in r.text and "import" not in r.text


@pytest.mark.parametrize(
    "k, message",
    [
        (0, "between 1 and 20"),
        (21, "between 1 and 20"),
        (10**18, "between 1 and 20"),
        ("9" * 100, "between 1 and 20"),
        (-1, "between 1 and 20"),
        (2.5, "must be an integer"),
        ("1e3", "must be an integer"),
        (True, "must be an integer"),
        ([3], "must be an integer"),
        ({"k": 3}, "must be an integer"),
        ("NaN", "must be an integer"),
    ],
)
def test_huge_or_ill_typed_k_is_bounded(client, engine, k, message):
    _clear_4xx(client.post("/search", json={"q": "a cat", "k": k}), 422, message)
    if not isinstance(k, (list, dict)):
        _clear_4xx(client.get("/search", params={"q": "a cat", "k": str(k)}), 422, "k must be")
        _clear_4xx(client.post(f"/search/image?k={k}", content=b"\x89PNG"), 422, "k must be")
    assert engine.asked == []
    r = client.post("/search", json={"q": "a cat", "k": 20})
    assert r.status_code == 200 and engine.asked == [20]


@pytest.mark.parametrize(
    "body, status, message",
    [
        (b"{not json", 400, "must be JSON"),
        (b"", 400, "JSON object"),
        (b"null", 400, "JSON object"),
        (b'["a cat"]', 400, "JSON object"),
        (b'"a cat"', 400, "JSON object"),
        (b'{"q": "\xff\xfe"}', 400, "must be JSON"),
        (b'{"q": 3}', 422, "must be a string"),
        (b'{"q": ["a"]}', 422, "must be a string"),
        (b'{"k": 3}', 422, "required"),
        (b'{"q": "   "}', 422, "query is empty"),
        (b'{"q": "a\\u0000b"}', 422, "control characters"),
        (json.dumps({"q": "w" * 65}).encode(), 422, "the limit is 64"),
    ],
)
def test_malformed_json_bodies(client, engine, body, status, message):
    _clear_4xx(
        client.post("/search", content=body, headers={"content-type": "application/json"}), status, message
    )
    assert engine.asked == []


def test_wrong_methods_and_hosts(client):
    assert client.put("/search").status_code == 405
    assert client.delete("/thumb/0").status_code == 405
    assert client.get("/healthz", headers={"host": "attacker.example"}).status_code == 400
    r = client.get("/search", params={"q": "a cat"}, headers={"origin": "http://attacker.example"})
    assert (
        r.status_code == 403 and "access-control-allow-origin" not in r.headers
    )  # tests/test_server_limits.py


# Requests that were answered 500 before search/server.py was hardened (regression tests).


def test_non_ascii_digit_picture_id_is_404(client):
    assert client.get("/thumb/\u00b2").status_code == 404  # '²'.isdigit() is True but int('²') raises


def test_deeply_nested_json_is_400(client):
    r = client.post("/search", content=b'{"q": "a", "x": ' + b"[" * 3000 + b"]" * 3000 + b"}")
    assert r.status_code == 400  # json.loads raises RecursionError


@pytest.mark.parametrize("raw", [b"1e999", b"9" * 5000])  # inf -> OverflowError; > 4300 digits -> ValueError
def test_unrepresentable_k_is_4xx(client, raw):
    r = client.post("/search", content=b'{"q": "a", "k": ' + raw + b"}")
    assert 400 <= r.status_code < 500


def test_lone_surrogate_query_is_4xx(client):
    r = client.post("/search", content=b'{"q": "\\ud800"}')  # valid JSON, not encodable as UTF-8
    assert 400 <= r.status_code < 500


def test_rate_limit_answers_429_with_retry_after_and_refills(engine):
    from vsekit.search.server import RateLimiter

    limits = ServerLimits(max_k=20, rate_per_s=1.0, rate_burst=3)
    app = create_app(engine, limits=limits, logger=logging.getLogger("vsekit.test.hardening"))
    with TestClient(app, base_url=BASE, raise_server_exceptions=False) as c:
        codes = [c.get("/search", params={"q": "a cat"}).status_code for _ in range(5)]
        assert codes == [200, 200, 200, 429, 429]
        r = c.get("/healthz")
        assert (
            r.status_code == 429
            and r.headers["retry-after"] == "1"
            and "too many requests" in r.json()["detail"]
        )
    assert len(engine.asked) == 3  # refused requests never reach the engine
    now = [0.0]
    bucket = RateLimiter(rate=2.0, burst=2, max_clients=2, clock=lambda: now[0])
    assert [bucket.allow("a") for _ in range(3)] == [
        0.0,
        0.0,
        0.5,
    ]  # token arithmetic on binary fractions: exact
    now[0] = 0.5  # one token back after 1 / rate seconds
    assert bucket.allow("a") == 0.0 and bucket.allow("a") > 0
    bucket.allow("b"), bucket.allow("c")
    assert list(bucket.buckets) == ["b", "c"]  # bounded memory: the oldest client was dropped
    assert RateLimiter(rate=0, burst=1).allow("x") == 0.0  # 0 = no limit


def test_slow_request_is_answered_504(engine):
    import time as _time

    def slow_search(query, k=10):
        _time.sleep(1.0)
        return []

    engine.search_text = slow_search
    limits = ServerLimits(max_k=20, timeout_s=0.2)
    app = create_app(engine, limits=limits, logger=logging.getLogger("vsekit.test.hardening"))
    with TestClient(app, base_url=BASE, raise_server_exceptions=False) as c:
        r = c.get("/search", params={"q": "a cat"})
        assert r.status_code == 504 and "0.2 s limit" in r.json()["detail"]
        assert c.get("/healthz").status_code == 200  # the server keeps answering
