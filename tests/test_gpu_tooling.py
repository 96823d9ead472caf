"""The GPU tooling, checked on CPU: ``pytest -m gpu`` starts on a machine with torch alone (no Ray, vLLM,
DeepSpeed, transformers or pydantic) and says what it skips and why, and benchmarks/gpu.sh reports a pytest
step in which every test skipped as skipped, not ok, with the reasons, and exits saying nothing ran."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.timeout(300)

# what a machine with torch (and pytest) alone lacks of the project's dependencies
NOT_ON_A_TORCH_MACHINE = ("ray", "vllm", "deepspeed", "transformers", "pydantic")
# GPU tests of the suite (there may be more); on a machine without a CUDA device each skips with this reason
GPU_TESTS = {
    "tests/test_gpu.py::test_whitening_and_loss_counts_all_reduce_on_cuda_in_an_nccl_group",
    "tests/test_gpu.py::test_bfloat16_logits_give_float32_logprobs_on_cuda",
    "tests/test_weight_transfer.py::test_vllm_weight_transfer_into_a_cuda_engine[nccl]",
    "tests/test_weight_transfer.py::test_vllm_weight_transfer_into_a_cuda_engine[ipc]",
}
NO_CUDA = "needs a CUDA device"


def torch_alone_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a Python that cannot import the packages a torch-only machine lacks: a
    ``sitecustomize`` that makes importing them fail as if they were not installed; no plugins but pytest's
    own, and no CUDA device."""
    site = tmp_path / "torch-alone"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import sys\n"
        f"MISSING = {NOT_ON_A_TORCH_MACHINE!r}\n"
        "class NotInstalled:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.partition('.')[0] in MISSING:\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, NotInstalled())\n"
    )
    return {**os.environ, "PYTHONPATH": str(site), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
            "CUDA_VISIBLE_DEVICES": "", "PYTHONDONTWRITEBYTECODE": "1"}


def test_pytest_m_gpu_starts_with_torch_alone_and_says_what_it_skips(tmp_path):
    env = torch_alone_env(tmp_path)
    probe = ("import importlib, torch\n"  # the stand-in works: torch imports, the others do not
             f"for name in {NOT_ON_A_TORCH_MACHINE!r}:\n"
             "    try:\n"
             "        importlib.import_module(name)\n"
             "        print(name, 'imported')\n"
             "    except ModuleNotFoundError:\n"
             "        print(name, 'missing')\n")
    probed = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                            text=True, timeout=120, check=False)
    assert probed.stdout.split() == \
        [word for name in NOT_ON_A_TORCH_MACHINE for word in (name, "missing")], probed

    # from the repository's root (every test module in reach) and for one module, as a user would run them
    for args in ([], ["tests/test_gpu.py"]):
        proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-rs", "-p",
                               "no:cacheprovider", *args],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=240, check=False)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 0, out
        assert re.search(r"learner\.cluster is not importable \(No module named '(ray|pydantic)'\)", out), out
        last = out.strip().splitlines()[-1]  # e.g. "4 skipped, 3 deselected in 2.10s": nothing else ran
        assert "skipped" in last and not any(word in last for word in ("passed", "failed", "error")), out
        skipped = [line for line in out.splitlines() if line.startswith("SKIPPED")]
        assert skipped and all(NO_CUDA in line for line in skipped), out
        for module in {t.split("::")[0] for t in GPU_TESTS if not args or t.startswith(args[0])}:
            assert any(module in line for line in skipped), (module, out)


def test_pytest_m_gpu_collects_only_the_gpu_modules():
    """Under ``-m gpu`` the conftest leaves out the modules without a GPU mark: the tests collected are
    the same as under a mark expression that imports every module (the selection is not changed)."""
    ids = {}
    for markexpr in ("gpu", "gpu or gpu"):
        proc = subprocess.run([sys.executable, "-m", "pytest", "-m", markexpr, "--collect-only", "-q",
                               "-p", "no:cacheprovider", "tests/test_gpu.py", "tests/test_weight_transfer.py",
                               "tests/test_gpu_tooling.py", "tests/test_ppo.py"],
                              cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        ids[markexpr] = {line for line in proc.stdout.splitlines() if "::" in line}
    assert ids["gpu"] == ids["gpu or gpu"] and GPU_TESTS <= ids["gpu"], ids


def load_gpu_report():
    spec = importlib.util.spec_from_file_location("gpu_report", ROOT / "benchmarks" / "gpu_report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


SAMPLE_TESTS = '''
import pytest

def test_passes():
    assert 1 + 1 == 2

def test_skips():
    pytest.skip("needs a CUDA device")

def test_fails():
    assert 1 + 1 == 3
'''


def run_sample(tmp_path: Path, name: str, *args: str) -> tuple[Path, int]:
    """A real pytest run over SAMPLE_TESTS: (its JUnit report, its exit code)."""
    junit = tmp_path / f"{name}.xml"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           f"--junitxml={junit}", "sample_test.py", *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, check=False,
                          env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})
    return junit, proc.returncode


def test_pytest_step_status_passes_only_what_ran_and_passed(tmp_path):
    (tmp_path / "sample_test.py").write_text(SAMPLE_TESTS)
    status_of = load_gpu_report().pytest_step_status

    junit, code = run_sample(tmp_path, "all-skipped", "-k", "skips")
    assert code == 0  # what the script used to read as "ok"
    status, lines = status_of(junit, code)
    assert status == "skipped (nothing ran: 1 skipped)"
    assert lines == ["SKIPPED sample_test::test_skips: needs a CUDA device"]

    junit, code = run_sample(tmp_path, "none-selected", "-k", "no_such_test")
    assert code == 5
    assert status_of(junit, code)[0] == "skipped (nothing ran: no test selected)"

    junit, code = run_sample(tmp_path, "some-ran", "-k", "passes or skips")
    assert status_of(junit, code) == ("ok (1 passed, 1 skipped)",
                                      ["SKIPPED sample_test::test_skips: needs a CUDA device"])

    junit, code = run_sample(tmp_path, "one-failed")
    status, lines = status_of(junit, code)
    assert code == 1 and status == "FAILED (pytest exit 1: 1 passed, 1 failed, 1 skipped)"
    assert any(line.startswith("FAILED sample_test::test_fails: assert") for line in lines), lines

    assert status_of(tmp_path / "absent.xml", 0)[0].startswith("FAILED (pytest exit 0, no readable report")
    assert status_of(junit, 2)[0].startswith("FAILED (pytest exit 2")
    cli = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_report.py"),
                          "--pytest-junit", str(junit)],
                         capture_output=True, text=True, timeout=120, check=False)
    assert cli.returncode == 2 and "--pytest-junit needs --pytest-exit" in cli.stderr, cli.stderr


def test_gpu_sh_reports_an_all_skipped_pytest_step_as_skipped(tmp_path):
    """The real script, its pytest step alone, on a machine without a CUDA device: every GPU test skips,
    so the step is "skipped" with the reasons and the script exits 3 (nothing ran), not 0."""
    out = tmp_path / "gpu-out"
    env = {**os.environ, "TETHER_GPU_SKIP_CHECK": "1", "TETHER_GPU_STEPS": "pytest-gpu",
           "CUDA_VISIBLE_DEVICES": "", "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu.sh"), str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=280, check=False)
    console = proc.stdout + proc.stderr
    assert proc.returncode == 3, console
    summary = (out / "summary.txt").read_text()
    row = next(line for line in summary.splitlines() if line.startswith("pytest-gpu "))
    assert "skipped (nothing ran:" in row and " ok" not in row, summary
    for test in GPU_TESTS:
        name = test.replace(".py", "").replace("/", ".")
        assert any(name in line and NO_CUDA in line for line in summary.splitlines()), (test, summary)
    assert "not selected" in console and "nothing ran" in console, console
