"""CLI: ``python -m services.reward_service`` serves, in one command, one of
* ``--task randomwalks``: a task's reward;
* ``--function package.module:function``: ``function(prompt=..., completion=..., **fields)`` per sample, the
  signature of a dataset job's ``task.reward_function`` (a sample without a field it needs is a 400);
* ``--model PATH_OR_HUB_ID [--label L]``: a sequence-classification reward model, scored as the reward actors
  score it (services/reward_models.py);
* ``--judge judge.yaml``: an LLM judge on vLLM, the ``reward.judge`` section of a job (``judge``).
A model and a judge batch dynamically: requests that arrive together are scored in one forward of at most
``--max-batch-tokens`` tokens, on ``--device`` (cuda where there is one). The token, if any, comes from the
environment (``--token-env``, default ``TETHER_REWARD_TOKEN``) or a file (``--token-file``), never from the
"""

from __future__ import annotations

import argparse
import inspect
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable

from services.reward_service.server import HTTPError, RewardFn, serve


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
    """``function(prompt=..., completion=..., **row fields) -> score`` (a dataset job's task.reward_function)
    as the service's batch reward; a sample whose fields the function cannot take is a 400 naming them."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: called as it is
        parameters = None
    takes_any = parameters is None or any(p.kind is p.VAR_KEYWORD for p in parameters)
    named = {p.name for p in parameters or () if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if parameters is not None and not ({"prompt", "completion"} <= named or takes_any):
        raise ValueError(f"--function {name} cannot be called as {name}(prompt=..., completion=..., "
                         f"**fields): it takes ({', '.join(sorted(named))})")
    required = sorted(p.name for p in parameters or () if p.default is p.empty
                      and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                      and p.name not in ("prompt", "completion"))

    def reward(prompts: list[str], completions: list[str], fields: list[dict]) -> list:
        for i, sample in enumerate(fields):
            missing = [f for f in required if f not in sample]
            unknown = [] if takes_any else sorted(set(sample) - named)
            if missing or unknown:
                problem = f"lacks {missing}" if missing else f"has field(s) {unknown} it does not take"
                raise HTTPError(400, f"sample {i}: {name} needs the fields {required}; this sample {problem}")
        return [function(prompt=p, completion=c, **f)
                for p, c, f in zip(prompts, completions, fields, strict=True)]

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

        model = SequenceClassifierReward(args.model, args.label, device,
                                         f"reward model {args.model} (--model)")
        batcher = ScoreBatcher(model.score_batch, model.count_tokens, args.max_batch_tokens)
        return batcher, (f"reward model {args.model} on {device} "
                         f"(batches of up to {args.max_batch_tokens} tokens)")
    from services.reward_service.judge import Judge

    cfg = _judge_config(args.judge)
    judge = Judge(cfg, cfg.model_path, device, cfg.engine_args(1.0 if device == "cuda" else 0.0))
    return (judged_reward(judge, args.max_batch_tokens),
            f"judge {cfg.model_path} on {device} (batches of up to {args.max_batch_tokens} tokens)")


def judged_reward(judge, max_batch_tokens: int):
    """A ``services.reward_service.judge.Judge`` as the service's reward, batched; a sample without a field
    its template names is a 400, and each call's unparseable answers are logged."""
    from services.reward_models import ScoreBatcher

    def judged(prompts: list[str], completions: list[str], fields: list[dict]) -> list[float]:
        try:
            return judge(prompts, completions, fields)
        except ValueError as err:  # a sample without a field the template names
            raise HTTPError(400, str(err)) from None
        finally:
            judge.take_counts()  # logs the unparseable answers of this call

    return ScoreBatcher(judged, judge.count_tokens, max_batch_tokens)


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m services.reward_service",
                                     description="Serve a reward over HTTP (JSON): a task's, your function, "
                                                 "a reward model or an LLM judge.")
    served = parser.add_mutually_exclusive_group(required=True)
    served.add_argument("--task", help="a task's reward, e.g. randomwalks")
    served.add_argument("--function", help="package.module:function called as function(prompt=..., "
                                           "completion=..., **fields) per sample: a dataset job's "
                                           "task.reward_function")
    served.add_argument("--model", help="a Hugging Face sequence-classification reward model (dir or hub "
                                        "id); its logit of --label is the score")
    served.add_argument("--judge", help="a YAML file with an LLM judge's settings: the reward.judge section "
                                        "(or a job config that has one)")
    parser.add_argument("--task-seed", type=int, default=None, help="the task's seed (task.seed of the job)")
    parser.add_argument("--label", default=None, help="--model: the label whose logit is the score (index or "
                                                      "name); required when the model has more than one")
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="--model, --judge: where the model runs (default: cuda when there is one)")
    parser.add_argument("--max-batch-tokens", type=int, default=16384,
                        help="--model, --judge: requests that arrive together are scored in one forward of "
                             "up to this many tokens")
    parser.add_argument("--host", default="127.0.0.1",
                        help="bind address (default 127.0.0.1; anything else needs a token)")
    parser.add_argument("--port", type=int, default=8000, help="port (0 picks a free one)")
    parser.add_argument("--token-env", default="TETHER_REWARD_TOKEN",
                        help="environment variable holding the bearer token (default TETHER_REWARD_TOKEN)")
    parser.add_argument("--token-file", default=None, help="file holding the bearer token "
                        "(overrides --token-env)")
    parser.add_argument("--max-request-bytes", type=int, default=1 << 20)
    parser.add_argument("--max-batch", type=int, default=256)
    parser.add_argument("--timeout-s", type=float, default=30.0, help="overall deadline of one request")
    parser.add_argument("--max-concurrent", type=int, default=4, help="reward calls at once")
    parser.add_argument("--max-connections", type=int, default=64, help="open connections at once")
    parser.add_argument("--max-connections-per-client", type=int, default=32, help="open connections per "
                        "client address")
    parser.add_argument("--header-timeout-s", type=float, default=5.0,
                        help="close a connection that has not sent a request's whole headers in this long")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    for option, value in (("--label", args.label), ("--device", args.device)):
        if value is not None and not (args.model or (args.judge and option == "--device")):
            parser.error(f"{option} applies to "
                         + ("--model" if option == "--label" else "--model and --judge"))
    if args.task_seed is not None and not args.task:
        parser.error("--task-seed applies to --task")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # uvicorn's start and stop lines say nothing the line below does not
    if args.log_level.upper() != "DEBUG":
        logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
    try:
        reward, served_name = build_reward(args)  # a bad option fails here, before the port opens
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    # before the URL is printed: whoever reads it may stop us at once
    for sig in (signal.SIGINT, signal.SIGTERM):
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
