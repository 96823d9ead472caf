"""The reward service's HTTP connections: uvicorn's h11 protocol with per-client bounds, the eviction of
connections slow to send their headers (a slowloris), and parse errors answered as JSON (``server.serve``)."""

from __future__ import annotations

import asyncio
import json
import logging
import math

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("services.reward_service")


class ConnectionTable:
    """One server's open connections counted per client address, and those waiting for a request's headers
    in the order they began to wait (oldest first): what the per-client bound and the eviction of slow
    connections read. Touched only on the server's event loop, so it needs no lock."""

    warn_every_s = 10.0  # evictions and refusals are logged as one summary this often at most: no log flood

    def __init__(self) -> None:
        self.per_client: dict[str, int] = {}
        # a dict keeps insertion order: the oldest waiter first
        self.waiting: dict[ConnectionProtocol, None] = {}
        self._counts: dict[str, int] = {}
        self._last_warning = -math.inf

    def add(self, conn: ConnectionProtocol) -> None:
        self.per_client[conn.client_host] = self.per_client.get(conn.client_host, 0) + 1

    def remove(self, conn: ConnectionProtocol) -> None:
        self.waiting.pop(conn, None)
        left = self.per_client[conn.client_host] - 1
        if left:
            self.per_client[conn.client_host] = left
        else:
            del self.per_client[conn.client_host]

    def start_waiting(self, conn: ConnectionProtocol) -> None:
        self.waiting.pop(conn, None)  # re-inserted: now the newest waiter
        self.waiting[conn] = None

    def stop_waiting(self, conn: ConnectionProtocol) -> None:
        self.waiting.pop(conn, None)

    def oldest_waiting(self, host: str | None = None) -> ConnectionProtocol | None:
        """The connection that has waited longest for request headers (of client address ``host`` if
        given)."""
        return next((conn for conn in self.waiting if host is None or conn.client_host == host), None)

    def note(self, what: str, n: int, now: float) -> None:
        """Count ``n`` connections evicted or refused for reason ``what``; log the counts now and then."""
        self._counts[what] = self._counts.get(what, 0) + n
        if now - self._last_warning >= self.warn_every_s:
            self._last_warning = now
            log.warning("reward service under connection pressure: %s",
                        "; ".join(f"{count} {reason}" for reason, count in self._counts.items()))
            self._counts.clear()


class ConnectionProtocol(H11Protocol):
    """uvicorn's h11 protocol with these changes: a request the HTTP parser rejects is answered as JSON
    naming what was wrong, and the connection is then closed without a TCP reset (``_close_after_draining``);
    a connection that has not sent a request's whole headers within ``header_timeout_s`` of opening (or of its
    last answer) is closed, so a slow client holds nothing; a client address holds at most
    ``max_connections_per_client`` connections; and a request whose headers arrive while the server is at
    ``max_connections`` (uvicorn's ``limit_concurrency``, checked right after the headers) first evicts the
    connections that have waited longest for their headers, so slow clients cannot lock out whole requests.
    A connection answering a request is never evicted. ``table`` (a ``ConnectionTable``) is set per server."""

    header_timeout_s = 5.0
    max_connections_per_client = 32
    table: ConnectionTable
    drain_s = 2.0  # after a rejected request: how long its unread rest is read and dropped before the close
    drain_max_bytes = 2 << 20  # and how many bytes of it at most

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._protocol_error = ""
        self._draining = False
        self._drained_bytes = 0
        self._deadline: asyncio.TimerHandle | None = None
        self._counted = False  # in self.table
        self.client_host = self.client[0] if self.client else ""
        next_event = self.conn.next_event

        def recorded():
            try:
                event = next_event()
            except h11.RemoteProtocolError as e:
                self._protocol_error = str(e)
                raise
            if isinstance(event, h11.Request):  # before uvicorn's limit check, which follows in handle_events
                self._headers_complete()
            return event

        self.conn.next_event = recorded
        if self.table.per_client.get(self.client_host, 0) >= self.max_connections_per_client:
            oldest = self.table.oldest_waiting(self.client_host)
            if oldest is None:  # all of this address's connections are answering requests: refuse this one
                self.table.note(f"connection(s) refused: their client address had max_connections_per_client="
                                f"{self.max_connections_per_client} connections, all answering requests",
                                1, self.loop.time())
                self.connections.discard(self)
                self.transport.close()
                return
            oldest._evict()
            self.table.note(f"connection(s) evicted for a newer one of the same client address (at "
                            f"max_connections_per_client={self.max_connections_per_client}): they had not "
                            "sent their request headers", 1, self.loop.time())
        self._counted = True
        self.table.add(self)
        self._wait_for_headers()

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _wait_for_headers(self) -> None:
        """The next request's headers are due within ``header_timeout_s``; meanwhile the connection may be
        evicted."""
        self._cancel_deadline()
        self._deadline = self.loop.call_later(self.header_timeout_s, self._deadline_passed)
        self.table.start_waiting(self)

    def _headers_complete(self) -> None:
        """A request's headers are in: from here the app's deadline (timeout_s) bounds its body and its
        answer. At the connection limit, the connections that have waited longest for their headers make room
        for it."""
        self._cancel_deadline()
        self.table.stop_waiting(self)
        limit, evicted = self.limit_concurrency, 0
        while limit is not None and len(self.connections) >= limit:
            oldest = self.table.oldest_waiting()
            if oldest is None:  # all are answering requests: uvicorn's 503 stands
                break
            oldest._evict()
            evicted += 1
        if evicted:
            self.table.note("connection(s) evicted to make room for whole requests "
                            f"(at max_connections={limit}): they had not sent their request headers",
                            evicted, self.loop.time())

    def _evict(self) -> None:
        """Close this connection, which waits for request headers, and stop counting it at once: its
        connection_lost, which would, comes only on a later turn of the event loop."""
        self._forget()
        self.connections.discard(self)
        self._cancel_deadline()
        self.transport.close()

    def _forget(self) -> None:
        if self._counted:
            self._counted = False
            self.table.remove(self)

    def _deadline_passed(self) -> None:
        # armed only while waiting for headers: a request being answered is never cut here
        self._deadline = None
        if not self.transport.is_closing():
            log.debug("reward service: closing a connection that sent no whole request headers in %.1fs",
                      self.header_timeout_s)
            self.transport.close()

    def connection_lost(self, exc) -> None:
        self._cancel_deadline()
        self._forget()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self._wait_for_headers()  # before uvicorn's, which may read a pipelined request's headers at once
        super().on_response_complete()

    def send_400_response(self, msg: str) -> None:
        body = json.dumps({"error": f"invalid HTTP request: {self._protocol_error or msg}"}).encode()
        # a Content-Length: else h11, which never saw a valid request, ends the answer by closing the
        # connection
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self._close_after_draining()

    def _close_after_draining(self) -> None:
        """Close the connection after its answer without a TCP reset.

        Closing the socket at once while bytes of the request are still unread (its body, sent after the
        headers and landing after the server's read: a loaded machine) makes the kernel send a reset instead
        of a FIN, and a client still reading the answer, or still sending, gets ConnectionResetError instead
        of the answer's end: the suite's flake under load. So the write side is shut (a FIN after the answer)
        and what the client still sends is read and dropped until it closes its side, for at most ``drain_s``
        and ``drain_max_bytes``; past either the connection is closed anyway."""
        self._draining = True
        self.table.stop_waiting(self)  # answered: not evicted, bounded by the drain
        self._cancel_deadline()
        self._deadline = self.loop.call_later(self.drain_s, self.transport.close)
        self.transport.resume_reading()  # flow control may have paused reading; the drain must read
        if self.transport.can_write_eof():
            self.transport.write_eof()  # after the buffered answer; the client's end then closes ours
        else:
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._draining:  # the rest of a rejected request: dropped
            self._drained_bytes += len(data)
            if self._drained_bytes > self.drain_max_bytes:
                self.transport.close()
            return
        super().data_received(data)

