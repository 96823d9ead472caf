"""The settings-space harness: every accepted combination of the algorithm's settings, run through the
algorithm layer (``learner.algorithm``, the functions the learner rank calls) on exact tabular problems.

The problem: a vocabulary {0, 1, EOS}, every response of up to 3 model tokens (15 of them), policies given by
a logit table per prefix. Behaviour (the engine), proximal (the learner at the start of the update), current
(the policy being stepped), reference and teacher policies all differ; in sync mode the engine holds the
learner's version, so behaviour = proximal there. Expectations are exact sums over every response (and every
pair of responses for the group estimators, whose baselines couple a group), weighted by the behaviour's
probabilities. Async mode comes twice: one older version sampled each response (``async``), or the older
version sampled its first token and a newer one its later tokens (``async_mixed``: the engine's weights
updated in flight, ``rollout.in_flight_updates`` keep_kv or partial, an axis of its own), so the rows carry
per-token behaviour log-probs of two versions, as the engine reports them. For the algorithm the two in-flight
settings are one: each token's behaviour log-prob is what the engine reported for it, whichever weights
computed it.

Three task shapes: one response; a multi-turn trajectory (an environment token after the first model token, a
reward at each turn's end); an agent episode split into two rows (the environment's token opens the second
row, the episode's reward on the last row's last token).

For every combination ``JobConfig`` and the registered entries it chooses accept, the harness checks
- the controller's statistic: its expectation is KL(pi || ref) per episode, pi the proximal policy (the one
  the learner optimises), or it is classed biased by design (k2, ``kl.scope: token_mean``) with its bias
  printed;
- the penalty identity: the rewards the layer builds are the scores minus beta times the per-episode KL sum it
  logs (``kl.placement: reward``), or the scores alone (``loss``);
- the expected gradient of each term of the objective (the task score, the KL to the reference, the reverse KL
  to the teacher) against the gradient of that term: exact (relative error < 1e-6), bounded (token-level
  rollout correction in async mode: within the bound each correction states, ``TOKEN_LEVEL_BOUND_PER_NAT``
  times the problem's shift), or biased by design (peers' forms and the normalisations, selections and masks
  that change the objective on purpose), with the measured error printed;
- each policy term's expected gradient against the one of its documented objective, written again from the
  entries' formulas (``documented_gradient``): equal in every class, so a bias by design is the number the
  reference computes, not merely a nonzero one;
and for every refused combination, that the message names the fields.

The policy losses are taken at the start of the update, where every ratio pi / pi_prox is 1: PPO's and GSPO's
clip, CISPO's clipped weight and SAPO's gate are all the policy gradient there, so each is classed as PPO is.
``test_policy_loss_figures_off_the_first_step`` measures them where the ratio is not 1. The rollout
correction's masks (``ppo.correction`` icepop, geometric_mask, off_policy_mask) keep their default bands (the
geometric mask in async mode [0.95, 1.05]: its default is refused there), and IcePop a narrow one too: a mask
that drops a token of the problem (``mask_binds``, from the problem's tables) makes every policy term biased
by design; one that drops none leaves the class of the weights it multiplies. The harness asserts that each
mask binds at the async shift and not in sync mode, so both classes are checked.

Axes and the reduction: the full product of the axes is about 25.7 million combinations. The harness takes the
full product of the axes that reach the controller's statistic (mode, placement, estimator, scope, task shape,
dynamic sampling, distillation: 648) and a pairwise covering array over all the axes (every pair of two axes'
values in at least one combination), the other axes of each controller combination taken from the covering
array in turn.

Fixed settings: GAE at gamma = lambda = 1 without whitening (the variance reductions that trade bias are axes
of their own elsewhere: whitening is REINFORCE++'s and is classed there), an uncapped importance weight
(``ppo.is_cap`` 1e6: a cap is a bias by its own definition;
``test_rollout_correction_and_placement_figures_over_seeds`` measures the default), and clip ranges wide
enough that no ratio is clipped at the step the gradient is taken.

It runs what the update runs: the rows are collected as a rank collects a chunk (``collect_chunk`` through
``TabularEngine``, a training engine over the tables, the reference scored by the rank's ``RankScoring``),
carry their tokens' versions and are admitted by the staleness bound as the rank admits them
(``check_admission``), and ``learner.update.update`` takes exactly the step ``layer_gradient`` measures
(``check_update``). Each registered entry is checked against its own documented objective, written from its
paper without calling it (``check_policy_loss_entry``, ``check_correction_entry``,
``check_kl_estimator_entry``, ``check_advantage_estimator_entry``): the checks each plausible bug of
``tests/test_mutations.py`` must fail. The tables the docs give are this run's, written to
docs/harness-figures.md and checked against it (``figures``).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
import re
import warnings
from dataclasses import dataclass

import pytest
import torch
from torch import Tensor

from learner.advantages import ESTIMATORS
from learner.algorithm import Algorithm, episode_view
from learner.correction import CORRECTIONS
from learner.kl import KL_ESTIMATORS, kl_stats_from_sums
from learner.policy_losses import POLICY_LOSSES
from learner.update import RankScoring, collect_chunk
from services.config import JobConfig, load_config
from services.experience import FINISH_LENGTH, FINISH_STOP, Episodes, RolloutBatch, make_batch, pad_right
from tests.conftest import ROOT

EOS, ENV = 2, 3
LEARNER_VERSION = 2  # the learner's version; the engine's are this or older (Problem.token_version)
WIDTH = 4  # response positions: a, ENV, b, c at most
BETA, DISTILL_COEF = 0.3, 0.2
# each token-level correction's stated bound on its bias: the relative error of the expected gradient per nat
# of the mean per-token shift between the learner and the engine (``token_shift``), on responses of up to 3
# tokens; its weight ignores the response's other tokens' ratios, an error first-order in the shift. An entry
# whose token-level factor the harness classes bounded must state one
TOKEN_LEVEL_BOUND_PER_NAT = {"tis": 2.0, "mis": 2.0, "icepop": 2.0}
EXACT = 1e-6

AXES: dict[str, tuple] = {
    "mode": ("sync", "async", "async_mixed"),
    "placement": ("reward", "loss"),
    "estimator": KL_ESTIMATORS.names(),
    "loss_form": (None, "kl_to_go", "response_k2", "grpo_token_k3"),
    "scope": ("response_sum", "token_mean"),
    "advantage": ("gae", "grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline"),
    "policy_loss": POLICY_LOSSES.names(),
    "aggregation": ("token_mean", "sequence_mean", "seq_mean_token_sum_norm"),
    "correction": (("tis", "token"), ("tis", "sequence"), ("mis", "token"), ("mis", "sequence"),
                   ("none", "token"), ("icepop", "token"), ("icepop", "token", "narrow"),
                   ("geometric_mask", "token"), ("geometric_mask", "sequence"),
                   ("off_policy_mask", "token"), ("off_policy_mask", "sequence")),
    "grpo_normalize": ("score", "return"),
    "mask_truncated": (False, True),
    "dynamic_sampling": (False, True),
    "distill": ("off", "with_task", "without_task"),
    "shape": ("single", "multi_turn", "agent_split"),
    "in_flight": ("off", "keep_kv", "partial"),  # rollout.in_flight_updates
}
# IcePop's default band [0.5, 5] drops no token at the harness's async shift; this one does
NARROW_ICEPOP = {"icepop_low": 0.8, "icepop_high": 1.25}
# the geometric mask's default band [0.999, 1.001] is refused in async mode (a stale row's drift leaves it);
# this one, wider, still drops rows at the harness's shifts (0.15-0.35 nats of logits between the versions)
ASYNC_GEOMETRIC = {"geometric_mask_low": 0.95, "geometric_mask_high": 1.05}
CONTROLLER_AXES = ("mode", "placement", "estimator", "scope", "shape", "dynamic_sampling", "distill")


# ---------------------------------------------------------------------------- combinations and the config


def repaired(c: dict, fixed: set[str]) -> dict:
    """``c`` with the axes outside ``fixed`` moved to values the others allow (the config's own rules, so that
    a covering row tests what it was drawn for rather than a refusal)."""
    c = dict(c)

    def put(axis, value):
        if axis not in fixed:
            c[axis] = value

    put("loss_form", None if c["placement"] == "reward" else c["loss_form"] or "kl_to_go")
    if c["advantage"] != "grpo" or c["placement"] == "loss":
        put("grpo_normalize", "score")
    if c["advantage"] not in ("grpo", "rloo", "reinforce_pp_baseline") or c["shape"] != "single" \
            or c["distill"] == "without_task":
        put("dynamic_sampling", False)
    if c["shape"] != "single" or c["placement"] == "loss":
        put("mask_truncated", False)
    if c["mode"] == "sync":
        put("in_flight", "off")
    if c["mode"] == "async_mixed" and c["in_flight"] == "off":  # a response spans versions: loaded in flight
        put("in_flight", "keep_kv")
    if c["mode"] != "sync" and c["correction"][0] == "none":
        put("correction", ("tis", c["correction"][1]))
    if c["policy_loss"] == "gspo" and c["correction"][0] == "icepop":  # IcePop is per token, GSPO per row
        put("policy_loss", "gspo_token")
    if c["policy_loss"] == "gspo":
        put("advantage", "grpo" if c["advantage"] == "gae" else c["advantage"])
        if c["correction"][1] == "token":
            kind = c["correction"][0]
            put("correction", ("none", "token") if kind == "none" else ("tis", "sequence") if kind == "icepop"
                else (kind, "sequence"))
    return c


def covering_array(axes: dict[str, tuple], seed: int = 0, tries: int = 32) -> tuple[list[dict], list[dict]]:
    """Accepted combinations covering every pair of two axes' values that some accepted combination holds
    (greedy: each new one is the candidate, of ``tries`` drawn around a pair still missing and repaired, that
    covers the most pairs not yet covered). Returns (the combinations, one refused combination per pair none
    could hold)."""
    names = list(axes)
    pairs = lambda c: {(x, c[x], y, c[y]) for i, x in enumerate(names) for y in names[i + 1:]}  # noqa: E731, RUF100
    uncovered = {(a, va, b, vb) for i, a in enumerate(names) for b in names[i + 1:]
                 for va in axes[a] for vb in axes[b]}
    rng = torch.Generator().manual_seed(seed)
    rows, refused = [], []
    while uncovered:
        a, va, b, vb = min(uncovered, key=repr)
        candidates = []
        for _ in range(tries):
            cand = ({n: axes[n][int(torch.randint(len(axes[n]), (1,), generator=rng))] for n in names}
                    | {a: va, b: vb})
            cand = repaired(cand, {a, b})
            candidates.append((len(pairs(cand) & uncovered), len(candidates), cand))
        best = example = None
        # the config asked in order of gain
        for _, _, cand in sorted(candidates, key=lambda t: (-t[0], t[1])):
            if resolve(cand)[0] is not None:
                best = cand
                break
            example = example or cand
        if best is None:  # no accepted combination holds this pair: the config refuses it
            refused.append(example)
            uncovered.discard((a, va, b, vb))
            continue
        rows.append(best)
        uncovered -= pairs(best)
    return rows, refused


def combinations() -> tuple[list[dict], list[dict]]:
    """(the covering rows and the full product of the controller's axes, each product row's other axes from a
    covering row and repaired; the refused pairs' examples)."""
    pairwise, refused = covering_array(AXES)
    product = [dict(zip(CONTROLLER_AXES, values, strict=True))
               for values in itertools.product(*(AXES[a] for a in CONTROLLER_AXES))]
    filled = [repaired({**pairwise[i % len(pairwise)], **controller}, set(CONTROLLER_AXES))
              for i, controller in enumerate(product)]
    return pairwise + filled, refused


def overrides(c: dict) -> dict:
    """The JobConfig settings of a combination."""
    correction, level, *band = c["correction"]
    ppo = {"advantage": c["advantage"], "policy_loss": c["policy_loss"], "loss_aggregation": c["aggregation"],
           "correction": correction, "grpo_normalize": c["grpo_normalize"],
           "mask_truncated": c["mask_truncated"]}
    if correction not in ("none", "icepop"):  # IcePop has no cap; the masks keep their default bands
        ppo |= {"correction_level": level, "is_cap": 1e6}
    if band:
        ppo |= NARROW_ICEPOP
    if correction == "geometric_mask" and c["mode"] != "sync":  # async mode refuses the default band
        ppo |= ASYNC_GEOMETRIC
    if c["advantage"] == "gae":
        ppo |= {"lam": 1.0, "whiten_advantages": False}
    if c["policy_loss"] == "ppo":
        ppo |= {"clip_range": 0.9}
    elif c["policy_loss"] in ("gspo", "gspo_token"):
        ppo |= {"gspo_clip_low": 0.9, "gspo_clip_high": 0.9}  # CISPO's default bounds are [0, 5] already
    out = {"ppo": ppo, "kl": {"placement": c["placement"], "estimator": c["estimator"], "scope": c["scope"],
                              "loss_form": c["loss_form"]},
           "rollout": {"mode": "sync" if c["mode"] == "sync" else "async",
                       "dynamic_sampling": c["dynamic_sampling"],
                       "in_flight_updates": c.get("in_flight", "off")}}
    if c["advantage"] in ("grpo", "rloo", "reinforce_pp_baseline"):
        out["rollout"]["samples_per_prompt"] = 2
    if c["distill"] != "off":
        out["distill"] = {"teacher_path": "teacher-dir", "task_reward": c["distill"] == "with_task",
                          "coef": DISTILL_COEF}
    if c["shape"] == "multi_turn":
        out["task"] = {"name": "environment", "environment": "tests.agent_envs:make"}
    if c["shape"] == "agent_split":
        out["task"] = {"name": "agent", "path": "rows.jsonl"}
        out["rollout"]["agent"] = "tests.agent_programs:agent"
        out["model"] = {"path": "policy-dir"}
    return out


def resolve(c: dict) -> tuple[JobConfig | None, str | None]:
    """``JobConfig``'s answer for a combination: (the config, None), or (None, its refusal)."""
    key = tuple(sorted((k, repr(v)) for k, v in c.items()))
    if key not in _RESOLVED:
        _RESOLVED[key] = _resolve(c)
    return _RESOLVED[key]


_RESOLVED: dict = {}


def _resolve(c: dict) -> tuple[JobConfig | None, str | None]:
    """The config, then the check of the registered entries it chooses (``Algorithm.from_config``), as the
    job does before any actor."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # token_mean and grpo_token_k3 warn by design
        try:
            cfg = load_config(None, overrides(c))
            Algorithm.from_config(cfg)
            return cfg, None
        except ValueError as err:  # pydantic's ValidationError is one
            return None, str(err)


FIELD = re.compile(r"\b(rollout|ppo|kl|distill|task|reward|learner|model|reference)\.[a-z_]+")


# ---------------------------------------------------------------------------- the tabular problem


def all_responses() -> list[tuple[int, ...]]:
    """Every response of up to 3 model tokens over {0, 1, EOS}: EOS ends it, 3 tokens without EOS are cut."""
    out = [(EOS,)]
    for n in (1, 2):
        for prefix in itertools.product((0, 1), repeat=n):
            out += [(*prefix, EOS)] if n == 1 else [(*prefix, EOS)] + [(*prefix, t) for t in (0, 1)]
    return out


STATES = {prefix: i for i, prefix in enumerate([(), (0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1)])}


def sequence_logprob(table: torch.Tensor, y: tuple[int, ...]) -> torch.Tensor:
    logp = torch.log_softmax(table, -1)
    return sum(logp[STATES[y[:t]], y[t]] for t in range(len(y)))


@dataclass
class Problem:
    """Logit tables [7 states, 3 tokens] of every policy, and the task's rewards."""

    behaviour: torch.Tensor
    proximal: torch.Tensor
    current: torch.Tensor
    reference: torch.Tensor
    teacher: torch.Tensor
    values: torch.Tensor  # [7] the critic's value of each state
    turn_reward: torch.Tensor  # [2] the first turn's reward by its token (multi-turn shapes)
    score: dict  # response -> final score, 0 or 1
    mode: str = "sync"

    @classmethod
    def make(cls, seed: int, mode: str) -> Problem:
        """``mode`` sync (the engine holds the proximal version), async (an older version 0.35 away sampled),
        or async_mixed: the older version sampled each response's first token and a newer one (0.15 away) its
        later tokens, as when the engine's weights are updated in flight. The state holds the position (the
        prefix), so that sampler is one table: the older version's first row, the newer one's others."""
        g = torch.Generator().manual_seed(seed)

        def table(scale=1.0):
            return (scale * torch.randn(7, 3, generator=g)).double()

        proximal = table()
        behaviour = proximal + 0.35 * table() if mode != "sync" else proximal.clone()
        current = proximal + 0.1 * table()
        problem = cls(behaviour, proximal, current, table(), table(), torch.randn(7, generator=g).double(),
                      torch.randn(2, generator=g).double(),
                      # 0 or 1, as a verifier scores: groups of different responses tie, as dynamic
                      # sampling needs
                      {y: float(torch.rand(1, generator=g) < 0.5) for y in all_responses()})
        if mode == "async_mixed":  # drawn last: the other tables are async mode's own
            newer = proximal + 0.15 * table()
            problem.behaviour = torch.cat([behaviour[:1], newer[1:]])
        problem.mode = mode
        return problem

    def token_version(self, state: tuple | None) -> int:
        """The version that sampled a token from ``state`` (-1: the environment's): the learner's
        ``LEARNER_VERSION`` in sync mode, one older in async mode; in flight (async_mixed), two older for
        the first token and one older for the later ones."""
        if state is None:
            return -1
        if self.mode == "sync":
            return LEARNER_VERSION
        return LEARNER_VERSION - (2 if self.mode == "async_mixed" and state == () else 1)


def rows_of(y: tuple[int, ...], shape: str) -> list[tuple[list[int], list[int], list[tuple | None]]]:
    """One episode's rows: (ids, action mask, the model prefix of each position's token or None)."""
    states = [y[:t] for t in range(len(y))]
    if shape == "single" or len(y) == 1:
        return [(list(y), [1] * len(y), states)]
    if shape == "multi_turn":
        return [([y[0], ENV, *y[1:]], [1, 0] + [1] * (len(y) - 1), [states[0], None, *states[1:]])]
    return [([y[0]], [1], [states[0]]), ([ENV, *y[1:]], [0] + [1] * (len(y) - 1), [None, *states[1:]])]


def episode_rewards(problem: Problem, y: tuple[int, ...], shape: str) -> list[list[float]]:
    """Each row's per-position rewards: the first turn's at its token (multi-turn), the final score at the
    last model token of the episode (an agent's: of its last row)."""
    rows = rows_of(y, shape)
    out = [[0.0] * len(ids) for ids, _, _ in rows]
    final = problem.score[y]
    if shape == "single":
        out[0][-1] = final
        return out
    if len(y) > 1:
        first = float(problem.turn_reward[y[0]])
        if shape == "multi_turn":
            out[0][0] = first
        else:  # an agent: one reward, the episode's, on its last row's last token
            final += first
    out[-1][len(rows[-1][0]) - 1] += final
    return out


def logprob_rows(table: torch.Tensor, states: list[list], ids: list[list[int]]) -> torch.Tensor:
    """[R, WIDTH] log-probs of each row's tokens under ``table`` (one table, or [R, 7, 3] one per row); 0 off
    the model's tokens."""
    logp = torch.log_softmax(table, -1)
    out = []
    for r, (row_states, row_ids) in enumerate(zip(states, ids, strict=True)):
        row_table = logp if logp.dim() == 2 else logp[r]
        values = [row_table[STATES[s], t] if s is not None else row_table.new_zeros(()) for s, t in
                  zip(row_states, row_ids, strict=True)]
        out.append(torch.stack(values + [row_table.new_zeros(())] * (WIDTH - len(values))))
    return torch.stack(out)


# ---------------------------------------------------------------------------- a rank over the tables


class TabularEngine:
    """``learner.engine.TrainingEngine`` over the harness's tabular policy: each row of an enumeration has its
    own copy of the logit table (``theta`` [R, 7, 3], a row found by its ``prompt_index``), so that a step's
    gradient holds each row's; values from the problem's table. ``step`` keeps the gradient and moves
    nothing, so every step of an update is taken at the table it started from."""

    rank, world_size, device, lm = 0, 1, torch.device("cpu"), None

    def __init__(self, table: Tensor, states: list[list], ids: list[list[int]], values: Tensor) -> None:
        from learner.ppo import LOCAL

        self.reducer, self.states, self.ids, self.values = LOCAL, states, ids, values
        self.theta = torch.nn.Parameter(table.expand(len(ids), *table.shape).clone())
        self.steps: list[Tensor] = []
        self._lr = 1.0

    def forward(self, batch: RolloutBatch, grad: bool):
        rows = batch.prompt_index.tolist()
        states, ids = [self.states[i] for i in rows], [self.ids[i] for i in rows]
        with torch.set_grad_enabled(grad):
            logprobs = logprob_rows(self.theta[rows], states, ids)
        zero = self.values.new_zeros(())
        values = torch.stack([torch.stack([self.values[STATES[s]] if s is not None else zero for s in row]
                                          + [zero] * (WIDTH - len(row))) for row in states])
        return logprobs, values, torch.zeros(logprobs.shape, dtype=torch.float64)  # entropy: stats only

    def backward(self, loss: Tensor, boundary: bool | None = None) -> None:
        loss.backward()

    def step(self) -> None:
        self.steps.append(self.theta.grad.clone())
        self.theta.grad = None

    def set_lr(self, lr: float) -> None:
        self._lr = lr

    def lr(self) -> float:
        return self._lr

    def agree(self, count: int) -> int:
        return count

    def lockstep(self, forwards: int):
        import contextlib

        return contextlib.nullcontext()

    def filler_backward(self, boundary: bool | None) -> None:
        raise AssertionError("one rank has no filler")


class TabularReference:
    """The frozen reference a rank scores with (``actors.reference.ReferenceModel``'s ``score``), over a
    table."""

    def __init__(self, table: Tensor, states: list[list], ids: list[list[int]]) -> None:
        self.table, self.states, self.ids = table, states, ids

    def score(self, chunk: RolloutBatch) -> Tensor:
        rows = chunk.prompt_index.tolist()
        return logprob_rows(self.table, [self.states[i] for i in rows],
                            [self.ids[i] for i in rows]) * chunk.action_mask


@dataclass
class Enumeration:
    """Every episode (every pair of episodes for a group estimator) as one batch, with each row's weight."""

    batch: RolloutBatch
    states: list[list]
    ids: list[list[int]]
    weight: torch.Tensor  # [R] the probability under the behaviour policy of the row's group
    group_size: int
    responses: list[tuple[int, ...]]  # [R] the episode's response


def enumerate_batch(problem: Problem, shape: str, group_size: int) -> Enumeration:
    responses = all_responses()
    groups = [(y,) for y in responses] if group_size == 1 else list(itertools.product(responses, repeat=2))
    prompts, ids, masks, states, rewards, finish, group_index, episode_index, weight, of = (
        [] for _ in range(10))
    episode = 0
    for g, members in enumerate(groups):
        w = math.exp(sum(float(sequence_logprob(problem.behaviour, y)) for y in members))
        for y in members:
            for (row_ids, row_mask, row_states), row_rewards in zip(rows_of(y, shape),
                                                                     episode_rewards(problem, y, shape),
                                                                     strict=True):
                prompts.append([0])
                (ids.append(row_ids), masks.append(row_mask), states.append(row_states),
                 rewards.append(row_rewards))
                finish.append(FINISH_STOP if y[-1] == EOS else FINISH_LENGTH)
                group_index.append(g if group_size > 1 else -1), episode_index.append(episode)
                weight.append(w), of.append(y)
            episode += 1
    behaviour = logprob_rows(problem.behaviour, states, ids)
    episodic = shape != "single"
    # each token's version as the engine reports it: in flight, a row's tokens span two
    versions = [[problem.token_version(s) for s in row] for row in states]
    batch = make_batch(prompts, ids, [row[: len(i)].tolist() for row, i in zip(behaviour, ids, strict=True)],
                       finish, list(range(len(ids))), 0, LEARNER_VERSION, BETA, response_width=WIDTH,
                       group_index=group_index, action_masks=masks, episode_index=episode_index,
                       episodes=Episodes(rewards, [1] * len(ids), [0] * len(ids), [0.0] * len(ids),
                                         [0] * len(ids)) if episodic else None,
                       token_versions=versions if problem.mode == "async_mixed" else None)
    if problem.mode == "async":  # one older version sampled each row
        batch.policy_version = batch.policy_version - 1
    batch.rollout_logprobs = behaviour  # the harness is float64 throughout
    batch.action_mask = batch.action_mask.double()
    batch.response_mask = batch.response_mask.double()
    if batch.turn_rewards is not None:  # exact: make_batch's float32 would round them
        batch.turn_rewards = pad_right(rewards, 0.0, WIDTH, dtype=torch.float64)
    # collected as a rank collects a chunk: the learner's forward at the start of the update (old log-probs
    # and values), the reference the rank scores itself (its frozen copy), the scores and the teacher's
    engine = TabularEngine(problem.proximal, states, ids, problem.values)
    scoring = RankScoring(engine, TabularReference(problem.reference, states, ids), None)
    scores = torch.tensor([sum(r) for r in rewards], dtype=torch.float64)
    collect_chunk(engine, scoring, batch, 0, False, scores, None, logprob_rows(problem.teacher, states, ids))
    return Enumeration(batch, states, ids, torch.tensor(weight, dtype=torch.float64), group_size, of)


# ---------------------------------------------------------------------------- exact objectives


def exact_kl(table: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """KL(pi_table || pi_other) of whole responses, by enumeration (differentiable in ``table``)."""
    return sum(sequence_logprob(table, y).exp() * (sequence_logprob(table, y) - sequence_logprob(other, y))
               for y in all_responses())


def exact_score(table: torch.Tensor, problem: Problem, shape: str) -> torch.Tensor:
    return sum(sequence_logprob(table, y).exp() * sum(sum(r) for r in episode_rewards(problem, y, shape))
               for y in all_responses())


def objective_gradient(fn, at: torch.Tensor) -> torch.Tensor:
    theta = at.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(fn(theta), theta)
    return grad


# ---------------------------------------------------------------------------- running the layer


def trained_rows(algorithm: Algorithm, batch: RolloutBatch) -> tuple[Tensor, Tensor | None]:
    """The rank's dynamic sampling (``Algorithm.select``, keeping every group whose scores differ): (the rows
    it trains on, the rows it drops or None)."""
    if not algorithm.dynamic_sampling:
        return torch.arange(batch.shape[0]), None
    keep, _ = algorithm.select(batch, algorithm.differing_groups(batch))
    return keep.nonzero().squeeze(-1), (~keep).nonzero().squeeze(-1)


def fed_statistic(algorithm: Algorithm, e: Enumeration) -> float:
    """The expectation of the statistic the controller is fed, exact, through the rank's path: dynamic
    sampling's selection, ``Algorithm.controller_values`` over what ``Algorithm.sampled`` holds, the driver's
    scope (``kl.scope``). A ratio statistic (``token_mean``) is taken at its large-batch limit, E[sum] /
    E[tokens]."""
    from learner.kl import controller_statistic

    kept, dropped = trained_rows(algorithm, e.batch)
    sampled = algorithm.sampled(e.batch[kept], None if dropped is None else e.batch[dropped])
    view = episode_view(sampled)
    # make_batch's prompt_index: the row's number
    w = view.first(e.weight[sampled.prompt_index]) / e.group_size
    x = algorithm.controller_values(sampled)
    # the rank's own call gives the same sums, counted per episode
    sums = algorithm.controller_sums(e.batch[kept], None if dropped is None else e.batch[dropped])
    tokens = float(sampled.action_mask.sum())
    assert sums["num_responses"] == view.episodes and sums["num_tokens"] == tokens, (sums, view.episodes)
    assert abs(sums["response_sum"] - float(x.sum())) <= 1e-9 * max(1.0, abs(float(x.sum()))), sums
    total = {"response_sum": float((w * x).sum()), "num_responses": float(w.sum()),
             "num_tokens": float((w * view.total(sampled.action_mask.sum(-1))).sum()), "empty_responses": 0.0,
             **{f"{k}_response_sum": 0.0 for k in KL_ESTIMATORS.names()}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return controller_statistic(kl_stats_from_sums(total), algorithm.kl.scope)


def token_logprob(table: Tensor, y: tuple[int, ...], t: int) -> Tensor:
    return sequence_logprob(table, y[: t + 1]) - sequence_logprob(table, y[:t])


def documented_statistic(problem: Problem, estimator: str, scope: str) -> float:
    """The statistic the docs define for the KL estimator ``estimator`` (its entry's ``objective``, k(r)), by
    enumeration: ``E_prox[sum_t k(r_t)]`` per episode (the prefix weights make the sampler's rows estimate
    it), or per token (``token_mean``, its large-batch limit: that over the tokens the sampler drew,
    E_behav[|y|])."""
    k = KL_ESTIMATORS.get(estimator).objective
    total = tokens = 0.0
    for y in all_responses():
        r = torch.stack([token_logprob(problem.proximal, y, t) - token_logprob(problem.reference, y, t)
                         for t in range(len(y))])
        total += float(sequence_logprob(problem.proximal, y).exp()) * float(k(r).sum())
        tokens += float(sequence_logprob(problem.behaviour, y).exp()) * len(y)
    return total if scope == "response_sum" else total / tokens


def layer_gradient(algorithm: Algorithm, e: Enumeration, at: torch.Tensor,
                   kl_coef: float) -> tuple[Tensor, dict]:
    """The expected gradient of the objective the layer's loss descends, at the policy ``at`` (a logit table),
    exact: every row has its own copy of the table, so one backward gives each row's gradient, which the rows'
    behaviour weights average. The loss divides its sum over episodes by a count over the batch (its tokens,
    or episodes, ``Algorithm.loss_counts``), a constant per episode as the batch grows: the expectation is
    taken of the sum per episode, the gradient of the documented objective. Returns (minus the loss's expected
    gradient per episode [7, 3], prepare's sums on the enumeration batch)."""
    rows, _ = trained_rows(algorithm, e.batch)
    batch, weight = e.batch[rows], e.weight[rows]
    states, ids = [e.states[i] for i in rows.tolist()], [e.ids[i] for i in rows.tolist()]
    sums = algorithm.prepare(batch, kl_coef)
    counts = algorithm.loss_counts(batch)
    theta = at.expand(batch.shape[0], *at.shape).clone().requires_grad_(True)
    logprobs = logprob_rows(theta, states, ids)
    values = batch.old_values.clone() if algorithm.has_critic else None
    entropy = torch.zeros(logprobs.shape, dtype=torch.float64)
    loss, _ = algorithm.loss(batch, (logprobs, values, entropy), counts, kl_coef)
    (per_row,) = torch.autograd.grad(loss, theta)
    return expected_step(algorithm, per_row, weight, e.group_size, counts, kl_coef), sums


def expected_step(algorithm: Algorithm, per_row: Tensor, weight: Tensor, group_size: int, counts: dict,
                  kl_coef: float) -> Tensor:
    """Minus the expected gradient per episode [7, 3] of the rows' own gradients ``per_row`` [R, 7, 3], each
    weighted by its group's behaviour probability ``weight`` [R] (once per group: / ``group_size``), times
    the count the loss divided by (the KL term's where the KL in the loss is the only term)."""
    expected = torch.einsum("r,rsv->sv", weight, per_row) / group_size
    kl_only = "kl_count" in counts and kl_coef > 0 and algorithm.kl.placement == "loss"
    return -expected * float(counts["kl_count"] if kl_only else counts["denominator"])


def prepared(algorithm: Algorithm, e: Enumeration) -> tuple[RolloutBatch, dict]:
    """The enumeration's rows with their advantages (the score alone, no KL penalty) and their loss
    counts."""
    batch = e.batch.clone()
    algorithm.prepare(batch, 0.0)
    return batch, algorithm.loss_counts(batch)


def reference_step(algorithm: Algorithm, e: Enumeration, batch: RolloutBatch, counts: dict, at: Tensor,
                   terms_of) -> Tensor:
    """``expected_step`` of a documented objective: ``terms_of(logprobs)``, the [R, T] per-token terms of the
    rows' log-probs under their own copies of the table ``at``, summed over the tokens and divided by the
    loss's count as the layer divides its loss."""
    theta = at.expand(batch.shape[0], *at.shape).clone().requires_grad_(True)
    terms = terms_of(logprob_rows(theta, e.states, e.ids))
    (per_row,) = torch.autograd.grad((terms * batch.action_mask).sum() / counts["denominator"], theta)
    return expected_step(algorithm, per_row, e.weight, e.group_size, counts, 0.0)


def documented_gradient(algorithm: Algorithm, e: Enumeration, at: Tensor, kl_coef: float) -> Tensor:
    """``layer_gradient`` of the policy term written again from the entries' documented formulas: each
    token's ``ppo.correction`` factor (its entry's ``objective``: the cap, band or mask included) times
    ``ppo.policy_loss``'s documented objective on the ratio to pi_old, aggregated as ``ppo.loss_aggregation``
    says (``sequence_mean``: each episode's tokens by 1 / its length), without the rows cut at the cap under
    ``ppo.mask_truncated``, on the rows the rank trains with the advantages its estimator gives them (each
    estimator checked against its own formula, ``check_advantage_estimator_entry``). The loss's count is a
    constant per episode, which ``layer_gradient`` takes out: none here. Where a setting changes the objective
    on purpose (a bias by design) this is the biased objective: the bias is the reference's number, which the
    layer must match."""
    rows, _ = trained_rows(algorithm, e.batch)
    batch, weight = e.batch[rows], e.weight[rows]
    row_mask = batch.action_mask.clone()
    algorithm.prepare(batch, kl_coef)
    p, view = algorithm.ppo, episode_view(batch)
    if p.mask_truncated:  # DAPO's overlong filtering: a response cut at the cap is out of the loss
        row_mask = row_mask * (batch.finish_reason != FINISH_LENGTH).unsqueeze(-1)
    theta = at.expand(batch.shape[0], *at.shape).clone().requires_grad_(True)
    logprobs = view.merge(logprob_rows(theta, [e.states[i] for i in rows.tolist()],
                                       [e.ids[i] for i in rows.tolist()]))
    mask, advantages = view.merge(row_mask), view.merge(batch.advantages)
    old, behaviour = view.merge(batch.old_logprobs) * mask, view.merge(batch.rollout_logprobs) * mask
    factor = CORRECTIONS.get(p.correction).objective(old, behaviour, logprobs.detach(), advantages, mask,
                                                     p.correction_level, p)
    terms = factor * POLICY_LOSSES.get(p.policy_loss).objective((logprobs - old) * mask, advantages, mask, p)
    length = mask.sum(-1, keepdim=True).clamp(min=1)
    per_token = 1 / length if p.loss_aggregation == "sequence_mean" else torch.ones_like(length)
    (per_row,) = torch.autograd.grad((terms * mask * per_token).sum(), theta)
    return -torch.einsum("r,rsv->sv", weight, per_row) / e.group_size


def relative_error(got: Tensor, want: Tensor) -> float:
    scale = float(want.norm())
    return float((got - want).norm()) / scale if scale > 1e-12 else float((got - want).norm())


# ---------------------------------------------------------------------------- what each combination should be


def expected_classes(c: dict, mask_binds: bool = False) -> dict[str, str]:
    """The documented class of each check: exact, bounded, or biased (by design). ``mask_binds``: the
    correction's mask (IcePop's band, the geometric band, the off-policy sequence mask) drops a token of the
    problem at the step the gradient is taken (``mask_binds``); one that drops none leaves the class of the
    weights it multiplies."""
    unbiased = KL_ESTIMATORS.get(c["estimator"]).unbiased
    statistic = "exact" if unbiased and c["scope"] == "response_sum" else "biased"
    # the token-level correction weighs a token by its own ratio, not its prefix's: bounded, in async mode
    # only (IcePop's weight inside its band is the token's ratio, untruncated: the same)
    base = "bounded" if c["mode"] != "sync" and c["correction"][1] == "token" else "exact"

    def policy_term(per_token_advantages: bool) -> str:
        """What the policy loss makes of a term: 1 / length weights (sequence_mean), rows left out (DAPO's
        overlong filtering, a binding mask) and whitening change the objective; GSPO's one ratio per response
        averages a term's advantages over the response, exact only where they are one per response. CISPO and
        SAPO are the policy gradient at the step's start (rho = 1): as PPO."""
        if c["aggregation"] == "sequence_mean" or c["mask_truncated"] or mask_binds:
            return "biased"
        sequence_ratio = POLICY_LOSSES.get(c["policy_loss"]).ratio_level == "sequence"
        if c["advantage"] in ("reinforce_pp", "reinforce_pp_baseline") or (sequence_ratio
                                                                           and per_token_advantages):
            return "biased"
        return base

    normalised_return = c["advantage"] == "grpo" and c["grpo_normalize"] == "return"
    if c["distill"] == "without_task":  # no task reward reaches the gradient at all (issue A)
        score = "exact"
    elif c["advantage"] == "grpo" or (c["dynamic_sampling"] and c["advantage"] != "rloo"):
        score = "biased"  # the group's std; a selection on scores (RLOO's tied groups carry 0 anyway)
    else:
        score = policy_term(c["advantage"] == "gae")
    if c["dynamic_sampling"]:  # dropped groups' KL is left out of the gradient: a selection on scores
        kl = "biased"
    elif c["placement"] == "loss":
        kl = "biased" if c["loss_form"] == "grpo_token_k3" else "exact"
    else:
        kl = ("biased" if not KL_ESTIMATORS.get(c["estimator"]).exact_penalty_gradient or normalised_return
              else policy_term(c["advantage"] != "rloo"))
    # the statistic against what the docs define for the estimator and scope: exact everywhere
    # and each policy term's gradient against its documented objective (a bias by design included): exact
    out = {"statistic": statistic, "statistic_documented": "exact", "score": score, "kl": kl,
           "score_documented": "exact", "kl_documented": "exact"}
    if c["distill"] != "off":
        out["teacher"] = "biased" if normalised_return or c["dynamic_sampling"] else \
            policy_term(c["advantage"] != "rloo")
        out["teacher_documented"] = "exact"
    return out


def zeroed_scores(e: Enumeration) -> Enumeration:
    batch = e.batch.clone()
    batch.scores = torch.zeros_like(batch.scores)
    if batch.turn_rewards is not None:
        batch.turn_rewards = torch.zeros_like(batch.turn_rewards)
    return Enumeration(batch, e.states, e.ids, e.weight, e.group_size, e.responses)


def with_logprobs(e: Enumeration, **tables) -> Enumeration:
    batch = e.batch.clone()
    for name, table in tables.items():
        setattr(batch, name, logprob_rows(table, e.states, e.ids) if table is not None else
                torch.zeros_like(batch.old_values))
    return Enumeration(batch, e.states, e.ids, e.weight, e.group_size, e.responses)


_DOCUMENTED: dict[tuple, float] = {}  # (mode, estimator, scope) -> documented_statistic


def check_combination(c: dict, cfg: JobConfig, problems: dict) -> dict[str, float]:
    """Run the layer on the tabular problem of ``c``; returns {check: relative error}."""
    algorithm = Algorithm.from_config(cfg)
    group = 2 if cfg.rollout.samples_per_prompt > 1 else 1
    problem, e = problems[(c["mode"], c["shape"], group)]
    measured = {}

    def against_documented(check: str, rows: Enumeration, at: Tensor, kl_coef: float, got: Tensor) -> None:
        documented = documented_gradient(algorithm, rows, at, kl_coef)
        measured[f"{check}_documented"] = relative_error(got, documented)
    distill = c["distill"] != "off"

    # the controller's statistic against KL(proximal || reference)
    fed = fed_statistic(algorithm, e)
    truth = float(exact_kl(problem.proximal, problem.reference))
    error = abs(fed - truth) / truth
    measured["statistic"] = error
    key = (c["mode"], c["estimator"], c["scope"])
    if key not in _DOCUMENTED:
        _DOCUMENTED[key] = documented_statistic(problem, c["estimator"], c["scope"])
    measured["statistic_documented"] = abs(fed - _DOCUMENTED[key]) / abs(_DOCUMENTED[key])

    # the penalty identity on the trained rows, with the teacher switched off (its log-probs = the learner's)
    quiet = with_logprobs(e, teacher_logprobs=problem.proximal)
    rows, _ = trained_rows(algorithm, quiet.batch)
    batch = quiet.batch[rows]
    sums = algorithm.prepare(batch, BETA)
    trained_scores = 0.0 if c["distill"] == "without_task" else float(algorithm.final_scores(batch)[0].sum())
    penalty = BETA * sums["penalty_sum"] if c["placement"] == "reward" else 0.0
    identity = abs(sums["reward_sum"] - (trained_scores - penalty))
    assert identity < 1e-9, (c, sums, trained_scores)

    # each term's expected gradient against that term's own gradient, at the proximal policy (the first step)
    # for the terms in the policy loss, at the current policy for the KL in the loss (its weights are exact
    # anywhere)
    got, _ = layer_gradient(algorithm, quiet, problem.proximal, 0.0)
    if c["distill"] == "without_task":  # the task's scores and turn rewards reach nothing: as if they were 0
        score_target = torch.zeros_like(problem.proximal)
        measured["score"] = relative_error(got, layer_gradient(algorithm, zeroed_scores(quiet),
                                                               problem.proximal, 0.0)[0])
    else:
        score_target = objective_gradient(lambda t: exact_score(t, problem, c["shape"]), problem.proximal)
        measured["score"] = relative_error(got, score_target)
    against_documented("score", quiet, problem.proximal, 0.0, got)

    no_values = (with_logprobs(zeroed_scores(quiet), old_values=None) if c["placement"] == "loss"
                 else zeroed_scores(quiet))
    at = problem.current if c["placement"] == "loss" else problem.proximal
    kl_target = -BETA * objective_gradient(lambda t: exact_kl(t, problem.reference), at)
    # no score, no group kept: the selection is the bias; measured with the scores on
    kl_rows = quiet if c["dynamic_sampling"] else no_values
    got, _ = layer_gradient(algorithm, kl_rows, at, BETA)
    if c["dynamic_sampling"]:
        kl_target = kl_target + score_target
    measured["kl"] = relative_error(got, kl_target)
    if c["placement"] == "reward":  # in the loss, the KL is a term of its own (``response_kl_loss``)
        against_documented("kl", kl_rows, at, BETA, got)

    if distill:  # the reverse KL to the teacher, the task score and the reference KL switched off
        teaching = with_logprobs(zeroed_scores(e), teacher_logprobs=problem.teacher)
        target = -DISTILL_COEF * objective_gradient(lambda t: exact_kl(t, problem.teacher), problem.proximal)
        teacher_rows = teaching if not c["dynamic_sampling"] else e
        got, _ = layer_gradient(algorithm, teacher_rows, problem.proximal, 0.0)
        measured["teacher"] = relative_error(got, target + (score_target if c["dynamic_sampling"] else 0))
        against_documented("teacher", teacher_rows, problem.proximal, 0.0, got)
    return measured


# the values whose gradient checks the harness prints apart (the later settings: mixed versions, CISPO,
# SAPO, masks)
NEW_VALUES = ("mode async_mixed", "in_flight keep_kv", "in_flight partial", "policy_loss cispo",
              "policy_loss sapo", "correction icepop", "correction icepop [0.8, 1.25]",
              "correction geometric_mask", "correction off_policy_mask")


def label_of(c: dict) -> str:
    """The correction's name, IcePop's narrow band marked."""
    return c["correction"][0] + (" [0.8, 1.25]" if len(c["correction"]) > 2 else "")


def mask_binds(c: dict, cfg: JobConfig, problems: dict) -> bool | None:
    """Whether the correction's mask drops a token of the problem at the step the gradient is taken (the
    proximal policy), from the problem's tables at the config's bands: IcePop's band on a token's k = pi_prox
    / pi_behav, the geometric band on an episode's exp(mean_t log k_t), the off-policy mask's delta on an
    episode's mean log(pi_behav / pi_prox) (its negative-advantage tokens). None for a correction without a
    mask."""
    kind, p = c["correction"][0], cfg.ppo
    if kind not in ("icepop", "geometric_mask", "off_policy_mask"):
        return None
    group = 2 if cfg.rollout.samples_per_prompt > 1 else 1
    batch = problems[(c["mode"], c["shape"], group)][1].batch
    view = episode_view(batch)
    mask = view.merge(batch.action_mask)
    log_k = view.merge((batch.old_logprobs - batch.rollout_logprobs) * batch.action_mask)
    if kind == "icepop":
        outside = (log_k < math.log(p.icepop_low)) | (log_k > math.log(p.icepop_high))
        return bool((outside & (mask > 0)).any())
    per_episode = log_k.sum(-1) / mask.sum(-1).clamp(min=1)  # mean log k, minus the off-policy divergence
    if kind == "geometric_mask":
        low, high = math.log(p.geometric_mask_low), math.log(p.geometric_mask_high)
        return bool(((per_episode < low) | (per_episode > high)).any())
    return bool((-per_episode > p.off_policy_mask_delta).any())


CHECKS = {"statistic": "the controller's statistic against KL(pi_prox \\|\\| pi_ref)",
          "statistic_documented": "the controller's statistic against its estimator's documented expectation",
          "score": "the task score's expected gradient", "kl": "the reference KL's expected gradient",
          "teacher": "the teacher's reverse KL's expected gradient",
          "score_documented": "the task score's expected gradient against its documented objective's",
          "kl_documented": "the reference KL's (in the reward) against its documented objective's",
          "teacher_documented": "the teacher's reverse KL's against its documented objective's"}
FIGURES = ROOT / "docs" / "harness-figures.md"


def span(errors: list[float], cls: str = "") -> str:
    """A range of relative errors as the docs give it: an exact class by its bound, and an error below it as 0
    (their digits at 1e-16 are the machine's rounding); the others to two significant digits."""
    if cls == "exact":
        return "below 1e-6"
    low, high = (f"{x:.2g}" if x >= EXACT else "0" for x in (min(errors), max(errors)))
    return low if low == high else f"{low} .. {high}"


def figures(section: str, lines: list[str]) -> None:
    """The harness's figures of ``section`` in docs/harness-figures.md, between its markers: the page must
    hold exactly what this run measured (``TETHER_WRITE_FIGURES=1`` writes them instead)."""
    text = FIGURES.read_text()
    start, end = f"<!-- {section} -->\n", f"<!-- /{section} -->"
    i, j = text.index(start) + len(start), text.index(end)
    body = "\n".join(lines) + "\n"
    if os.environ.get("TETHER_WRITE_FIGURES"):
        FIGURES.write_text(text[:i] + body + text[j:])
        return
    assert text[i:j] == body, (f"docs/harness-figures.md's {section!r} figures are not this run's; run the "
                               "harness with TETHER_WRITE_FIGURES=1 to write them:\n" + body)


def seed_table(what: str, rows: dict[str, list[float]], against: str = "") -> list[str]:
    """A table of each row's relative gradient errors over the seeds, an exact row by its class's bound."""
    return [f"| {what} | relative gradient error{against} (min .. max over seeds) |", "|---|---|",
            *(f"| {name} | {span(errors)} |" for name, errors in rows.items())]


def stated_bound(c: dict, problems: dict) -> float | None:
    """The bound ``c``'s correction states on its token-level bias at the problem's shift (None: none
    stated)."""
    per_nat = TOKEN_LEVEL_BOUND_PER_NAT.get(c["correction"][0])
    return None if per_nat is None else per_nat * token_shift(problems[(c["mode"], "single", 1)][0])


def meets(expected: str, error: float, bound: float | None = None) -> bool:
    """Whether a measured error fits its documented class: exact below ``EXACT``; bounded within ``bound``,
    its correction's own (``stated_bound``); biased by design never silently exact (and equal to its
    documented objective, a check of its own)."""
    if expected == "exact":
        return error < EXACT
    if expected == "bounded":
        assert bound is not None, "a bounded check of a correction that states no token-level bound"
        return error <= bound
    return error >= EXACT


def check_combinations(problems: dict, limit: int = 24, **values) -> int:
    """The harness's checks of each accepted combination that holds ``values`` (axis -> value), at most
    ``limit`` of them: the check a bug in the code of one axis's value must fail. Returns how many ran."""
    combos, refused_pairs = combinations()
    ran = 0
    for c in refused_pairs + combos:
        if ran == limit or any(c[axis] != value for axis, value in values.items()):
            continue
        cfg, _ = resolve(c)
        if cfg is None:
            continue
        expected, bound = expected_classes(c, bool(mask_binds(c, cfg, problems))), stated_bound(c, problems)
        for check, error in check_combination(c, cfg, problems).items():
            assert meets(expected[check], error, bound), (check, expected[check], error, c)
        ran += 1
    assert ran, f"no accepted combination holds {values}"
    return ran


# ---------------------------------------------------------------------------- the harness


def make_problems() -> dict:
    """(mode, shape, group size) -> (the problem, its enumeration, collected as a rank collects)."""
    out = {}
    for mode in AXES["mode"]:
        for shape in AXES["shape"]:
            problem = Problem.make(7, mode)
            for group in (1, 2):
                out[(mode, shape, group)] = (problem, enumerate_batch(problem, shape, group))
    return out


@pytest.fixture(scope="module")
def problems() -> dict:
    return make_problems()


def test_every_accepted_combination_is_exact_bounded_or_biased_by_design_and_every_refusal_names_its_fields(
    problems
):
    combos, refused_pairs = combinations()
    table: dict[tuple, list[float]] = {}
    bound: dict[tuple, set] = {}  # (mask, mode) -> whether it bound, over the accepted combinations
    by_value: dict[str, dict] = {}  # a new setting's value -> class -> the errors of its gradient checks
    refused = 0
    failures = []
    shifts = {mode: token_shift(problems[(mode, "single", 1)][0]) for mode in AXES["mode"]}
    for c in refused_pairs + combos:
        cfg, error = resolve(c)
        if cfg is None:
            refused += 1
            named = {m.group(0) for m in FIELD.finditer(error)}
            assert named, f"refusal names no field: {error}"
            continue
        binds = mask_binds(c, cfg, problems)
        if binds is not None:
            bound.setdefault((label_of(c), c["mode"]), set()).add(binds)
        expected = expected_classes(c, bool(binds))
        for check, err in check_combination(c, cfg, problems).items():
            table.setdefault((check, expected[check]), []).append(err)
            values = (f"mode {c['mode']}", f"in_flight {c['in_flight']}", f"policy_loss {c['policy_loss']}",
                      f"correction {label_of(c)}")
            for value in values:
                if check in ("score", "kl", "teacher") and value in NEW_VALUES:
                    by_value.setdefault(value, {}).setdefault(expected[check], []).append(err)
            if not meets(expected[check], err, stated_bound(c, problems)):
                failures.append((check, expected[check], err, c))
    total = len(combos) + len(refused_pairs)
    counts = (f"{total} combinations: {total - refused} accepted, {refused} refused ({len(refused_pairs)} "
              "pairs of values no accepted combination holds).")
    stated = ", ".join(f"`{name}` {per_nat:g}" for name, per_nat in TOKEN_LEVEL_BOUND_PER_NAT.items())
    shift = ", ".join(f"{mode} {shifts[mode]:.3f}" for mode in AXES["mode"] if mode != "sync")
    bounds = (f"A bounded check is held to its correction's stated bound per nat of shift ({stated}) times "
              f"the problem's mean per-token shift between the learner and the engine ({shift} nats).")
    lines = [counts, "", bounds, "",
             "| check | class | accepted combinations | relative error (min .. max) |", "|---|---|---|---|"]
    order = {cls: i for i, cls in enumerate(("exact", "bounded", "biased"))}
    lines += [f"| {CHECKS[check]} | {cls} | {len(errors)} | {span(errors, cls)} |"
              for (check, cls), errors in sorted(table.items(), key=lambda kv: (list(CHECKS).index(kv[0][0]),
                                                                                 order[kv[0][1]]))]
    lines += ["", "| setting | gradient checks: class, how many, relative error (min .. max) |", "|---|---|"]
    lines += [f"| `{value}` | " + "; ".join(f"{cls} {len(errors)}: {span(errors, cls)}"
                                            for cls, errors in sorted(by_value[value].items())) + " |"
              for value in NEW_VALUES]
    lines += ["", "| mask | mode | drops a token of the problem |", "|---|---|---|"]
    lines += [f"| `{kind}` | {mode} | {' and '.join(sorted(map(str, binds)))} |"
              for (kind, mode), binds in sorted(bound.items())]
    assert not failures, "\n".join(map(repr, failures[:10])) + f"\n... {len(failures)} in all"
    figures("combinations", lines)
    # every mask is exercised both ways: not binding where the engine holds the learner's version (k = 1),
    # binding at the async shift, where the class it changes to (biased) is checked
    for label in ("icepop [0.8, 1.25]", "geometric_mask", "off_policy_mask"):
        assert bound[(label, "sync")] == {False}, label
        assert bound[(label, "async")] == bound[(label, "async_mixed")] == {True}, label
    assert bound[("icepop", "async")] == {False}  # [0.5, 5]: bounded, as the uncapped token-level weight


# ---------------------------------------------------------------------------- the figures the docs quote


SEEDS = (1, 2, 3, 4, 5)
GRPO_ASYNC = {"mode": "async", "placement": "reward", "estimator": "k1", "loss_form": None,
              "scope": "response_sum", "advantage": "rloo", "policy_loss": "ppo", "aggregation": "token_mean",
              "grpo_normalize": "score", "mask_truncated": False, "dynamic_sampling": False, "distill": "off",
              "shape": "single"}


def token_shift(problem: Problem, other: Tensor | None = None) -> float:
    """The mean |log pi_prox - log pi_other| per token under the behaviour policy, ``other`` the behaviour's
    table by default: how far the engine's version is from the learner's at the harness's async shift (or the
    current policy from the proximal one)."""
    other = problem.behaviour if other is None else other
    total = sum(math.exp(float(sequence_logprob(problem.behaviour, y))) * sum(
        abs(float(sequence_logprob(problem.proximal, y[: t + 1]) - sequence_logprob(problem.proximal, y[:t])
                  - sequence_logprob(other, y[: t + 1]) + sequence_logprob(other, y[:t])))
        for t in range(len(y))) for y in all_responses())
    length = sum(math.exp(float(sequence_logprob(problem.behaviour, y))) * len(y) for y in all_responses())
    return total / length


GEOMETRIC_DEFAULT = "geometric_mask token, band [0.999, 1.001] (the default; async mode refuses it), uncapped"
GEOMETRIC_ASYNC = "geometric_mask token, band [0.95, 1.05], uncapped"


def mixed_target(problem: Problem) -> Tensor:
    """The gradient of the score minus beta times the reference KL at the proximal policy (what the layer's
    first step should follow, whichever versions sampled)."""
    return objective_gradient(
        lambda t: exact_score(t, problem, "single") - BETA * exact_kl(t, problem.reference), problem.proximal)


def test_rollout_correction_and_placement_figures_over_seeds():
    """The figures the docs state for the rollout correction and the two KL placements, measured over seeds on
    the harness's async problem (RLOO, groups of 2, the score and the KL in the reward), and their bounds."""
    rows, shifts, mixed_shifts = {}, [], []
    for seed in SEEDS:
        problem = Problem.make(seed, "async")
        shifts.append(token_shift(problem))
        e = enumerate_batch(problem, "single", 2)
        e = with_logprobs(e, teacher_logprobs=problem.proximal)
        target = objective_gradient(
            lambda t, p=problem: exact_score(t, p, "single") - BETA * exact_kl(t, p.reference),
            problem.proximal)
        mixed = Problem.make(seed, "async_mixed")  # the same versions, a newer one sampling the later tokens
        mixed_shifts.append(token_shift(mixed))
        e_mixed = with_logprobs(enumerate_batch(mixed, "single", 2), teacher_logprobs=mixed.proximal)
        # (name, correction, level, is_cap or None for IcePop's, the settings beside, mixed versions)
        for name, correction, level, cap, extra, in_flight in (
                ("tis token, cap 2 (the default)", "tis", "token", 2.0, {}, False),
                ("tis token, uncapped", "tis", "token", 1e6, {}, False),
                ("tis sequence, cap 2", "tis", "sequence", 2.0, {}, False),
                ("tis sequence, uncapped", "tis", "sequence", 1e6, {}, False),
                ("mis sequence, uncapped", "mis", "sequence", 1e6, {}, False),
                ("icepop, band [0.5, 5] (the default)", "icepop", "token", None, {}, False),
                ("icepop, band [0.8, 1.25]", "icepop", "token", None, NARROW_ICEPOP, False),
                (GEOMETRIC_ASYNC, "geometric_mask", "token", 1e6, ASYNC_GEOMETRIC, False),
                (GEOMETRIC_DEFAULT, "geometric_mask", "token", 1e6, {}, False),
                ("geometric_mask sequence, band [0.5, 2], uncapped", "geometric_mask", "sequence", 1e6,
                 {"geometric_mask_low": 0.5, "geometric_mask_high": 2.0}, False),
                ("off_policy_mask token, delta 1e-4 (the default), uncapped", "off_policy_mask", "token", 1e6,
                 {}, False),
                ("off_policy_mask sequence, delta 1e-4, uncapped", "off_policy_mask", "sequence", 1e6, {},
                 False),
                ("mixed versions: tis token, uncapped", "tis", "token", 1e6, {}, True),
                ("mixed versions: tis sequence, uncapped", "tis", "sequence", 1e6, {}, True)):
            settings = overrides({**GRPO_ASYNC, "correction": (correction, level)})
            settings["ppo"] |= extra | ({} if cap is None else {"is_cap": cap})
            cfg = load_config(None, settings)
            algorithm = Algorithm.from_config(cfg)
            if name == GEOMETRIC_DEFAULT:  # measured to show why async mode refuses it
                algorithm = dataclasses.replace(algorithm, ppo=cfg.ppo.model_copy(
                    update={"geometric_mask_low": 0.999, "geometric_mask_high": 1.001}))
            at, batch, want = ((mixed.proximal, e_mixed, mixed_target(mixed)) if in_flight
                               else (problem.proximal, e, target))
            got, _ = layer_gradient(algorithm, batch, at, BETA)
            rows.setdefault(name, []).append(relative_error(got, want))
    shift = f"{min(shifts):.2f} .. {max(shifts):.2f}"
    head = f"The async shift: {shift} nats per token |log pi_prox - log pi_behav|, {len(SEEDS)} seeds."
    figures("corrections", [head, "", *seed_table("correction", rows)])
    assert max(rows["tis sequence, uncapped"]) < EXACT and max(rows["mis sequence, uncapped"]) < EXACT

    def within(name: str, entry: str, at: list[float]) -> bool:  # its stated bound at each seed's shift
        return all(err <= TOKEN_LEVEL_BOUND_PER_NAT[entry] * s for err, s in zip(rows[name], at))

    assert within("tis token, uncapped", "tis", shifts)
    assert min(rows["tis token, cap 2 (the default)"]) > EXACT  # a cap is a bias: never silently exact
    # the per-token behaviour log-probs of a response sampled by two versions: the sequence weight is still
    # the likelihood ratio of the sampler, exact; the token weight as bounded as with one version
    assert max(rows["mixed versions: tis sequence, uncapped"]) < EXACT
    assert within("mixed versions: tis token, uncapped", "tis", mixed_shifts)
    # IcePop's default band drops nothing here (the token weight's bound holds); the masks that drop change it
    assert within("icepop, band [0.5, 5] (the default)", "icepop", shifts)
    for name in ("icepop, band [0.8, 1.25]", GEOMETRIC_DEFAULT,
                 "off_policy_mask sequence, delta 1e-4, uncapped"):
        assert min(rows[name]) > EXACT, name

    # the two placements: one gradient at GAE(1, 1) unwhitened on the first step, and not at the job's GAE
    # defaults
    problem = Problem.make(1, "sync")
    e = with_logprobs(enumerate_batch(problem, "single", 1), teacher_logprobs=problem.proximal)
    base = {**GRPO_ASYNC, "mode": "sync", "advantage": "gae", "correction": ("tis", "token")}
    placements = {}
    for defaults in (False, True):
        for placement, form in (("reward", None), ("loss", "kl_to_go")):
            settings = overrides({**base, "placement": placement, "loss_form": form})
            if defaults:
                settings["ppo"] = {k: v for k, v in settings["ppo"].items()
                                   if k not in ("lam", "whiten_advantages")}
            got, _ = layer_gradient(Algorithm.from_config(load_config(None, settings)), e, problem.proximal,
                                    BETA)
            placements[(defaults, placement)] = got
    exact_lambda = relative_error(placements[(False, "loss")], placements[(False, "reward")])
    defaults = relative_error(placements[(True, "loss")], placements[(True, "reward")])
    figures("placements", [
        ("`kl.placement` loss against reward, the relative difference of the gradients: at GAE with gamma = "
         f"lambda = 1 unwhitened {span([exact_lambda], 'exact')}; at the job's lambda 0.95 with whitening "
         f"{span([defaults])}.")])
    assert exact_lambda < EXACT and defaults > 0.01


def test_policy_loss_figures_off_the_first_step():
    """CISPO and SAPO where rho != 1. The main harness takes each gradient at the start of the update, where
    every ratio is 1: there CISPO's weight sg(clip(1)) = 1 and SAPO's gate factor 4 s (1 - s) = 1, and both
    are the policy gradient (exact, as PPO). Off the start, at the harness's current policy (sync, RLOO,
    groups of 2, the score alone), each policy loss's expected gradient is measured against the gradient of
    PPO's unclipped surrogate E_prox[sum_t rho_t A_t], the importance-weighted policy gradient at that policy
    for the step's advantages: CISPO is it exactly while its clip does not bind (its default [0, 5] does not
    here) and biased by design where it does; SAPO's gate weighs each token's grad rho by 4 s (1 - s) < 1,
    biased by design by how far rho is from 1."""
    base = {**GRPO_ASYNC, "mode": "sync", "correction": ("tis", "token")}
    variants = {
        "ppo, unclipped (the target)": ("ppo", {"clip_range_low": 0.999, "clip_range_high": 1e6}),
        "ppo, clip 0.2 (the default)": ("ppo", {"clip_range": 0.2}),
        "cispo, weight in [0, 5] (the default)": ("cispo", {}),
        "cispo, weight in [0.95, 1.05]": ("cispo", {"cispo_clip_low": 0.05, "cispo_clip_high": 0.05}),
        "sapo, tau 1.0 / 1.05 (the default)": ("sapo", {}),
        "sapo, tau 5 / 5": ("sapo", {"sapo_tau_pos": 5.0, "sapo_tau_neg": 5.0}),
    }
    rows, shifts = {}, []
    for seed in SEEDS:
        problem = Problem.make(seed, "sync")
        shifts.append(token_shift(problem, problem.current))
        e = with_logprobs(enumerate_batch(problem, "single", 2), teacher_logprobs=problem.proximal)
        grads = {}
        for name, (loss, ppo) in variants.items():
            settings = overrides({**base, "policy_loss": loss})
            settings["ppo"] = {k: v for k, v in settings["ppo"].items() if k != "clip_range"} | ppo
            algorithm = Algorithm.from_config(load_config(None, settings))
            grads[name], _ = layer_gradient(algorithm, e, problem.current, 0.0)
        target = grads.pop("ppo, unclipped (the target)")
        for name, got in grads.items():
            rows.setdefault(name, []).append(relative_error(got, target))
    shift = f"{min(shifts):.2f} .. {max(shifts):.2f}"
    head = (f"The current policy's shift from the proximal one: {shift} nats per token |log rho|, "
            f"{len(SEEDS)} seeds.")
    table = seed_table("policy loss", rows, " against PPO's unclipped surrogate")
    figures("policy_losses", [head, "", *table])
    assert max(rows["cispo, weight in [0, 5] (the default)"]) < EXACT
    for name in ("cispo, weight in [0.95, 1.05]", "sapo, tau 1.0 / 1.05 (the default)", "sapo, tau 5 / 5"):
        assert min(rows[name]) > EXACT, name


# ---------------------------------------------------------------------------- each entry off-policy

# how far the current policy's logits are moved from the proximal one's: the ratios pi / pi_prox then
# spread from inside every clip to far beyond CISPO's ceiling and SAPO's gate
# (GSPO's band is 3e-4 wide: the first shift keeps its rows inside)
OFF_POLICY_SHIFTS = (3e-4, 0.3, 1.0, 3.0)


def policy_loss_objective_errors(name: str, seed: int = 7, advantage: str = "grpo",
                                 **ppo) -> list[tuple[float, float, float, float]]:
    """The entry ``name``'s loss (``ppo.policy_loss``, through ``Algorithm.loss``: the terms the update
    descends) against the gradient of its documented objective (the entry's ``objective``, float64 from the
    token ratios), both in expectation over the problem's responses, at current policies off the proximal
    one by ``OFF_POLICY_SHIFTS``. In sync mode (behaviour = proximal) without a correction, with
    ``advantage`` (GRPO's one advantage per response, or GAE's per token) in groups of 2, so only the loss
    differs between the two. Returns (shift, relative error, the fraction of the tokens whose ratio is outside
    [0.2, 5], the norm of the objective's gradient) for each shift."""
    settings = {"advantage": advantage, "policy_loss": name, "correction": "none", **ppo}
    cfg = load_config(None, {"ppo": settings, "rollout": {"samples_per_prompt": 2}})
    algorithm, entry = Algorithm.from_config(cfg), POLICY_LOSSES.get(name)
    problem = Problem.make(seed, "sync")
    e = enumerate_batch(problem, "single", 2)
    batch, counts = prepared(algorithm, e)
    mask = batch.action_mask
    g = torch.Generator().manual_seed(seed + 1)
    out = []
    for shift in OFF_POLICY_SHIFTS:
        at = problem.proximal + shift * torch.randn(7, 3, generator=g).double()
        got, _ = layer_gradient(algorithm, e, at, 0.0)
        want = reference_step(algorithm, e, batch, counts, at, lambda logprobs: entry.objective(
            (logprobs - batch.old_logprobs) * mask, batch.advantages, mask, cfg.ppo))
        log_ratio = (logprob_rows(at, e.states, e.ids) - batch.old_logprobs) * mask
        tokens = mask > 0
        far = float(((log_ratio.abs() > math.log(5.0)) & tokens).sum() / tokens.sum())
        out.append((shift, relative_error(got, want), far, float(want.norm())))
    return out


def check_policy_loss_entry(name: str, **ppo) -> None:
    """The harness's check of a registered policy loss off-policy: its gradient is its documented objective's
    at every shift (exact), where some tokens' ratios are beyond 5 (or 0.2) and some near 1; with one
    advantage per response (GRPO) and, where the entry's rules accept them, per-token advantages (GAE)."""
    errors = policy_loss_objective_errors(name, **ppo)
    try:
        errors += policy_loss_objective_errors(name, advantage="gae", **ppo)
    except ValueError as refusal:  # the entry refuses per-token advantages (GSPO)
        assert "gae" in str(refusal), refusal
    print(f"{name}: " + "; ".join(f"shift {s:g}: error {err:.1e}, ratios beyond [0.2, 5] {far:.0%}, gradient "
                                  f"{norm:.2e}" for s, err, far, norm in errors))
    assert max(err for _, err, _, _ in errors) < EXACT, (name, errors)
    fars = [far for _, _, far, _ in errors]
    assert min(fars) < 0.05 and max(fars) > 0.2, (name, fars)
    # a gradient to compare at every shift, the first one's (the ratios near 1) above all
    assert min(norm for *_, norm in errors) > 1e-9 and errors[0][3] > 1e-3, (name, errors)


@pytest.mark.parametrize("name", POLICY_LOSSES.names())
def test_each_policy_loss_descends_its_documented_objective_off_policy(name):
    check_policy_loss_entry(name)


# the settings each correction is checked at: caps and bands that bind at the async shift
CORRECTION_SETTINGS = {"tis": {"is_cap": 1.2}, "mis": {"is_cap": 1.2}, "icepop": NARROW_ICEPOP,
                       "geometric_mask": ASYNC_GEOMETRIC, "off_policy_mask": {}, "none": {}}


def correction_objective_error(name: str, level: str, mode: str = "async", seed: int = 7,
                               advantage: str = "rloo", **ppo) -> tuple[float, float]:
    """The entry ``name``'s factor on the policy term (``ppo.correction``, through ``Algorithm.loss``) against
    its documented factor (the entry's ``objective``, from the three policies' log-probs), as the expected
    gradient of PPO's term at the current policy: behaviour, proximal and current all differ (``mode``
    async), ``advantage`` (RLOO's one per response, or GAE's per token) in groups of 2. Returns (the relative
    error, the fraction of tokens whose factor the cap or mask changed from w)."""
    entry = CORRECTIONS.get(name)
    settings = {"advantage": advantage, "correction": name, **ppo}
    if "correction_level" in entry.reads:
        settings["correction_level"] = level
    cfg = load_config(None, {"ppo": settings, "rollout": {"samples_per_prompt": 2,
                                                          "mode": "sync" if mode == "sync" else "async"}})
    algorithm = Algorithm.from_config(cfg)
    problem = Problem.make(seed, mode)
    e = enumerate_batch(problem, "single", 2)
    batch, counts = prepared(algorithm, e)
    mask = batch.action_mask
    got, _ = layer_gradient(algorithm, e, problem.current, 0.0)
    current = logprob_rows(problem.current, e.states, e.ids)
    factor = entry.objective(batch.old_logprobs, batch.rollout_logprobs, current, batch.advantages, mask,
                             level, cfg.ppo)
    ppo = POLICY_LOSSES.get("ppo").objective
    want = reference_step(algorithm, e, batch, counts, problem.current, lambda logprobs: factor * ppo(
        (logprobs - batch.old_logprobs) * mask, batch.advantages, mask, cfg.ppo))
    w = ((batch.old_logprobs - batch.rollout_logprobs) * mask)
    w = (w.sum(-1, keepdim=True).expand_as(w) if level == "sequence" and name != "icepop" else w).exp()
    changed = float((((factor - w).abs() > 1e-12) & (mask > 0)).sum() / (mask > 0).sum())
    return relative_error(got, want), changed


def check_correction_entry(name: str, level: str = "token", mode: str = "async", **ppo) -> None:
    """The harness's check of a registered correction: the update's gradient is its documented factor's
    (exact: a mask's bias is the objective's), where the cap or mask changes some tokens' factor and not
    all (``none`` and sync mode: none)."""
    for advantage in ("rloo", "gae"):  # one advantage per response, and per token
        error, changed = correction_objective_error(name, level, mode, advantage=advantage,
                                                    **{**CORRECTION_SETTINGS[name], **ppo})
        print(f"{name} {level} {mode} {advantage}: error {error:.1e}, factor changed on {changed:.0%} of the "
              "tokens")
        assert error < EXACT, (name, level, mode, advantage, error)
        if name != "none" and mode != "sync":
            assert 0 < changed < 1, (name, level, advantage, changed)


CORRECTION_LEVELS = [(name, level) for name in CORRECTIONS.names() if name != "none"
                     for level in (("token", "sequence") if "correction_level" in CORRECTIONS.get(name).reads
                                   else ("token",))]


@pytest.mark.parametrize(("name", "level"), CORRECTION_LEVELS)
def test_each_rollout_correction_is_its_documented_factor_where_behaviour_proximal_and_current_differ(name,
                                                                                                      level):
    check_correction_entry(name, level)
    check_correction_entry(name, level, "async_mixed")


def test_no_correction_is_the_plain_policy_gradient_in_sync_mode():
    check_correction_entry("none", mode="sync")


def check_kl_estimator_entry(name: str, problems: dict) -> None:
    """The harness's check of a registered KL estimator: the controller's statistic, through the rank's path,
    is the estimator's documented expectation (its ``objective``) in every mode, on single rows and on
    episodes split into rows, and that expectation is KL(pi || pi_ref) where the entry says it is unbiased."""
    for mode in AXES["mode"]:
        for shape in ("single", "agent_split"):
            c = {**GRPO_ASYNC, "mode": mode, "shape": shape, "estimator": name, "advantage": "reinforce_pp",
                 "correction": ("tis", "token"), "in_flight": "keep_kv" if mode == "async_mixed" else "off"}
            cfg, refusal = resolve(c)
            assert cfg is not None, refusal
            problem, e = problems[(mode, shape, 1)]
            fed = fed_statistic(Algorithm.from_config(cfg), e)
            documented = documented_statistic(problem, name, "response_sum")
            assert abs(fed - documented) <= EXACT * abs(documented), (name, mode, shape, fed, documented)
            if KL_ESTIMATORS.get(name).unbiased:
                truth = float(exact_kl(problem.proximal, problem.reference))
                assert abs(documented - truth) <= EXACT * truth, (name, "documented as unbiased", documented)


@pytest.mark.parametrize("name", KL_ESTIMATORS.names())
def test_each_kl_estimator_feeds_the_controller_its_documented_statistic(name, problems):
    check_kl_estimator_entry(name, problems)


# ---------------------------------------------------------------------------- the update itself


def update_gradient(algorithm: Algorithm, cfg: JobConfig, e: Enumeration, at: Tensor, kl_coef: float,
                    values: Tensor) -> Tensor:
    """``layer_gradient``'s measure of the step ``learner.update.update`` takes on the enumeration, driven
    with a ``TabularEngine`` at ``at`` (the rows' old log-probs are the engine's own there): one epoch, one
    minibatch of every row, so one step."""

    from learner.plan import UpdateSettings
    from learner.update import update

    rows, _ = trained_rows(algorithm, e.batch)
    engine = TabularEngine(at, e.states, e.ids, values)
    settings = UpdateSettings(cfg.ppo.model_copy(update={"epochs": 1, "minibatch_size": rows.numel(),
                                                         "lr_schedule": "constant"}),
                              rollout_batch_size=rows.numel() if algorithm.dynamic_sampling else None,
                              rows_per_episode_vary=not episode_view(e.batch).trivial)
    update(engine, algorithm, settings, e.batch.clone(), kl_coef, 1, version=LEARNER_VERSION)
    (per_row,) = engine.steps
    trained = e.batch[rows]
    algorithm.prepare(trained, kl_coef)  # the loss's mask: DAPO's overlong filtering takes rows out of it
    counts = algorithm.loss_counts(trained)
    return expected_step(algorithm, per_row[rows], e.weight[rows], e.group_size, counts, kl_coef)


def check_update(problems: dict, every: int = 1) -> int:
    """``learner.update.update``, through a training engine as a rank runs it (the rows to train on, the
    controller's sums, the advantages, the epochs and minibatches), takes the gradient step whose expectation
    the harness checks (``layer_gradient``), on the covering rows (every ``every``-th) of every mode, shape
    and estimator. Returns how many it checked."""
    rows, _ = covering_array(AXES, tries=8)
    checked = 0
    for c in rows[::every]:
        cfg, refusal = resolve(c)
        assert cfg is not None, refusal
        algorithm = Algorithm.from_config(cfg)
        group = 2 if cfg.rollout.samples_per_prompt > 1 else 1
        problem, e = problems[(c["mode"], c["shape"], group)]
        e = with_logprobs(e, teacher_logprobs=problem.proximal)
        want, _ = layer_gradient(algorithm, e, problem.proximal, BETA)
        got = update_gradient(algorithm, cfg, e, problem.proximal, BETA, problem.values)
        assert relative_error(got, want) < EXACT, (c, relative_error(got, want))
        checked += 1
    return checked


def test_the_update_takes_the_step_the_layer_checks(problems):
    checked = check_update(problems)
    print(f"the update's step equals the layer's on {checked} combinations")
    assert checked >= 40


def check_admission(problems: dict) -> None:
    """The staleness admission the rank applies (``learner.records.Admission``) to the rows as the engine
    stamps them: a row whose tokens span versions (in flight) is as stale as its oldest token, so at each
    bound exactly the rows whose oldest token is beyond it are refused."""
    from learner.records import Admission

    for mode in ("sync", "async", "async_mixed"):
        for shape in AXES["shape"]:
            problem, e = problems[(mode, shape, 1)]
            oldest = [min(problem.token_version(s) for s in row if s is not None) for row in e.states]
            assert e.batch.policy_version.tolist() == oldest, (mode, shape)
            for bound in (0, 1, 2):
                refused = Admission(LEARNER_VERSION, None, bound).refuses(e.batch.policy_version,
                                                                          e.batch.kl_coef)
                assert refused.tolist() == [LEARNER_VERSION - v > bound for v in oldest], (mode, shape, bound)
    mixed, e = problems[("async_mixed", "single", 1)]
    assert {v for row in e.states for v in map(mixed.token_version, row)} >= {0, 1}  # rows span two versions


def test_rows_are_admitted_by_their_oldest_token(problems):
    check_admission(problems)


# the settings an estimator's check takes, each field it reads over these values (its rules refuse the rest)
ESTIMATOR_SETTINGS = {"gamma": (1.0, 0.9), "lam": (0.95, 1.0), "whiten_rewards": (False, True),
                      "whiten_advantages": (True, False), "grpo_normalize": ("score", "return")}


def estimator_inputs(seed: int, gaps: bool) -> dict:
    """8 rows in 4 groups of 2, 6 positions: rows of 1 to 6 model tokens (with an environment's gap where
    ``gaps``), random float64 rewards, values and KL penalties, and one group whose returns tie."""
    g = torch.Generator().manual_seed(seed)
    lengths = [6, 1, 4, 3, 5, 2, 6, 4]
    mask = torch.tensor([[1.0] * n + [0.0] * (6 - n) for n in lengths], dtype=torch.float64)
    if gaps:
        mask[[0, 2, 6], 1] = 0.0  # the environment's token inside a trajectory
    rewards = torch.randn(8, 6, generator=g, dtype=torch.float64) * mask
    rewards[5] = 0.0
    rewards[4] = 0.0
    rewards[4, 0], rewards[5, 0] = 1.0, 1.0  # group 2's returns tie
    values = torch.randn(8, 6, generator=g, dtype=torch.float64) * mask
    kl = -0.1 * torch.rand(8, 6, generator=g, dtype=torch.float64) * mask
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    return {"rewards": rewards, "mask": mask, "values": values, "groups": groups, "kl": kl}


def check_advantage_estimator_entry(name: str) -> int:
    """The harness's check of a registered advantage estimator: ``compute_advantages`` (the entry's function,
    as the layer calls it) equals its documented advantages (the entry's ``objective``, and GAE's returns),
    on rows with and without an environment's gaps, with and without the KL penalty's share apart, over the
    values of every setting it reads. Returns how many cases it checked."""
    from learner.advantages import Settings, compute_advantages

    entry = ESTIMATORS.get(name)
    fields = [f for f in ESTIMATOR_SETTINGS if f in entry.reads]
    checked = 0
    for values in itertools.product(*(ESTIMATOR_SETTINGS[f] for f in fields)):
        settings = dict(zip(fields, values, strict=True))
        for seed, gaps, apart in itertools.product((0, 1), (False, True), (False, True)):
            x = estimator_inputs(seed, gaps)
            kl = x["kl"] if apart else None
            try:
                got, got_returns = compute_advantages(name, x["rewards"], x["mask"], values=x["values"],
                                                      group_index=x["groups"], kl_rewards=kl, **settings)
            except ValueError as refusal:  # a setting its rules refuse (REINFORCE++-baseline's gamma)
                assert "gamma" in str(refusal), refusal
                continue
            want, want_returns = entry.objective(x["rewards"], x["mask"], x["values"], x["groups"], kl,
                                                 Settings(**settings))
            assert torch.allclose(got, want, rtol=1e-9, atol=1e-9), (name, settings, seed, gaps, apart)
            assert (got_returns is None) == (want_returns is None), name
            if want_returns is not None:
                assert torch.allclose(got_returns, want_returns, rtol=1e-9, atol=1e-9), (name, settings)
            checked += 1
    assert checked >= 8, (name, checked)
    return checked


@pytest.mark.parametrize("name", ESTIMATORS.names())
def test_each_advantage_estimator_is_its_documented_formula(name):
    check_advantage_estimator_entry(name)
