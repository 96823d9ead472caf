"""A remote reward service over HTTP + JSON (FastAPI on uvicorn), and its client, so a reward model or
function can run outside the training job; ``reward.kind: remote`` makes a job's reward actors use it.

Server: ``serve(reward_fn, ...)`` runs the app on uvicorn in a background thread and returns a handle
with ``.url``, ``.port`` and ``.close()``.

* ``POST /score`` with ``{"prompts": [str, ...], "completions": [str, ...], "fields": [{...}, ...]}``
  returns ``{"scores": [float, ...]}``; ``fields`` (one JSON object per sample: a dataset row's other
  fields) is optional. ``GET /health`` returns ``{"ok": true}``. Errors are ``{"error": "<message>"}``
  with a 4xx/5xx status; a reward function's exception text goes to the service's log, never to the client.
* JSON only, never pickle: a request must say ``Content-Type: application/json`` (else 415).
* Bounded: the body by ``max_request_bytes`` (413; no Content-Length is 411, an invalid one 400), the batch
  by ``max_batch`` (413), and each request by one overall deadline of ``timeout_s`` from the end of its
  headers: reading its body (408), waiting for a reward slot (503) and the reward call (504). A connection
  that has not sent a request's whole headers within ``header_timeout_s`` (5 s; ``max(timeout_s, 1)`` if
  shorter) of opening or of its last answer is closed, so a slow client holds nothing for long. Open
  connections are bounded by ``max_connections_per_client`` per client address (a new one evicts that
  address's oldest connection still waiting for headers, else it is closed unanswered) and by
  ``max_connections`` in all: a request whose headers arrive at that limit evicts the connections that have
  waited longest for their headers (slow clients: a slowloris) and is served; only when every connection
  is answering a request is it refused (503). A connection answering a request is never evicted. At most
  ``max_concurrent`` reward calls run at once, a timed-out one included until it really returns.
* Binds to 127.0.0.1 by default. Binding to anything but a loopback address needs a bearer ``token``
  (ValueError otherwise) of at least ``MIN_TOKEN_CHARS`` characters. With a token, every request must
  carry ``Authorization: Bearer <token>`` (401), compared in constant time. The server speaks plain
  HTTP: off loopback, put it behind TLS (or an SSH tunnel) so the token and data are not sent in the clear.

Client: ``RewardClient(url, token=None, timeout_s=30.0, max_retries=0).score(prompts, completions,
fields=None)`` returns one finite float per sample and raises ``RewardServiceError`` (with ``.status`` and
the server's message) otherwise. A timeout, a lost connection or a 5xx is retried ``max_retries`` times
with exponential backoff; a 4xx or a malformed answer is not. It never follows redirects, so the token
goes only to the URL given, and it ignores proxy settings of the environment.

CLI: ``python -m services.reward_service`` serves, in one command, one of
* ``--task randomwalks``: a task's reward;
* ``--function package.module:function``: ``function(prompt=..., completion=..., **fields)`` per sample, the
  signature of a dataset job's ``task.reward_function`` (a sample without a field it needs is a 400);
* ``--model PATH_OR_HUB_ID [--label L]``: a sequence-classification reward model, scored as the reward actors
  score it (services/reward_models.py);
* ``--judge judge.yaml``: an LLM judge on vLLM, the ``reward.judge`` section of a job (services/judge.py).
A model and a judge batch dynamically: requests that arrive together are scored in one forward of at most
``--max-batch-tokens`` tokens, on ``--device`` (cuda where there is one). The token, if any, comes from the
environment (``--token-env``, default ``TETHER_REWARD_TOKEN``) or a file (``--token-file``), never from the
command line, where other users could read it.
"""

from __future__ import annotations

import argparse
import asyncio
import hmac
import inspect
import ipaddress
import json
import logging
import math
import os
import signal
import socket
import sys
import threading
import urllib.parse
import uuid
from collections.abc import Callable, Sequence
from typing import Self

import h11
import httpx
import tenacity
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger(__name__)

# reward_fn(prompts, completions) or reward_fn(prompts, completions, fields)
RewardFn = Callable[..., Sequence[float]]

MIN_TOKEN_CHARS = 16  # a bearer token shorter than this is refused: it could be guessed
_MAX_MESSAGE_CHARS = 2000  # an error message is cut to this length


class RewardServiceError(RuntimeError):
    """The reward service answered with an error, an invalid answer, or could not be reached.

    ``status`` is the HTTP status (None when no HTTP answer came back); ``message`` the server's message.
    """

    def __init__(self, status: int | None, message: str, url: str = "") -> None:
        self.status, self.message, self.url = status, message, url
        where = f" from {url}" if url else ""
        prefix = f"HTTP {status}" if status is not None else "no HTTP answer"
        super().__init__(f"reward service{where}: {prefix}: {message}")

    @property
    def transient(self) -> bool:
        """A timeout, a lost connection or a 5xx: worth another try. A 4xx or a bad answer is not."""
        return self.status is None or self.status >= 500


# ---------------------------------------------------------------------------------------------- server


def is_loopback(host: str) -> bool:
    """True for 'localhost' and loopback IP literals (127.0.0.0/8, ::1); False for anything else,
    including '' and '0.0.0.0' (all interfaces) and host names, which may resolve anywhere."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class _HTTPError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status, self.message = status, message


def _error(status: int, message: str) -> JSONResponse:
    headers = {"Cache-Control": "no-store"}
    if status == 401:
        headers["WWW-Authenticate"] = 'Bearer realm="tether-reward"'
    return JSONResponse({"error": message[:_MAX_MESSAGE_CHARS]}, status_code=status, headers=headers)


def _takes_fields(fn: RewardFn) -> bool:
    """Whether ``fn`` takes a third argument (the samples' fields) besides prompts and completions."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return False
    if any(p.kind is p.VAR_POSITIONAL or p.name == "fields" for p in params):
        return True
    return len([p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]) >= 3


def _validate_request(payload: object, max_batch: int) -> tuple[list[str], list[str], list[dict]]:
    if not isinstance(payload, dict):
        raise _HTTPError(400, f"request body must be a JSON object, got {type(payload).__name__}")
    unknown = sorted(set(payload) - {"prompts", "completions", "fields"})
    if unknown:
        raise _HTTPError(400, f"unknown field(s) {unknown}; expected only 'prompts', 'completions' and 'fields'")
    lists = {}
    for name in ("prompts", "completions"):
        if name not in payload:
            raise _HTTPError(400, f"missing field {name!r} (a list of strings)")
        value = payload[name]
        if not isinstance(value, list):
            raise _HTTPError(400, f"field {name!r} must be a list of strings, got {type(value).__name__}")
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise _HTTPError(400, f"{name}[{i}] must be a string, got {type(item).__name__}")
        lists[name] = value
    prompts, completions = lists["prompts"], lists["completions"]
    if len(prompts) != len(completions):
        raise _HTTPError(
            400, f"'prompts' and 'completions' differ in length: {len(prompts)} prompts, {len(completions)} completions"
        )
    fields = payload.get("fields", [{} for _ in prompts])
    if not isinstance(fields, list) or len(fields) != len(prompts):
        raise _HTTPError(400, f"field 'fields' must be a list of {len(prompts)} JSON objects (one per sample)")
    for i, item in enumerate(fields):
        if not isinstance(item, dict):
            raise _HTTPError(400, f"fields[{i}] must be a JSON object, got {type(item).__name__}")
    if len(prompts) > max_batch:
        raise _HTTPError(413, f"batch of {len(prompts)} samples exceeds max_batch={max_batch}")
    return prompts, completions, fields


def _validate_scores(scores: object, n: int) -> list[float]:
    """One finite float per sample, or a 500 naming the first bad sample index."""
    if isinstance(scores, (str, bytes, dict)) or not hasattr(scores, "__len__"):
        raise _HTTPError(500, f"reward function returned {type(scores).__name__}, not a sequence of {n} scores")
    try:
        values = list(scores)
    except TypeError:
        raise _HTTPError(500, "reward function returned an unreadable sequence") from None
    if len(values) != n:
        index = min(len(values), n)
        detail = f"sample index {index} has no score" if len(values) < n else f"extra score at index {index}"
        raise _HTTPError(500, f"reward function returned {len(values)} scores for {n} samples ({detail})")
    out = []
    for i, value in enumerate(values):
        if isinstance(value, (bool, str, bytes)):
            raise _HTTPError(500, f"reward function returned a {type(value).__name__} for sample index {i}; "
                                  "expected a number")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise _HTTPError(
                500, f"reward function returned {type(value).__name__} for sample index {i}; expected a number"
            ) from None
        if not math.isfinite(number):
            raise _HTTPError(500, f"reward function returned non-finite score {number} for sample index {i}")
        out.append(number)
    return out


class _Limiter:
    """Runs the reward function on its own thread, at most ``slots`` at a time, until a deadline.

    A timed-out call cannot be killed; it keeps its slot until it returns, so a hung reward function
    holds at most ``slots`` threads, and later requests get 503 instead of piling up more."""

    def __init__(self, fn: RewardFn, timeout_s: float, slots: int) -> None:
        self.fn, self.timeout_s, self.n_slots = fn, timeout_s, slots
        self.takes_fields = _takes_fields(fn)
        self.slots: asyncio.Semaphore | None = None  # made on the server's event loop

    async def __call__(self, prompts: list[str], completions: list[str], fields: list[dict], deadline: float):
        if self.takes_fields:
            args = (prompts, completions, fields)
        else:
            named = sorted({k for f in fields for k in f})
            if named:
                raise _HTTPError(400, f"this service's reward function takes no fields; the request sent {named}")
            args = (prompts, completions)
        loop = asyncio.get_running_loop()
        if self.slots is None:
            self.slots = asyncio.Semaphore(self.n_slots)
        slots = self.slots
        try:
            await asyncio.wait_for(slots.acquire(), max(0.0, deadline - loop.time()))
        except TimeoutError:
            raise _HTTPError(503, f"reward service busy: no reward slot freed within timeout_s={self.timeout_s}") from None
        future = loop.create_future()

        def settle(value: object, error: BaseException | None) -> None:
            slots.release()
            if not future.done():
                future.set_exception(error) if error is not None else future.set_result(value)

        def work() -> None:
            value, error = None, None
            try:
                value = self.fn(*args)
            except BaseException as e:  # noqa: BLE001 - logged, answered as a 500
                error = e
            try:
                loop.call_soon_threadsafe(settle, value, error)
            except RuntimeError:  # the server stopped meanwhile: nobody waits for this answer
                pass

        try:
            threading.Thread(target=work, name="reward-fn", daemon=True).start()
        except BaseException:
            slots.release()
            raise
        try:
            return await asyncio.wait_for(asyncio.shield(future), max(0.0, deadline - loop.time()))
        except TimeoutError:
            raise _HTTPError(504, f"reward function did not return within timeout_s={self.timeout_s}") from None
        except _HTTPError:  # the reward refused the request itself (a sample without a field it needs)
            raise
        except Exception as e:
            incident = uuid.uuid4().hex[:12]
            log.error("reward function raised (incident %s)", incident, exc_info=e)
            raise _HTTPError(500, f"reward function raised {type(e).__name__}; its message is in the reward "
                                  f"service's log (incident {incident})") from None


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not valid JSON")


def build_app(reward_fn: RewardFn, token: str | None = None, max_request_bytes: int = 1 << 20,
              max_batch: int = 256, timeout_s: float = 30.0, max_concurrent: int = 4) -> FastAPI:
    """The reward service as a FastAPI app (what ``serve`` runs on uvicorn)."""
    limiter = _Limiter(reward_fn, float(timeout_s), max_concurrent)
    expected = token.encode() if token is not None else None
    app = FastAPI(title="tether reward service", docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def guard(request: Request, call_next):
        """Bearer token first (every path, an unknown one included), then the route; every error a JSON
        ``{"error": ...}``, an unexpected one logged and answered without its text."""
        try:
            if expected is not None:
                header = request.headers.get("authorization")
                if header is None:
                    raise _HTTPError(401, "missing Authorization header; expected 'Authorization: Bearer <token>'")
                scheme, _, presented = header.partition(" ")
                if scheme.lower() != "bearer" or not presented:
                    raise _HTTPError(401, "Authorization header must be 'Bearer <token>'")
                if not hmac.compare_digest(presented.strip().encode("latin-1", "replace"), expected):
                    raise _HTTPError(401, "invalid bearer token")
            return await call_next(request)
        except _HTTPError as e:
            if e.status >= 500:
                log.warning("reward service %s %s -> %d: %s", request.method, request.url.path, e.status, e.message)
            return _error(e.status, e.message)
        except Exception:
            incident = uuid.uuid4().hex[:12]
            log.exception("reward service: internal error (incident %s)", incident)
            return _error(500, f"internal error; see the reward service's log (incident {incident})")

    @app.exception_handler(StarletteHTTPException)
    async def routing_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        path = request.url.path
        if exc.status_code == 404:
            return _error(404, f"no such endpoint {path!r}; endpoints: POST /score, GET /health")
        if exc.status_code == 405:
            allowed = "POST" if path == "/score" else "GET"
            return _error(405, f"{request.method} {path} is not allowed; use {allowed}")
        return _error(exc.status_code, str(exc.detail))

    @app.exception_handler(_HTTPError)
    async def service_error(request: Request, exc: _HTTPError) -> JSONResponse:
        if exc.status >= 500:
            log.warning("reward service %s %s -> %d: %s", request.method, request.url.path, exc.status, exc.message)
        return _error(exc.status, exc.message)

    @app.get("/health")
    async def health() -> dict:
        return {"ok": True}

    async def read_json(request: Request) -> object:
        if request.headers.get("transfer-encoding") is not None:
            raise _HTTPError(411, "Transfer-Encoding is not supported; send a Content-Length")
        content_type = request.headers.get("content-type")
        media_type = (content_type or "").split(";", 1)[0].strip().lower()
        if media_type != "application/json":
            raise _HTTPError(415, f"Content-Type must be application/json, got {content_type!r}")
        lengths = request.headers.getlist("content-length")
        if not lengths:
            raise _HTTPError(411, "Content-Length header is required")
        length = int(lengths[0])  # h11 has checked it: digits only, all copies equal
        if length > max_request_bytes:
            raise _HTTPError(413, f"request body of {length} bytes exceeds max_request_bytes={max_request_bytes}")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_request_bytes:
                raise _HTTPError(413, f"request body exceeds max_request_bytes={max_request_bytes}")
        try:
            text = bytes(body).decode("utf-8")
        except UnicodeDecodeError as e:
            raise _HTTPError(400, f"request body is not valid UTF-8 (byte {e.start})") from None
        try:
            return json.loads(text, parse_constant=_reject_constant)
        except ValueError as e:
            raise _HTTPError(400, f"request body is not valid JSON: {e}") from None
        except RecursionError:
            raise _HTTPError(400, "request body is not valid JSON: nested too deeply") from None

    @app.post("/score")
    async def score(request: Request) -> dict:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            async with asyncio.timeout_at(deadline):
                payload = await read_json(request)
        except TimeoutError:
            raise _HTTPError(408, f"request body not received within timeout_s={timeout_s}") from None
        prompts, completions, fields = _validate_request(payload, max_batch)
        if not prompts:
            return {"scores": []}
        return {"scores": _validate_scores(await limiter(prompts, completions, fields, deadline), len(prompts))}

    return app


class _ConnectionTable:
    """One server's open connections counted per client address, and those waiting for a request's headers
    in the order they began to wait (oldest first): what the per-client bound and the eviction of slow
    connections read. Touched only on the server's event loop, so it needs no lock."""

    warn_every_s = 10.0  # evictions and refusals are logged as one summary this often at most: no log flood

    def __init__(self) -> None:
        self.per_client: dict[str, int] = {}
        self.waiting: dict[_Protocol, None] = {}  # a dict keeps insertion order: the oldest waiter first
        self._counts: dict[str, int] = {}
        self._last_warning = -math.inf

    def add(self, conn: _Protocol) -> None:
        self.per_client[conn.client_host] = self.per_client.get(conn.client_host, 0) + 1

    def remove(self, conn: _Protocol) -> None:
        self.waiting.pop(conn, None)
        left = self.per_client[conn.client_host] - 1
        if left:
            self.per_client[conn.client_host] = left
        else:
            del self.per_client[conn.client_host]

    def start_waiting(self, conn: _Protocol) -> None:
        self.waiting.pop(conn, None)  # re-inserted: now the newest waiter
        self.waiting[conn] = None

    def stop_waiting(self, conn: _Protocol) -> None:
        self.waiting.pop(conn, None)

    def oldest_waiting(self, host: str | None = None) -> _Protocol | None:
        """The connection that has waited longest for request headers (of client address ``host`` if given)."""
        return next((conn for conn in self.waiting if host is None or conn.client_host == host), None)

    def note(self, what: str, n: int, now: float) -> None:
        """Count ``n`` connections evicted or refused for reason ``what``; log the counts now and then."""
        self._counts[what] = self._counts.get(what, 0) + n
        if now - self._last_warning >= self.warn_every_s:
            self._last_warning = now
            log.warning("reward service under connection pressure: %s",
                        "; ".join(f"{count} {reason}" for reason, count in self._counts.items()))
            self._counts.clear()


class _Protocol(H11Protocol):
    """uvicorn's h11 protocol with these changes: a request the HTTP parser rejects is answered as JSON
    naming what was wrong, and the connection is then closed without a TCP reset (``_close_after_draining``);
    a connection that has not sent a request's whole headers within ``header_timeout_s`` of opening (or of its
    last answer) is closed, so a slow client holds nothing; a client address holds at most
    ``max_connections_per_client`` connections; and a request whose headers arrive while the server is at
    ``max_connections`` (uvicorn's ``limit_concurrency``, checked right after the headers) first evicts the
    connections that have waited longest for their headers, so slow clients cannot lock out whole requests.
    A connection answering a request is never evicted. ``table`` (a ``_ConnectionTable``) is set per server."""

    header_timeout_s = 5.0
    max_connections_per_client = 32
    table: _ConnectionTable
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
                            f"max_connections_per_client={self.max_connections_per_client}): they had not sent "
                            "their request headers", 1, self.loop.time())
        self._counted = True
        self.table.add(self)
        self._wait_for_headers()

    def _cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _wait_for_headers(self) -> None:
        """The next request's headers are due within ``header_timeout_s``; meanwhile the connection may be evicted."""
        self._cancel_deadline()
        self._deadline = self.loop.call_later(self.header_timeout_s, self._deadline_passed)
        self.table.start_waiting(self)

    def _headers_complete(self) -> None:
        """A request's headers are in: from here the app's deadline (timeout_s) bounds its body and its answer.
        At the connection limit, the connections that have waited longest for their headers make room for it."""
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
            self.table.note(f"connection(s) evicted to make room for whole requests (at max_connections={limit}): "
                            "they had not sent their request headers", evicted, self.loop.time())

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
        self._deadline = None  # armed only while waiting for headers: a request being answered is never cut here
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
        # a Content-Length: else h11, which never saw a valid request, ends the answer by closing the connection
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                   (b"connection", b"close")]
        for event in (h11.Response(status_code=400, headers=headers, reason=b"Bad Request"), h11.Data(data=body),
                      h11.EndOfMessage()):
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


class RewardServer:
    """A running reward service: ``url``, ``host``, ``port``; ``close()`` stops it (also as a context manager)."""

    def __init__(self, server: uvicorn.Server, sock: socket.socket, host: str) -> None:
        self._server, self._sock = server, sock
        self.host = host
        self.port: int = sock.getsockname()[1]
        url_host = f"[{host}]" if ":" in host else host
        self.url = f"http://{url_host}:{self.port}"
        self._thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]},
                                        name=f"reward-service:{self.port}", daemon=True)
        self._closed = False
        self._thread.start()
        while not server.started and self._thread.is_alive():
            self._thread.join(0.02)
        if not server.started:
            sock.close()
            raise RuntimeError(f"the reward service on {self.url} did not start (see the log above)")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RewardServer(url={self.url!r})"


def check_token(token: str | None, host: str) -> None:
    """Refuse a token too short or not fit for a header, and a non-loopback ``host`` without one."""
    if token is not None:
        if not isinstance(token, str) or len(token.strip()) < MIN_TOKEN_CHARS:
            raise ValueError(f"token must be a string of at least {MIN_TOKEN_CHARS} characters (or None on a "
                             "loopback address): a shorter one can be guessed")
        if not (token.isascii() and token.isprintable() and " " not in token):
            raise ValueError("token must be printable ASCII without spaces (it travels in an HTTP header)")
    if not is_loopback(host) and token is None:
        raise ValueError(
            f"refusing to bind the reward service to {host!r} without a token: anything but a loopback "
            "address (127.0.0.1, ::1, localhost) needs token=... (and, off a trusted network, TLS in front)"
        )


def serve(
    reward_fn: RewardFn,
    host: str = "127.0.0.1",
    port: int = 0,
    token: str | None = None,
    max_request_bytes: int = 1 << 20,
    max_batch: int = 256,
    timeout_s: float = 30.0,
    *,
    max_concurrent: int = 4,
    max_connections: int = 64,
    header_timeout_s: float = 5.0,
    # a job's reward actors each hold one keep-alive connection, and the actors of one node share its address:
    # 32 is more than a node runs, yet one address (a slowloris) holds at most half of the default max_connections
    max_connections_per_client: int = 32,
) -> RewardServer:
    """Serve ``reward_fn(prompts, completions[, fields]) -> scores`` over HTTP in a background thread.

    ``port=0`` picks a free port (read it from the handle). Binding to a non-loopback ``host`` requires
    a ``token``; a token, when given, is required on every request. A connection that has not sent a request's
    whole headers within ``header_timeout_s`` (or ``max(timeout_s, 1)`` if shorter) of opening or of its last
    answer is closed; a client address holds at most ``max_connections_per_client`` connections."""
    if not callable(reward_fn):
        raise TypeError(f"reward_fn must be callable, got {type(reward_fn).__name__}")
    check_token(token, host)
    for name, value in (("max_request_bytes", max_request_bytes), ("max_batch", max_batch),
                        ("max_concurrent", max_concurrent), ("max_connections", max_connections),
                        ("max_connections_per_client", max_connections_per_client)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    for name, value in (("timeout_s", timeout_s), ("header_timeout_s", header_timeout_s)):
        if isinstance(value, bool) or not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    app = build_app(reward_fn, token, max_request_bytes, max_batch, float(timeout_s), max_concurrent)
    request_timeout_s = max(float(timeout_s), 1.0)
    # the header deadline never exceeds the request deadline: a client that sends nothing whole holds nothing
    # longer; a rejected request's rest is drained for at most the request deadline, and at most a whole
    # accepted request plus what socket buffers hold in flight
    protocol = type("RewardProtocol", (_Protocol,), {"header_timeout_s": min(float(header_timeout_s),
                                                                             request_timeout_s),
                                                     "max_connections_per_client": max_connections_per_client,
                                                     "table": _ConnectionTable(),
                                                     "drain_s": min(_Protocol.drain_s, request_timeout_s),
                                                     "drain_max_bytes": max_request_bytes + (1 << 20)})
    bind_host = host.strip("[]")
    sock = socket.socket(socket.AF_INET6 if ":" in bind_host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((bind_host, port))
    # backlog: a burst of connects (a slowloris opening or reopening hundreds) must not fill the accept queue,
    # where the kernel drops a real client's SYN and its connect is retried only a second later
    config = uvicorn.Config(app, http=protocol, ws="none", lifespan="off", log_config=None, access_log=False,
                            server_header=False, date_header=False, timeout_keep_alive=5,
                            limit_concurrency=max_connections, backlog=1024)
    server = RewardServer(uvicorn.Server(config), sock, bind_host)
    log.info("reward service listening on %s (token %s)", server.url, "required" if token else "off")
    return server


# ---------------------------------------------------------------------------------------------- client


class RewardClient:
    """Scores (prompt, completion, fields) samples on a remote reward service."""

    def __init__(self, url: str, token: str | None = None, timeout_s: float = 30.0, max_retries: int = 0) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"reward service url must be http(s)://host:port, got {url!r}")
        if parts.username or parts.password:
            raise ValueError("put the token in token=..., not in the url")
        if token is not None and (not isinstance(token, str) or not token.strip()):
            raise ValueError("token must be a non-empty string or None")
        if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        if not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries must be an integer >= 0, got {max_retries!r}")
        self.url = url.rstrip("/")
        self.token, self.timeout_s, self.max_retries = token, float(timeout_s), max_retries
        headers = {"Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        self._http = httpx.Client(timeout=self.timeout_s, headers=headers, follow_redirects=False,
                                  trust_env=False)

    def __repr__(self) -> str:  # never shows the token
        return (f"RewardClient(url={self.url!r}, token={'set' if self.token else None}, "
                f"timeout_s={self.timeout_s}, max_retries={self.max_retries})")

    def close(self) -> None:
        self._http.close()

    def _request(self, method: str, path: str, payload: dict | None = None) -> dict:
        """One request; the answer's JSON object, or RewardServiceError."""
        endpoint = f"{self.url}{path}"
        body = None if payload is None else json.dumps(payload, allow_nan=False).encode()
        headers = {"Content-Type": "application/json"} if body is not None else {}
        try:
            response = self._http.request(method, endpoint, content=body, headers=headers)
        except httpx.TimeoutException:
            raise RewardServiceError(None, f"no answer within timeout_s={self.timeout_s}", endpoint) from None
        except httpx.HTTPError as e:
            raise RewardServiceError(None, f"request failed: {type(e).__name__}: {e}", endpoint) from None
        text = response.content.decode("utf-8", "replace")
        try:
            decoded = json.loads(text, parse_constant=_reject_constant)
        except (ValueError, RecursionError):
            decoded = None
        decoded = decoded if isinstance(decoded, dict) else None
        if response.status_code != 200:
            message = decoded.get("error") if decoded and isinstance(decoded.get("error"), str) else text[:500]
            raise RewardServiceError(response.status_code, message or "(empty body)", endpoint)
        if decoded is None:
            raise RewardServiceError(200, f"answer is not a JSON object: {text[:200]!r}", endpoint)
        return decoded

    def _with_retries(self, call: Callable[[], dict]) -> dict:
        """``call()``, retried on a timeout, a lost connection or a 5xx with exponential backoff."""
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(lambda e: isinstance(e, RewardServiceError) and e.transient),
            stop=tenacity.stop_after_attempt(self.max_retries + 1),
            wait=tenacity.wait_exponential_jitter(multiplier=0.5, max=30.0),
            before_sleep=lambda state: log.warning("reward service: attempt %d failed (%s); retrying",
                                                   state.attempt_number, state.outcome.exception()),
            reraise=True,
        )
        return retrying(call)

    def health(self) -> bool:
        return self._with_retries(lambda: self._request("GET", "/health")).get("ok") is True

    def score(self, prompts: Sequence[str], completions: Sequence[str],
              fields: Sequence[dict] | None = None) -> list[float]:
        """One finite float per (prompt, completion[, fields]) sample, in order."""
        prompts, completions = list(prompts), list(completions)
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        for name, items in (("prompts", prompts), ("completions", completions)):
            for i, item in enumerate(items):
                if not isinstance(item, str):
                    raise TypeError(f"{name}[{i}] must be a string, got {type(item).__name__}")
        payload: dict = {"prompts": prompts, "completions": completions}
        if fields is not None:
            fields = list(fields)
            if len(fields) != len(prompts) or not all(isinstance(f, dict) for f in fields):
                raise ValueError(f"fields must be {len(prompts)} dicts, one per sample")
            payload["fields"] = fields
        answer = self._with_retries(lambda: self._request("POST", "/score", payload))
        endpoint = f"{self.url}/score"
        scores = answer.get("scores")
        if not isinstance(scores, list):
            raise RewardServiceError(200, f"answer has no 'scores' list: {json.dumps(answer)[:200]!r}", endpoint)
        if len(scores) != len(prompts):
            raise RewardServiceError(200, f"got {len(scores)} scores for {len(prompts)} samples", endpoint)
        out = []
        for i, value in enumerate(scores):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise RewardServiceError(200, f"score for sample index {i} is {value!r}, not a finite number",
                                         endpoint)
            out.append(float(value))
        return out

    __call__ = score


# ---------------------------------------------------------------------------------------------- CLI


def _read_token(args: argparse.Namespace) -> str | None:
    if args.token_file:
        with open(args.token_file, encoding="utf-8") as f:
            token = f.read().strip()
        if not token:
            raise SystemExit(f"--token-file {args.token_file} is empty")
        return token
    token = os.environ.get(args.token_env, "").strip()
    return token or None


def per_sample(function: Callable, name: str) -> RewardFn:
    """``function(prompt=..., completion=..., **row fields) -> score`` (a dataset job's task.reward_function) as
    the service's batch reward; a sample whose fields the function cannot take is a 400 naming them."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: called as it is
        parameters = None
    takes_any = parameters is None or any(p.kind is p.VAR_KEYWORD for p in parameters)
    named = {p.name for p in parameters or () if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if parameters is not None and not ({"prompt", "completion"} <= named or takes_any):
        raise ValueError(f"--function {name} cannot be called as {name}(prompt=..., completion=..., **fields): "
                         f"it takes ({', '.join(sorted(named))})")
    required = sorted(p.name for p in parameters or () if p.default is p.empty
                      and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in ("prompt", "completion"))

    def reward(prompts: list[str], completions: list[str], fields: list[dict]) -> list:
        for i, sample in enumerate(fields):
            missing = [f for f in required if f not in sample]
            unknown = [] if takes_any else sorted(set(sample) - named)
            if missing or unknown:
                problem = f"lacks {missing}" if missing else f"has field(s) {unknown} it does not take"
                raise _HTTPError(400, f"sample {i}: {name} needs the fields {required}; this sample {problem}")
        return [function(prompt=p, completion=c, **f) for p, c, f in zip(prompts, completions, fields, strict=True)]

    return reward


def _judge_config(path: str):
    """The judge section of a YAML file: a job config's ``reward.judge``, or the section alone."""
    from services.config import JudgeConfig, read_yaml

    data = read_yaml(path)
    section = data.get("reward", {}).get("judge") if isinstance(data.get("reward"), dict) else data
    if section is None:
        raise ValueError(f"--judge {path}: the job config there has no reward.judge section")
    return JudgeConfig.model_validate(section)


def build_reward(args: argparse.Namespace) -> tuple[RewardFn, str]:
    """The reward the command line names, and how to say what is served; ValueError naming a bad option."""
    device = args.device or ("cuda" if _cuda() else "cpu")
    if args.task:
        from services.tasks import get_task

        task = get_task(args.task) if args.task_seed is None else get_task(args.task, seed=args.task_seed)
        return task.reward, f"task {args.task!r} reward"
    if args.function:
        from services.tasks.dataset import import_reward_function

        function = import_reward_function(args.function, "--function")
        return per_sample(function, args.function), f"function {args.function}"
    from services.reward_models import ScoreBatcher

    if args.model:
        from services.reward_models import SequenceClassifierReward

        model = SequenceClassifierReward(args.model, args.label, device, f"reward model {args.model} (--model)")
        batcher = ScoreBatcher(model.score_batch, model.count_tokens, args.max_batch_tokens)
        return batcher, f"reward model {args.model} on {device} (batches of up to {args.max_batch_tokens} tokens)"
    from services.judge import Judge

    cfg = _judge_config(args.judge)
    judge = Judge(cfg, cfg.model_path, device, cfg.engine_args(1.0 if device == "cuda" else 0.0))
    return (judged_reward(judge, args.max_batch_tokens),
            f"judge {cfg.model_path} on {device} (batches of up to {args.max_batch_tokens} tokens)")


def judged_reward(judge, max_batch_tokens: int):
    """A ``services.judge.Judge`` as the service's reward, batched; a sample without a field its template
    names is a 400, and each call's unparseable answers are logged."""
    from services.reward_models import ScoreBatcher

    def judged(prompts: list[str], completions: list[str], fields: list[dict]) -> list[float]:
        try:
            return judge(prompts, completions, fields)
        except ValueError as err:  # a sample without a field the template names
            raise _HTTPError(400, str(err)) from None
        finally:
            judge.take_counts()  # logs the unparseable answers of this call

    return ScoreBatcher(judged, judge.count_tokens, max_batch_tokens)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m services.reward_service",
                                     description="Serve a reward over HTTP (JSON): a task's, your function, a "
                                                 "reward model or an LLM judge.")
    served = parser.add_mutually_exclusive_group(required=True)
    served.add_argument("--task", help="a task's reward, e.g. randomwalks")
    served.add_argument("--function", help="package.module:function called as function(prompt=..., completion=..., "
                                           "**fields) per sample: a dataset job's task.reward_function")
    served.add_argument("--model", help="a Hugging Face sequence-classification reward model (dir or hub id); "
                                        "its logit of --label is the score")
    served.add_argument("--judge", help="a YAML file with an LLM judge's settings: the reward.judge section "
                                        "(or a job config that has one)")
    parser.add_argument("--task-seed", type=int, default=None, help="the task's seed (task.seed of the job)")
    parser.add_argument("--label", default=None, help="--model: the label whose logit is the score (index or "
                                                      "name); required when the model has more than one")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="--model, --judge: where the model runs (default: cuda when there is one)")
    parser.add_argument("--max-batch-tokens", type=int, default=16384,
                        help="--model, --judge: requests that arrive together are scored in one forward of up "
                             "to this many tokens")
    parser.add_argument("--host", default="127.0.0.1",
                        help="bind address (default 127.0.0.1; anything else needs a token)")
    parser.add_argument("--port", type=int, default=8000, help="port (0 picks a free one)")
    parser.add_argument("--token-env", default="TETHER_REWARD_TOKEN",
                        help="environment variable holding the bearer token (default TETHER_REWARD_TOKEN)")
    parser.add_argument("--token-file", default=None, help="file holding the bearer token (overrides --token-env)")
    parser.add_argument("--max-request-bytes", type=int, default=1 << 20)
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--timeout-s", type=float, default=30.0, help="overall deadline of one request")
    parser.add_argument("--max-concurrent", type=int, default=4, help="reward calls at once")
    parser.add_argument("--max-connections", type=int, default=64, help="open connections at once")
    parser.add_argument("--max-connections-per-client", type=int, default=32, help="open connections per client "
                        "address")
    parser.add_argument("--header-timeout-s", type=float, default=5.0,
                        help="close a connection that has not sent a request's whole headers in this long")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    for option, value in (("--label", args.label), ("--device", args.device)):
        if value is not None and not (args.model or (args.judge and option == "--device")):
            parser.error(f"{option} applies to " + ("--model" if option == "--label" else "--model and --judge"))
    if args.task_seed is not None and not args.task:
        parser.error("--task-seed applies to --task")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.log_level.upper() != "DEBUG":  # uvicorn's start and stop lines say nothing the line below does not
        logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
    try:
        reward, served_name = build_reward(args)  # a bad option fails here, before the port opens
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):  # before the URL is printed: whoever reads it may stop us at once
        signal.signal(sig, lambda *_: stop.set())
    try:
        server = serve(reward, host=args.host, port=args.port, token=_read_token(args),
                       max_request_bytes=args.max_request_bytes, max_batch=args.max_batch,
                       timeout_s=args.timeout_s, max_concurrent=args.max_concurrent,
                       max_connections=args.max_connections,
                       max_connections_per_client=args.max_connections_per_client,
                       header_timeout_s=args.header_timeout_s)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"serving {served_name} at {server.url} (POST /score, GET /health)", flush=True)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
