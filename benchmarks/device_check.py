"""Device check: the learner's update, its weight gather, the HF engine on the learner's weights, CUDA IPC of
a packed buffer and packed scoring, on one device, with torch alone plus DeepSpeed and tether's small pure
Python dependencies (no vLLM, no Ray: a machine with only torch and CUDA can run it).

    python benchmarks/device_check.py --device cuda     # on a GPU, in bfloat16; writes the results table
    python benchmarks/device_check.py --device cpu      # float32 on gloo, the tiny model (make test runs it)

Steps, each on the randomwalks GPT-2 (random init) and, on CUDA, a SmolLM2-135M-shaped Llama built from its
config (random init):
- ``update``: ``learner.update.update`` driven by the plain-torch engine and by DeepSpeed's engine at ZeRO-0
  and ZeRO-3 on one rank (NCCL on CUDA, gloo on CPU; DeepSpeed's each in a process of its own): the loss
  finite, the parameters moved, the first step's loss within 2e-2 (relative) of the same batch's in float32
  on CPU; and the weight gather as vLLM's loader checks it: each announced name a parameter of the model's
  own checkpoint, with the announced dtype and full shape, the gathered tensor the same;
- ``hf engine``: transformers' engine on the device loading the learner's weights: its log-probs within 0.1
  nats (max abs) of the learner's in bfloat16 (1e-4 in float32);
- ``cuda ipc``: a packed weight buffer shared with a second process through CUDA IPC, read there and
  compared bit for bit (reported as skipped on CPU);
- ``packing``: packed sequences do not attend to each other (SDPA on CUDA), and the log-probs against the
  same model's in float64 on CPU.

The wheels a GPU machine without the project's packages needs: ``--wheels DIR [--python 3.12]`` builds and
downloads them into DIR and lists them with their sizes (6.55 MiB in all for Python 3.12, measured 2026-12-06:
DeepSpeed 0.19.8 built from its sdist 2.1 MiB, pydantic-core 2.0 MiB, tensordict 0.8 MiB, the rest under
0.5 MiB each), far under the 64 MiB a call may carry; install them with ``pip install --no-deps DIR/*.whl``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import torch

LOSS_TOLERANCE = 2e-2  # the first step's loss, relative, against float32 on CPU
LOGPROB_TOLERANCE = {"bfloat16": 0.1, "float32": 1e-4}  # the HF engine against the learner, max abs nats
FLOAT64_TOLERANCE = {"bfloat16": 0.1, "float32": 1e-4}  # the learner's log-probs against float64 on CPU
# SmolLM2-135M's shape (its config.json), random init
SMOLLM2_SHAPE = {"vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                 "num_attention_heads": 9, "num_key_value_heads": 3, "max_position_embeddings": 2048,
                 "tie_word_embeddings": True, "rms_norm_eps": 1e-5, "rope_theta": 100000.0}
# beside the device machine's torch, transformers, accelerate and peft: DeepSpeed (built from its sdist, pure
# Python) and what tether's modules and DeepSpeed import that such a machine lacks
BUILT = ("deepspeed==0.19.8",)
WHEELS = ("pydantic==2.12.5", "pydantic-core==2.41.5", "pydantic-settings==2.16.0", "tensordict==0.15.3",
          "annotated-types", "typing-inspection", "python-dotenv", "hjson", "ninja", "py-cpuinfo", "msgpack",
          "einops", "fsspec", "psutil")


class Skip(Exception):
    """A step this device cannot run, and why."""


def model_dir(kind: str, root: Path) -> str:
    """The randomwalks GPT-2, or the SmolLM2-shaped Llama with a character tokenizer of its vocabulary
    size."""
    from _bench import gpt2_dir

    if kind == "randomwalks":
        return str(gpt2_dir(root / "randomwalks"))
    path = root / "smollm2-shaped"
    if not (path / "config.json").is_file():
        from transformers import LlamaConfig, LlamaForCausalLM

        from services.models import build_char_tokenizer, save_model_dir

        vocabulary = [chr(0x4E00 + i) for i in range(SMOLLM2_SHAPE["vocab_size"] - 1)]
        tokenizer = build_char_tokenizer(vocabulary)
        torch.manual_seed(0)
        config = LlamaConfig(**SMOLLM2_SHAPE, bos_token_id=tokenizer.eos_token_id,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
        save_model_dir(LlamaForCausalLM(config), tokenizer, path)
    return str(path)


def job_config(device: str, dtype: str, zero_stage: int = 0):
    from services.config import load_config

    return load_config(None, {
        "rollout": {"batch_size": 16, "chunk_size": 8, "samples_per_prompt": 2, "max_new_tokens": 8},
        "ppo": {"advantage": "gae", "minibatch_size": 16, "epochs": 1, "lr": 1e-3},
        "learner": {"dtype": dtype, "zero_stage": zero_stage},
        "cluster": {"learner": {"num_gpus": 1 if device == "cuda" else 0}}})


def sampled_batch(engine, vocab: int, seed: int = 0):
    """16 responses in groups of 2 whose engine log-probs are the policy's own, scored 1 where the first
    token is even; the initial policy as the reference (``collect_chunk``'s fields)."""
    from learner.update import RankScoring, collect_chunk
    from services.experience import make_batch

    g = torch.Generator().manual_seed(seed)
    n = 16
    prompts = [[1 + i // 2] for i in range(n)]
    responses = [torch.randint(1, min(vocab, 20), (int(k),), generator=g).tolist()
                 for k in torch.randint(2, 9, (n,), generator=g)]
    batch = make_batch(prompts, responses, [[0.0] * len(r) for r in responses], [0] * n, list(range(n)), 0, 0,
                       0.0, 8, group_index=[i // 2 for i in range(n)])
    batch.rollout_logprobs = engine.forward(batch, grad=False)[0].float().cpu() * batch.action_mask
    scores = torch.tensor([float(r[0] % 2 == 0) for r in responses])
    collect_chunk(engine, RankScoring(engine, None, None), batch, 0, False, scores,
                  batch.rollout_logprobs.clone(), None)
    return batch


def build_engine(model: str, kind: str, device: str, dtype: str, zero_stage: int):
    from learner.engine import DeepSpeedEngine, TorchEngine
    from learner.plan import RankSpec

    spec = RankSpec.of(job_config(device, dtype, zero_stage), model)
    if kind == "torch":
        return spec, TorchEngine.build(model, spec, device)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    return spec, DeepSpeedEngine.build(model, spec, 0, 1, torch.device(device))


def update_step(model: str, kind: str, device: str, dtype: str, zero_stage: int) -> dict:
    """One optimizer step of ``learner.update.update`` on ``kind``'s engine, and the weight gather."""
    from transformers import AutoConfig

    from learner.update import update
    from learner.weight_transfer import announced_parameters, gathered_parameters
    from services.models import load_causal_lm

    spec, engine = build_engine(model, kind, device, dtype, zero_stage)
    zero3 = kind == "deepspeed" and zero_stage == 3
    before = {name: t.detach().float().cpu().clone() for name, t in gathered_parameters(engine.lm, zero3)}
    batch = sampled_batch(engine, AutoConfig.from_pretrained(model).vocab_size)
    result = update(engine, spec.algorithm, spec.update, batch, 0.05, 1)
    after = dict(gathered_parameters(engine.lm, zero3))
    moved = max(float((t.float().cpu() - before[name]).abs().max()) for name, t in after.items())
    # vLLM's loader: every announced name one of the checkpoint's, with the announced dtype and full shape
    wire = torch.bfloat16 if dtype == "bfloat16" else torch.float32
    announced = announced_parameters(engine.lm, wire)
    checkpoint = {name: tuple(p.shape) for name, p in load_causal_lm(model).named_parameters()}
    gathered = dict(gathered_parameters(engine.lm, zero3, wire))
    problems = [name for name, dtype_name, shape in announced
                if checkpoint.get(name) != tuple(shape) or str(gathered[name].dtype) != f"torch.{dtype_name}"
                or tuple(gathered[name].shape) != tuple(shape)]
    return {"loss": float(result.ppo["loss"]), "moved": moved, "gather_problems": problems[:5],
            "announced": len(announced)}


def hf_engine_logprobs(model: str, device: str, dtype: str) -> list[float]:
    """Max |HF engine - learner| log-prob before and after the engine on ``device`` loads the learner's
    weights (moved away from the checkpoint both start from)."""
    from actors.engines import HFEngine

    _, engine = build_engine(model, "torch", device, dtype, 0)
    with torch.no_grad():  # the learner's weights, away from the checkpoint the engine starts from
        g = torch.Generator().manual_seed(1)
        for p in engine.lm.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g).to(p))
    sequences, prompt_lengths = [[1, 3, 5, 7, 9, 2, 4], [2, 4, 6, 8, 10]], [2, 1]
    learner = engine.sequence_logprobs(sequences, prompt_lengths)
    hf = HFEngine(model, 0, dtype, device)

    def gap() -> float:
        scored = hf.score(sequences, prompt_lengths)
        return max(abs(a - b) for x, y in zip(scored, learner, strict=True)
                   for a, b in zip(x, y, strict=True))

    before = gap()
    missing = hf.load_weights(engine.lm.state_dict())  # the tied head too, as the object-store sync sends it
    if missing:
        raise AssertionError(f"the HF engine did not load {missing[:5]}")
    return [before, gap()]


def _ipc_reader(queue, answers) -> None:
    tensor = queue.get()
    answers.put(tensor.cpu().clone())


def cuda_ipc(device: str) -> str:
    """A packed buffer (every parameter of a model flattened into one bfloat16 tensor) read by a second
    process through CUDA IPC, compared bit for bit."""
    if device != "cuda":
        raise Skip("CUDA IPC needs a CUDA device")
    import torch.multiprocessing as mp

    g = torch.Generator().manual_seed(0)
    buffer = torch.randn(8 << 20, generator=g).to(torch.bfloat16).to("cuda")
    ctx = mp.get_context("spawn")
    queue, answers = ctx.Queue(), ctx.Queue()
    reader = ctx.Process(target=_ipc_reader, args=(queue, answers))
    reader.start()
    queue.put(buffer)
    got = answers.get(timeout=120)
    reader.join(60)
    same = torch.equal(got.view(torch.int16), buffer.cpu().view(torch.int16))
    if not same:
        raise AssertionError("the buffer read through CUDA IPC differs from the one sent")
    return f"{buffer.numel() * 2 >> 20} MiB bit for bit"


def packing(model: str, device: str, dtype: str) -> tuple[float, float]:
    """(the packing leak against its tolerance, max |log-prob - float64's|)."""
    from services.logprobs import token_logprobs
    from services.models import load_causal_lm
    from services.packing_check import compute_dtype, leak_tolerance, packing_leak

    lm = load_causal_lm(model, dtype).to(device)
    leak = packing_leak(lm, lm.config.vocab_size)
    tolerance = leak_tolerance(leak, compute_dtype(lm))
    if leak.neighbour > tolerance:
        raise AssertionError(f"packed sequences attend to each other: {leak.neighbour:.3g} > {tolerance:.3g}")
    exact = load_causal_lm(model, "float32").double()
    ids = torch.tensor([[1, 5, 9, 3, 7, 2, 4, 6, 8, 10]])
    with torch.no_grad():
        got = token_logprobs(lm(input_ids=ids.to(device)).logits[:, :-1].float(), ids[:, 1:].to(device)).cpu()
        want = token_logprobs(exact(input_ids=ids).logits[:, :-1], ids[:, 1:])
    return leak.neighbour / max(tolerance, 1e-30), float((got.double() - want).abs().max())


# ------------------------------------------------------------------------------------------- the runner


def in_process(step: str, *args) -> dict:
    """``step`` in a process of its own (DeepSpeed's process group stays for the process): its JSON line."""
    code = (f"import json, sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); import device_check as d; "
            f"print('RESULT', json.dumps(d.{step}(*{args!r})))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          check=False)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise RuntimeError(f"{step}{args} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return json.loads(line[len("RESULT "):])


def check(device: str, root: Path) -> list[tuple[str, str, str]]:
    """(step, status, detail) of every step; raises nothing: a failure is a row."""
    dtype = "bfloat16" if device == "cuda" else "float32"
    kinds = ("randomwalks", "smollm2-shaped") if device == "cuda" else ("randomwalks",)
    rows = []

    def run(name: str, fn) -> None:
        start = time.perf_counter()
        try:
            status, detail = "pass", fn()
        except Skip as reason:
            status, detail = "skipped", str(reason)
        except Exception as err:  # noqa: BLE001 - each failure is a row of the table, named
            status, detail = "FAIL", f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"
        rows.append((name, status, f"{detail} ({time.perf_counter() - start:.1f} s)"))
        print(f"[device_check] {name}: {status}: {detail}", flush=True)

    for kind in kinds:
        model = model_dir(kind, root)
        reference = in_process("update_step", model, "torch", "cpu", "float32", 0)["loss"]
        for engine, zero in (("torch", 0), ("deepspeed", 0), ("deepspeed", 3)):
            def step(engine=engine, zero=zero, model=model, reference=reference) -> str:
                r = in_process("update_step", model, engine, device, dtype, zero)
                error = abs(r["loss"] - reference) / max(abs(reference), 1e-2)
                if not (math.isfinite(r["loss"]) and r["moved"] > 0 and error <= LOSS_TOLERANCE
                        and not r["gather_problems"]):
                    raise AssertionError(f"loss {r['loss']:.5g} against {reference:.5g} on CPU (relative "
                                         f"{error:.2g}), parameters moved {r['moved']:.3g}, gather problems "
                                         f"{r['gather_problems']}")
                return (f"loss {r['loss']:.5g} (float32 CPU {reference:.5g}, relative {error:.1e}); moved "
                        f"{r['moved']:.2g}; {r['announced']} parameters gathered as announced")
            name = f"{kind}: update, {engine} engine" + (f" ZeRO-{zero}" if engine == "deepspeed" else "")
            run(name, step)

        def hf(model=model) -> str:
            before, gap = in_process("hf_engine_logprobs", model, device, dtype)
            if gap > LOGPROB_TOLERANCE[dtype] or before <= LOGPROB_TOLERANCE[dtype]:
                raise AssertionError(f"max |engine - learner| log-prob {gap:.3g} after the load (tolerance "
                                     f"{LOGPROB_TOLERANCE[dtype]}), {before:.3g} before it")
            return f"max |engine - learner| {gap:.2g} nats after the load, {before:.2g} before"
        run(f"{kind}: hf engine on the learner's weights", hf)

        def packed(model=model) -> str:
            leak, gap = packing(model, device, dtype)
            if gap > FLOAT64_TOLERANCE[dtype]:
                raise AssertionError(f"log-probs {gap:.3g} from float64's")
            return f"leak {leak:.2g} of its tolerance; max |log-prob - float64's| {gap:.2g}"
        run(f"{kind}: packing, log-probs against float64", packed)
    run("cuda ipc of a packed buffer", lambda: cuda_ipc(device))
    return rows


def wheels(out: Path, python: str) -> list[tuple[str, int]]:
    """The wheels the device machine (its Python ``python``, e.g. 3.12) needs beside its torch, built or
    downloaded into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "--quiet"]
    subprocess.run([*pip, "wheel", "--no-deps", "-w", str(out), *BUILT], check=True)
    subprocess.run([*pip, "download", "--no-deps", "--only-binary=:all:", "--python-version", python,
                    "--platform", "manylinux_2_28_x86_64", "--platform", "manylinux2014_x86_64",
                    "-d", str(out), *WHEELS], check=True)
    return sorted((p.name, p.stat().st_size) for p in out.glob("*.whl"))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available()
                        else "cpu")
    parser.add_argument("--out", default=None, help="write the table here (default: benchmarks/results on "
                        "CUDA, nowhere on CPU)")
    parser.add_argument("--wheels", default=None, help="build the wheels the device machine needs into DIR")
    parser.add_argument("--python", default="3.12", help="the device machine's Python, for --wheels")
    args = parser.parse_args()
    if args.wheels:
        listed = wheels(Path(args.wheels), args.python)
        for name, size in listed:
            print(f"{size / 2**20:7.2f} MiB  {name}")
        print(f"{sum(s for _, s in listed) / 2**20:7.2f} MiB in all")
        return 0
    with tempfile.TemporaryDirectory(prefix="tether-device-check-") as tmp:
        rows = check(args.device, Path(tmp))
    out = args.out or (str(ROOT / "benchmarks" / "results") if args.device == "cuda" else None)
    if out:
        from _bench import stamp, write_results

        card = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
        results = {**stamp(), "device": card, "torch": torch.__version__, "rows": rows}
        table = [f"{card}, torch {torch.__version__}", "", "| step | status | detail |", "|---|---|---|",
                 *(f"| {name} | {status} | {detail} |" for name, status, detail in rows)]
        write_results(out, f"device_check-{args.device}", results, table)
    failed = [name for name, status, _ in rows if status == "FAIL"]
    print(f"[device_check] {len(rows) - len(failed)} of {len(rows)} steps without failure"
          + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
