"""`vse serve`: a FastAPI app over one index — JSON API, thumbnails and a small web page.

Safety basics: the CLI binds to 127.0.0.1; Host headers are checked (DNS
rebinding); a request whose Origin is another site's, or whose browser says it comes from another site
(Sec-Fetch-Site: cross-site / same-site, as an `<img src>` of a foreign page does without an Origin), is
refused (403) unless its Origin is named with --cors-origin, so no web page open in the user's browser can
query the server; request bodies are capped (413); k and the
query length are bounded (422 with a message that says the bound); CORS is off unless origins are named;
picture uploads must be sent as image/* (415 otherwise) and are decoded within a memory budget, at most
`decode_slots` at a time (`uploads.py`); request heads and bodies have deadlines, silent or slow
connections cannot hold the connection slots and a request framed twice is refused (`connections.py`); thumbnails are served by picture id only, and a picture's file
must resolve inside the root it was indexed from, so no request can name a path; static files come from a
fixed in-memory set; every response carries nosniff / frame / CSP headers; each request is logged as one
JSON line (method, path, status, ms — never the query text).
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from urllib.parse import urlsplit

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from PIL import Image
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import MutableHeaders
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from vsekit.data.precomp import DataFormatError
from vsekit.search.connections import BODY_MIN_RATE, BODY_TIMEOUT_S, HEAD_TIMEOUT_S
from vsekit.search.engine import SearchEngine
from vsekit.search.uploads import UPLOAD_DECODE_BYTES, UploadRefused, content_type_problem, decode_reduced

SECURITY_HEADERS = {
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "no-referrer",
    "content-security-policy": "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'; "
    "frame-ancestors 'none'; form-action 'self'",
}
STATIC_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
}


@dataclass
class ServerLimits:
    """Bounds on what one request may ask for."""

    max_k: int = 100
    max_query_chars: int = 256
    max_body_bytes: int = 8 << 20  # picture uploads
    thumb_px: int = 256
    thumb_cache: int = 512  # thumbnails kept in memory
    rate_per_s: float = 100.0  # sustained requests per second per client address (0 = no limit)
    rate_burst: int = 200  # requests a client may send at once before the rate applies
    timeout_s: float = 30.0  # a request that takes longer is answered 504 (0 = no timeout)
    head_timeout_s: float = HEAD_TIMEOUT_S  # a connection without a whole request head by then is closed
    body_timeout_s: float = BODY_TIMEOUT_S  # a body may take this long; beyond it, it must keep up ...
    body_min_rate: float = BODY_MIN_RATE  # ... this many bytes a second since its head, else it is closed
    decode_slots: int = 2  # picture uploads decoded at once (each may take up to upload_decode_bytes)
    decode_wait_s: float = 10.0  # an upload that waits longer for a decode slot is answered 503
    upload_decode_bytes: int = UPLOAD_DECODE_BYTES
    query_px: int = 224  # the model's input side when the engine does not say (uploads keep twice this)


class RateLimiter:
    """Token bucket per client address: `burst` requests at once, then `rate` per second; thread-safe.

    Keeps at most `max_clients` buckets (the least recently seen are dropped), so a flood of addresses
    cannot grow memory without bound."""

    def __init__(self, rate: float, burst: int, max_clients: int = 10_000, clock=time.monotonic) -> None:
        self.rate, self.burst, self.max_clients, self.clock = rate, max(1, burst), max_clients, clock
        self.buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self.lock = threading.Lock()

    def allow(self, client: str) -> float:
        """0 when the request may go ahead, else the seconds until it could."""
        if self.rate <= 0:
            return 0.0
        with self.lock:
            now = self.clock()
            tokens, last = self.buckets.pop(client, (float(self.burst), now))
            tokens = min(float(self.burst), tokens + (now - last) * self.rate)
            wait = 0.0 if tokens >= 1.0 else (1.0 - tokens) / self.rate
            self.buckets[client] = (tokens - 1.0 if wait == 0.0 else tokens, now)
            while len(self.buckets) > self.max_clients:
                self.buckets.popitem(last=False)
            return wait


class _BodyTooLarge(Exception):
    pass


def _origin_key(scheme: str, netloc: str) -> str:
    """host[:port] in lower case, without the scheme's default port (browsers omit it in Origin and Host)."""
    netloc = netloc.strip().lower()
    default = {"http": ":80", "https": ":443"}.get(scheme, "")
    return netloc[: -len(default)] if default and netloc.endswith(default) else netloc


OWN_FETCH_SITES = ("same-origin", "none")  # Sec-Fetch-Site of the server's own page, and of a typed URL


def foreign_origin(
    origin: str | None,
    host: str | None,
    allowed: frozenset[str] = frozenset(),
    fetch_site: str | None = None,
) -> bool:
    """True when a request comes from a web page of another site: it has an Origin header (browsers send one
    with every cross-origin request and every POST) that is neither this server's own (scheme://Host) nor
    one of `allowed`, or the browser's `Sec-Fetch-Site` says another site sent it (anything but same-origin
    or none: a foreign page's `<img src>` sends no Origin; same-site is another port of this host, another
    program's page). Clients that send neither header (curl, scripts) are not browsers' pages: False."""
    if "*" in allowed or (origin is not None and origin.strip() in allowed):
        return False
    if fetch_site is not None and fetch_site.strip().lower() not in OWN_FETCH_SITES:
        return True
    if origin is None:
        return False
    try:
        parts = urlsplit(origin.strip())
    except ValueError:
        return True
    if parts.scheme not in ("http", "https") or not parts.netloc or not host:
        return True  # "null" (a sandboxed frame, a file:// page) included
    return _origin_key(parts.scheme, parts.netloc) != _origin_key(parts.scheme, host)


class Guard:
    """Outermost ASGI layer: rate limit, cross-origin refusal, body-size cap, timeout, security headers and
    one structured log line per request."""

    def __init__(
        self,
        app,
        max_body_bytes: int,
        logger: logging.Logger,
        rate_per_s: float = 0.0,
        rate_burst: int = 1,
        timeout_s: float = 0.0,
        allowed_origins: tuple[str, ...] = (),
    ) -> None:
        self.app = app
        self.max_body = max_body_bytes
        self.logger = logger
        self.limiter = RateLimiter(rate_per_s, rate_burst)
        self.timeout = timeout_s
        self.allowed_origins = frozenset(allowed_origins)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        state = {"status": 500, "started": False, "received": 0}

        async def send_wrapper(message) -> None:
            if message["type"] == "http.response.start":
                state["started"] = True
                state["status"] = message["status"]
                headers = MutableHeaders(scope=message)
                for k, v in SECURITY_HEADERS.items():
                    if k not in headers:
                        headers[k] = v
            await send(message)

        async def limited_receive():
            message = await receive()
            if message["type"] == "http.request":
                state["received"] += len(message.get("body", b""))
                if state["received"] > self.max_body:
                    raise _BodyTooLarge
            return message

        too_large = JSONResponse(
            {"detail": f"request body is larger than the {self.max_body} byte limit"}, 413
        )
        client = scope.get("client")
        try:
            headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers") or []}
            length = headers.get("content-length")
            origin = headers.get("origin")
            wait = self.limiter.allow(client[0] if client else "?")
            if wait > 0:
                retry = str(max(1, int(wait + 0.999)))
                await JSONResponse(
                    {"detail": f"too many requests from this address; retry in {retry} s"},
                    429,
                    headers={"retry-after": retry},
                )(scope, receive, send_wrapper)
            elif foreign_origin(
                origin, headers.get("host"), self.allowed_origins, headers.get("sec-fetch-site")
            ):
                sender = (
                    repr(origin[:80])
                    if origin is not None
                    else f"another site (Sec-Fetch-Site: {headers['sec-fetch-site'][:20]!r})"
                )
                why = (
                    f"cross-origin request from {sender} refused: this server answers its own page "
                    "and clients that send no Origin (vse serve --cors-origin ORIGIN allows "
                    "a site)"
                )
                await JSONResponse({"detail": why}, 403)(scope, receive, send_wrapper)
            elif length is not None and not (
                length.isascii() and length.isdigit() and int(length) <= self.max_body
            ):
                await too_large(scope, receive, send_wrapper)
            elif self.timeout > 0:
                await asyncio.wait_for(self.app(scope, limited_receive, send_wrapper), self.timeout)
            else:
                await self.app(scope, limited_receive, send_wrapper)
        except _BodyTooLarge:
            if not state["started"]:
                await too_large(scope, receive, send_wrapper)
        except ClientDisconnect:  # the client left, or its connection was closed at its body deadline
            state["status"] = 499
        except asyncio.TimeoutError:
            if not state["started"]:
                await JSONResponse(
                    {"detail": f"the request took longer than the {self.timeout:g} s limit"}, 504
                )(scope, receive, send_wrapper)
        finally:
            self.logger.info(
                json.dumps(
                    {
                        "ts": round(time.time(), 3),
                        "event": "request",
                        "method": scope.get("method"),
                        "path": scope.get("path"),
                        "status": state["status"],
                        "ms": round((time.perf_counter() - t0) * 1000, 2),
                        "client": client[0] if client else None,
                    }
                )
            )


def json_log_handler(stream=None) -> logging.Handler:
    """A handler that prints the server's JSON log lines as they are (one object per line)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    return handler


def _static_files() -> dict[str, tuple[bytes, str]]:
    """The web page's files, read once; nothing else is ever served as a static file."""
    out = {}
    for entry in (resources.files("vsekit.search") / "static").iterdir():
        suffix = Path(entry.name).suffix
        if entry.is_file() and suffix in STATIC_TYPES:
            out[entry.name] = (entry.read_bytes(), STATIC_TYPES[suffix])
    if "index.html" not in out:
        raise FileNotFoundError("vsekit/search/static/index.html is missing from the installed package")
    return out


def _parse_k(raw, limits: ServerLimits) -> int:
    if raw is None or raw == "":
        return min(10, limits.max_k)
    try:
        if isinstance(raw, (float, bool)) or (
            isinstance(raw, str) and not (raw.isascii() and len(raw) <= 20)
        ):
            raise ValueError
        k = int(raw)
    except (TypeError, ValueError, OverflowError):
        raise HTTPException(
            422, f"k must be an integer between 1 and {limits.max_k}, got {str(raw)[:20]!r}"
        ) from None
    if not 1 <= k <= limits.max_k:
        raise HTTPException(422, f"k must be between 1 and {limits.max_k}, got {k}")
    return k


def _check_query(q, limits: ServerLimits) -> str:
    if not isinstance(q, str):
        raise HTTPException(422, "q (the text query) is required and must be a string")
    q = q.strip()
    if not q:
        raise HTTPException(422, "the query is empty; type a few words describing a picture")
    if len(q) > limits.max_query_chars:
        raise HTTPException(
            422, f"the query is {len(q)} characters long; the limit is {limits.max_query_chars}"
        )
    if any(ord(ch) < 32 for ch in q):
        raise HTTPException(422, "the query contains control characters")
    try:
        q.encode("utf-8")
    except UnicodeEncodeError:
        raise HTTPException(422, "the query is not valid Unicode text (lone surrogate)") from None
    return q


def create_app(
    index_dir: str | Path | SearchEngine,
    *,
    device: str = "cpu",
    run_dir: str | Path | None = None,
    limits: ServerLimits | None = None,
    cors_origins: list[str] | None = None,
    allowed_hosts: list[str] | tuple[str, ...] | None = ("127.0.0.1", "localhost"),
    logger: logging.Logger | None = None,
    shortlist: int | None = None,
) -> FastAPI:
    """The app for one index (or an already opened engine). No module-level state: two apps never share.
    `shortlist`: the candidates a model whose similarity is not an inner product re-scores (`SearchEngine`)."""
    engine = (
        index_dir
        if isinstance(index_dir, SearchEngine)
        else SearchEngine.open(index_dir, device, run_dir=run_dir, shortlist=shortlist)
    )
    limits = limits or ServerLimits()
    logger = logger or logging.getLogger("vsekit.search.server")
    static = _static_files()
    thumbs: OrderedDict[int, bytes] = OrderedDict()
    thumbs_lock = threading.Lock()
    # Uploads are decoded on their own few threads: at most decode_slots at once, and the memory glibc keeps
    # after a decode stays with these threads instead of one malloc arena per request thread.
    decoders = ThreadPoolExecutor(max(1, limits.decode_slots), thread_name_prefix="vse-decode")

    app = FastAPI(title="vsekit search", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        msgs = [
            "{}: {}".format(".".join(str(p) for p in e.get("loc", ())[1:]) or "request", e.get("msg"))
            for e in exc.errors()
        ]
        return JSONResponse({"detail": "; ".join(msgs)}, 422)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse({"detail": exc.detail}, exc.status_code, headers=getattr(exc, "headers", None))

    def input_side() -> int:
        """The side the model reads a query picture at (builds the picture pipeline on first use)."""
        return int(getattr(getattr(engine, "images", None), "image_size", None) or limits.query_px)

    def busy() -> HTTPException:
        why = f"the server is decoding other pictures (waited {limits.decode_wait_s:g} s); try again shortly"
        return HTTPException(503, why, headers={"retry-after": "2"})

    async def decode(data: bytes) -> Image.Image:
        """An upload decoded (uploads.decode_reduced) on one of the `decode_slots` decoder threads: what one
        decode may allocate is bounded, so this bounds the memory of all uploads together."""
        try:
            side = await run_in_threadpool(input_side)
        except ValueError as e:  # e.g. extractor weights that do not match the run's
            raise HTTPException(501, f"picture queries are not available for this index: {e}") from None
        job = decoders.submit(decode_reduced, data, side, limits.upload_decode_bytes)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(job), limits.decode_wait_s)
        except asyncio.TimeoutError:
            raise busy() from None
        except UploadRefused as e:
            raise HTTPException(e.status, str(e)) from None

    def thumbnail_png(path: Path) -> bytes:
        """An indexed picture as a PNG of at most thumb_px a side, decoded like an upload (the formats of
        `vsekit.data.pictures.PICTURE_FORMATS`: a file changed since it was indexed is not trusted), alpha on
        white."""
        im = decode_reduced(path, limits.thumb_px, limits.upload_decode_bytes).convert("RGBA")
        im.thumbnail((limits.thumb_px, limits.thumb_px))
        out = io.BytesIO()
        white = Image.new("RGBA", im.size, (255, 255, 255, 255))
        Image.alpha_composite(white, im).convert("RGB").save(out, format="PNG")
        return out.getvalue()

    def picture_json(pid: int | None) -> dict:
        if pid is None:
            return {"picture": None, "path": None, "thumb": None}
        return {"picture": pid, "path": engine.index.pictures[pid]["path"], "thumb": f"/thumb/{pid}"}

    def text_search(q: str, k: int) -> dict:
        t0 = time.perf_counter()
        hits = engine.search_text(q, k)
        results = [
            {"id": h.id, "score": round(h.score, 6), "caption": h.caption, **picture_json(h.picture)}
            for h in hits
        ]
        return {
            "query": q,
            "k": k,
            "took_ms": round((time.perf_counter() - t0) * 1000, 2),
            "unknown_words": engine.text.unknown_words(q),
            "results": results,
        }

    @app.get("/", include_in_schema=False)
    def page() -> Response:
        body, kind = static["index.html"]
        return Response(body, media_type=kind, headers={"cache-control": "no-cache"})

    @app.get("/static/{name}", include_in_schema=False)
    def static_file(name: str) -> Response:
        if name not in static:
            raise HTTPException(404, "no such file")
        body, kind = static[name]
        return Response(body, media_type=kind, headers={"cache-control": "no-cache"})

    @app.get("/healthz")
    def healthz() -> dict:
        return {
            "status": "ok",
            **engine.info(),
            "limits": {"max_k": limits.max_k, "max_query_chars": limits.max_query_chars},
        }

    @app.get("/search")
    def search_get(q: str | None = None, k: str | None = None) -> dict:
        """Text -> pictures: `/search?q=a+red+apple&k=10`."""
        return text_search(_check_query(q, limits), _parse_k(k, limits))

    @app.post("/search")
    async def search_post(request: Request) -> dict:
        """Text -> pictures with a JSON body {"q": str, "k": int}."""
        try:
            body = json.loads(await request.body() or b"null")
        except (ValueError, RecursionError):  # bad JSON or UTF-8, > 4300-digit ints, deep nesting
            raise HTTPException(400, 'the body must be JSON: {"q": "a red apple", "k": 10}') from None
        if not isinstance(body, dict):
            raise HTTPException(400, 'the body must be a JSON object: {"q": "a red apple", "k": 10}')
        q, k = _check_query(body.get("q"), limits), _parse_k(body.get("k"), limits)
        return await run_in_threadpool(text_search, q, k)

    @app.post("/search/image")
    async def search_image(request: Request, k: str | None = None, target: str | None = None) -> dict:
        """Picture -> indexed captions (`target=captions`, the default) or the indexed pictures most like it
        (`target=images`): the raw picture bytes as the body (PNG, JPEG, …)."""
        kk = _parse_k(k, limits)
        target = target or "captions"
        if target not in ("captions", "images"):
            raise HTTPException(422, f"target must be 'captions' or 'images', got {target[:20]!r}")
        if why := engine.picture_query_problem():  # before the upload is read
            raise HTTPException(501, f"picture queries are not available for this index: {why}")
        if why := content_type_problem(request.headers.get("content-type")):
            raise HTTPException(415, why)
        data = await request.body()
        if not data:
            raise HTTPException(422, "the body is empty; send the picture's bytes")

        t0 = time.perf_counter()
        img = await decode(data)

        def run() -> dict:
            try:
                hits = (
                    engine.search_image_to_images(img, kk)
                    if target == "images"
                    else engine.search_image(img, kk)
                )
            except DataFormatError as e:
                raise HTTPException(400, str(e)) from None
            except ValueError as e:  # e.g. a run without a feature extractor
                raise HTTPException(501, f"picture queries are not available for this index: {e}") from None
            results = [
                {"id": h.id, "score": round(h.score, 6), "caption": h.caption, **picture_json(h.picture)}
                for h in hits
            ]
            return {
                "k": kk,
                "target": target,
                "took_ms": round((time.perf_counter() - t0) * 1000, 2),
                "results": results,
            }

        return await run_in_threadpool(run)

    @app.get("/thumb/{pid}")
    def thumb(pid: str) -> Response:
        """A picture's thumbnail by id (never by path)."""
        if not (pid.isascii() and pid.isdigit()) or len(pid) > 18 or int(pid) >= engine.index.n_pictures:
            raise HTTPException(404, f"no picture with id {pid[:20]!r}")
        i = int(pid)
        with thumbs_lock:
            body = thumbs.get(i)
            if body is not None:
                thumbs.move_to_end(i)
        if body is None:
            path = engine.index.picture_file(i)
            if path is None:
                raise HTTPException(404, f"picture {i} has no file on this server")
            try:
                body = decoders.submit(thumbnail_png, path).result(timeout=limits.decode_wait_s)
            except FutureTimeout:
                raise busy() from None
            except UploadRefused as e:
                why = "is too large to thumbnail" if e.status == 413 else "cannot be read"
                raise HTTPException(404, f"picture {i} {why}") from None
            except (OSError, ValueError):
                raise HTTPException(404, f"picture {i} cannot be read") from None
            with thumbs_lock:
                thumbs[i] = body
                while len(thumbs) > limits.thumb_cache:
                    thumbs.popitem(last=False)
        return Response(body, media_type="image/png", headers={"cache-control": "max-age=3600"})

    if cors_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(cors_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["content-type"],
        )
    if allowed_hosts and "*" not in allowed_hosts:
        from starlette.middleware.trustedhost import TrustedHostMiddleware

        app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(allowed_hosts))
    app.add_middleware(
        Guard,
        max_body_bytes=limits.max_body_bytes,
        logger=logger,
        rate_per_s=limits.rate_per_s,
        rate_burst=limits.rate_burst,
        timeout_s=limits.timeout_s,
        allowed_origins=tuple(cors_origins or ()),
    )
    app.state.engine = engine
    app.state.limits = limits
    return app
