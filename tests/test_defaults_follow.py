"""Defaults that follow what a user changes, the settings' merge, and the one error base. Pure config: no
cluster, no model."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

import pytest
import yaml

from learner.checkpoint import keep_followed_defaults
from learner.main import parse_cli
from services.config import JobConfig, load_config, merge_settings
from services.errors import ConfigError, TetherError, load_object

ROOT = Path(__file__).resolve().parents[1]


def test_the_default_job_keeps_its_batch_split_and_rate():
    cfg = parse_cli([])
    assert (cfg.rollout.batch_size, cfg.ppo.minibatch_size, cfg.rollout.chunk_size, cfg.ppo.lr) == \
        (128, 64, 32, 3e-4)
    assert cfg.followed_defaults() is None


@pytest.mark.parametrize("args, minibatch, chunk", [
    (["--rollout.batch_size", "32"], 32, 32),
    (["--rollout.batch_size", "48"], 48, 24),
    (["--rollout.batch_size", "16"], 16, 16),
    (["--rollout.batch_size", "96", "--rollout.samples_per_prompt", "3", "--ppo.advantage", "rloo"], 48, 24),
    (["--rollout.batch_size", "48", "--learner.world_size", "2"], 48, 24),
    (["--rollout.batch_size", "40", "--learner.world_size", "2"], 40, 20),
])
def test_minibatch_and_chunk_follow_the_batch_when_unset(args, minibatch, chunk):
    cfg = parse_cli(args)
    assert (cfg.ppo.minibatch_size, cfg.rollout.chunk_size) == (minibatch, chunk)
    w, n = cfg.learner.world_size, cfg.rollout.samples_per_prompt
    assert cfg.rollout.batch_size % minibatch == 0 and minibatch % w == 0
    assert chunk % n == 0 and (cfg.rollout.batch_size // chunk) % w == 0
    line = cfg.followed_defaults()
    assert f"ppo.minibatch_size={minibatch} follows rollout.batch_size={cfg.rollout.batch_size}" in line
    # a resolved config (--print-config, a run's config.yaml) sets them: the same job, nothing followed
    dumped = JobConfig.model_validate(cfg.model_dump(mode="json"))
    assert dumped == cfg and dumped.followed_defaults() is None


def test_what_the_user_sets_is_kept_and_what_cannot_fit_is_still_refused():
    cfg = parse_cli(["--rollout.batch_size", "48", "--ppo.minibatch_size", "16",
                     "--rollout.chunk_size", "12"])
    assert (cfg.ppo.minibatch_size, cfg.rollout.chunk_size) == (16, 12) and cfg.followed_defaults() is None
    with pytest.raises(ValueError, match="rollout.batch_size=32 is not a multiple of ppo.minibatch_size=64"):
        parse_cli(["--rollout.batch_size", "32", "--ppo.minibatch_size", "64"])
    with pytest.raises(ValueError, match="cannot be split over learner.world_size=3"):
        parse_cli(["--learner.world_size", "3"])  # no divisor of 128 fits 3 ranks: the defaults stay, refused


@pytest.mark.parametrize("advantage, lr, shown", [("grpo", 1e-4, "0.0001"), ("rloo", 1e-4, "0.0001"),
                                                   ("reinforce_pp", 1e-4, "0.0001"),
                                                   ("reinforce_pp_baseline", 1e-4, "0.0001")])
def test_each_estimator_has_its_learning_rate_when_ppo_lr_is_unset(advantage, lr, shown):
    cfg = parse_cli(["--ppo.advantage", advantage, "--rollout.samples_per_prompt", "8"])
    assert cfg.ppo.lr == lr
    assert f"ppo.lr={shown} follows ppo.advantage={advantage}" in cfg.followed_defaults()
    assert parse_cli(["--ppo.advantage", advantage, "--rollout.samples_per_prompt", "8", "--ppo.lr", "3e-4"]
                     ).ppo.lr == 3e-4
    # a pretrained policy is still told, at the rate it would train at
    assert cfg.tiny_model_settings_notice(134_515_008).startswith(f"note: ppo.lr={shown} is the default")


def test_grpos_rate_is_annealed_when_neither_the_rate_nor_its_schedule_is_set():
    group = ["--ppo.advantage", "grpo", "--rollout.samples_per_prompt", "8"]
    cfg = parse_cli(group)
    assert (cfg.ppo.lr, cfg.ppo.lr_schedule) == (1e-4, "linear")
    assert "ppo.lr_schedule=linear follows ppo.advantage=grpo" in cfg.followed_defaults()
    # a chosen rate: the field's own
    assert parse_cli([*group, "--ppo.lr", "1e-4"]).ppo.lr_schedule == "constant"
    chosen = parse_cli([*group, "--ppo.lr_schedule", "constant"])
    assert (chosen.ppo.lr, chosen.ppo.lr_schedule) == (1e-4, "constant")
    assert parse_cli(["--ppo.advantage", "rloo", "--rollout.samples_per_prompt", "8"]).ppo.lr_schedule == \
        "constant"
    saved = cfg.model_dump()
    saved["ppo"]["lr"], saved["ppo"]["lr_schedule"] = 5e-5, "constant"  # as the version before resolved them
    keep_followed_defaults(saved, cfg)
    assert (cfg.ppo.lr, cfg.ppo.lr_schedule) == (5e-5, "constant")


@pytest.mark.parametrize("setting", [["--ppo.policy_loss", "cispo"], ["--ppo.policy_loss", "sapo"],
                                     ["--ppo.correction", "icepop"]])
def test_async_losses_that_weigh_stale_rows_beyond_tis_cap_train_two_epochs_when_ppo_epochs_is_unset(setting):
    group = ["--ppo.advantage", "grpo", "--rollout.samples_per_prompt", "8"]
    cfg = parse_cli([*group, *setting, "--rollout.mode", "async"])
    assert cfg.ppo.epochs == 2
    assert (f"ppo.epochs=2 follows rollout.mode=async, ppo.policy_loss={cfg.ppo.policy_loss}, "
            f"ppo.correction={cfg.ppo.correction}") in cfg.followed_defaults()
    assert parse_cli([*group, *setting, "--rollout.mode", "async", "--ppo.epochs", "4"]).ppo.epochs == 4
    assert parse_cli([*group, *setting]).ppo.epochs == 4  # sync mode keeps the recipe's 4
    assert parse_cli([*group, "--rollout.mode", "async"]).ppo.epochs == 4  # PPO's clip with TIS too


def test_a_resume_keeps_the_followed_values_it_ran_with():
    saved = load_config(None,
                        {"ppo": {"advantage": "grpo"}, "rollout": {"samples_per_prompt": 8}}).model_dump()
    saved["ppo"]["lr"], saved["ppo"]["minibatch_size"] = 3e-4, 32  # as an older tether resolved them
    cfg = parse_cli(["--ppo.advantage", "grpo", "--rollout.samples_per_prompt", "8"])
    keep_followed_defaults(saved, cfg)
    assert (cfg.ppo.lr, cfg.ppo.minibatch_size) == (3e-4, 32)
    chosen = parse_cli(["--ppo.advantage", "grpo", "--rollout.samples_per_prompt", "8", "--ppo.lr", "2e-4"])
    keep_followed_defaults(saved, chosen)
    assert chosen.ppo.lr == 2e-4  # what the user set now is theirs: check_compatible then says it differs


def test_a_dict_on_the_command_line_replaces_the_files_in_both_merge_paths(tmp_path):
    preset = ROOT / "deploy" / "configs" / "calculator-smollm2.yaml"
    assert yaml.safe_load(preset.read_text())["task"]["environment_kwargs"]  # the file sets some
    args = ["--config", str(preset), "--task.environment", "tests.agent_envs:scripted",
            "--task.environment_kwargs", '{"max_turns": 4}']
    assert parse_cli(args).task.environment_kwargs == {"max_turns": 4}
    assert parse_cli(args).rollout.max_turns == yaml.safe_load(preset.read_text())["rollout"]["max_turns"]
    merged = merge_settings({"task": {"environment_kwargs": {"examples": 2}, "seed": 3}, "cluster": {
        "rollout": {"resources": {"a": 1.0}, "num_cpus": 1.0}}},
        {"task": {"environment_kwargs": {"max_turns": 4}}, "cluster": {"rollout": {"resources": {"b": 1.0}}}})
    assert merged == {"task": {"environment_kwargs": {"max_turns": 4}, "seed": 3},
                      "cluster": {"rollout": {"resources": {"b": 1.0}, "num_cpus": 1.0}}}  # sections merge
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump({"cluster": {"rollout": {"resources": {"a": 1.0}}}}))
    assert load_config(path, {"cluster": {"rollout": {"resources": {"b": 1.0}}}}) \
        .cluster.rollout.resources == {"b": 1.0}


def tether_error_classes() -> list[type]:
    found = []
    for layer in ("services", "actors", "learner"):
        for path in sorted((ROOT / layer).rglob("*.py")):
            name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
            if name.endswith("__main__"):
                continue
            module = importlib.import_module(name)
            found += [obj for _, obj in inspect.getmembers(module, inspect.isclass)
                      if issubclass(obj, BaseException) and obj.__module__ == name]
    return found


def test_every_error_tether_defines_is_a_tether_error():
    classes = tether_error_classes()
    assert len(classes) >= 14
    assert [c.__qualname__ for c in classes if not issubclass(c, TetherError)] == []


@pytest.mark.parametrize("spec, message", [
    ("nocolon", "task.environment='nocolon' must be given as 'package.module:factory'"),
    ("no_such_module_x:f", "module 'no_such_module_x' cannot be imported: ModuleNotFoundError"),
    ("services.errors:Nowhere", "module 'services.errors' has no attribute 'Nowhere'"),
])
def test_the_one_loader_names_the_setting_and_what_is_wrong(spec, message):
    with pytest.raises(ConfigError, match=message):
        load_object(spec, "task.environment", "package.module:factory")
    assert load_object("services.errors:ConfigError.mro", "x") == ConfigError.mro
