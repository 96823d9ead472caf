"""Benchmark: the SmolLM2 presets in each learner dtype on this CPU. For each preset (the calculator agent and
the sentiment task) and each ``learner.dtype`` (float32, bfloat16, auto), one job of 2 iterations with an
evaluation at the second (none before training), one after the other. Reports per run the second iteration's
training seconds (its evaluation taken out), the evaluation's seconds and their ratio, the whole process, and
what ``auto`` chose with its measured figures (the job's own line).

    .venv/bin/python benchmarks/presets_dtype.py [--presets calculator-smollm2 smollm2-sentiment]

Writes ``benchmarks/results/presets_dtype.json`` and ``presets_dtype.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench import RAY_ENV, RESULTS, ROOT, cpu_model, stamp, write_results
from trl_compare import cpu_flags

DTYPES = ("float32", "bfloat16", "auto")
AUTO_LINE = re.compile(r"learner\.dtype auto: (\w+) \((.*)\)")
EVAL_LINE = re.compile(r"\[tether\] (evaluation: .*)")


def run(preset: str, dtype: str, work: Path) -> dict:
    name = f"{preset}-{dtype}"
    log = work / f"{name}.log"
    start = time.perf_counter()
    with open(log, "w") as out:
        code = subprocess.run(
            [sys.executable, "-m", "learner.main", "--config", f"deploy/configs/{preset}.yaml",
             "--run.iterations", "2", "--run.eval_every", "2", "--no-run.eval_before_training",
             "--learner.dtype", dtype, "--run.output_dir", str(work), "--run.name", name],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, check=False,
            env={**os.environ, **RAY_ENV, "PYTHONPATH": str(ROOT)}).returncode
    seconds = time.perf_counter() - start
    text = log.read_text()
    if code != 0:
        raise RuntimeError(f"{name} exited {code}; see {log}")
    records = [json.loads(line) for line in (work / name / "metrics.jsonl").read_text().splitlines()]
    last = records[-1]
    auto = AUTO_LINE.search(text)
    evaluation = EVAL_LINE.search(text)
    return {"preset": preset, "dtype": dtype, "whole_process_seconds": seconds,
            "first_iteration_seconds": records[0]["iteration_seconds"],
            "iteration_seconds": last["iteration_seconds"] - last["eval_seconds"],
            "eval_seconds": last["eval_seconds"],
            "eval_over_iteration": last["eval_seconds"] / (last["iteration_seconds"] - last["eval_seconds"]),
            "auto_chose": auto.group(1) if auto else None, "auto_figures": auto.group(2) if auto else None,
            "evaluation_line": evaluation.group(1) if evaluation else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["calculator-smollm2", "smollm2-sentiment"])
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="presets-dtype-"))
    runs = []
    for preset in args.presets:
        for dtype in args.dtypes:
            runs.append(run(preset, dtype, work))
            print(f"[presets_dtype] {runs[-1]}", flush=True)
    results = {**stamp(), "cpu_flags": cpu_flags(), "runs": runs}
    table = [
        (f"The SmolLM2 presets, 2 iterations each with an evaluation at the second, one run per "
         f"learner.dtype, one after the other; {results['date']}, {results['machine']}, CPU flags: "
         f"{results['cpu_flags']}; "
         f"`.venv/bin/python benchmarks/presets_dtype.py`"),
        "",
        ("| preset | learner.dtype | iteration 2 s (training) | evaluation s | evaluation / iteration | "
         "iteration 1 s | whole process s | auto chose |"),
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        chose = f"{r['auto_chose']}: {r['auto_figures']}" if r["auto_chose"] else ""
        table.append(f"| {r['preset']} | {r['dtype']} | {r['iteration_seconds']:.1f} | "
                     f"{r['eval_seconds']:.1f} | {r['eval_over_iteration']:.2f}x | "
                     f"{r['first_iteration_seconds']:.1f} | "
                     f"{r['whole_process_seconds']:.1f} | {chose} |")
    table += ["", "What each evaluation ran (the job's own line):", ""]
    table += sorted({f"- {r['preset']}: {r['evaluation_line']}" for r in runs if r["evaluation_line"]})
    json_path, md_path = write_results(args.out, "presets_dtype", results, table)
    print("\n".join(table), flush=True)
    print(f"[presets_dtype] {json_path} {md_path} (CPU {cpu_model()})", flush=True)


if __name__ == "__main__":
    main()
