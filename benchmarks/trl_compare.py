"""tether's default job against TRL's GRPOTrainer on randomwalks, from the same cached SFT start, each to
sampled optimality >= 0.95; reports the whole-process time of each and their ratio, on this machine.

- TRL 1.16 goes into its own virtualenv under ``--cache-dir`` (torch 2.13.0 from the local wheels, then
  ``pip install trl``), never into the project's: it pins other versions.
- Same episodes per step: TRL takes 16 prompts x 8 completions = 128, tether its default rollout batch of
  128; lr 3e-4, beta 0 (TRL) and 2 threads for TRL.
- The same evaluation for both: 20 prompts x 50 samples of the saved policy, drawn by one sampler
  (transformers ``generate`` at temperature 1, tether's ``HFEngine``) and scored by the task's optimality.
- Each side, for each seed (``run.seed``; TRL's ``--seed``; the SFT start of that seed), runs at the step
  counts of ``--ladder`` in turn until a run's final evaluation reaches 0.95: its time to the target is that
  run's. The ratio is tether's over TRL's per seed; the median over the seeds is the race's figure.
- Whole process: from starting the command to its exit, SFT model cached, evaluation not included: TRL's
  process evaluates nothing, so tether's runs evaluate once, at their last iteration (``run.eval_every`` the
  run's iterations, ``run.eval_before_training`` off); ``--with-start-eval`` keeps the default job's
  evaluation before training in tether's time.

    .venv/bin/python benchmarks/trl_compare.py [--seeds 1 2 3] [--ladder 5 10 15 20 30 40 60 80]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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
            return ", ".join(f for f in ("amx_bf16", "amx_tile", "avx512_bf16", "avx512f")
                             if f in flags) or "none"
    return "unknown"


def trl_python(cache_dir: Path, extra: tuple[str, ...] = ()) -> Path:
    """A virtualenv with torch, TRL and ``extra`` packages under ``cache_dir`` (made on first use, ``extra``
    added to it when missing); its python."""
    venv = cache_dir / f"venv-trl-{TRL_VERSION}"
    python = venv / "bin" / "python"
    installs = [[f"torch=={TORCH_VERSION}"], [f"trl=={TRL_VERSION}"]]
    if python.is_file() and subprocess.run([str(python), "-c", "import trl"], check=False,
                                           capture_output=True).returncode == 0:
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


def sft_start(seed: int | None = None) -> Path:
    """The default job's SFT warm start for ``run.seed`` ``seed`` (the job's own by default; built and cached
    on a miss, outside both timings)."""
    from services.config import JobConfig
    from services.models import policy_dir
    from services.tasks import get_task

    cfg = JobConfig()
    task = get_task(cfg.task.name, seed=cfg.task.seed)
    return policy_dir(task, None, cfg.model.cache_dir, cfg.run.seed if seed is None else seed,
                      cfg.model.sft_steps, cfg.model.sft_batch_size, cfg.model.sft_lr)


def timed(cmd: list[str], log: Path, env: dict | None = None) -> float:
    """Whole-process seconds of ``cmd`` (output to ``log``); raises naming the log when it fails."""
    start = time.perf_counter()
    with open(log, "w") as out:
        code = subprocess.run(cmd, check=False, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                              env=env).returncode
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
        generations = engine.generate([ids] * samples, SamplingSettings(1.0, 1.0, task.max_new_tokens),
                                      [seed + i])
        completions += [engine.tokenizer.decode(g.response_ids, skip_special_tokens=True)
                        for g in generations]
        prompt_texts += [text] * samples
    return task.evaluate(prompt_texts, completions)["optimality"]


def run_tether(steps: int, work: Path, seed: int, start_eval: bool = False) -> dict:
    name = f"tether-{seed}-{steps}"
    seconds = timed([sys.executable, "-m", "learner.main", "--run.iterations", str(steps), "--run.eval_every",
                     str(steps), "--run.seed", str(seed), "--run.output_dir", str(work), "--run.name", name,
                     "--run.eval_before_training" if start_eval else "--no-run.eval_before_training"],
                    work / f"{name}.log", env={**os.environ, "PYTHONPATH": str(ROOT)})
    return {"steps": steps, "whole_process_seconds": seconds, "optimality": evaluate(work / name / "export")}


def run_trl(python: Path, sft: Path, steps: int, work: Path, seed: int) -> dict:
    out = work / f"trl-{seed}-{steps}"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2"}
    seconds = timed([str(python), str(ROOT / "benchmarks" / "_trl_grpo.py"), "--model", str(sft),
                     "--steps", str(steps), "--seed", str(seed), "--out", str(out)],
                    work / f"trl-{seed}-{steps}.log", env=env)
    timings = json.loads((out / "timings.json").read_text())
    return {"steps": steps, "whole_process_seconds": seconds, "seconds_per_step": timings["seconds_per_step"],
            "optimality": evaluate(out / "model")}


def to_target(run, ladder: list[int]) -> list[dict]:
    """Runs at each step count of ``ladder`` in turn until one's evaluation reaches the target (the last run's
    is the time to it), or the ladder ends."""
    tries = []
    for steps in ladder:
        tries.append(run(steps))
        print(f"[trl_compare] {tries[-1]}", flush=True)
        if tries[-1]["optimality"] >= TARGET:
            break
    return tries


def parse_args(parser: argparse.ArgumentParser) -> tuple[argparse.Namespace, Path]:
    """``parser``'s arguments plus those every TRL comparison takes; the cache directory, made."""
    parser.add_argument("--cache-dir", default="~/.cache/tether/trl-compare",
                        help="TRL's virtualenv goes here")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    cache = Path(args.cache_dir).expanduser()
    cache.mkdir(parents=True, exist_ok=True)
    return args, cache


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3],
                        help="run.seed (TRL's --seed) of each race")
    parser.add_argument("--ladder", nargs="+", type=int, default=[5, 10, 15, 20, 30, 40, 60, 80],
                        help="the step counts each side tries, in turn, until one reaches the target")
    parser.add_argument("--with-start-eval", action="store_true",
                        help="keep tether's evaluation before training "
                             "(results: trl_compare-with-start-eval)")
    args, cache = parse_args(parser)
    python = trl_python(cache)
    work = Path(tempfile.mkdtemp(prefix="trl-compare-", dir=cache))
    races = {}
    for seed in args.seeds:
        sft = sft_start(seed)
        tether = to_target(lambda s, seed=seed: run_tether(s, work, seed, args.with_start_eval), args.ladder)
        trl = to_target(lambda s, seed=seed, sft=sft: run_trl(python, sft, s, work, seed), args.ladder)
        a, b = tether[-1], trl[-1]
        races[str(seed)] = {"sft_optimality": evaluate(sft), "tether": tether, "trl": trl,
                            "ratio_tether_over_trl": a["whole_process_seconds"] / b["whole_process_seconds"],
                            "both_reached_target": a["optimality"] >= TARGET and b["optimality"] >= TARGET}
    ratios = [r["ratio_tether_over_trl"] for r in races.values()]
    reached = all(r["both_reached_target"] for r in races.values())
    results = {**stamp(), "cpu_flags": cpu_flags(), "races": races, "median_ratio": statistics.median(ratios),
               "all_reached_target": reached, "tether_evaluates_before_training": args.with_start_eval}
    table = [
        ("randomwalks, tether's default job ("
         + ("with its evaluation before training" if args.with_start_eval
            else "no evaluation before training")
         + f", one at its last iteration) against TRL {TRL_VERSION} GRPO (16 prompts x 8, lr 3e-4, beta 0, 2 "
         f"threads), same SFT start per seed, each side at the first step count of {args.ladder} whose one "
         f"evaluation (20 prompts x 50 samples) reached {TARGET}; {results['date']}, {results['machine']}, "
         f"CPU flags: {results['cpu_flags']}; `.venv/bin/python benchmarks/trl_compare.py --seeds "
         f"{' '.join(map(str, args.seeds))}{' --with-start-eval' if args.with_start_eval else ''}`"),
        "",
        ("| seed | SFT start | tether: iterations, whole process, optimality | "
         "TRL GRPO: steps, whole process, optimality | tether / TRL |"),
        "|---|---|---|---|---|",
    ]
    for seed, r in races.items():
        a, b = r["tether"][-1], r["trl"][-1]
        table.append(f"| {seed} | {r['sft_optimality']:.3f} | {a['steps']}, "
                     f"{a['whole_process_seconds']:.1f} s, {a['optimality']:.3f} | {b['steps']}, "
                     f"{b['whole_process_seconds']:.1f} s, {b['optimality']:.3f} "
                     f"| {r['ratio_tether_over_trl']:.2f}x |")
    table.append(
        f"| median | | | | {results['median_ratio']:.2f}x"
        f"{'' if reached else ' (a side did NOT reach the target in some race: not a time to target)'} |")
    name = "trl_compare-with-start-eval" if args.with_start_eval else "trl_compare"
    json_path, md_path = write_results(args.out, name, results, table)
    print("\n".join(table), flush=True)
    print(f"[trl_compare] {json_path} {md_path} (CPU {cpu_model()})", flush=True)


if __name__ == "__main__":
    main()
