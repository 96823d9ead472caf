"""The docs site: it builds in strict mode, shows every benchmark result as written, every `learner.main`
command in it parses, and docs/settings.md is the config's own reference (current, with every setting and
rule)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

from learner.main import parse_cli
from services.config import JobConfig, _section
from services.rules import BOOKS

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]
CODE_BLOCK = re.compile(r"```[^\n]*\n(.*?)```", re.DOTALL)


def leaf_settings(model: type[BaseModel], path: str = "") -> list[str]:
    out = []
    for name in model.model_fields:
        sub = _section(model, name)
        out += leaf_settings(sub, f"{path}{name}.") if sub else [f"{path}{name}"]
    return out


def test_the_settings_reference_is_current():
    done = subprocess.run([sys.executable, "docs/generate_settings.py", "--check"], cwd=ROOT,
                          capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr


def test_the_reference_lists_every_setting_with_the_jobs_default_and_every_rule():
    page = (ROOT / "docs" / "settings.md").read_text()
    missing = [s for s in leaf_settings(JobConfig) if f"| `{s}` |" not in page]
    assert missing == []
    assert "| `kl.init_kl_coef` | float | `0.05` |" in page  # the job's beta, not KLConfig's 0.15
    assert [r.name for b in BOOKS for r in b.rules if f"| `{r.name}` |" not in page] == []


def test_the_site_builds_with_no_warning_and_shows_every_result(tmp_path):
    """Strict: a broken link, a page in no table of contents, a missing anchor or any other warning fails."""
    done = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-c",
                           "docs", "-b", "html", ".", str(tmp_path)], cwd=ROOT, capture_output=True,
                          text=True, check=False)
    assert done.returncode == 0, done.stderr
    results = sorted((ROOT / "benchmarks" / "results").glob("*.md"))
    assert len(results) > 10
    assert [r.name for r in results
            if not (tmp_path / "benchmarks" / "results" / f"{r.stem}.html").exists()] == []
    # the page's title
    assert [r.name for r in results if not r.read_text().startswith(f"# {r.stem}\n")] == []


def learner_main_commands(page: Path) -> list[list[str]]:
    """The arguments of each `learner.main` command on ``page``: in code blocks (continued lines joined) and
    inline code; a shell comment ends a command."""
    text = page.read_text()
    lines = [line for block in CODE_BLOCK.findall(text)
             for line in re.sub(r"\\\n\s*", " ", block).split("\n")]
    lines += re.findall(r"`([^`\n]*learner\.main[^`\n]*)`", CODE_BLOCK.sub("", text))
    return [shlex.split(line.split("learner.main", 1)[1], comments=True) for line in lines
            if "learner.main" in line]


def files_the_page_writes(page: Path) -> dict[str, str]:
    """Code blocks that open with a comment naming a file (``# my-prompts.yaml``): the page's own example
    files."""
    files = {}
    for block in CODE_BLOCK.findall(page.read_text()):
        named = re.match(r"# ([\w./-]+\.(?:yaml|py|jsonl))\b", block)
        if named:
            files[named.group(1)] = block
    return files


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_learner_main_command_in_the_docs_parses(page, tmp_path, monkeypatch, capsys):
    """Each command line, run with --print-config beside the files the page itself shows and the repository's
    configs, resolves to a config: a renamed setting or a refused combination in the docs fails here."""
    for name, text in files_the_page_writes(page).items():
        (tmp_path / name).write_text(text)
    for shared in ("deploy", "tests", "data"):
        if (ROOT / shared).exists():
            (tmp_path / shared).symlink_to(ROOT / shared)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for args in learner_main_commands(page):
        if args in (["ARGS"], ["--help"]):  # the placeholder and the help, not a job
            continue
        capsys.readouterr()
        assert parse_cli([*args, "--print-config"]) is None, args
        assert "kl:" in capsys.readouterr().out, args


DEFAULT_COLUMN = re.compile(r"^\| setting \| tether \(?default\)? \|")
ONE_SETTING = re.compile(r"^\| `([a-z_]+(?:\.[a-z_]+)+)` \| ([^|]*) \|")


def shown_default(value) -> set[str]:
    """The ways a docs table may write a setting's default."""
    if value is None:
        return {"none", "null", "unset"}
    if isinstance(value, bool):
        return {str(value).lower()}
    return {str(value), repr(value)}


def test_the_defaults_the_docs_tables_give_are_the_configs():
    """A row of a docs table headed "setting | tether default" that names one setting gives the config's own
    default first, and where the default follows other settings when unset, names them."""
    from services.config import FOLLOWED_DEFAULTS

    followed = {f"{section}.{name}": sources for section, name, sources in FOLLOWED_DEFAULTS}
    checked = []
    for page in PAGES:
        in_table = False
        for line in page.read_text().splitlines():
            in_table = bool(DEFAULT_COLUMN.match(line)) or (in_table and line.startswith("|"))
            if not in_table or not (row := ONE_SETTING.match(line)):
                continue
            path, cell = row.groups()
            *sections, name = path.split(".")
            model = JobConfig
            for key in sections:
                model = _section(model, key)
            default = model.model_fields[name].default
            first = re.split(r"[\s:(;,]", cell.strip().replace("`", ""), maxsplit=1)[0]
            assert first in shown_default(default), (page.name, path, cell, default)
            assert all(source in cell for source in followed.get(path, ())), (page.name, path, cell)
            checked.append(path)
    assert {"ppo.lr_schedule", "ppo.whiten_rewards", "distill.coef"} <= set(checked), checked
