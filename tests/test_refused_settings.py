"""Settings the config would accept but the algorithm ignores are refused, each with a message that names the
ignored field with its value, the field that makes it ignored, and the fix; the default left alone (or given
explicitly, as a resolved config gives every field) stays accepted."""

from __future__ import annotations

import re

import pytest
import yaml

from learner.algorithm import Algorithm
from learner.policy_losses import POLICY_LOSSES
from services.config import config_to_yaml, load_config

NON_GAE = ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")
GROUP = {"grpo", "rloo", "reinforce_pp_baseline"}


def _estimator(advantage: str, **ppo) -> dict:
    """A config with ``ppo.advantage`` and the samples per prompt a group estimator needs."""
    out = {"ppo": {"advantage": advantage, **ppo}}
    if advantage in GROUP:
        out["rollout"] = {"samples_per_prompt": 2}
    return out


def _refused(overrides: dict, *fragments: str) -> str:
    """The message of the refusal of ``overrides`` (by the config, or by the check of the registered entries
    it chooses before any actor: ``Algorithm.from_config``), checked to hold every fragment (literal text)."""
    with pytest.raises(ValueError, match=re.escape(fragments[0])) as err:
        Algorithm.from_config(load_config(None, overrides))
    message = str(err.value)
    for fragment in fragments[1:]:
        assert fragment in message, (fragment, message)
    return message


# ------------------------------------------------------- 1. what only GAE reads, with another estimator


GAE_ONLY = [("lam", 0.9, "0.9", "0.95"), ("whiten_rewards", True, "true", "false"),
            ("whiten_advantages", False, "false", "true"), ("vf_coef", 0.5, "0.5", "1.0"),
            ("clip_range_value", 0.3, "0.3", "0.2")]


@pytest.mark.parametrize("advantage", NON_GAE)
@pytest.mark.parametrize("field, value, shown, default", GAE_ONLY)
def test_gae_settings_are_refused_with_another_estimator(advantage, field, value, shown, default):
    _refused(_estimator(advantage, **{field: value}),
             f"ppo.{field}={shown} is set but ppo.advantage={advantage!r} ignores it",
             "read by gae); set ppo.advantage='gae'", f"or ppo.{field}={default} (its default)")


@pytest.mark.parametrize("field, value, shown, default", GAE_ONLY)
def test_gae_settings_are_accepted_with_gae_and_at_their_default_with_any_estimator(field, value, shown,
                                                                                    default):
    # gae, the default estimator
    assert getattr(load_config(None, {"ppo": {field: value}}).ppo, field) == value
    for advantage in NON_GAE:
        # the default, explicit
        cfg = load_config(None, _estimator(advantage, **{field: yaml.safe_load(default)}))
        assert getattr(cfg.ppo, field) == yaml.safe_load(default)


def test_grpo_alone_keeps_whiten_advantages_true_and_false_is_refused():
    """whiten_advantages defaults to true: ``--ppo.advantage grpo`` alone is accepted, turning it off is
    refused."""
    assert load_config(None, _estimator("grpo")).ppo.whiten_advantages is True
    _refused(_estimator("grpo", whiten_advantages=False),
             "ppo.whiten_advantages=false is set but ppo.advantage='grpo' ignores it")


def test_the_command_line_takes_grpo_alone_and_refuses_it_without_whitening():
    from learner.main import parse_cli

    assert parse_cli(["--ppo.advantage", "grpo", "--rollout.samples_per_prompt", "2"]).ppo.advantage == "grpo"
    with pytest.raises(ValueError, match=r"ppo.whiten_advantages=false is set but ppo.advantage='grpo'"):
        Algorithm.from_config(parse_cli(["--ppo.advantage", "grpo", "--rollout.samples_per_prompt", "2",
                                         "--no-ppo.whiten_advantages"]))


@pytest.mark.parametrize("advantage", NON_GAE)
def test_a_resolved_config_of_another_estimator_loads_again(advantage):
    """A dumped config (config.yaml, --print-config) sets every field, the GAE ones at their defaults."""
    cfg = load_config(None, _estimator(advantage))
    again = load_config(None, yaml.safe_load(config_to_yaml(cfg)))
    assert again.ppo == cfg.ppo


# ------------------------------------------------------- 2. the discount with grpo and rloo


@pytest.mark.parametrize("advantage", ["grpo", "rloo"])
def test_gamma_is_refused_with_the_undiscounted_estimators(advantage):
    _refused(_estimator(advantage, gamma=0.99),
             f"ppo.gamma=0.99 is set but ppo.advantage={advantage!r} ignores it",
             "read by gae, reinforce_pp, reinforce_pp_baseline", "ppo.gamma=1.0 (its default)")


def test_gamma_is_accepted_where_it_discounts_and_at_one_everywhere():
    assert load_config(None, {"ppo": {"gamma": 0.99}}).ppo.gamma == 0.99
    assert load_config(None, _estimator("reinforce_pp", gamma=0.99)).ppo.gamma == 0.99
    for advantage in ("grpo", "rloo", "reinforce_pp_baseline"):
        assert load_config(None, _estimator(advantage, gamma=1.0)).ppo.gamma == 1.0
    # reinforce_pp_baseline keeps its own refusal of any other discount
    _refused(_estimator("reinforce_pp_baseline", gamma=0.9),
             "ppo.advantage='reinforce_pp_baseline' needs ppo.gamma=1")


# ------------------------------------------------------- 3. PPO's clip range with GSPO's ratio


GSPO = {"gspo": {"advantage": "rloo", "correction_level": "sequence"}, "gspo_token": {}}


@pytest.mark.parametrize("policy_loss", ["gspo", "gspo_token"])
def test_clip_range_is_refused_with_gspo(policy_loss):
    ppo = {"policy_loss": policy_loss, **GSPO[policy_loss], "clip_range": 0.3}
    overrides = {"ppo": ppo, "rollout": {"samples_per_prompt": 2}}
    _refused(overrides, f"ppo.clip_range=0.3 is set but ppo.policy_loss={policy_loss!r} ignores it",
             "read by ppo", "ppo.clip_range=0.2 (its default)")


@pytest.mark.parametrize("policy_loss", ["gspo", "gspo_token"])
def test_gspo_with_the_default_clip_range_and_ppo_with_its_own_are_accepted(policy_loss):
    ppo = {"policy_loss": policy_loss, **GSPO[policy_loss], "clip_range": 0.2, "gspo_clip_high": 5e-4}
    cfg = load_config(None, {"ppo": ppo, "rollout": {"samples_per_prompt": 2}})
    assert Algorithm.from_config(cfg).policy.clip(cfg.ppo) == (3e-4, 5e-4)
    ppo_cfg = load_config(None, {"ppo": {"clip_range": 0.3}})
    assert Algorithm.from_config(ppo_cfg).policy.clip(ppo_cfg.ppo) == (0.3, 0.3)


# ------------------------------------------------------- 4. the staleness bound in sync mode


@pytest.mark.parametrize("staleness", [0, 2])
def test_max_staleness_is_refused_in_sync_mode(staleness):
    _refused({"rollout": {"max_staleness": staleness}},
             f"rollout.max_staleness={staleness} is set but rollout.mode='sync' ignores it",
             "set rollout.mode='async', or rollout.max_staleness=1 (its default)")


def test_max_staleness_is_accepted_in_async_mode_and_at_its_default_in_sync():
    for staleness in (0, 1, 2):
        assert load_config(None, {"rollout": {"mode": "async",
                                              "max_staleness": staleness}}).rollout.max_staleness == staleness
    assert load_config(None, {"rollout": {"mode": "sync", "max_staleness": 1}}).rollout.mode == "sync"


# ------------------------------------------------------- 5. vLLM's reference at another temperature


def test_a_vllm_reference_is_refused_at_another_temperature():
    _refused({"reference": {"backend": "vllm"}, "rollout": {"temperature": 0.7}},
             "rollout.temperature=0.7 is refused with reference.backend='vllm'",
             "prompt_logprobs score at temperature 1", "use reference.backend='hf'",
             "or rollout.temperature=1.0")


def test_a_vllm_reference_at_temperature_one_and_hf_at_any_are_accepted():
    assert load_config(None, {"reference": {"backend": "vllm"},
                              "rollout": {"temperature": 1.0}}).reference.backend == "vllm"
    assert load_config(None, {"rollout": {"temperature": 0.7}}).rollout.temperature == 0.7  # hf scores at it


# ------------------------------------------------------- 6. the exact KL in the loss with an agent's episodes


AGENT = {"task": {"name": "agent", "path": "rows.jsonl"}, "rollout": {"agent": "my_agent:solve"},
         "model": {"path": "policy-dir"}}


def test_agents_take_every_kl_placement_an_episodes_rows_laid_end_to_end():
    """The KL in the loss is taken on an episode's rows laid end to end (learner.algorithm.EpisodeView); the
    settings-space harness checks its gradient on an agent episode split into rows."""
    for form in ("kl_to_go", "response_k2"):
        assert load_config(None, {**AGENT, "kl": {"placement": "loss",
                                                  "loss_form": form}}).kl.loss_form == form


def test_clip_range_beside_both_of_its_bounds_is_refused():
    _refused({"ppo": {"clip_range": 0.1, "clip_range_low": 0.2, "clip_range_high": 0.28}},
             "ppo.clip_range=0.1 is set but ppo.clip_range_low and ppo.clip_range_high are both set")
    ppo = load_config(None, {"ppo": {"clip_range": 0.1, "clip_range_high": 0.28}}).ppo
    assert POLICY_LOSSES.get("ppo").clip(ppo) == (0.1, 0.28)
