"""The device check (``benchmarks/device_check.py``) in its CPU mode: every step it runs on a GPU (the update
by the plain-torch engine and by DeepSpeed at ZeRO-0 and ZeRO-3, the weight gather as vLLM's loader checks
it, the HF engine on the learner's weights, packing and float64 log-probs) runs in float32 on gloo, so the
check is known to work before it meets a GPU; CUDA IPC is reported as skipped here."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.conftest import ROOT


def test_the_device_checks_cpu_mode_passes_every_step_but_cuda_ipc():
    proc = subprocess.run([sys.executable, "benchmarks/device_check.py", "--device", "cpu"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, check=False)
    steps = [line for line in proc.stdout.splitlines() if line.startswith("[device_check] ")]
    assert proc.returncode == 0, "\n".join(steps) + proc.stderr[-3000:]
    step = re.compile(r"\[device_check\] (.*): (pass|skipped|FAIL): ")
    status = dict(step.match(line).groups() for line in steps[:-1])
    assert status == {"randomwalks: update, torch engine": "pass",
                      "randomwalks: update, deepspeed engine ZeRO-0": "pass",
                      "randomwalks: update, deepspeed engine ZeRO-3": "pass",
                      "randomwalks: hf engine on the learner's weights": "pass",
                      "randomwalks: packing, log-probs against float64": "pass",
                      "cuda ipc of a packed buffer": "skipped"}, steps


def test_the_device_check_imports_neither_ray_nor_vllm():
    """A GPU machine with only torch (and the check's wheels) can run it: the modules it loads bring neither
    Ray nor vLLM."""
    code = ("import sys; sys.path.insert(0, 'benchmarks'); import device_check; "
            "import learner.plan, learner.engine, learner.update, learner.weight_transfer, actors.engines; "
            "print(sorted(m for m in ('ray', 'vllm') if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0 and proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout + proc.stderr
