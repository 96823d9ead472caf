"""Tests of services/reward_service/ (server, connections, client): a real server on 127.0.0.1 (port 0)
scoring with the randomwalks task's reward, its client, and every rejection path (auth, size, shape, type,
batch, time)."""

from __future__ import annotations

import http.client
import json
import math
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest

from services.reward_service import RewardClient, RewardServiceError, is_loopback, serve
from services.tasks import get_task

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "test-token-0123456789"
MAX_BYTES = 4096
MAX_BATCH = 8

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def task():
    return get_task("randomwalks")


@pytest.fixture(scope="module")
def server(task):
    srv = serve(task.reward, host="127.0.0.1", port=0, token=TOKEN, max_request_bytes=MAX_BYTES,
                max_batch=MAX_BATCH, timeout_s=5.0)
    yield srv
    srv.close()


@pytest.fixture
def make_server():
    """Start servers with a custom reward function; all are closed at the end of the test."""
    started = []

    def make(fn, **kwargs):
        kwargs.setdefault("host", "127.0.0.1")
        srv = serve(fn, **kwargs)
        started.append(srv)
        return srv

    yield make
    for srv in started:
        srv.close()


def raw(server, method, path, body=b"", headers=None, token=TOKEN, content_type="application/json"):
    """One raw HTTP request; returns (status, decoded JSON or None)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        hdrs = dict(headers or {})
        if token is not None:
            hdrs.setdefault("Authorization", f"Bearer {token}")
        if content_type is not None:
            hdrs.setdefault("Content-Type", content_type)
        conn.request(method, path, body=body if method != "GET" else None, headers=hdrs)
        response = conn.getresponse()
        data = response.read()
    finally:
        conn.close()
    try:
        return response.status, json.loads(data)
    except ValueError:
        return response.status, None


def post(server, payload, **kwargs):
    body = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
    return raw(server, "POST", "/score", body, **kwargs)


def samples(task, n):
    """Real walks (valid, mostly non-optimal) plus a few invalid completions."""
    walks = task.graph.walks[:n]
    prompts = [w[0] for w in walks] + ["b", "c", "u"]
    completions = [w[1:] for w in walks] + ["", "zz|", "a"]
    return prompts, completions


# ---------------------------------------------------------------- round trip


def test_round_trip_equals_task_reward(server, task):
    client = RewardClient(server.url, token=TOKEN)
    prompts, completions = samples(task, 5)
    assert len(prompts) <= MAX_BATCH
    scores = client.score(prompts, completions)
    assert scores == task.reward(prompts, completions)
    assert all(isinstance(s, float) for s in scores)
    assert len(set(scores)) > 1  # not a constant: the comparison means something
    assert client.score([], []) == []
    assert client.health() is True


def test_health_and_routes(server):
    assert raw(server, "GET", "/health") == (200, {"ok": True})
    status, body = raw(server, "GET", "/nope")
    assert status == 404 and "no such endpoint" in body["error"]
    status, body = raw(server, "GET", "/score")
    assert status == 405 and "POST" in body["error"]


def test_server_binds_loopback_by_default(task):
    with serve(task.reward) as srv:
        assert srv.url.startswith("http://127.0.0.1:") and srv.port > 0
        assert RewardClient(srv.url).score(["b"], ["a"]) == task.reward(["b"], ["a"])


# ---------------------------------------------------------------- auth


def test_missing_and_wrong_token_are_401(server, task):
    payload = {"prompts": ["b"], "completions": ["a"]}
    status, body = post(server, payload, token=None)
    assert status == 401 and "Authorization" in body["error"]
    status, body = post(server, payload, token="wrong-token")
    assert status == 401 and "invalid bearer token" in body["error"]
    status, _ = post(server, payload, headers={"Authorization": f"Basic {TOKEN}"})
    assert status == 401
    assert raw(server, "GET", "/health", token=None)[0] == 401

    for client in (RewardClient(server.url), RewardClient(server.url, token="wrong-token")):
        with pytest.raises(RewardServiceError) as info:
            client.score(["b"], ["a"])
        assert info.value.status == 401 and "401" in str(info.value)
    assert "wrong-token" not in repr(RewardClient(server.url, token="wrong-token"))


def test_non_loopback_bind_requires_token():
    for host in ("0.0.0.0", "", "::", "192.0.2.1", "example.com"):
        with pytest.raises(ValueError, match="without a token"):
            serve(lambda p, c: [0.0] * len(p), host=host, port=0)
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("")
    with pytest.raises(ValueError):
        serve(lambda p, c: [], token="")


# ---------------------------------------------------------------- size, type, shape


def test_oversized_request_is_413(server):
    big = {"prompts": ["b"], "completions": ["x" * (MAX_BYTES + 10)]}
    status, body = post(server, big)
    assert status == 413 and "max_request_bytes" in body["error"]
    with pytest.raises(RewardServiceError) as info:
        RewardClient(server.url, token=TOKEN).score(["b"], ["x" * (MAX_BYTES + 10)])
    assert info.value.status == 413


def test_missing_or_invalid_content_length(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.putrequest("POST", "/score")
        conn.putheader("Authorization", f"Bearer {TOKEN}")
        conn.putheader("Content-Type", "application/json")
        conn.endheaders()
        response = conn.getresponse()
        assert response.status == 411 and "Content-Length" in json.loads(response.read())["error"]
    finally:
        conn.close()
    status, body = post(server, b"{}", headers={"Content-Length": "5_0"})
    assert status == 400 and "Content-Length" in body["error"]


def test_content_type_must_be_json(server):
    body = json.dumps({"prompts": ["b"], "completions": ["a"]}).encode()
    for content_type in ("text/plain", "application/x-python-pickle", None):
        status, answer = post(server, body, content_type=content_type)
        assert status == 415 and "application/json" in answer["error"]
    assert post(server, body, content_type="application/json; charset=utf-8")[0] == 200


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b"not json at all", "not valid JSON"),
        (b"\xff\xfe\x00", "UTF-8"),
        (b'{"prompts": ["b"], "completions": [NaN]}', "not valid JSON"),
        (b'["b", "a"]', "JSON object"),
        ({"prompts": "b", "completions": ["a"]}, "'prompts' must be a list"),
        ({"prompts": ["b"], "completions": [1]}, "completions[0] must be a string"),
        ({"prompts": ["b"]}, "missing field 'completions'"),
        ({"prompts": ["b"], "completions": ["a"], "pickle": "x"}, "unknown field"),
        ({"prompts": ["b", "c"], "completions": ["a"]}, "differ in length"),
    ],
)
def test_malformed_body_is_400(server, body, fragment):
    status, answer = post(server, body)
    assert status == 400
    assert fragment in answer["error"]


def test_batch_over_max_batch_is_rejected(server):
    n = MAX_BATCH + 1
    status, body = post(server, {"prompts": ["b"] * n, "completions": ["a"] * n})
    assert status == 413 and f"max_batch={MAX_BATCH}" in body["error"]
    with pytest.raises(RewardServiceError, match="max_batch"):
        RewardClient(server.url, token=TOKEN).score(["b"] * n, ["a"] * n)


# ---------------------------------------------------------------- a misbehaving reward function


def test_reward_fn_errors_surface_with_sample_index(make_server):
    def raises(prompts, completions):
        raise RuntimeError("reward model exploded")

    def nan_at_2(prompts, completions):
        return [0.5, 1.0, float("nan"), 0.0][: len(prompts)]

    def inf_at_0(prompts, completions):
        return [math.inf] * len(prompts)

    def too_few(prompts, completions):
        return [0.0] * (len(prompts) - 1)

    prompts, completions = ["b", "c", "d", "e"], ["a", "a", "a", "a"]
    cases = [
        (raises, "reward function raised RuntimeError; its message is in the reward service's log"),
        (nan_at_2, "sample index 2"),
        (inf_at_0, "sample index 0"),
        (too_few, "sample index 3 has no score"),
    ]
    for fn, fragment in cases:
        client = RewardClient(make_server(fn, port=0).url)
        with pytest.raises(RewardServiceError) as info:
            client.score(prompts, completions)
        assert info.value.status == 500, fn.__name__
        assert fragment in info.value.message, (fn.__name__, info.value.message)
        assert "exploded" not in info.value.message  # the exception's text goes to the log, not the client


def test_slow_reward_fn_is_504_within_bound(make_server):
    release = threading.Event()

    def slow(prompts, completions):
        release.wait(10)  # "sleeps" far past the timeout; released at the end so no thread lingers
        return [0.0] * len(prompts)

    try:
        srv = make_server(slow, port=0, timeout_s=0.5, max_concurrent=1)
        client = RewardClient(srv.url, timeout_s=5)
        start = time.monotonic()
        with pytest.raises(RewardServiceError) as info:
            client.score(["b"], ["a"])
        elapsed = time.monotonic() - start
        assert info.value.status == 504 and "timeout_s=0.5" in info.value.message
        assert 0.4 < elapsed < 3.0
        # the hung call still holds the only slot: the next request is refused in bounded time, not queued
        start = time.monotonic()
        with pytest.raises(RewardServiceError) as info:
            client.score(["b"], ["a"])
        assert info.value.status == 503 and time.monotonic() - start < 3.0
    finally:
        release.set()


# ---------------------------------------------------------------- client-side validation


class _BadAnswers(BaseHTTPRequestHandler):
    answers: ClassVar[dict[str, bytes]] = {
        "/nan/score": b'{"scores": [1.0, NaN]}',
        "/short/score": b'{"scores": [1.0]}',
        "/string/score": b'{"scores": [1.0, "2"]}',
        "/html/score": b"<html>oops</html>",
    }

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        body = self.answers[self.path]
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_client_validates_answers():
    stub = ThreadingHTTPServer(("127.0.0.1", 0), _BadAnswers)
    thread = threading.Thread(target=stub.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
    thread.start()
    try:
        base = f"http://127.0.0.1:{stub.server_address[1]}"
        for path, fragment in [("/nan", "not a JSON object"), ("/short", "got 1 scores for 2"),
                               ("/string", "sample index 1"), ("/html", "not a JSON object")]:
            with pytest.raises(RewardServiceError, match=fragment):
                RewardClient(base + path).score(["b", "c"], ["a", "a"])
    finally:
        stub.shutdown()
        stub.server_close()
    with pytest.raises(ValueError):
        RewardClient("http://127.0.0.1:1").score(["b"], [])
    with pytest.raises(ValueError):
        RewardClient("ftp://127.0.0.1:1")


# ---------------------------------------------------------------- CLI


def test_cli_serves_task_reward(task):
    env = {**os.environ, "TETHER_REWARD_TOKEN": TOKEN}
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.reward_service", "--task", "randomwalks", "--port", "0"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        line = proc.stdout.readline()
        match = re.search(r"http://127\.0\.0\.1:\d+", line)
        assert match, line
        prompts, completions = samples(task, 4)
        assert RewardClient(match.group(0), token=TOKEN).score(prompts, completions) == task.reward(
            prompts, completions
        )
        with pytest.raises(RewardServiceError):
            RewardClient(match.group(0)).score(prompts, completions)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(timeout=10) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.stdout.close()


# ---------------------------------------------------------------- what the FastAPI server adds


def test_token_has_a_minimum_length():
    for short in ("x", "0123456789abcde"):  # 1 and 15 characters
        with pytest.raises(ValueError, match="at least 16 characters"):
            serve(lambda p, c: [0.0] * len(p), token=short)
        with pytest.raises(ValueError, match="at least 16 characters"):
            serve(lambda p, c: [0.0] * len(p), host="0.0.0.0", token=short)
    with serve(lambda p, c: [0.0] * len(p), token="0123456789abcdef") as srv:  # 16: accepted
        assert RewardClient(srv.url, token="0123456789abcdef").health() is True


def _read_until_closed(sock) -> bytes:
    """Everything the server sends until it closes the connection (socket timeout: the test's guard)."""
    received = b""
    while chunk := sock.recv(65536):
        received += chunk
    return received


def test_slow_clients_hold_nothing(make_server, task):
    """A client that never finishes its headers, or its body, is cut off by the request deadline; while
    such clients hang on, the service still answers others."""
    import socket

    srv = make_server(task.reward, port=0, timeout_s=0.5, max_concurrent=1)
    stalled = []
    try:
        for _ in range(3):
            sock = socket.create_connection(("127.0.0.1", srv.port), timeout=20)
            sock.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: appl")
            stalled.append(sock)
        assert RewardClient(srv.url).score(["b"], ["a"]) == task.reward(["b"], ["a"])
        for sock in stalled:
            assert _read_until_closed(sock) == b""  # closed without an answer: it never sent a request
        with socket.create_connection(("127.0.0.1", srv.port), timeout=20) as sock:
            sock.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{\"prompts\": ")
            answer = _read_until_closed(sock)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 408") and b"timeout_s=0.5" in body, answer
    finally:
        for sock in stalled:
            sock.close()


def test_invalid_http_is_answered_as_json(server):
    import socket

    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as sock:
        sock.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n{}")
        answer = _read_until_closed(sock)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400")
    assert "Content-Length" in json.loads(body)["error"]


def test_rejected_request_ends_with_its_answer_not_a_reset(server):
    """A request the HTTP parser rejects while its body is still arriving gets its 400 and then a clean end
    of the connection. The server used to close at once with the body unread, which makes the kernel send a
    TCP reset: the client got ConnectionResetError instead (test_missing_or_invalid_content_length under
    load, when the body landed after the server's read). A body larger than one read of the server (asyncio
    reads 256 KiB at most) leaves bytes unread at the answer every time."""
    import socket

    request = (b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
               b"Content-Length: 5_0\r\n\r\n"
               + b"x" * (512 << 10))
    with socket.create_connection(("127.0.0.1", server.port), timeout=20) as sock:
        sock.sendall(request)
        answer = _read_until_closed(sock)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and \
        f"content-length: {len(body)}".encode() in head.lower(), answer
    assert "Content-Length" in json.loads(body)["error"]
    assert raw(server, "GET", "/health") == (200, {"ok": True})


def _connections(srv) -> int:
    return len(srv._server.server_state.connections)


def _wait_for_no_connections(srv) -> None:
    """Polls until the server holds no connection (the test's timeout is the bound)."""
    while _connections(srv):
        time.sleep(0.05)


def test_draining_a_rejected_request_is_bounded(make_server, task):
    """After a rejected request the server reads and drops what the client still sends, but not for ever:
    a client that keeps the connection open is let go after drain_s (here the 2 s request deadline), and
    one that keeps sending is cut after drain_max_bytes (max_request_bytes + 1 MiB: a few MiB with what the
    socket buffers hold, where 2 s on loopback would carry far more than the 64 MiB the client offers)."""
    import socket

    srv = make_server(task.reward, port=0, timeout_s=2.0, max_request_bytes=1024)
    bad = b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Length: 5_0\r\n\r\n"
    with socket.create_connection(("127.0.0.1", srv.port), timeout=20) as sock:
        sock.sendall(bad + b"x" * 1000)
        assert _read_until_closed(sock).startswith(b"HTTP/1.1 400")  # the answer, then the server's FIN
        _wait_for_no_connections(srv)  # the client never closes its side: let go after drain_s
    with socket.create_connection(("127.0.0.1", srv.port), timeout=20) as sock:
        sock.sendall(bad)
        assert _read_until_closed(sock).startswith(b"HTTP/1.1 400")
        sent = 0
        with pytest.raises((ConnectionResetError, BrokenPipeError)):  # the server closed a socket being fed
            while sent < (64 << 20):
                sent += sock.send(b"x" * (64 << 10))
    assert sent < (64 << 20)
    _wait_for_no_connections(srv)


def test_reward_fn_exception_text_is_logged_not_answered(make_server, caplog):
    def leaks(prompts, completions):
        raise RuntimeError("secret-path /srv/models/rm-v3 and key sk-123")

    client = RewardClient(make_server(leaks, port=0).url)
    with caplog.at_level("ERROR", logger="services.reward_service"), \
            pytest.raises(RewardServiceError) as info:
        client.score(["b"], ["a"])
    assert info.value.status == 500 and "secret-path" not in str(info.value) and \
        "sk-123" not in str(info.value)
    incident = re.search(r"incident ([0-9a-f]{12})", info.value.message).group(1)
    logged = [r for r in caplog.records if incident in r.getMessage()]
    assert logged and "secret-path" in str(logged[0].exc_info[1])


def test_fields_are_checked(make_server):
    srv = make_server(lambda p, c, fields: [float(len(f)) for f in fields], port=0)
    ok = {"prompts": ["b", "c"], "completions": ["a", "a"], "fields": [{"x": 1}, {}]}
    status, body = raw(srv, "POST", "/score", json.dumps(ok).encode(), token=None)
    assert (status, body) == (200, {"scores": [1.0, 0.0]})
    for fields, fragment in [([{}], "list of 2 JSON objects"),
                             ([{}, "x"], "fields[1] must be a JSON object")]:
        bad = {**ok, "fields": fields}
        status, body = raw(srv, "POST", "/score", json.dumps(bad).encode(), token=None)
        assert status == 400 and fragment in body["error"]


# ---------------------------------------------------------------- slow clients must not lock out real ones


class _Slowloris(threading.Thread):
    """A hostile client on loopback: ``n`` connections, spread over ``sources`` (the whole 127/8 is loopback
    on Linux), that each send one more header line every ``period_s`` and never finish their headers; one the
    server closes is opened again at the next round. It stops by itself after ``duration_s`` (or at
    ``stop()``) and closes its sockets."""

    def __init__(self, port: int, n: int, sources: list[str], period_s: float, duration_s: float) -> None:
        super().__init__(name="slowloris", daemon=True)
        self.port, self.n, self.sources, self.period_s, self.duration_s = port, n, sources, \
            period_s, duration_s
        self.opened = threading.Event()  # set once all n were opened once (or the attack ended)
        self.cut = 0  # connections the server closed
        self._stop_event = threading.Event()

    def _open(self, i: int) -> socket.socket:
        sock = socket.create_connection(("127.0.0.1", self.port), timeout=5,
                                        source_address=(self.sources[i % len(self.sources)], 0))
        sock.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\n")
        return sock

    @staticmethod
    def _closed_by_server(sock: socket.socket) -> bool:
        try:
            return sock.recv(1, socket.MSG_DONTWAIT) == b""  # the server's FIN: it never answers these
        except BlockingIOError:  # open, nothing to read
            return False
        except OSError:  # a reset
            return True

    def run(self) -> None:
        end = time.monotonic() + self.duration_s
        socks: list[socket.socket | None] = []
        try:
            for i in range(self.n):
                socks.append(self._open(i))
            self.opened.set()
            while not self._stop_event.wait(self.period_s) and time.monotonic() < end:
                for i, sock in enumerate(socks):
                    try:
                        if sock is not None and self._closed_by_server(sock):
                            sock.close()
                            self.cut += 1
                            sock = socks[i] = None
                        if sock is None:  # a hostile client comes back at once
                            socks[i] = self._open(i)
                        else:
                            sock.sendall(b"X-Slow: 1\r\n")
                    except OSError:
                        if sock is not None:
                            sock.close()
                            self.cut += 1
                        socks[i] = None
        finally:
            self.opened.set()
            for sock in socks:
                if sock is not None:
                    sock.close()

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=30)


def test_slowloris_does_not_lock_out_real_requests(make_server, task):
    """300 connections that send a header line every second and never finish (more than max_connections=64,
    from ten loopback addresses, 30 each) fill the connection limit; a whole request that arrives meanwhile
    is answered, not refused with 503: the slow connections waiting for their headers make room for it. The
    service used to answer 503 until the slow connections went away."""
    max_connections = 64
    srv = make_server(task.reward, port=0, max_connections=max_connections)
    slow = _Slowloris(srv.port, n=300, sources=[f"127.0.0.{i}" for i in range(2, 12)], period_s=1.0,
                      duration_s=8.0)
    slow.start()
    try:
        assert slow.opened.wait(30), "the slowloris did not open its connections"
        prompts, completions = samples(task, 4)
        expected = task.reward(prompts, completions)
        latencies = []
        for _ in range(3):  # a new connection each time, as a restarted actor opens one
            # the slowloris holds the server at its limit (again, after it reopened what was cut); the test's
            # timeout bounds the wait
            while _connections(srv) < max_connections and slow.is_alive():
                time.sleep(0.02)
            assert slow.is_alive(), "the slowloris stopped before the request: the test proves nothing"
            client = RewardClient(srv.url, timeout_s=5)
            start = time.monotonic()
            try:
                assert client.score(prompts, completions) == expected  # a 503 raises RewardServiceError
            finally:
                client.close()
            latencies.append(time.monotonic() - start)
        print("real request latency under a 300-connection slowloris:",
              ", ".join(f"{t:.3f} s" for t in latencies))
    finally:
        slow.stop()
    assert slow.cut > 0  # the server closed slow connections to make room


def _dribble_until_closed(sock: socket.socket, limit_s: float = 15.0) -> float:
    """Sends one header line every 0.2 s, never the blank line that ends the headers, until the server closes
    the connection; returns the seconds that took (``limit_s`` bounds the wait: then the test fails)."""
    start = time.monotonic()
    sock.settimeout(0.2)
    try:
        while time.monotonic() - start < limit_s:
            sock.sendall(b"X-Slow: 1\r\n")
            try:
                if sock.recv(1) == b"":  # the server's FIN, without an answer
                    return time.monotonic() - start
                pytest.fail("the server answered headers that were never finished")
            except TimeoutError:
                pass
    except (ConnectionResetError, BrokenPipeError):  # closed while a line was in flight
        return time.monotonic() - start
    pytest.fail(f"the connection was still open after {limit_s} s of header lines")


def test_headers_slower_than_header_timeout_are_cut(make_server, task):
    """A connection that keeps sending header lines but never ends its headers is closed header_timeout_s
    after it opened, and so is a kept-alive one after its last answer, though each line arrives well within
    it."""
    srv = make_server(task.reward, port=0, header_timeout_s=1.0)
    with socket.create_connection(("127.0.0.1", srv.port), timeout=20) as sock:
        sock.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\n")
        elapsed = _dribble_until_closed(sock)
    assert 0.9 < elapsed < 8.0, elapsed
    conn = http.client.HTTPConnection("127.0.0.1", srv.port, timeout=20)
    try:
        body = json.dumps({"prompts": ["b"], "completions": ["a"]}).encode()
        conn.request("POST", "/score", body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        assert (response.status, json.loads(response.read())) == (200, {"scores": task.reward(["b"], ["a"])})
        conn.sock.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\n")  # the same connection, kept alive
        elapsed = _dribble_until_closed(conn.sock)
    finally:
        conn.close()
    assert 0.5 < elapsed < 8.0, elapsed


def _send_partial_headers(port: int) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port), timeout=20)
    sock.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\n")
    return sock


def _finish_request(sock: socket.socket, payload: dict) -> tuple[int, dict]:
    """Ends the headers a _send_partial_headers socket began, sends ``payload``; the answer's status and
    JSON."""
    body = json.dumps(payload).encode()
    sock.sendall(b"Content-Type: application/json\r\nConnection: close\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(body) + body)
    head, _, answer = _read_until_closed(sock).partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(answer)


def test_connections_per_client_are_bounded(make_server, task):
    """A client address holds at most max_connections_per_client connections: a new one evicts the address's
    oldest connection still waiting for its headers (oldest first), and is refused (closed unanswered) only
    when all of them are answering requests, which go on undisturbed."""
    srv = make_server(task.reward, port=0, max_connections_per_client=3, header_timeout_s=30.0)
    payload = {"prompts": ["b", "c"], "completions": ["a", "a"]}
    expected = {"scores": task.reward(payload["prompts"], payload["completions"])}
    waiting = [_send_partial_headers(srv.port) for _ in range(3)]  # opened (and accepted) in this order
    try:
        waiting.append(_send_partial_headers(srv.port))  # a 4th: the 1st goes
        assert _read_until_closed(waiting[0]) == b""
        # a whole request on a 5th: the 2nd goes, and it is served
        client = RewardClient(srv.url, timeout_s=10)
        try:
            assert client.score(payload["prompts"], payload["completions"]) == expected["scores"]
        finally:
            client.close()
        assert _read_until_closed(waiting[1]) == b""
        assert _finish_request(waiting[2], payload) == (200, expected)  # the others were kept
        assert _finish_request(waiting[3], payload) == (200, expected)
    finally:
        for sock in waiting:
            sock.close()
    _wait_for_no_connections(srv)

    # three connections answering requests (their bodies still to come): a 4th is refused, they are not
    # disturbed
    busy = [socket.create_connection(("127.0.0.1", srv.port), timeout=20) for _ in range(3)]
    try:
        body = json.dumps(payload).encode()
        for sock in busy:
            sock.sendall(b"POST /score HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Connection: close\r\nExpect: 100-continue\r\nContent-Length: %d\r\n\r\n"
                         % len(body))
            interim = b""
            while not interim.endswith(b"\r\n\r\n"):
                interim += sock.recv(1)
            assert interim.startswith(b"HTTP/1.1 100"), interim  # the app is reading the body: answering
        with socket.create_connection(("127.0.0.1", srv.port), timeout=20) as refused:
            assert _read_until_closed(refused) == b""
        for sock in busy:
            sock.sendall(body)
            head, _, answer = _read_until_closed(sock).partition(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200") and json.loads(answer) == expected, head
    finally:
        for sock in busy:
            sock.close()


def test_bad_connection_settings_are_refused():
    def reward(prompts, completions):
        return [0.0] * len(prompts)

    for value in (0, -1.0, math.nan, math.inf, "5", True, None):
        with pytest.raises(ValueError, match=r"header_timeout_s must be a positive number of seconds, got"):
            serve(reward, header_timeout_s=value)
    for value in (0, -3, 2.5, "32", True, None):
        with pytest.raises(ValueError, match=r"max_connections_per_client must be a positive integer, got"):
            serve(reward, max_connections_per_client=value)
