"""A remote reward service over HTTP + JSON, and its client, so a reward model or function can run
outside the training job.

Server: ``serve(reward_fn, ...)`` runs a small threaded HTTP server (standard library only) in a
background thread and returns a handle with ``.url``, ``.port`` and ``.close()``.

* ``POST /score`` with ``{"prompts": [str, ...], "completions": [str, ...]}`` returns
  ``{"scores": [float, ...]}``; ``GET /health`` returns ``{"ok": true}``. Errors are
  ``{"error": "<message>"}`` with a 4xx/5xx status.
* JSON only, never pickle: a request must say ``Content-Type: application/json`` (else 415).
* Bounded: the body by ``max_request_bytes`` (413; no or an invalid Content-Length is 411 / 400), the batch
  by ``max_batch`` (413), and the reward call by ``timeout_s`` (504). At most ``max_concurrent`` reward
  calls run at once, a timed-out one included until it really returns (503 when none frees in time).
* Binds to 127.0.0.1 by default. Binding to anything but a loopback address needs a bearer ``token``
  (ValueError otherwise). With a token, every request must carry ``Authorization: Bearer <token>`` (401).
  The server speaks plain HTTP: off loopback, put it behind TLS (or an SSH tunnel) so the token and data
  are not sent in the clear.

Client: ``RewardClient(url, token=None, timeout_s=30.0).score(prompts, completions)`` returns one finite
float per sample and raises ``RewardServiceError`` (with ``.status`` and the server's message) otherwise.
It never follows redirects, so the token goes only to the URL given.

CLI: ``python -m services.reward_service --task randomwalks --port 8000`` serves a task's reward. The token,
if any, comes from the environment (``--token-env``, default ``TETHER_REWARD_TOKEN``) or a file
(``--token-file``), never from the command line, where other users could read it.
"""

from __future__ import annotations

import argparse
import hmac
import http.client
import ipaddress
import json
import logging
import math
import os
import re
import signal
import socket
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Self

log = logging.getLogger(__name__)

RewardFn = Callable[[list[str], list[str]], Sequence[float]]

_DIGITS = re.compile(r"[0-9]+")
_LINGER_BYTES = 1 << 20  # after an early error reply, read and drop at most this much of the unread body
_LINGER_S = 1.0  # ... for at most this long, so the client can read the reply before the connection closes
_MAX_MESSAGE_CHARS = 2000  # an error message from the reward function is cut to this length


class RewardServiceError(RuntimeError):
    """The reward service answered with an error, an invalid answer, or could not be reached.

    ``status`` is the HTTP status (None when no HTTP answer came back); ``message`` the server's message.
    """

    def __init__(self, status: int | None, message: str, url: str = "") -> None:
        self.status, self.message, self.url = status, message, url
        where = f" from {url}" if url else ""
        prefix = f"HTTP {status}" if status is not None else "no HTTP answer"
        super().__init__(f"reward service{where}: {prefix}: {message}")


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


def _validate_request(payload: object, max_batch: int) -> tuple[list[str], list[str]]:
    if not isinstance(payload, dict):
        raise _HTTPError(400, f"request body must be a JSON object, got {type(payload).__name__}")
    unknown = sorted(set(payload) - {"prompts", "completions"})
    if unknown:
        raise _HTTPError(400, f"unknown field(s) {unknown}; expected only 'prompts' and 'completions'")
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
    if len(prompts) > max_batch:
        raise _HTTPError(413, f"batch of {len(prompts)} samples exceeds max_batch={max_batch}")
    return prompts, completions


def _validate_scores(scores: object, n: int) -> list[float]:
    """One finite float per sample, or a 500 naming the first bad sample index."""
    if isinstance(scores, (str, bytes, dict)) or not hasattr(scores, "__len__"):
        raise _HTTPError(500, f"reward function returned {type(scores).__name__}, not a sequence of {n} scores")
    try:
        values = list(scores)
    except TypeError as e:
        raise _HTTPError(500, f"reward function returned an unreadable sequence: {e}") from None
    if len(values) != n:
        index = min(len(values), n)
        detail = f"sample index {index} has no score" if len(values) < n else f"extra score at index {index}"
        raise _HTTPError(500, f"reward function returned {len(values)} scores for {n} samples ({detail})")
    out = []
    for i, value in enumerate(values):
        if isinstance(value, (bool, str, bytes)):
            raise _HTTPError(500, f"reward function returned {value!r} for sample index {i}; expected a number")
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
    """Runs the reward function on its own thread with a deadline, at most ``slots`` at a time.

    A timed-out call cannot be killed; it keeps its slot until it returns, so a hung reward function
    holds at most ``slots`` threads, and later requests get 503 instead of piling up more."""

    def __init__(self, fn: RewardFn, timeout_s: float, slots: int) -> None:
        self.fn, self.timeout_s = fn, timeout_s
        self.slots = threading.BoundedSemaphore(slots)

    def __call__(self, prompts: list[str], completions: list[str]) -> object:
        deadline = time.monotonic() + self.timeout_s
        if not self.slots.acquire(timeout=self.timeout_s):
            raise _HTTPError(503, f"reward service busy: no reward slot freed within timeout_s={self.timeout_s}")
        done = threading.Event()
        box: dict[str, object] = {}

        def work() -> None:
            try:
                box["value"] = self.fn(prompts, completions)
            except BaseException as e:  # noqa: BLE001 - reported to the client as a 500
                box["error"] = e
            finally:
                self.slots.release()
                done.set()

        try:
            threading.Thread(target=work, name="reward-fn", daemon=True).start()
        except BaseException:
            self.slots.release()
            raise
        if not done.wait(max(0.0, deadline - time.monotonic())):
            raise _HTTPError(504, f"reward function did not return within timeout_s={self.timeout_s}")
        if "error" in box:
            e = box["error"]
            message = f"reward function raised {type(e).__name__}: {e}"
            raise _HTTPError(500, message[:_MAX_MESSAGE_CHARS])
        return box["value"]


class _Handler(BaseHTTPRequestHandler):
    server_version = "tether-reward/1"
    sys_version = ""
    protocol_version = "HTTP/1.0"  # one request per connection: no keep-alive state to get wrong
    server: _RewardHTTPServer

    # ----- plumbing

    def setup(self) -> None:
        self.timeout = self.server.io_timeout_s  # bounds every socket read/write (slow clients)
        super().setup()
        self._body_read = False

    def log_message(self, format: str, *args) -> None:
        log.debug("%s - %s", self.address_string(), format % args)

    def _reply(self, status: int, payload: dict) -> None:
        body = json.dumps(payload, allow_nan=False).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        if status == 401:
            self.send_header("WWW-Authenticate", 'Bearer realm="tether-reward"')
        self.send_header("Connection", "close")
        self.end_headers()
        try:
            self.wfile.write(body)
            self.wfile.flush()
        except OSError:  # the client went away: nothing left to tell it
            self.close_connection = True
            return
        if not self._body_read and self._has_body():
            self._linger()

    def _has_body(self) -> bool:
        length = (self.headers.get("Content-Length") or "").strip()
        return self.headers.get("Transfer-Encoding") is not None or (bool(length) and length != "0")

    def _linger(self) -> None:
        """Replied without reading the body: half-close and drop what the client still sends (bounded),
        so closing with unread data does not reset the connection before the client reads the reply."""
        try:
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(_LINGER_S)
            deadline, dropped = time.monotonic() + _LINGER_S, 0
            while dropped < _LINGER_BYTES and time.monotonic() < deadline:
                chunk = self.connection.recv(65536)
                if not chunk:
                    break
                dropped += len(chunk)
        except OSError:
            pass
        self.close_connection = True

    def _run(self, handler: Callable[[], dict]) -> None:
        try:
            self._check_auth()
            payload = handler()
            self._reply(200, payload)
        except _HTTPError as e:
            if e.status >= 500:
                log.warning("reward service %s %s -> %d: %s", self.command, self.path, e.status, e.message)
            self._reply(e.status, {"error": e.message})
        except (TimeoutError, ConnectionError):
            self.close_connection = True
        except Exception as e:
            log.exception("reward service: internal error")
            self._reply(500, {"error": f"internal error: {type(e).__name__}: {e}"[:_MAX_MESSAGE_CHARS]})

    # ----- checks

    def _check_auth(self) -> None:
        token = self.server.token
        if token is None:
            return
        header = self.headers.get("Authorization")
        if header is None:
            raise _HTTPError(401, "missing Authorization header; expected 'Authorization: Bearer <token>'")
        scheme, _, presented = header.partition(" ")
        if scheme.lower() != "bearer" or not presented:
            raise _HTTPError(401, "Authorization header must be 'Bearer <token>'")
        if not hmac.compare_digest(presented.strip().encode("latin-1", "replace"), token.encode()):
            raise _HTTPError(401, "invalid bearer token")

    def _read_json(self) -> object:
        if self.headers.get("Transfer-Encoding") is not None:
            raise _HTTPError(411, "Transfer-Encoding is not supported; send a Content-Length")
        content_type = self.headers.get("Content-Type")
        media_type = (content_type or "").split(";", 1)[0].strip().lower()
        if media_type != "application/json":
            raise _HTTPError(415, f"Content-Type must be application/json, got {content_type!r}")
        lengths = self.headers.get_all("Content-Length") or []
        if not lengths:
            raise _HTTPError(411, "Content-Length header is required")
        if len({v.strip() for v in lengths}) != 1 or not _DIGITS.fullmatch(lengths[0].strip()):
            raise _HTTPError(400, f"invalid Content-Length {', '.join(lengths)!r}")
        length = int(lengths[0].strip())
        limit = self.server.max_request_bytes
        if length > limit:
            raise _HTTPError(413, f"request body of {length} bytes exceeds max_request_bytes={limit}")
        body = self.rfile.read(length)
        self._body_read = True
        if len(body) != length:
            raise _HTTPError(400, f"request body ended after {len(body)} of {length} bytes (Content-Length)")
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as e:
            raise _HTTPError(400, f"request body is not valid UTF-8: {e}") from None
        try:
            return json.loads(text, parse_constant=_reject_constant)
        except (ValueError, RecursionError) as e:
            raise _HTTPError(400, f"request body is not valid JSON: {e}") from None

    # ----- routes

    def _health(self) -> dict:
        return {"ok": True}

    def _score(self) -> dict:
        prompts, completions = _validate_request(self._read_json(), self.server.max_batch)
        if not prompts:
            return {"scores": []}
        return {"scores": _validate_scores(self.server.limiter(prompts, completions), len(prompts))}

    def _route(self, method: str) -> None:
        path = urllib.parse.urlsplit(self.path).path
        routes = {"/health": ("GET", self._health), "/score": ("POST", self._score)}
        if path not in routes:
            self._run(lambda: _raise(404, f"no such endpoint {path!r}; endpoints: POST /score, GET /health"))
            return
        allowed, handler = routes[path]
        if method != allowed:
            self._run(lambda: _raise(405, f"{method} {path} is not allowed; use {allowed}"))
            return
        self._run(handler)

    def do_GET(self) -> None:
        self._route("GET")

    def do_POST(self) -> None:
        self._route("POST")

    def do_PUT(self) -> None:
        self._route("PUT")

    def do_DELETE(self) -> None:
        self._route("DELETE")


def _raise(status: int, message: str) -> dict:
    raise _HTTPError(status, message)


def _reject_constant(name: str) -> object:
    raise ValueError(f"{name} is not valid JSON")


class _RewardHTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 64

    def __init__(self, address, *, token, limiter, max_request_bytes, max_batch, io_timeout_s, ipv6):
        if ipv6:
            self.address_family = socket.AF_INET6
        self.token, self.limiter = token, limiter
        self.max_request_bytes, self.max_batch, self.io_timeout_s = max_request_bytes, max_batch, io_timeout_s
        super().__init__(address, _Handler)


class RewardServer:
    """A running reward service: ``url``, ``host``, ``port``; ``close()`` stops it (also as a context manager)."""

    def __init__(self, httpd: _RewardHTTPServer, host: str) -> None:
        self._httpd = httpd
        self.host = host
        self.port: int = httpd.server_address[1]
        url_host = f"[{host}]" if ":" in host else host
        self.url = f"http://{url_host}:{self.port}"
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.1},
                                        name=f"reward-service:{self.port}", daemon=True)
        self._thread.start()
        self._closed = False

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RewardServer(url={self.url!r})"


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
) -> RewardServer:
    """Serve ``reward_fn(prompts, completions) -> scores`` over HTTP in a background thread.

    ``port=0`` picks a free port (read it from the handle). Binding to a non-loopback ``host`` requires
    a ``token``; a token, when given, is required on every request."""
    if not callable(reward_fn):
        raise TypeError(f"reward_fn must be callable, got {type(reward_fn).__name__}")
    if token is not None and (not isinstance(token, str) or not token.strip()):
        raise ValueError("token must be a non-empty string (or None on a loopback address)")
    if token is not None and not (token.isascii() and token.isprintable() and " " not in token):
        raise ValueError("token must be printable ASCII without spaces (it travels in an HTTP header)")
    if not is_loopback(host) and token is None:
        raise ValueError(
            f"refusing to bind the reward service to {host!r} without a token: anything but a loopback "
            "address (127.0.0.1, ::1, localhost) needs token=... (and, off a trusted network, TLS in front)"
        )
    for name, value in (("max_request_bytes", max_request_bytes), ("max_batch", max_batch),
                        ("max_concurrent", max_concurrent)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    bind_host = host.strip("[]")
    httpd = _RewardHTTPServer(
        (bind_host, port),
        token=token,
        limiter=_Limiter(reward_fn, float(timeout_s), max_concurrent),
        max_request_bytes=max_request_bytes,
        max_batch=max_batch,
        io_timeout_s=max(float(timeout_s), 5.0),
        ipv6=":" in bind_host,
    )
    server = RewardServer(httpd, bind_host)
    log.info("reward service listening on %s (token %s)", server.url, "required" if token else "off")
    return server


# ---------------------------------------------------------------------------------------------- client


class RewardClient:
    """Scores (prompt, completion) pairs on a remote reward service."""

    def __init__(self, url: str, token: str | None = None, timeout_s: float = 30.0) -> None:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"reward service url must be http(s)://host:port, got {url!r}")
        if parts.username or parts.password:
            raise ValueError("put the token in token=..., not in the url")
        if token is not None and (not isinstance(token, str) or not token.strip()):
            raise ValueError("token must be a non-empty string or None")
        if not (isinstance(timeout_s, (int, float)) and math.isfinite(timeout_s) and timeout_s > 0):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        self.url = url.rstrip("/")
        self._scheme, self._host, self._port = parts.scheme, parts.hostname, parts.port
        self._base_path = parts.path.rstrip("/")
        self.token, self.timeout_s = token, float(timeout_s)

    def __repr__(self) -> str:  # never shows the token
        return f"RewardClient(url={self.url!r}, token={'set' if self.token else None}, timeout_s={self.timeout_s})"

    def _request(self, method: str, path: str, payload: dict | None = None) -> tuple[int, dict | None, str]:
        cls = http.client.HTTPSConnection if self._scheme == "https" else http.client.HTTPConnection
        conn = cls(self._host, self._port, timeout=self.timeout_s)
        headers = {"Accept": "application/json"}
        body = None
        if payload is not None:
            body = json.dumps(payload, allow_nan=False).encode()
            headers["Content-Type"] = "application/json"
        if self.token:
            headers["Authorization"] = f"Bearer {self.token}"
        endpoint = f"{self.url}{path}"
        try:
            conn.request(method, self._base_path + path, body=body, headers=headers)
            response = conn.getresponse()
            raw = response.read()
            status = response.status
        except TimeoutError:
            raise RewardServiceError(None, f"no answer within timeout_s={self.timeout_s}", endpoint) from None
        except (BrokenPipeError, ConnectionResetError) as e:
            hint = ""
            if body is not None and len(body) > 1 << 16:
                hint = f" (the request body was {len(body)} bytes: over the server's max_request_bytes?)"
            raise RewardServiceError(
                None, f"connection closed by the server: {type(e).__name__}: {e}{hint}", endpoint
            ) from None
        except (OSError, http.client.HTTPException) as e:
            raise RewardServiceError(None, f"request failed: {type(e).__name__}: {e}", endpoint) from None
        finally:
            conn.close()
        text = raw.decode("utf-8", "replace")
        try:
            decoded = json.loads(text, parse_constant=_reject_constant)
        except (ValueError, RecursionError):
            decoded = None
        return status, decoded if isinstance(decoded, dict) else None, text

    def _check(self, status: int, decoded: dict | None, text: str, path: str) -> dict:
        endpoint = f"{self.url}{path}"
        if status != 200:
            message = decoded.get("error") if decoded and isinstance(decoded.get("error"), str) else text[:500]
            raise RewardServiceError(status, message or "(empty body)", endpoint)
        if decoded is None:
            raise RewardServiceError(status, f"answer is not a JSON object: {text[:200]!r}", endpoint)
        return decoded

    def health(self) -> bool:
        status, decoded, text = self._request("GET", "/health")
        return self._check(status, decoded, text, "/health").get("ok") is True

    def score(self, prompts: Sequence[str], completions: Sequence[str]) -> list[float]:
        """One finite float per (prompt, completion) pair, in order."""
        prompts, completions = list(prompts), list(completions)
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts but {len(completions)} completions")
        for name, items in (("prompts", prompts), ("completions", completions)):
            for i, item in enumerate(items):
                if not isinstance(item, str):
                    raise TypeError(f"{name}[{i}] must be a string, got {type(item).__name__}")
        status, decoded, text = self._request("POST", "/score", {"prompts": prompts, "completions": completions})
        answer = self._check(status, decoded, text, "/score")
        endpoint = f"{self.url}/score"
        scores = answer.get("scores")
        if not isinstance(scores, list):
            raise RewardServiceError(status, f"answer has no 'scores' list: {text[:200]!r}", endpoint)
        if len(scores) != len(prompts):
            raise RewardServiceError(status, f"got {len(scores)} scores for {len(prompts)} samples", endpoint)
        out = []
        for i, value in enumerate(scores):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise RewardServiceError(status, f"score for sample index {i} is {value!r}, not a finite number",
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.reward_service",
                                     description="Serve a task's reward function over HTTP (JSON).")
    parser.add_argument("--task", required=True, help="task name, e.g. randomwalks")
    parser.add_argument("--host", default="127.0.0.1",
                        help="bind address (default 127.0.0.1; anything else needs a token)")
    parser.add_argument("--port", type=int, default=8000, help="port (0 picks a free one)")
    parser.add_argument("--token-env", default="TETHER_REWARD_TOKEN",
                        help="environment variable holding the bearer token (default TETHER_REWARD_TOKEN)")
    parser.add_argument("--token-file", default=None, help="file holding the bearer token (overrides --token-env)")
    parser.add_argument("--max-request-bytes", type=int, default=1 << 20)
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--timeout-s", type=float, default=30.0)
    parser.add_argument("--max-concurrent", type=int, default=4)
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    from services.tasks import get_task

    task = get_task(args.task)
    try:
        server = serve(task.reward, host=args.host, port=args.port, token=_read_token(args),
                       max_request_bytes=args.max_request_bytes, max_batch=args.max_batch,
                       timeout_s=args.timeout_s, max_concurrent=args.max_concurrent)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"serving task {args.task!r} reward at {server.url} (POST /score, GET /health)", flush=True)

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        while not stop.wait(0.5):
            pass
    finally:
        server.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
