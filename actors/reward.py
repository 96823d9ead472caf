"""RewardActor: scores a chunk with the task's reward function, a sequence-classification model, a
remote reward service over HTTP (services/reward_service/), or an LLM judge
(services/reward_service/judge.py)."""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

import torch

from actors.base import VersionedActor, starting_up
from actors.specs import RewardSpec
from services.errors import TetherError
from services.model_source import as_source
from services.reward_models import check_classifier_config, reward_label_index

if TYPE_CHECKING:  # the batch's module loads in the actor, not in the driver (services/experience.py)
    from services.config import RewardConfig
    from services.experience import RolloutBatch
    from services.reward_service import RewardClient


class RewardError(TetherError, RuntimeError):
    pass


def service_token(token_env: str, forwarded: str | None = None) -> str | None:
    """The reward service's bearer token: this process's ``$token_env``, else the one the driver forwarded."""
    return os.environ.get(token_env, "").strip() or forwarded or None


def check_reward_service(reward: RewardConfig, log=print) -> None:
    """Driver pre-flight for ``reward.kind: remote``: the service at ``reward.url`` answers GET /health
    (with the driver's token, when it has one), before any actor starts. Raises RewardError naming the URL."""
    from services.reward_service import RewardClient, RewardServiceError  # fastapi/httpx: only for remote

    token = service_token(reward.token_env)
    client = RewardClient(reward.url, token, reward.timeout_s, reward.max_retries)
    try:
        client.health()
    except RewardServiceError as err:
        if err.status == 401 and token is None:
            log(f"pre-flight: reward service {reward.url} answers and wants a bearer token; "
                f"${reward.token_env} is not set here, so the reward actors must have it in their "
                "environment")
            return
        hint = f" (the token in ${reward.token_env} was refused)" if err.status == 401 else ""
        raise RewardError(f"pre-flight: the reward service at {reward.url} (reward.url) does not answer "
                          f"GET /health: {err}{hint}") from None
    finally:
        client.close()
    log(f"pre-flight: reward service {reward.url} answers "
        f"(token {'from $' + reward.token_env if token else 'off'})")


def remote_scores(client: RewardClient, prompts: list[str], completions: list[str], fields: list[dict],
                  where: str) -> list[float]:
    """The reward service's scores (retried by the client on a timeout or a 5xx); RewardError naming
    ``where`` (the chunk) with the service's message on a 4xx, a malformed answer or retries spent."""
    from services.reward_service import RewardServiceError

    try:
        return client.score(prompts, completions, fields)
    except RewardServiceError as err:
        raise RewardError(f"reward service of {where}: {err}") from None


def check_reward_label(model_path: str, label: int | str | None) -> int | None:
    """``reward_label_index`` from the config.json of ``model_path`` when this process sees that
    directory (the driver, before any actor starts), after checking it is a classifier; None otherwise (a
    hub id, or a path only the nodes have): the reward actor checks both when it loads the model."""
    from pathlib import Path

    directory = Path(model_path).expanduser()
    if not (directory / "config.json").is_file():
        return None
    from transformers import AutoConfig

    config, where = AutoConfig.from_pretrained(directory), f"reward model {model_path} (reward.model_path)"
    check_classifier_config(config, where)
    return reward_label_index(label, config.id2label, where)


class RewardScorer:
    """The task's reward (function, model, service or judge) over chunks, from a ``RewardSpec``: a reward
    actor's, or (``reward.placement`` learner) the one a learner rank scores its own chunks with. Sets nothing
    process-wide."""

    def __init__(self, spec: RewardSpec, device: str, where: str) -> None:
        kind, model_path, remote = spec.kind, spec.model_path, spec.remote
        self.device = device
        from services.models import load_tokenizer
        from services.tasks import get_task

        self.task = get_task(spec.task_name, **spec.task_options)
        # the policy's tokenizer decodes the responses; it travels with the policy's files
        self.tokenizer = load_tokenizer(as_source(spec.policy).resolve(where))
        self.kind = kind
        self.score_clip = spec.score_clip
        self.judge = None
        if kind == "model":
            from services.reward_models import SequenceClassifierReward

            model_path = as_source(model_path).resolve(where)
            self.reward_model = SequenceClassifierReward(model_path, spec.label, self.device,
                                                         f"reward model {model_path} on {where}")
        elif kind == "remote":
            from services.reward_service import RewardClient

            self.client = RewardClient(remote.url, service_token(remote.token_env, spec.forwarded_token),
                                       remote.timeout_s, remote.max_retries)
        elif kind == "judge":
            from services.reward_service.judge import Judge

            self.judge = Judge(spec.judge, as_source(model_path).resolve(where), self.device,
                               spec.judge_engine_args)

    def decode(self, batch: RolloutBatch, roles: bool = False) -> tuple[list[str], list[str]]:
        """The prompts and responses as text; ``roles``: with the special tokens that mark the chat template's
        turns (an environment's trajectory, its model's and environment's turns in one response)."""
        prompts, completions, skip = [], [], not roles
        for p_ids, p_mask, r_ids, n in zip(batch.prompt_ids, batch.prompt_mask, batch.response_ids,
                                           batch.response_lengths, strict=True):
            prompts.append(self.tokenizer.decode(p_ids[p_mask.bool()].tolist(), skip_special_tokens=skip))
            completions.append(self.tokenizer.decode(r_ids[: int(n)].tolist(), skip_special_tokens=skip))
        return prompts, completions

    def score(self, batch: RolloutBatch, chunk_index: int = -1) -> torch.Tensor:
        """[B] scores; raises RewardError naming the task, chunk and sample when a score is bad."""
        if batch.turn_rewards is not None:  # an environment's episodes: its turns' rewards are the score
            return batch.turn_rewards.sum(-1)
        prompts, completions = self.decode(batch)
        return self.scores(prompts, completions, f"task {self.task.name!r}, chunk {chunk_index}",
                           batch.prompt_index.tolist(), "train")

    def scores(self, prompts: list[str], completions: list[str], where: str, rows: list[int],
               split: str) -> torch.Tensor:
        """[B] scores of samples of prompt rows ``rows`` of the task's "train" or "eval" prompts."""
        if self.kind == "model":
            scores = self.reward_model(prompts, completions)
        elif self.kind == "remote":  # the service gets each row's task.reward_fields too (a dataset's answer)
            scores = remote_scores(self.client, prompts, completions, self.task.row_fields(rows, split),
                                   where)
        elif self.kind == "judge":  # the template may name the row's task.reward_fields too
            try:
                scores = self.judge(prompts, completions, self.task.row_fields(rows, split))
            except ValueError as err:
                raise RewardError(f"reward judge of {where}: {err}") from None
        else:
            try:
                scores = list(self.task.reward_rows(prompts, completions, rows, split))
            except Exception as err:
                raise RewardError(f"reward function of {where} raised {type(err).__name__}: {err}") from err
        if len(scores) != len(prompts):
            raise RewardError(f"reward function of {where} returned {len(scores)} scores for {len(prompts)} "
                              "samples")
        for i, s in enumerate(scores):
            if not isinstance(s, int | float) or not math.isfinite(s):
                raise RewardError(f"reward function of {where} returned {s!r} for sample {i} "
                                  f"(prompt {prompts[i]!r}, completion {completions[i]!r})")
        out = torch.tensor(scores, dtype=torch.float32)
        return out.clamp(-self.score_clip, self.score_clip) if self.score_clip else out

    def take_counts(self) -> dict[str, float]:
        """A judge's answers and unparseable answers since the driver last asked (none for the other
        kinds)."""
        return self.judge.take_counts() if self.judge is not None else {}

    def evaluate(self, batch: RolloutBatch, chunk_index: int = -1, keep_samples: int = 0) -> dict:
        """The task's eval metrics over a chunk, as sums weighted by its size (so chunks merge), and
        its first ``keep_samples`` samples as text with their scores, for a person to read."""
        prompts, completions = self.decode(batch, roles=batch.turn_rewards is not None)
        rows = batch.prompt_index.tolist()
        kept = [{"prompt": p, "response": c}
                for p, c in zip(prompts[:keep_samples], completions[:keep_samples])]
        # an environment's episodes: the return under the task's metric name
        if batch.turn_rewards is not None:
            returns = batch.turn_rewards.sum(-1)
            for sample, score in zip(kept, returns.tolist()):
                sample["score"] = float(score)
            # per episode: an agent's episode may be several rows, its reward on the last one
            return {"count": float(torch.unique(batch.episode_index).numel()), "samples": kept,
                    "sums": {self.task.metric: float(returns.sum()), "turns": float(batch.num_turns.sum()),
                             "tool_calls": float(batch.tool_calls.sum())}}
        if kept:
            where = f"task {self.task.name!r}, evaluation chunk {chunk_index}"
            for sample, score in zip(kept, self.scores(prompts[:len(kept)], completions[:len(kept)], where,
                                                       rows[:len(kept)], "eval")):
                sample["score"] = float(score)
        try:
            metrics = self.task.evaluate_rows(prompts, completions, rows, "eval")
        except Exception as err:
            raise RewardError(f"evaluation function of task {self.task.name!r}, chunk {chunk_index} raised "
                              f"{type(err).__name__}: {err}") from err
        if not metrics:  # a task without a metric of its own (a dataset): the job's reward is its score
            where = f"task {self.task.name!r}, evaluation chunk {chunk_index}"
            metrics = {"score": float(self.scores(prompts, completions, where, rows, "eval").mean())}
        bad = {k: v for k, v in metrics.items() if not math.isfinite(v)}
        if bad:
            raise RewardError(f"evaluation function of task {self.task.name!r}, chunk {chunk_index} "
                              f"returned {bad}")
        return {"count": float(len(prompts)), "sums": {k: v * len(prompts) for k, v in metrics.items()},
                "samples": kept}


class RewardActor(VersionedActor):
    role = "reward"

    @starting_up()
    def __init__(self, index: int, spec: RewardSpec) -> None:
        super().__init__(index)
        self.scorer = RewardScorer(spec, self.on_device(spec.device), f"{self.role}-{index}")

    def score(self, batch: RolloutBatch, chunk_index: int = -1) -> torch.Tensor:
        """[B] scores (``RewardScorer.score``), timed as this actor's busy seconds."""
        with self.busy():
            return self.scorer.score(batch, chunk_index)

    def evaluate(self, batch: RolloutBatch, chunk_index: int = -1, keep_samples: int = 0) -> dict:
        return self.scorer.evaluate(batch, chunk_index, keep_samples)

    def take_counts(self) -> dict[str, float]:
        """Busy seconds, and a judge's answers and unparseable answers, since the driver last asked."""
        return {**super().take_counts(), **self.scorer.take_counts()}
