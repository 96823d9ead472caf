"""A console people can read: the default job prints tether's own lines (progress, summary, the run
directory) and few others, none of them a warning; `--log-level debug` brings the libraries back; `tether` is
the same command as `python -m learner.main`."""

from __future__ import annotations

import logging
import sys
import tomllib

import pytest

from tests.conftest import ROOT

MAX_LINES = 60


def test_library_env_by_level():
    from services.console import library_env

    quiet = library_env("warning")
    assert quiet["VLLM_LOGGING_LEVEL"] == "WARNING" and quiet["TRANSFORMERS_VERBOSITY"] == "warning"
    assert quiet["HF_HUB_DISABLE_PROGRESS_BARS"] == "1" and quiet["TORCH_CPP_LOG_LEVEL"] == "ERROR"
    loud = library_env("debug")
    assert loud["VLLM_LOGGING_LEVEL"] == "DEBUG" and loud["TETHER_LOG_LEVEL"] == "debug"
    assert "HF_HUB_DISABLE_PROGRESS_BARS" not in loud and "TORCH_CPP_LOG_LEVEL" not in loud


def test_harmless_vllm_warning_is_dropped_below_debug_only(monkeypatch):
    """The filter drops exactly the known harmless lines, on the logger vLLM emits them from."""
    from services.console import DropHarmless, quiet_vllm

    logger = logging.getLogger("vllm.v1.worker.cpu_worker")
    monkeypatch.setattr(logger, "filters", [])
    monkeypatch.setenv("TETHER_LOG_LEVEL", "debug")
    quiet_vllm()
    assert not logger.filters
    monkeypatch.setenv("TETHER_LOG_LEVEL", "warning")
    quiet_vllm()
    (drop,) = [f for f in logger.filters if isinstance(f, DropHarmless)]
    record = lambda msg: logging.LogRecord(logger.name, logging.WARNING, __file__, 1, msg, None, None)
    assert not drop.filter(record("CPU backend doesn't allow to use `torch.set_num_threads` after the thread "
                                  "binding, skip it."))
    assert drop.filter(record("Node 1 is not in available memory nodes [0]."))
    # an engine in 16 bits loading float32 weights: the cast tether asked for, once per weight
    (cast,) = [f for f in logging.getLogger("vllm.model_executor.models.utils").filters
               if isinstance(f, DropHarmless)]
    assert not cast.filter(record("Attempted to load weight model.norm.weight with dtype torch.float32 into "
                                  "parameter with dtype torch.bfloat16"))


def test_tether_entry_point_is_learner_main(monkeypatch, capsys):
    """pyproject's `tether` command runs learner.main's cli(), which is `python -m learner.main`."""
    from learner.main import cli

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["tether"] == "learner.main:cli"
    monkeypatch.setattr(sys, "argv", ["tether", "--print-config", "--log-level", "debug"])
    with pytest.raises(SystemExit) as stopped:
        cli()
    assert stopped.value.code == 0
    assert "log_level: debug" in capsys.readouterr().out


@pytest.mark.integration
def test_default_job_console_is_short_and_has_no_warning(default_run):
    """The default job (10 iterations here): under MAX_LINES lines of stdout and stderr together, no
    warning, and the lines a person looks for."""
    run_dir, proc = default_run
    lines = (proc.stdout + proc.stderr).splitlines()
    assert proc.returncode == 0, "\n".join(lines[-80:])
    assert len(lines) < MAX_LINES, f"{len(lines)} lines:\n" + "\n".join(lines)
    warnings = [line for line in lines if "warning" in line.lower()]
    assert not warnings, "\n".join(warnings)
    assert f"[tether] run directory {run_dir}" in lines
    for start in ("[tether] iter 1/10 | reward", "[tether] iter 10/10 | reward",
                  "[tether] summary: final optimality"):
        assert any(line.startswith(start) for line in lines), start
    assert lines[-1].startswith("[tether] summary:") and lines[-1].endswith(str(run_dir / "summary.json"))


@pytest.mark.filterwarnings("ignore:kl.scope='token_mean'")
@pytest.mark.parametrize("scope, shown", [("response_sum", "kl 7.500/6.0 nats |"),
                                          ("token_mean", "kl 7.500 nats, 0.2500/0.2 per token |")])
def test_the_iteration_line_shows_the_kl_the_controller_is_fed_against_its_target(scope, shown, capsys):
    """kl.scope token_mean: the per-token mean against the per-token target, beside the response KL."""
    from learner.main import Progress
    from services.config import load_config

    target = 6.0 if scope == "response_sum" else 0.2
    cfg = load_config(None, {"kl": {"scope": scope, "target": target}, "metrics": {"report_to": []}})
    record = {"iteration": 1, "reward_mean": 0.1, "score_mean": 0.2, "kl_response_mean": 7.5,
              "kl_token_mean": 0.25, "kl_coef": 0.05, "iteration_seconds": 1.0}
    Progress(cfg, None).update(record)
    assert shown in capsys.readouterr().out
