"""How `vse serve` holds HTTP connections: slow or silent clients cannot keep the connection slots.

uvicorn counts every open connection against `limit_concurrency` and answers 503 to new requests once the
count is reached; it has no deadline for a request head, so 64 clients that send half a head and wait would
hold every slot for as long as they like. The protocol here (uvicorn's h11 one, subclassed) adds:

- a deadline for each request head: a connection that has not sent a whole head `head_timeout_s` after it
  opened, or after its previous response, is closed;
- when every slot is taken, a new connection closes the connection that has waited longest for a head
  (silent, half a head, or idle between requests), so clients that send requests are served and never see
  a 503 because of clients that do not. Connections whose request is being answered are never closed.
"""

from __future__ import annotations

import json
import logging
import time

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from vsekit.errors import VseInputError

HEAD_TIMEOUT_S = 10.0  # nginx waits 60 s; a browser sends a head in one packet


class HeadDeadlineProtocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline on request heads and eviction of the longest-waiting
    connection when the slots are full (module docstring); `protocol_class` sets `head_timeout_s` and
    `event_log`."""

    head_timeout_s: float = HEAD_TIMEOUT_S
    event_log: logging.Logger = logging.getLogger("vsekit.search.server")

    def connection_made(self, transport) -> None:  # type: ignore[override]
        self.head_waiting_since: float | None = None
        self.head_deadline = None
        super().connection_made(transport)
        self._await_head()
        limit = self.limit_concurrency
        while limit is not None and len(self.connections) >= limit and self._evict_one():
            pass

    def connection_lost(self, exc) -> None:
        self._head_arrived()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a whole request head was parsed: the request is being answered
            self._head_arrived()

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

    def _evict_one(self) -> bool:
        """Close the other connection that has waited longest for a request head; False when none waits."""
        waiting = [
            c
            for c in self.connections
            if c is not self and getattr(c, "head_waiting_since", None) is not None
        ]
        if not waiting:
            return False
        min(waiting, key=lambda c: c.head_waiting_since)._close("evicted")
        return True

    def _close(self, reason: str) -> None:
        self._head_arrived()
        self.connections.discard(self)  # the slot is free now, not when the loop reports the close
        if not self.transport.is_closing():
            self.transport.close()
        client = self.client[0] if self.client else None
        event = {
            "ts": round(time.time(), 3),
            "event": "connection_closed",
            "reason": reason,
            "client": client,
        }
        self.event_log.info(json.dumps(event))


def protocol_class(head_timeout_s: float = HEAD_TIMEOUT_S, logger: logging.Logger | None = None) -> type:
    """`HeadDeadlineProtocol` with this head deadline (seconds, > 0) and event logger."""
    if not head_timeout_s > 0:
        raise VseInputError(f"head_timeout_s must be > 0, got {head_timeout_s}")
    attrs = {"head_timeout_s": float(head_timeout_s), "event_log": logger or HeadDeadlineProtocol.event_log}
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
) -> uvicorn.Config:
    """The uvicorn settings `vse serve` runs with: at most `max_connections` open connections (503 beyond,
    only when all of them have a request being answered), request heads within `head_timeout_s`, idle
    keep-alive connections closed after 5 s, no websockets, no access log (the app logs each request)."""
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        access_log=False,
        log_level=log_level,
        ws="none",
        http=protocol_class(head_timeout_s, logger),
        limit_concurrency=max_connections,
        timeout_keep_alive=5,
    )
