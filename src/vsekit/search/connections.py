"""How `vse serve` holds HTTP connections: slow or silent clients cannot keep the connection slots.

uvicorn counts every open connection against `limit_concurrency` and answers 503 to new requests once the
count is reached; it has no deadline for a request head, so 64 clients that send half a head and wait would
hold every slot for as long as they like. The protocol here (uvicorn's h11 one, subclassed) adds:

- a deadline for each request head: a connection that has not sent a whole head `head_timeout_s` after it
  opened, or after its previous response, is closed;
- a deadline and a minimum rate for each request body: a body still arriving `body_timeout_s` after its
  head, and later than its bytes so far would take at `body_min_rate` bytes a second, closes the connection
  (a body of 1 MB may take 16 s at the default 64 KiB/s; one byte every 2 s is closed after 10 s);
- when every slot is taken, a new connection closes the connection that has waited longest for a head
  (silent, half a head, or idle between requests) or for a body arriving slower than `body_min_rate`, so
  clients that send requests are served and never see a 503 because of clients that do not. Connections
  whose request is being answered (its body whole, or arriving at the minimum rate) are never closed;
- request smuggling refused (RFC 9112 section 6.1): a request with both Content-Length and Transfer-Encoding
  is answered 400 and its connection closed before the app sees it, so nothing sent after it on that
  connection is read as a request (h11 itself refuses a Transfer-Encoding other than `chunked`, repeated
  Transfer-Encoding headers and Content-Length headers that differ, also with 400 and a close).
"""

from __future__ import annotations

import json
import logging
import time

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from vsekit.errors import VseInputError

HEAD_TIMEOUT_S = 10.0  # nginx waits 60 s; a browser sends a head in one packet
BODY_TIMEOUT_S = 10.0  # every body may take this long, whatever its size
BODY_MIN_RATE = 64 * 1024  # bytes a second a body must keep up beyond BODY_TIMEOUT_S (8 MB: 128 s)
H11_EVENT_BYTES = 16 * 1024  # h11's (and uvicorn's) default cap on a request head
BOTH_LENGTHS = (
    "a request with both Content-Length and Transfer-Encoding is refused and its connection closed "
    "(RFC 9112 section 6.1: request smuggling)"
)


class FramingCheckedConnection(h11.Connection):
    """h11's server side, refusing a request that frames its body twice (Content-Length and
    Transfer-Encoding: a proxy and this server could disagree where it ends), and counting each request's
    body bytes for the body deadline."""

    def __init__(self, max_incomplete_event_size: int) -> None:
        super().__init__(h11.SERVER, max_incomplete_event_size=max_incomplete_event_size)
        self.refusal: str | None = None
        self.body_bytes = 0
        self.body_done = True

    def next_event(self):  # type: ignore[override]
        event = super().next_event()
        if isinstance(event, h11.Request):
            names = {name for name, _ in event.headers}
            if b"content-length" in names and b"transfer-encoding" in names:
                self.refusal = BOTH_LENGTHS
                raise h11.RemoteProtocolError(BOTH_LENGTHS, 400)
            self.body_bytes, self.body_done = 0, False
        elif isinstance(event, h11.Data):
            self.body_bytes += len(event.data)
        elif isinstance(event, h11.EndOfMessage):
            self.body_done = True
        return event


class HeadDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with deadlines on request heads and bodies, a refusal of requests with two
    body framings, and eviction of the longest-waiting connection when the slots are full (module
    docstring); `protocol_class` sets `head_timeout_s`, `body_timeout_s`, `body_min_rate` and `event_log`."""

    head_timeout_s: float = HEAD_TIMEOUT_S
    body_timeout_s: float = BODY_TIMEOUT_S
    body_min_rate: float = BODY_MIN_RATE
    event_log: logging.Logger = logging.getLogger("vsekit.search.server")

    def __init__(self, config, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(config, *args, **kwargs)
        self.conn = FramingCheckedConnection(config.h11_max_incomplete_event_size or H11_EVENT_BYTES)

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.head_waiting_since: float | None = None
        self.head_deadline = None
        self.body_since: float | None = None
        self.body_deadline = None
        super().connection_made(transport)
        self._await_head()
        limit = self.limit_concurrency
        while limit is not None and len(self.connections) >= limit and self._evict_one():
            pass

    def connection_lost(self, exc) -> None:
        self._head_arrived()
        self._body_arrived()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a whole request head was parsed: the request is being answered
            self._head_arrived()
            if not self.conn.body_done:
                self._await_body()
        if self.body_since is not None and self.conn.body_done:
            self._body_arrived()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's 400 and close, saying why when this protocol refused the request."""
        reason, self.conn.refusal = self.conn.refusal, None
        if reason is not None:
            self._log_close("both_content_length_and_transfer_encoding")
        super().send_400_response(reason or msg)

    def on_response_complete(self) -> None:
        self._await_head()  # before the parent: it handles a pipelined request, which disarms this again
        super().on_response_complete()
        if self.transport.is_closing():
            self._head_arrived()

    def _await_head(self) -> None:
        self._head_arrived()
        self.head_waiting_since = time.monotonic()
        self.head_deadline = self.loop.call_later(self.head_timeout_s, self._close, "head_timeout")

    def _head_arrived(self) -> None:
        if self.head_deadline is not None:
            self.head_deadline.cancel()
        self.head_deadline = None
        self.head_waiting_since = None

    def _await_body(self) -> None:
        self._body_arrived()
        self.body_since = time.monotonic()
        self.body_deadline = self.loop.call_later(self.body_timeout_s, self._check_body)

    def _body_arrived(self) -> None:
        if self.body_deadline is not None:
            self.body_deadline.cancel()
        self.body_deadline = None
        self.body_since = None

    def _body_allowed_s(self) -> float:
        """How long the body may have taken so far: `body_timeout_s`, or its bytes at `body_min_rate`."""
        return max(self.body_timeout_s, self.conn.body_bytes / self.body_min_rate)

    def _check_body(self) -> None:
        """At the body deadline: close the connection, unless its bytes so far earned more time (or this
        server paused reading it: the app has not taken what arrived)."""
        self.body_deadline = None
        if self.body_since is None or self.conn.body_done:
            return
        left = self.body_since + self._body_allowed_s() - time.monotonic()
        if self.flow is not None and self.flow.read_paused:
            left = max(left, self.body_timeout_s)
        if left > 0:
            self.body_deadline = self.loop.call_later(left, self._check_body)
        else:
            self._close("body_timeout")

    def _waiting_since(self, now: float) -> float | None:
        """Since when this connection has waited for its client: a request head, or a body arriving slower
        than `body_min_rate`; None when it has a request being answered."""
        if self.head_waiting_since is not None:
            return self.head_waiting_since
        since = self.body_since
        if (
            since is not None
            and not self.conn.body_done
            and self.conn.body_bytes < (now - since) * self.body_min_rate
        ):
            return since
        return None

    def _evict_one(self) -> bool:
        """Close the other connection that has waited longest for a request head or a slow body; False when
        none waits."""
        now = time.monotonic()
        waiting = [
            (since, id(c), c)
            for c in self.connections
            if c is not self
            and isinstance(c, HeadDeadlineProtocol)
            and (since := c._waiting_since(now)) is not None
        ]
        if not waiting:
            return False
        min(waiting, key=lambda w: w[:2])[2]._close("evicted")
        return True

    def _close(self, reason: str) -> None:
        self._head_arrived()
        self._body_arrived()
        self.connections.discard(self)  # the slot is free now, not when the loop reports the close
        if not self.transport.is_closing():
            self.transport.close()
        self._log_close(reason)

    def _log_close(self, reason: str) -> None:
        client = self.client[0] if self.client else None
        event = {
            "ts": round(time.time(), 3),
            "event": "connection_closed",
            "reason": reason,
            "client": client,
        }
        self.event_log.info(json.dumps(event))


def protocol_class(
    head_timeout_s: float = HEAD_TIMEOUT_S,
    logger: logging.Logger | None = None,
    body_timeout_s: float = BODY_TIMEOUT_S,
    body_min_rate: float = BODY_MIN_RATE,
) -> type:
    """`HeadDeadlineProtocol` with these deadlines (seconds, > 0), minimum body rate (bytes/s, > 0) and
    event logger."""
    for name, value in (
        ("head_timeout_s", head_timeout_s),
        ("body_timeout_s", body_timeout_s),
        ("body_min_rate", body_min_rate),
    ):
        if not (value > 0 and value != float("inf")):
            raise VseInputError(f"{name} must be a finite number > 0, got {value}")
    attrs = {
        "head_timeout_s": float(head_timeout_s),
        "body_timeout_s": float(body_timeout_s),
        "body_min_rate": float(body_min_rate),
        "event_log": logger or HeadDeadlineProtocol.event_log,
    }
    return type("HeadDeadlineProtocol", (HeadDeadlineProtocol,), attrs)


def uvicorn_config(
    app,
    host: str,
    port: int,
    *,
    max_connections: int,
    head_timeout_s: float = HEAD_TIMEOUT_S,
    log_level: str = "info",
    logger: logging.Logger | None = None,
    body_timeout_s: float = BODY_TIMEOUT_S,
    body_min_rate: float = BODY_MIN_RATE,
) -> uvicorn.Config:
    """The uvicorn settings `vse serve` runs with: at most `max_connections` open connections (503 beyond,
    only when all of them have a request being answered), request heads within `head_timeout_s`, bodies
    within `body_timeout_s` or at `body_min_rate`, idle keep-alive connections closed after 5 s, no
    websockets, no access log (the app logs each request)."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        access_log=False,
        log_level=log_level,
        ws="none",
        http=protocol_class(head_timeout_s, logger, body_timeout_s, body_min_rate),
        limit_concurrency=max_connections,
        timeout_keep_alive=5,
    )
