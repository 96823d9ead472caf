"""docs/settings.md is the config's own reference: current, and with every setting and every rule in it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pydantic import BaseModel

from services.config import JobConfig, _section
from services.rules import BOOKS

ROOT = Path(__file__).resolve().parents[1]


def leaf_settings(model: type[BaseModel], path: str = "") -> list[str]:
    out = []
    for name in model.model_fields:
        sub = _section(model, name)
        out += leaf_settings(sub, f"{path}{name}.") if sub else [f"{path}{name}"]
    return out


def test_the_settings_reference_is_current():
    done = subprocess.run([sys.executable, "docs/generate_settings.py", "--check"], cwd=ROOT, capture_output=True,
                          text=True, check=False)
    assert done.returncode == 0, done.stderr


def test_the_reference_lists_every_setting_with_the_jobs_default_and_every_rule():
    page = (ROOT / "docs" / "settings.md").read_text()
    missing = [s for s in leaf_settings(JobConfig) if f"| `{s}` |" not in page]
    assert missing == []
    assert "| `kl.init_kl_coef` | float | `0.05` |" in page  # the job's beta, not KLConfig's 0.15
    assert [r.name for b in BOOKS for r in b.rules if f"| `{r.name}` |" not in page] == []
