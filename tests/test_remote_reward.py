"""reward.kind: remote. The reward actor's client against real uvicorn servers on 127.0.0.1 (retries of a
5xx or a timeout, a 4xx or a malformed answer ending with the service's message and the chunk), the
driver's pre-flight, and the small randomwalks job trained against `python -m services.reward_service`,
which follows the local reward's run to the bit."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from actors.reward import RewardError, check_reward_service, remote_scores
from services.config import RewardConfig, load_config
from services.reward_service import RewardClient, serve
from services.tasks import get_task
from tests.conftest import SMALL, run_cli, run_job

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "remote-reward-test-token-0123"
WHERE = "task 'randomwalks', chunk 7"


@pytest.fixture(scope="module")
def task():
    return get_task("randomwalks")


def samples(task, n):
    walks = task.graph.walks[:n]
    return [w[0] for w in walks], [w[1:] for w in walks]


class AppServer:
    """A FastAPI app on uvicorn in a thread of this process, on 127.0.0.1 (a real server, port 0)."""

    def __init__(self, app: FastAPI) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_config=None, access_log=False))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        while not self.server.started and self.thread.is_alive():
            self.thread.join(0.02)
        assert self.server.started

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@pytest.fixture(scope="module")
def odd_service(task):
    """Routes that misbehave the way reward services do; ``calls`` counts the requests of each."""
    app, calls = FastAPI(), {}

    async def scores_for(request: Request) -> list[float]:
        body = await request.json()
        return task.reward(body["prompts"], body["completions"])

    @app.post("/flaky/score")  # 503 once, then the task's scores
    async def flaky(request: Request):
        calls["flaky"] = calls.get("flaky", 0) + 1
        if calls["flaky"] == 1:
            return JSONResponse({"error": "warming up"}, status_code=503)
        return {"scores": await scores_for(request)}

    @app.post("/down/score")  # 503 every time
    async def down(request: Request):
        calls["down"] = calls.get("down", 0) + 1
        return JSONResponse({"error": "reward model not loaded"}, status_code=503)

    @app.post("/refuses/score")  # 400 with its reason
    async def refuses(request: Request):
        calls["refuses"] = calls.get("refuses", 0) + 1
        return JSONResponse({"error": "prompt 2 is not a node of this graph"}, status_code=400)

    @app.post("/short/score")  # one score too few
    async def short(request: Request):
        calls["short"] = calls.get("short", 0) + 1
        return {"scores": (await scores_for(request))[:-1]}

    @app.post("/nan/score")  # a NaN, which JSON has no word for
    async def nan(request: Request):
        calls["nan"] = calls.get("nan", 0) + 1
        n = len((await request.json())["prompts"])
        return Response('{"scores": [' + ", ".join(["1.0"] * (n - 1) + ["NaN"]) + "]}",
                        media_type="application/json")

    server = AppServer(app)
    yield server, calls
    server.close()


def test_5xx_is_retried_and_the_scores_are_right(odd_service, task):
    server, calls = odd_service
    prompts, completions = samples(task, 6)
    client = RewardClient(server.url + "/flaky", max_retries=2)
    scores = remote_scores(client, prompts, completions, [{} for _ in prompts], WHERE)
    assert calls["flaky"] == 2  # the 503, then the answer
    assert scores == task.reward(prompts, completions) and len(set(scores)) > 1


def test_5xx_after_the_retries_ends_with_the_message_and_the_chunk(odd_service, task):
    server, calls = odd_service
    prompts, completions = samples(task, 3)
    with pytest.raises(RewardError) as info:
        remote_scores(RewardClient(server.url + "/down", max_retries=2), prompts, completions,
                      [{}] * 3, WHERE)
    assert calls["down"] == 3  # the first try and two retries
    message = str(info.value)
    assert "chunk 7" in message and "HTTP 503" in message and "reward model not loaded" in message


def test_timeout_is_retried(task):
    """The first call hangs past the client's timeout, the retry answers."""
    release, calls = threading.Event(), []

    def hangs_once(prompts, completions):
        calls.append(len(prompts))
        if len(calls) == 1:
            release.wait(30)
        return task.reward(prompts, completions)

    prompts, completions = samples(task, 4)
    with serve(hangs_once, max_concurrent=2, timeout_s=60) as srv:
        try:
            client = RewardClient(srv.url, timeout_s=1.0, max_retries=1)
            assert remote_scores(client, prompts, completions, [{}] * 4, WHERE) == \
                task.reward(prompts, completions)
            assert len(calls) == 2
        finally:
            release.set()


def test_4xx_ends_with_the_service_message_naming_the_chunk(odd_service, task):
    server, calls = odd_service
    prompts, completions = samples(task, 3)
    with pytest.raises(RewardError) as info:
        remote_scores(RewardClient(server.url + "/refuses", max_retries=3), prompts, completions,
                      [{}] * 3, WHERE)
    assert calls["refuses"] == 1  # a 4xx is not retried
    message = str(info.value)
    assert "chunk 7" in message and "HTTP 400" in message and \
        "prompt 2 is not a node of this graph" in message
    # the real service's own 4xx: a batch over its max_batch, fields its reward function does not take
    with serve(task.reward, max_batch=2) as srv:
        client = RewardClient(srv.url, max_retries=3)
        with pytest.raises(RewardError, match=r"chunk 7.*HTTP 413.*max_batch=2"):
            remote_scores(client, prompts, completions, [{}] * 3, WHERE)
        with pytest.raises(RewardError, match=r"chunk 7.*HTTP 400.*takes no fields.*'answer'"):
            remote_scores(client, prompts[:2], completions[:2], [{"answer": "x"}, {}], WHERE)


@pytest.mark.parametrize(("route", "fragment"), [("short", "got 2 scores for 3 samples"),
                                                 ("nan", "answer is not a JSON object")])
def test_malformed_answer_ends_naming_the_chunk(odd_service, task, route, fragment):
    server, calls = odd_service
    prompts, completions = samples(task, 3)
    with pytest.raises(RewardError) as info:
        remote_scores(RewardClient(server.url + f"/{route}", max_retries=3), prompts, completions,
                      [{}] * 3, WHERE)
    assert calls[route] == 1  # a malformed answer is not retried
    assert "chunk 7" in str(info.value) and fragment in str(info.value)


def test_fields_reach_a_reward_function_that_takes_them():
    def exact(prompts, completions, fields):
        return [float(c == f["answer"]) for c, f in zip(completions, fields, strict=True)]

    with serve(exact) as srv:
        client = RewardClient(srv.url)
        fields = [{"answer": "4"}, {"answer": "9"}]
        assert remote_scores(client, ["2+2=", "3*3="], ["4", "6"], fields, WHERE) == [1.0, 0.0]


def test_preflight_names_the_url(task, tmp_path):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    with pytest.raises(RewardError,
                       match=re.escape(f"reward service at {dead} (reward.url) does not answer")):
        check_reward_service(RewardConfig(kind="remote", url=dead, max_retries=0), log=lambda _: None)
    lines = []
    with serve(task.reward, token=TOKEN) as srv:
        cfg = RewardConfig(kind="remote", url=srv.url, token_env="TETHER_TEST_REMOTE_TOKEN")
        os.environ.pop("TETHER_TEST_REMOTE_TOKEN", None)
        check_reward_service(cfg, log=lines.append)  # answers; the token must be on the actors
        assert "wants a bearer token" in lines[-1]
        os.environ["TETHER_TEST_REMOTE_TOKEN"] = "not-the-token-0123456789"
        try:
            with pytest.raises(RewardError, match="HTTP 401.*was refused"):
                check_reward_service(cfg, log=lines.append)
            os.environ["TETHER_TEST_REMOTE_TOKEN"] = TOKEN
            check_reward_service(cfg, log=lines.append)
            assert "answers (token from $TETHER_TEST_REMOTE_TOKEN)" in lines[-1]
        finally:
            os.environ.pop("TETHER_TEST_REMOTE_TOKEN", None)


def test_config_of_a_remote_reward():
    cfg = load_config(overrides={"reward": {"kind": "remote", "url": "http://127.0.0.1:8000"}})
    assert (cfg.reward.token_env, cfg.reward.timeout_s, cfg.reward.max_retries) == \
        ("TETHER_REWARD_TOKEN", 30.0, 3)
    for reward, message in [({"kind": "remote"}, "needs reward.url"),
                            ({"kind": "remote", "url": "ftp://h:1"}, "must be http(s)://host:port"),
                            ({"kind": "remote", "url": "http://u:p@h:1"}, "must not hold credentials"),
                            ({"url": "http://127.0.0.1:8000"}, "reward.kind='function' ignores it")]:
        with pytest.raises(ValueError, match=re.escape(message)):
            load_config(overrides={"reward": reward})


# ---------------------------------------------------------------- the job against the service


@pytest.fixture
def reward_service_cli(monkeypatch):
    """`python -m services.reward_service <what it serves> --port 0` with a token, as the README starts it;
    the token is in this process's environment too, so the job's driver has it."""
    monkeypatch.setenv("TETHER_REWARD_TOKEN", TOKEN)
    started = []

    def start(*serving: str) -> str:
        proc = subprocess.Popen([sys.executable, "-m", "services.reward_service", *serving, "--port", "0"],
                                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, "TETHER_REWARD_TOKEN": TOKEN})
        started.append(proc)
        for line in proc.stdout:
            match = re.search(r"serving .* at (http://127\.0\.0\.1:\d+)", line)
            if match:
                return match.group(1)
        raise AssertionError(f"the reward service exited with {proc.wait()} before serving")

    yield start
    for proc in started:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.stdout.close()


@pytest.mark.integration
def test_remote_reward_job_follows_the_local_rewards_trajectory(ray_head, cache_dir, tmp_path,
                                                                reward_service_cli, small_run):
    """The small run (``conftest.small_run``, reward.kind function) again with reward.kind remote, served from
    a user's function of one sample (``--function``): every score from the service, and the same run to the
    bit: scores, rewards, KL, beta, losses and both evaluations. (The Ray head was started without the token:
    the driver forwards it to the reward actor.)"""
    local_dir, local = small_run
    assert local.returncode == 0, local.stderr[-3000:]
    url = reward_service_cli("--function", "tests.dataset_rewards:randomwalks_score")
    proc = run_job(["--cluster.address", ray_head.address, "--model.cache_dir", cache_dir, "--run.output_dir",
                    str(tmp_path), "--run.name", "remote", *SMALL, "--run.iterations", "4",
                    "--checkpoint.every", "2", "--reward.kind", "remote", "--reward.url", url])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"pre-flight: reward service {url} answers (token from $TETHER_REWARD_TOKEN)" in proc.stdout
    run_dir = tmp_path / "remote"
    remote, straight = (
        [json.loads(line) for line in (d / "metrics.jsonl").read_text().splitlines()]
        for d in (run_dir, local_dir))
    assert [r["iteration"] for r in remote] == [1, 2, 3, 4]
    assert [r["prompt_rows"] for r in remote] == [r["prompt_rows"] for r in straight]
    for key in ("score_mean", "reward_mean", "kl_response_mean", "kl_coef", "ppo_loss"):
        assert [r[key] for r in remote] == pytest.approx([r[key] for r in straight], rel=1e-6, abs=1e-9), key
    summary, local_summary = (json.loads((d / "summary.json").read_text()) for d in (run_dir, local_dir))
    for key in ("eval_start", "eval_final"):
        assert summary[key] == pytest.approx(local_summary[key], rel=1e-6, abs=1e-9), key
    config = (run_dir / "config.yaml").read_text()
    assert "kind: remote" in config and url in config
    assert TOKEN not in config + proc.stdout + proc.stderr  # the token stays in the environment


def test_unreachable_service_fails_before_any_actor(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    proc = run_cli(["--run.output_dir", str(tmp_path), "--cluster.address", "127.0.0.1:1", "--reward.kind",
                    "remote", "--reward.url", dead, "--reward.max_retries", "0"])
    assert proc.returncode == 1
    assert f"reward service at {dead} (reward.url) does not answer GET /health" in proc.stderr
    assert "actors ready" not in proc.stdout
