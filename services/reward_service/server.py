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
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import ipaddress
import json
import logging
import math
import socket
import threading
import uuid
from collections.abc import Callable, Sequence
from typing import Self

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from services.errors import TetherError
from services.reward_service.client import reject_constant
from services.reward_service.connections import ConnectionProtocol, ConnectionTable

log = logging.getLogger("services.reward_service")

# reward_fn(prompts, completions) or reward_fn(prompts, completions, fields)
RewardFn = Callable[..., Sequence[float]]

MIN_TOKEN_CHARS = 16  # a bearer token shorter than this is refused: it could be guessed
_MAX_MESSAGE_CHARS = 2000  # an error message is cut to this length


def is_loopback(host: str) -> bool:
    """True for 'localhost' and loopback IP literals (127.0.0.0/8, ::1); False for anything else,
    including '' and '0.0.0.0' (all interfaces) and host names, which may resolve anywhere."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class HTTPError(TetherError):
    """A request the service refuses, answered with ``status`` and ``{\"error\": message}``."""

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
        raise HTTPError(400, f"request body must be a JSON object, got {type(payload).__name__}")
    unknown = sorted(set(payload) - {"prompts", "completions", "fields"})
    if unknown:
        raise HTTPError(400, f"unknown field(s) {unknown}; expected only 'prompts', 'completions' "
                             "and 'fields'")
    lists = {}
    for name in ("prompts", "completions"):
        if name not in payload:
            raise HTTPError(400, f"missing field {name!r} (a list of strings)")
        value = payload[name]
        if not isinstance(value, list):
            raise HTTPError(400, f"field {name!r} must be a list of strings, got {type(value).__name__}")
        for i, item in enumerate(value):
            if not isinstance(item, str):
                raise HTTPError(400, f"{name}[{i}] must be a string, got {type(item).__name__}")
        lists[name] = value
    prompts, completions = lists["prompts"], lists["completions"]
    if len(prompts) != len(completions):
        raise HTTPError(
            400, f"'prompts' and 'completions' differ in length: {len(prompts)} prompts, {len(completions)} "
                 "completions"
        )
    fields = payload.get("fields", [{} for _ in prompts])
    if not isinstance(fields, list) or len(fields) != len(prompts):
        raise HTTPError(400, f"field 'fields' must be a list of {len(prompts)} JSON objects (one per sample)")
    for i, item in enumerate(fields):
        if not isinstance(item, dict):
            raise HTTPError(400, f"fields[{i}] must be a JSON object, got {type(item).__name__}")
    if len(prompts) > max_batch:
        raise HTTPError(413, f"batch of {len(prompts)} samples exceeds max_batch={max_batch}")
    return prompts, completions, fields


def _validate_scores(scores: object, n: int) -> list[float]:
    """One finite float per sample, or a 500 naming the first bad sample index."""
    if isinstance(scores, (str, bytes, dict)) or not hasattr(scores, "__len__"):
        raise HTTPError(500, f"reward function returned {type(scores).__name__}, "
                             f"not a sequence of {n} scores")
    try:
        values = list(scores)
    except TypeError:
        raise HTTPError(500, "reward function returned an unreadable sequence") from None
    if len(values) != n:
        index = min(len(values), n)
        detail = f"sample index {index} has no score" if len(values) < n else f"extra score at index {index}"
        raise HTTPError(500, f"reward function returned {len(values)} scores for {n} samples ({detail})")
    out = []
    for i, value in enumerate(values):
        if isinstance(value, (bool, str, bytes)):
            raise HTTPError(500, f"reward function returned a {type(value).__name__} for sample index {i}; "
                                  "expected a number")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise HTTPError(
                500, f"reward function returned {type(value).__name__} for sample index {i}; expected a "
                     "number"
            ) from None
        if not math.isfinite(number):
            raise HTTPError(500, f"reward function returned non-finite score {number} for sample index {i}")
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
                raise HTTPError(400, "this service's reward function takes no fields; "
                                     f"the request sent {named}")
            args = (prompts, completions)
        loop = asyncio.get_running_loop()
        if self.slots is None:
            self.slots = asyncio.Semaphore(self.n_slots)
        slots = self.slots
        try:
            await asyncio.wait_for(slots.acquire(), max(0.0, deadline - loop.time()))
        except TimeoutError:
            raise HTTPError(503, "reward service busy: no reward slot freed within "
                                 f"timeout_s={self.timeout_s}") from None
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
            raise HTTPError(504, "reward function did not return within "
                                 f"timeout_s={self.timeout_s}") from None
        except HTTPError:  # the reward refused the request itself (a sample without a field it needs)
            raise
        except Exception as e:
            incident = uuid.uuid4().hex[:12]
            log.error("reward function raised (incident %s)", incident, exc_info=e)
            raise HTTPError(500, f"reward function raised {type(e).__name__}; its message is in the reward "
                                  f"service's log (incident {incident})") from None


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
                    raise HTTPError(401, "missing Authorization header; "
                                         "expected 'Authorization: Bearer <token>'")
                scheme, _, presented = header.partition(" ")
                if scheme.lower() != "bearer" or not presented:
                    raise HTTPError(401, "Authorization header must be 'Bearer <token>'")
                if not hmac.compare_digest(presented.strip().encode("latin-1", "replace"), expected):
                    raise HTTPError(401, "invalid bearer token")
            return await call_next(request)
        except HTTPError as e:
            if e.status >= 500:
                log.warning("reward service %s %s -> %d: %s", request.method, request.url.path, e.status,
                            e.message)
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

    @app.exception_handler(HTTPError)
    async def service_error(request: Request, exc: HTTPError) -> JSONResponse:
        if exc.status >= 500:
            log.warning("reward service %s %s -> %d: %s", request.method, request.url.path, exc.status,
                        exc.message)
        return _error(exc.status, exc.message)

    @app.get("/health")
    async def health() -> dict:
        return {"ok": True}

    async def read_json(request: Request) -> object:
        if request.headers.get("transfer-encoding") is not None:
            raise HTTPError(411, "Transfer-Encoding is not supported; send a Content-Length")
        content_type = request.headers.get("content-type")
        media_type = (content_type or "").split(";", 1)[0].strip().lower()
        if media_type != "application/json":
            raise HTTPError(415, f"Content-Type must be application/json, got {content_type!r}")
        lengths = request.headers.getlist("content-length")
        if not lengths:
            raise HTTPError(411, "Content-Length header is required")
        length = int(lengths[0])  # h11 has checked it: digits only, all copies equal
        if length > max_request_bytes:
            raise HTTPError(413, f"request body of {length} bytes exceeds "
                                 f"max_request_bytes={max_request_bytes}")
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > max_request_bytes:
                raise HTTPError(413, f"request body exceeds max_request_bytes={max_request_bytes}")
        try:
            text = bytes(body).decode("utf-8")
        except UnicodeDecodeError as e:
            raise HTTPError(400, f"request body is not valid UTF-8 (byte {e.start})") from None
        try:
            return json.loads(text, parse_constant=reject_constant)
        except ValueError as e:
            raise HTTPError(400, f"request body is not valid JSON: {e}") from None
        except RecursionError:
            raise HTTPError(400, "request body is not valid JSON: nested too deeply") from None

    @app.post("/score")
    async def score(request: Request) -> dict:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        try:
            async with asyncio.timeout_at(deadline):
                payload = await read_json(request)
        except TimeoutError:
            raise HTTPError(408, f"request body not received within timeout_s={timeout_s}") from None
        prompts, completions, fields = _validate_request(payload, max_batch)
        if not prompts:
            return {"scores": []}
        return {"scores": _validate_scores(await limiter(prompts, completions, fields, deadline),
                                           len(prompts))}

    return app


class RewardServer:
    """A running reward service: ``url``, ``host``, ``port``; ``close()`` stops it (also as a context
    manager)."""

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
    # 32 is more than a node runs, yet one address (a slowloris) holds at most half of the default
    # max_connections
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
        if isinstance(value, bool) or not (isinstance(value, (int, float)) and math.isfinite(value)
                                           and value > 0):
            raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
    app = build_app(reward_fn, token, max_request_bytes, max_batch, float(timeout_s), max_concurrent)
    request_timeout_s = max(float(timeout_s), 1.0)
    # the header deadline never exceeds the request deadline: a client that sends nothing whole holds nothing
    # longer; a rejected request's rest is drained for at most the request deadline, and at most a whole
    # accepted request plus what socket buffers hold in flight
    protocol = type("RewardProtocol", (ConnectionProtocol,),
                    {"header_timeout_s": min(float(header_timeout_s), request_timeout_s),
                     "max_connections_per_client": max_connections_per_client,
                     "table": ConnectionTable(),
                     "drain_s": min(ConnectionProtocol.drain_s, request_timeout_s),
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
