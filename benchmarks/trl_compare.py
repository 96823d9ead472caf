"""tether's default job against TRL's GRPOTrainer on randomwalks, from the same cached SFT start, each to
sampled optimality >= 0.95; reports the whole-process time of each and their ratio, on this machine.

- TRL 1.16 goes into its own virtualenv under ``--cache-dir`` (torch 2.13.0 from the local wheels, then
  ``pip install trl``), never into the project's: it pins other versions.
- Same episodes per step: TRL takes 16 prompts x 8 completions = 128, tether its default rollout batch of
  128; lr 3e-4, beta 0 (TRL) and 2 threads for TRL.
- The same evaluation for both: 20 prompts x 50 samples of the saved policy, drawn by one sampler
  (transformers ``generate`` at temperature 1, tether's ``HFEngine``) and scored by the task's optimality.
- A side that stays below 0.95 after ``--steps`` is run again with twice the steps, up to ``--max-steps``.
- Whole process: from starting the command to its exit, SFT model cached, evaluation not included.

    .venv/bin/python benchmarks/trl_compare.py [--steps 20] [--max-steps 80]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _bench import RESULTS, ROOT, cpu_model, stamp, write_results

TRL_VERSION = "1.16.0"
TORCH_VERSION = "2.13.0"
TARGET = 0.95
def cpu_flags() -> str:
    """The flags that decide matmul speed here: AMX and AVX-512 BF16, or neither."""
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            return ", ".join(f for f in ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f") if f in flags) or "none"
    return "unknown"


def trl_python(cache_dir: Path, extra: tuple[str, ...] = ()) -> Path:
    """A virtualenv with torch, TRL and ``extra`` packages under ``cache_dir`` (made on first use, ``extra``
    added to it when missing); its python."""
    venv = cache_dir / f"venv-trl-{TRL_VERSION}"
    python = venv / "bin" / "python"
    installs = [[f"torch=={TORCH_VERSION}"], [f"trl=={TRL_VERSION}"]]
    if python.is_file() and subprocess.run([str(python), "-c", "import trl"], check=False, capture_output=True).returncode == 0:
        installs = [list(extra)] if extra else []
    else:
        print(f"[trl_compare] installing TRL {TRL_VERSION} into {venv}", flush=True)
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        installs += [list(extra)] if extra else []
    for packages in installs:
        proc = subprocess.run([str(python), "-m", "pip", "install", "-q", *packages], check=False,
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"pip install {' '.join(packages)} into {venv} failed:\n{proc.stdout[-3000:]}"
                               f"{proc.stderr[-3000:]}")
    return python


def sft_start() -> Path:
    """The default job's SFT warm start (built and cached on a miss, outside both timings)."""
    from services.config import JobConfig
    from services.models import policy_dir
    from services.tasks import get_task

    cfg = JobConfig()
    task = get_task(cfg.task.name, seed=cfg.task.seed)
    return policy_dir(task, None, cfg.model.cache_dir, cfg.run.seed, cfg.model.sft_steps, cfg.model.sft_batch_size,
                      cfg.model.sft_lr)


def timed(cmd: list[str], log: Path, env: dict | None = None) -> float:
    """Whole-process seconds of ``cmd`` (output to ``log``); raises naming the log when it fails."""
    start = time.perf_counter()
    with open(log, "w") as out:
        code = subprocess.run(cmd, check=False, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, env=env).returncode
    seconds = time.perf_counter() - start
    if code != 0:
        raise RuntimeError(f"{cmd[:4]}... exited {code}; see {log}")
    return seconds


def evaluate(model_dir: Path, prompts_n: int = 20, samples: int = 50, seed: int = 12345) -> float:
    """Mean optimality of ``samples`` sampled walks for each of ``prompts_n`` eval prompts: one sampler for
    both sides (transformers generate, temperature 1, no top-k/top-p)."""
    from actors.engines import HFEngine, SamplingSettings
    from services.tasks import get_task

    task = get_task("randomwalks")
    engine = HFEngine(str(model_dir), seed)
    texts = task.eval_prompts()[:prompts_n]
    prompts = [engine.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    completions, prompt_texts = [], []
    for i, (text, ids) in enumerate(zip(texts, prompts, strict=True)):
        generations = engine.generate([ids] * samples, SamplingSettings(1.0, 1.0, task.max_new_tokens), [seed + i])
        completions += [engine.tokenizer.decode(g.response_ids, skip_special_tokens=True) for g in generations]
        prompt_texts += [text] * samples
    return task.evaluate(prompt_texts, completions)["optimality"]


def run_tether(steps: int, work: Path) -> dict:
    name = f"tether-{steps}"
    seconds = timed([sys.executable, "-m", "learner.main", "--run.iterations", str(steps), "--run.eval_every",
                     str(steps), "--run.output_dir", str(work), "--run.name", name],
                    work / f"{name}.log", env={**os.environ, "PYTHONPATH": str(ROOT)})
    return {"steps": steps, "whole_process_seconds": seconds, "optimality": evaluate(work / name / "export")}


def run_trl(python: Path, sft: Path, steps: int, work: Path) -> dict:
    out = work / f"trl-{steps}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2"}
    seconds = timed([str(python), str(ROOT / "benchmarks" / "_trl_grpo.py"), "--model", str(sft), "--steps",
                     str(steps), "--out", str(out)], work / f"trl-{steps}.log", env=env)
    timings = json.loads((out / "timings.json").read_text())
    return {"steps": steps, "whole_process_seconds": seconds, "seconds_per_step": timings["seconds_per_step"],
            "optimality": evaluate(out / "model")}


def to_target(run, steps: int, max_steps: int) -> list[dict]:
    """Runs at ``steps``, doubling until the evaluation reaches the target or ``max_steps`` is passed."""
    tries = []
    while steps <= max_steps:
        tries.append(run(steps))
        print(f"[trl_compare] {tries[-1]}", flush=True)
        if tries[-1]["optimality"] >= TARGET:
            break
        steps *= 2
    return tries


def parse_args(parser: argparse.ArgumentParser) -> tuple[argparse.Namespace, Path]:
    """``parser``'s arguments plus those every TRL comparison takes; the cache directory, made."""
    parser.add_argument("--cache-dir", default="~/.cache/tether/trl-compare", help="TRL's virtualenv goes here")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    cache = Path(args.cache_dir).expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    return args, cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20, help="iterations (tether) and optimizer steps (TRL)")
    parser.add_argument("--max-steps", type=int, default=80, help="give up doubling past this")
    args, cache = parse_args(parser)
    python = trl_python(cache)
    sft = sft_start()
    work = Path(tempfile.mkdtemp(prefix="trl-compare-", dir=cache))
    sft_optimality = evaluate(sft)
    tether = to_target(lambda s: run_tether(s, work), args.steps, args.max_steps)
    trl = to_target(lambda s: run_trl(python, sft, s, work), args.steps, args.max_steps)
    a, b = tether[-1], trl[-1]
    reached = a["optimality"] >= TARGET and b["optimality"] >= TARGET
    results = {**stamp(), "cpu_flags": cpu_flags(), "sft_optimality": sft_optimality, "tether": tether, "trl": trl,
               "ratio_tether_over_trl": a["whole_process_seconds"] / b["whole_process_seconds"],
               "both_reached_target": reached}
    table = [
        (f"randomwalks, tether's default job against TRL {TRL_VERSION} GRPO (16 prompts x 8, lr 3e-4, beta 0, 2 "
         f"threads), same SFT start (optimality {sft_optimality:.2f}), one evaluation (20 prompts x 50 samples); "
         f"{results['date']}, {results['machine']}, CPU flags: {results['cpu_flags']}; "
         "`.venv/bin/python benchmarks/trl_compare.py`"),
        "",
        "| | steps | whole process | sampled optimality |",
        "|---|---|---|---|",
        f"| tether | {a['steps']} | {a['whole_process_seconds']:.1f} s | {a['optimality']:.3f} |",
        f"| TRL GRPO | {b['steps']} | {b['whole_process_seconds']:.1f} s | {b['optimality']:.3f} |",
        (f"| tether / TRL | | {results['ratio_tether_over_trl']:.2f}x | "
         f"{'both >= 0.95' if reached else 'target NOT reached by both: ratio not to target'} |"),
    ]
    json_path, md_path = write_results(args.out, "trl_compare", results, table)
    print("\n".join(table), flush=True)
    print(f"[trl_compare] {json_path} {md_path} (CPU {cpu_model()})", flush=True)


if __name__ == "__main__":
    main()
