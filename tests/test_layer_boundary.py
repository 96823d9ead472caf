"""The algorithm layer's boundary (``learner/algorithm.py``): nothing outside it computes the algorithm, it
imports no distributed framework, and every setting it reads changes what it computes, or the config refuses
it.

- The algorithm's functions (rewards, advantages, losses, the rollout correction, the teacher's penalties) are
  called only by the layer and the modules that define them: a learner rank or an actor that called one itself
  would compute the algorithm a second way, which the layer's tests would not see.
- ``import learner.algorithm`` loads neither Ray nor DeepSpeed (nor vLLM): a test runs the layer as the rank
  does.
- The settings the layer reads, found by recording every field it reads (a proxy over ``JobConfig``), are each
  changed on a set of base combinations (estimator x mode x placement) and the layer run on a batch where
  every setting bites: ``JobConfig`` must refuse a change whose outputs are bit-identical to the base's (it
  found ``ppo.clip_range`` beside both ``clip_range_low`` and ``clip_range_high``, now refused).
"""

from __future__ import annotations

import ast
import functools
import itertools
import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from pydantic import BaseModel
from torch import Tensor

from learner.advantages import ESTIMATORS
from learner.algorithm import Algorithm
from services.config import JobConfig, load_config, merge_settings
from services.experience import FINISH_LENGTH, FINISH_STOP, RolloutBatch, make_batch

ROOT = Path(__file__).resolve().parents[1]

# ===================================================================== no algorithm outside the layer

LAYER_ONLY = ("kl_penalized_rewards", "compute_advantages", "policy_loss", "value_loss", "response_kl_loss",
              "grpo_token_k3_loss", "rollout_correction_weights", "teacher_penalties")
LAYER = "learner/algorithm.py"
DEFINING = {"learner/kl.py", "learner/ppo.py", "learner/policy_losses.py", "learner/correction.py",
            "learner/advantages.py"}


def sources() -> dict[str, ast.Module]:
    """Every .py file under learner/, actors/ and services/, parsed, by its path from the repository root."""
    files = sorted(p for top in ("learner", "actors", "services") for p in (ROOT / top).rglob("*.py"))
    assert len(files) > 30, files  # the scan sees the packages
    return {p.relative_to(ROOT).as_posix(): ast.parse(p.read_text(encoding="utf-8"), str(p)) for p in files}


def uses(tree: ast.Module) -> list[tuple[str, int, str]]:
    """(name, line, how) of each call of a ``LAYER_ONLY`` function (as a name or an attribute,
    ``ppo.policy_loss``) and each import of one (``from learner.ppo import policy_loss as loss`` would hide
    its calls)."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            func = node.func
            name = (func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute)
                    else None)
            if name in LAYER_ONLY:
                out.append((name, node.lineno, "call"))
        elif isinstance(node, ast.ImportFrom):
            out += [(alias.name, node.lineno, "import") for alias in node.names if alias.name in LAYER_ONLY]
    return out


def defined(tree: ast.Module) -> set[str]:
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)}


def test_the_algorithm_functions_are_called_only_by_the_layer():
    trees = sources()
    definers = {name: [path for path, tree in trees.items() if name in defined(tree)] for name in LAYER_ONLY}
    assert all(len(paths) == 1 and paths[0] in DEFINING for paths in definers.values()), definers
    offenders = [f"{path}:{line}: {how} of {name}" for path, tree in trees.items() if path != LAYER
                 for name, line, how in uses(tree) if name not in defined(tree)]
    assert not offenders, "the algorithm computed outside learner/algorithm.py:\n" + "\n".join(offenders)
    # the scan finds what it looks for: the layer calls each of them
    assert {name for name, _, how in uses(trees[LAYER]) if how == "call"} == set(LAYER_ONLY)


def test_the_scan_sees_a_call_an_attribute_call_and_an_aliased_import():
    tree = ast.parse("from learner.ppo import policy_loss as pl\nimport learner.kl as kl\n"
                     "def f(x):\n    return kl.teacher_penalties(x) + pl(x) + compute_advantages(x)\n")
    assert sorted(uses(tree)) == [("compute_advantages", 4, "call"), ("policy_loss", 1, "import"),
                                  ("teacher_penalties", 4, "call")]


# ===================================================================== the layer is pure


def test_importing_the_layer_loads_no_distributed_framework():
    """The algorithm, the update that drives it and the engines' module (DeepSpeed's inside its set-up
    alone)."""
    code = ("import sys, learner.algorithm, learner.update, learner.engine\n"
            "print(sorted(m for m in ('ray', 'deepspeed', 'vllm') if m in sys.modules or any("
            "k.startswith(m + '.') for k in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         check=False)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout


# ===================================================================== settings the layer ignores are refused

KL_COEF = 0.3
TEACHER = {"distill": {"teacher_path": "teacher"}}
OVERLONG = {"rollout": {"max_new_tokens": 6}, "reward": {"overlong_buffer": 3, "overlong_penalty": 1.0}}
GEOMETRIC, OFF_POLICY = {"ppo": {"correction": "geometric_mask"}}, {"ppo": {"correction": "off_policy_mask"}}

# (name, context, change): the base with ``context`` (when the config takes it) is compared with it plus
# ``change``
VARIANTS: list[tuple[str, dict, dict]] = [
    ("ppo.gamma", {}, {"ppo": {"gamma": 0.9}}),
    ("ppo.lam", {}, {"ppo": {"lam": 0.5}}),
    ("ppo.vf_coef", {}, {"ppo": {"vf_coef": 0.5}}),
    ("ppo.clip_range_value", {}, {"ppo": {"clip_range_value": 0.05}}),
    ("ppo.whiten_advantages", {}, {"ppo": {"whiten_advantages": False}}),
    ("ppo.whiten_rewards", {}, {"ppo": {"whiten_rewards": True}}),
    ("ppo.clip_range", {}, {"ppo": {"clip_range": 0.05}}),
    ("ppo.clip_range (clip_range_low set)", {"ppo": {"clip_range_low": 0.1}}, {"ppo": {"clip_range": 0.05}}),
    ("ppo.clip_range (clip_range_high set)",
     {"ppo": {"clip_range_high": 0.3}}, {"ppo": {"clip_range": 0.05}}),
    ("ppo.clip_range (clip_range_low and clip_range_high set)",
     {"ppo": {"clip_range_low": 0.1, "clip_range_high": 0.3}}, {"ppo": {"clip_range": 0.05}}),
    ("ppo.clip_range_low", {}, {"ppo": {"clip_range_low": 0.05}}),
    ("ppo.clip_range_high", {}, {"ppo": {"clip_range_high": 0.05}}),
    ("ppo.gspo_clip_low", {}, {"ppo": {"gspo_clip_low": 0.05}}),
    ("ppo.gspo_clip_high", {}, {"ppo": {"gspo_clip_high": 0.05}}),
    ("ppo.gspo_clip_low (gspo_token)",
     {"ppo": {"policy_loss": "gspo_token"}}, {"ppo": {"gspo_clip_low": 0.05}}),
    ("ppo.gspo_clip_high (gspo_token)",
     {"ppo": {"policy_loss": "gspo_token"}}, {"ppo": {"gspo_clip_high": 0.05}}),
    ("ppo.gspo_clip_low (gspo)", {"ppo": {"policy_loss": "gspo", "correction_level": "sequence"}},
     {"ppo": {"gspo_clip_low": 0.05}}),
    ("ppo.gspo_clip_high (gspo)", {"ppo": {"policy_loss": "gspo", "correction_level": "sequence"}},
     {"ppo": {"gspo_clip_high": 0.05}}),
    ("ppo.is_cap", {}, {"ppo": {"is_cap": 1.2}}),
    ("ppo.is_cap (mis)", {"ppo": {"correction": "mis"}}, {"ppo": {"is_cap": 1.2}}),
    ("ppo.is_cap (sequence)", {"ppo": {"correction_level": "sequence"}}, {"ppo": {"is_cap": 1.2}}),
    ("ppo.correction_level", {}, {"ppo": {"correction_level": "sequence"}}),
    ("ppo.correction_level (mis)", {"ppo": {"correction": "mis"}}, {"ppo": {"correction_level": "sequence"}}),
    ("ppo.correction mis", {}, {"ppo": {"correction": "mis"}}),
    ("ppo.correction none", {}, {"ppo": {"correction": "none"}}),
    ("ppo.grpo_normalize", {}, {"ppo": {"grpo_normalize": "return"}}),
    ("ppo.mask_truncated", {}, {"ppo": {"mask_truncated": True}}),
    ("ppo.loss_aggregation sequence_mean", {}, {"ppo": {"loss_aggregation": "sequence_mean"}}),
    ("ppo.loss_aggregation seq_mean_token_sum_norm",
     {}, {"ppo": {"loss_aggregation": "seq_mean_token_sum_norm"}}),
    ("ppo.policy_loss gspo", {}, {"ppo": {"policy_loss": "gspo"}}),
    ("ppo.policy_loss gspo (sequence correction)", {"ppo": {"correction_level": "sequence"}},
     {"ppo": {"policy_loss": "gspo"}}),
    ("ppo.policy_loss gspo_token", {}, {"ppo": {"policy_loss": "gspo_token"}}),
    ("kl.estimator k2", {}, {"kl": {"estimator": "k2"}}),
    ("kl.estimator k3", {}, {"kl": {"estimator": "k3"}}),
    ("kl.loss_form response_k2", {}, {"kl": {"loss_form": "response_k2"}}),
    ("kl.loss_form grpo_token_k3", {}, {"kl": {"loss_form": "grpo_token_k3"}}),
    ("distill.teacher_path", {}, TEACHER),
    ("distill.coef", TEACHER, {"distill": {"coef": 0.5}}),
    ("distill.credit", TEACHER, {"distill": {"credit": "token"}}),
    ("distill.task_reward", TEACHER, {"distill": {"task_reward": False}}),
    ("reward.missing_eos_penalty", {}, {"reward": {"missing_eos_penalty": -1.0}}),
    ("reward.overlong_buffer", {"rollout": {"max_new_tokens": 6}},
     {"reward": {"overlong_buffer": 3, "overlong_penalty": 1.0}}),
    ("reward.overlong_buffer (value)", OVERLONG, {"reward": {"overlong_buffer": 2}}),
    ("reward.overlong_penalty", OVERLONG, {"reward": {"overlong_penalty": 0.5}}),
    ("rollout.max_new_tokens (overlong)", OVERLONG, {"rollout": {"max_new_tokens": 5}}),
    # CISPO, SAPO and the masks (a delta of 10 nats per token masks no row of the batch, where the default
    # masks the negative rows of 5 of its 8)
    ("ppo.policy_loss cispo", {}, {"ppo": {"policy_loss": "cispo"}}),
    ("ppo.policy_loss sapo", {}, {"ppo": {"policy_loss": "sapo"}}),
    ("ppo.cispo_clip_low", {"ppo": {"policy_loss": "cispo"}}, {"ppo": {"cispo_clip_low": 0.2}}),
    ("ppo.cispo_clip_high", {"ppo": {"policy_loss": "cispo"}}, {"ppo": {"cispo_clip_high": 0.28}}),
    ("ppo.sapo_tau_pos", {"ppo": {"policy_loss": "sapo"}}, {"ppo": {"sapo_tau_pos": 3.0}}),
    ("ppo.sapo_tau_neg", {"ppo": {"policy_loss": "sapo"}}, {"ppo": {"sapo_tau_neg": 3.0}}),
    ("ppo.correction icepop", {}, {"ppo": {"correction": "icepop"}}),
    ("ppo.icepop_low", {"ppo": {"correction": "icepop"}}, {"ppo": {"icepop_low": 0.8}}),
    ("ppo.icepop_high", {"ppo": {"correction": "icepop"}}, {"ppo": {"icepop_high": 1.5}}),
    ("ppo.correction geometric_mask", {}, {"ppo": {"correction": "geometric_mask"}}),
    ("ppo.geometric_mask_low", GEOMETRIC, {"ppo": {"geometric_mask_low": 0.3}}),
    ("ppo.geometric_mask_high", GEOMETRIC, {"ppo": {"geometric_mask_high": 3.0}}),
    ("ppo.is_cap (geometric_mask)", {"ppo": {"correction": "geometric_mask", "geometric_mask_low": 0.3,
                                             "geometric_mask_high": 3.0}}, {"ppo": {"is_cap": 1.2}}),
    ("ppo.correction off_policy_mask", {}, {"ppo": {"correction": "off_policy_mask"}}),
    ("ppo.off_policy_mask_delta", OFF_POLICY, {"ppo": {"off_policy_mask_delta": 10.0}}),
    ("ppo.correction_level (off_policy_mask)", {"ppo": {"correction": "off_policy_mask"}},
     {"ppo": {"correction_level": "sequence"}}),
    ("ppo.correction icepop (cispo)", {"ppo": {"policy_loss": "cispo"}}, {"ppo": {"correction": "icepop"}}),
    ("ppo.correction off_policy_mask (sapo)", {"ppo": {"policy_loss": "sapo"}},
     {"ppo": {"correction": "off_policy_mask"}}),
]
# read by the layer, but axes of the bases or what the rank's other calls read (``select``, the group check)
BASE_FIELDS = {"ppo.advantage", "rollout.mode", "kl.placement", "rollout.samples_per_prompt",
               "rollout.dynamic_sampling"}
BASES = {f"{advantage}-{mode}-{placement}": {
    "ppo": {"advantage": advantage},
    "rollout": {"mode": mode, **({"samples_per_prompt": 2} if ESTIMATORS.get(advantage).group else {})},
    "kl": {"placement": placement, **({"loss_form": "kl_to_go"} if placement == "loss" else {})},
} for advantage, mode, placement in itertools.product(("gae", "grpo", "rloo", "reinforce_pp",
                                                       "reinforce_pp_baseline"),
                                                      ("sync", "async"), ("reward", "loss"))}


def merged(*parts: dict) -> dict:
    return functools.reduce(merge_settings, parts, {})


def dotted(change: dict, prefix: str = "") -> set[str]:
    return {name for key, value in change.items()
            for name in (dotted(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}"})}


@functools.cache
def _config(key: str) -> JobConfig | str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # grpo_token_k3 warns by design
        try:
            cfg = load_config(None, json.loads(key))
            Algorithm.from_config(cfg)  # the registered entries' check, before any actor
            return cfg
        except ValueError as err:  # pydantic's ValidationError is one
            return str(err)


def config(*parts: dict) -> JobConfig | None:
    """The config of the merged overrides, or None where ``JobConfig`` or the entries it chooses refuse it."""
    cfg = _config(json.dumps(merged(*parts), sort_keys=True))
    return cfg if isinstance(cfg, JobConfig) else None


def fixed_batch() -> RolloutBatch:
    """8 rows in 4 groups of 2, unequal lengths, 3 cut at the cap (FINISH_LENGTH, 6 tokens), scores differing
    in every group; the engine's, the learner's (proximal), the current and the reference's and teacher's
    log-probs far apart (ratios beyond every clip range, weights beyond every cap); old values and current
    values apart."""
    g = torch.Generator().manual_seed(0)
    lengths = [6, 3, 5, 2, 6, 4, 1, 6]
    b, width = len(lengths), 6
    batch = make_batch([[1, 2]] * b, [[3] * n for n in lengths], [[0.0] * n for n in lengths],
                       [FINISH_LENGTH if n == width else FINISH_STOP for n in lengths], list(range(b)), 0, 0,
                       KL_COEF, response_width=width, group_index=[0, 0, 1, 1, 2, 2, 3, 3])
    mask = batch.action_mask

    def noise(scale: float) -> Tensor:
        return scale * torch.randn(b, width, generator=g)

    behaviour = -torch.rand(b, width, generator=g) * 2
    batch.rollout_logprobs = behaviour * mask
    batch.old_logprobs = (behaviour + noise(0.8)) * mask
    batch.ref_logprobs = (batch.old_logprobs + noise(0.5)) * mask
    batch.teacher_logprobs = (batch.old_logprobs + noise(0.5)) * mask
    batch.old_values = noise(1.0) * mask
    batch.scores = torch.randn(b, generator=g)
    return batch


BATCH = fixed_batch()
_g = torch.Generator().manual_seed(1)
CURRENT = (BATCH.old_logprobs + 0.6 * torch.randn(BATCH.old_logprobs.shape, generator=_g)) * BATCH.action_mask
CURRENT_VALUES = ((BATCH.old_values + 0.3 * torch.randn(BATCH.old_values.shape, generator=_g))
                  * BATCH.action_mask)
ENTROPY = torch.rand(BATCH.old_logprobs.shape, generator=_g)


def canonical(x) -> object:
    """A value compared bit for bit: tensors by dtype, shape and bytes (NaN equal to itself), floats by
    repr."""
    if isinstance(x, Tensor):
        x = x.detach().contiguous()
        return ("tensor", str(x.dtype), tuple(x.shape), x.numpy().tobytes())
    if isinstance(x, dict):
        return tuple(sorted((k, canonical(v)) for k, v in x.items()))
    if isinstance(x, list | tuple):
        return tuple(canonical(v) for v in x)
    return repr(x)


def run_layer(cfg) -> dict[str, object]:
    """Everything the layer computes on ``BATCH`` under ``cfg``: the controller's values and sums,
    ``prepare``'s advantages, returns, loss mask and sums, ``loss_counts``, the loss and its gradient with
    respect to the current log-probs (and values)."""
    algorithm = Algorithm.from_config(cfg)
    batch = BATCH.clone()
    out: dict[str, object] = {"controller_values": algorithm.controller_values(batch),
                              "controller_sums": algorithm.controller_sums(batch)}
    out["prepare_sums"] = algorithm.prepare(batch, KL_COEF)
    out |= {"advantages": batch.advantages, "returns": batch.returns, "loss_mask": batch.action_mask}
    counts = algorithm.loss_counts(batch)
    logprobs = CURRENT.clone().requires_grad_(True)
    values = CURRENT_VALUES.clone().requires_grad_(True) if algorithm.has_critic else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # grpo_token_k3 warns by design
        loss, _ = algorithm.loss(batch, (logprobs, values, ENTROPY), counts, KL_COEF)
    grads = torch.autograd.grad(loss, [logprobs] + ([values] if values is not None else []))
    out |= {"loss_counts": counts, "loss": loss, "gradient": grads}
    return {k: canonical(v) for k, v in out.items()}


@functools.cache
def outputs(base: str, *parts: str) -> dict[str, object] | None:
    cfg = config(BASES[base], *(json.loads(p) for p in parts))
    return None if cfg is None else run_layer(cfg)


def compare(base: str, variant: tuple[str, dict, dict]) -> str | None:
    """'refused', 'no base' (the context is refused), 'differs', or 'ignored' (accepted, every output
    identical)."""
    _, context, change = variant
    reference = outputs(base, json.dumps(context, sort_keys=True))
    if reference is None:
        return "no base"
    changed = outputs(base, json.dumps(context, sort_keys=True), json.dumps(change, sort_keys=True))
    if changed is None:
        return "refused"
    return "ignored" if changed == reference else "differs"


@pytest.mark.parametrize("base", sorted(BASES))
def test_every_setting_the_layer_reads_changes_its_outputs_or_is_refused(base):
    results = {variant[0]: compare(base, variant) for variant in VARIANTS}
    ignored = [name for name, result in results.items() if result == "ignored"]
    assert not ignored, (f"base {base} ({BASES[base]}): JobConfig accepts these changes, yet the layer's "
                         f"outputs are bit-identical to the base's; the config must refuse them: {ignored}")
    assert "differs" in results.values()


class Reads:
    """A config (section) whose field reads are recorded by dotted name in ``log``; sections are wrapped in
    turn, and methods run on the proxy, so the fields they read are recorded too."""

    def __init__(self, real: BaseModel, log: set[str], prefix: str = "") -> None:
        object.__setattr__(self, "_real", real)
        object.__setattr__(self, "_log", log)
        object.__setattr__(self, "_prefix", prefix)

    def __getattr__(self, name: str):
        real = self._real
        if name in type(real).model_fields:
            value = getattr(real, name)
            if isinstance(value, BaseModel):
                return Reads(value, self._log, f"{self._prefix}{name}.")
            self._log.add(self._prefix + name)
            return value
        attribute = getattr(type(real), name, None)
        if callable(attribute):
            return functools.partial(attribute, self)
        return getattr(real, name)


def test_the_variants_cover_every_field_the_layer_reads(monkeypatch):
    """Every field the layer reads in any base (and in the variants' contexts: distillation, the overlong
    penalty) is changed by some variant, or is a base axis: a field added to the layer without a variant fails
    here. (The check of the registered entries, which reads every entry's fields, ran on the real config in
    ``config``: here the layer alone.)"""
    import learner.algorithm

    monkeypatch.setattr(learner.algorithm, "REGISTRIES", ())
    read: set[str] = set()
    contexts = {json.dumps(context, sort_keys=True): context for _, context, _ in VARIANTS}
    for base, context in itertools.product(sorted(BASES), contexts.values()):
        cfg = config(BASES[base], context)
        if cfg is not None:
            run_layer(Reads(cfg, read))  # type: ignore[arg-type]
    covered = set().union(*(dotted(change) for _, _, change in VARIANTS))
    assert read - covered - BASE_FIELDS == set(), "fields the layer reads that no variant changes"
    assert covered - read == set(), "variants of fields the layer never reads (out of scope: the driver's)"
    assert {"ppo.clip_range", "ppo.gspo_clip_low", "kl.estimator", "distill.credit",
            "reward.overlong_penalty", "ppo.cispo_clip_high", "ppo.sapo_tau_neg", "ppo.icepop_low",
            "ppo.geometric_mask_high", "ppo.off_policy_mask_delta"} <= read


def test_the_fixed_batch_makes_the_settings_bite():
    """The batch is what makes the comparison mean something: ratios beyond the clip ranges on both sides,
    weights beyond the caps, truncated rows, unequal lengths, values apart from their old ones."""
    mask = BATCH.action_mask.bool()
    ratio = (CURRENT - BATCH.old_logprobs).exp()[mask]
    weight = (BATCH.old_logprobs - BATCH.rollout_logprobs).exp()[mask]
    assert (ratio > 1.3).sum() >= 5 and (ratio < 0.75).sum() >= 5 and ((ratio > 1.05) & (ratio < 1.2)).any()
    assert (weight > 2.0).sum() >= 3 and ((weight > 1.2) & (weight < 2.0)).any()
    assert ((BATCH.finish_reason == FINISH_LENGTH).sum() == 3
            and len(set(BATCH.action_mask.sum(-1).tolist())) >= 5)
    assert ((CURRENT_VALUES - BATCH.old_values).abs()[mask] > 0.2).sum() >= 5
