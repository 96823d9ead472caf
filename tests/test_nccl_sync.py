"""Bucketed weight sync, learner rank 0 -> vLLM workers (learner/nccl_sync.py, actors/vllm_extension.py).

CPU: the packing both sides share, the bucket plan, the lazy receive, and the worker extension's
``receive_policy_weights`` inside a real (CPU) vLLM engine with a stand-in communicator.
GPU (``-m gpu``): the real thing, a PyNcclCommunicator between this process and a vLLM worker.
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import socket
import traceback
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from learner.nccl_sync import (
    ALIGN,
    bucket_layout,
    bucketize,
    pack_bucket,
    plan_buckets,
    receive_buckets,
    unpack_bucket,
    weight_metadata,
)

BUCKET = 64 << 10  # small enough that the tiny GPT-2 (~4.8 MB) goes over in dozens of buckets


def mixed_tensors() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(7, 5, generator=g)),
        ("a.bias", torch.randn(3, generator=g).to(torch.bfloat16)),  # 6 bytes: next slot needs padding
        ("b.scale", torch.tensor(1.5, dtype=torch.float16)),  # 0-d
        ("b.weight", torch.randn(4, 6, generator=g).to(torch.float16).t()),  # not contiguous
        ("c.empty", torch.empty(0, 3)),
        ("c.weight", torch.randn(2, 3, 4, generator=g).to(torch.bfloat16)),
        ("d.weight", torch.randn(11, generator=g)),
    ]


# ------------------------------------------------------------------------------------------- CPU


def test_pack_unpack_round_trips_exactly():
    named = mixed_tensors()
    flat, layout = pack_bucket(named)
    assert flat.dtype == torch.uint8 and flat.dim() == 1
    assert all(slot.offset % ALIGN == 0 for slot in layout)
    assert flat.numel() == layout[-1].offset + layout[-1].nbytes
    out = unpack_bucket(flat, layout)
    assert [n for n, _ in out] == [n for n, _ in named]
    for (name, want), (_, got) in zip(named, out, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        assert torch.equal(got, want), name
    # the receiver rebuilds the same layout from metadata alone (lists, as after serialisation)
    total, layout_from_meta = bucket_layout([list(m) for m in weight_metadata(named)])
    assert (total, layout_from_meta) == (flat.numel(), layout)
    # through an independent buffer, as after a broadcast
    out = unpack_bucket(flat.clone(), layout_from_meta)
    assert all(torch.equal(got, want) for (_, got), (_, want) in zip(out, named, strict=True))


def test_weight_metadata():
    named = mixed_tensors()
    assert weight_metadata(named) == [
        ("a.weight", "float32", [7, 5]),
        ("a.bias", "bfloat16", [3]),
        ("b.scale", "float16", []),
        ("b.weight", "float16", [6, 4]),
        ("c.empty", "float32", [0, 3]),
        ("c.weight", "bfloat16", [2, 3, 4]),
        ("d.weight", "float32", [11]),
    ]


def test_bucketize_respects_bound_and_order():
    sizes = [100, 200, 300, 5000, 50, 50, 4000, 10, 1000, 1024]  # float32 elements
    named = [(f"t{i}", torch.full((n,), float(i))) for i, n in enumerate(sizes)]
    bound = 4096  # bytes
    buckets = bucketize(named, bound)
    assert [n for b in buckets for n, _ in b] == [n for n, _ in named]  # order kept, nothing lost
    for bucket in buckets:
        total, _ = bucket_layout(weight_metadata(bucket))
        assert total <= bound or len(bucket) == 1
    by_name = {b[0][0]: b for b in buckets}
    assert [n for n, _ in by_name["t3"]] == ["t3"]  # 20000 bytes > bound: its own bucket
    assert [n for n, _ in by_name["t6"]] == ["t6"]
    assert [n for n, _ in by_name["t0"]] == ["t0", "t1", "t2"]  # 400 + 800 + 1200 bytes
    assert [n for n, _ in by_name["t7"]] == ["t7", "t8"]  # 40 (+ 8 padding) + 4000 = 4048 bytes
    assert [n for n, _ in by_name["t9"]] == ["t9"]  # exactly the bound, after a bucket it would overflow
    # greedy: a bucket closes only when the next tensor would overflow it
    for prev, nxt in itertools.pairwise(buckets):
        total, _ = bucket_layout(weight_metadata(prev + nxt[:1]))
        assert total > bound
    # the receiver's plan from metadata is the same grouping
    plan = plan_buckets([list(m) for m in weight_metadata(named)], bound)
    assert [[m[0] for m in b] for b in plan] == [[n for n, _ in b] for b in buckets]
    # one exactly at the bound fits; a bound below every tensor gives one bucket per tensor
    assert len(bucketize([("x", torch.zeros(1024))], 4096)) == 1
    assert [len(b) for b in bucketize(named, 1)] == [1] * len(named)
    with pytest.raises(ValueError):
        bucketize(named, 0)


class ReplayComm:
    """Stands in for a PyNcclCommunicator on a receiver: ``broadcast`` fills the buffer with the next
    bucket rank 0 would send (packed from the sender's own tensors, as ``WeightBroadcaster`` does)."""

    def __init__(self, named, bucket_bytes: int, device: str = "cpu") -> None:
        self.device = torch.device(device)
        self.sent = [pack_bucket(bucket, device=self.device)[0] for bucket in bucketize(named, bucket_bytes)]
        self.calls = 0

    def broadcast(self, tensor, src, stream=None):
        assert src == 0 and tensor.device == self.device and tensor.dtype == torch.uint8
        tensor.copy_(self.sent[self.calls])  # shape mismatch = the two sides planned differently
        self.calls += 1


def test_receive_buckets_is_lazy_and_exact():
    named = [(f"t{i}", torch.randn(300 + 10 * i).to(dt))
             for i, dt in enumerate([torch.float32, torch.bfloat16, torch.float16] * 4)]
    comm = ReplayComm(named, 2048)
    stream = receive_buckets(comm, [list(m) for m in weight_metadata(named)], 2048)
    got = []
    for name, tensor in stream:
        # the bucket holding this tensor, and none after it, has been received
        bucket_of = next(i for i, b in enumerate(bucketize(named, 2048)) if name in [n for n, _ in b])
        assert comm.calls == bucket_of + 1
        got.append((name, tensor.clone()))
    assert comm.calls == len(comm.sent) > 3
    assert [n for n, _ in got] == [n for n, _ in named]
    assert all(torch.equal(g, w) for (_, g), (_, w) in zip(got, named, strict=True))


# ------------------------------------------------------------ a vLLM engine in its own process


def build_tiny_gpt2(path: Path) -> str:
    from services.models import build_char_tokenizer, build_gpt2, save_model_dir
    from services.tasks import get_task

    task = get_task("randomwalks")
    tokenizer = build_char_tokenizer(task.vocabulary)
    return str(save_model_dir(build_gpt2(tokenizer, task.model_config, seed=0), tokenizer, path))


def perturbed_state_dict(model_dir: str) -> dict[str, torch.Tensor]:
    """The policy's weights after a fake update (tied embeddings stay tied)."""
    from services.models import load_causal_lm

    model = load_causal_lm(model_dir, "float32")
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def hf_logprobs(model_dir: str, weights: dict[str, torch.Tensor], seq: list[int]) -> list[float]:
    from services.models import load_causal_lm

    model = load_causal_lm(model_dir, "float32")
    model.load_state_dict(weights, strict=True)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([seq])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1)[torch.arange(len(seq) - 1), torch.tensor(seq[1:])].tolist()


def probe_sequence(model_dir: str) -> list[int]:
    from services.models import load_tokenizer

    tokenizer = load_tokenizer(model_dir)
    return tokenizer("bcdefghijklmnopqrstu|")["input_ids"]


def _engine_main(conn, model_dir: str, on_gpu: bool) -> None:
    """Child process: a vLLM LLM with the worker extension, driven over ``conn``."""
    try:
        from vllm import LLM, SamplingParams, TokensPrompt

        kwargs = {"gpu_memory_utilization": 0.2} if on_gpu else {"kv_cache_memory_bytes": 64 << 20}
        llm = LLM(model=model_dir, worker_extension_cls="actors.vllm_extension.WeightSyncExtension",
                  enforce_eager=True, dtype="float32", seed=0, max_model_len=32, **kwargs)
        conn.send(("ok", None))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        conn.send(("error", traceback.format_exc()))
        return
    while True:
        cmd, args = conn.recv()
        if cmd == "stop":
            conn.send(("ok", None))
            return
        try:
            if cmd == "logprobs":
                params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
                out = llm.generate([TokensPrompt(prompt_token_ids=args)], params, use_tqdm=False)[0]
                result = [out.prompt_logprobs[i][args[i]].logprob for i in range(1, len(args))]
            elif cmd == "replay_comm":  # CPU: stand in for NCCL, replaying what rank 0 would send
                comm = ReplayComm(*args)  # (named tensors, bucket_bytes)
                result = llm.collective_rpc("attach_weight_sync_comm", args=(comm,))
            elif cmd == "init_group":
                result = llm.collective_rpc("init_weight_sync_group", args=args)
            elif cmd == "receive":
                result = llm.collective_rpc("receive_policy_weights", args=args)
                llm.reset_prefix_cache()
            else:
                raise ValueError(cmd)
            conn.send(("ok", result))
        except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
            conn.send(("error", traceback.format_exc()))


@contextmanager
def env_vars(**values):
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class EngineProcess:
    def __init__(self, model_dir: str, on_gpu: bool, env: dict[str, str]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        # the worker runs inside this child (no engine-core process): objects pass to it as they are
        with env_vars(VLLM_ENABLE_V1_MULTIPROCESSING="0", **env):
            # not daemonic: vLLM may start processes of its own; stop() ends it
            self.proc = ctx.Process(target=_engine_main, args=(child, model_dir, on_gpu))
            self.proc.start()
        child.close()
        try:
            self.wait(300)
        except BaseException:
            self.stop()
            raise

    def send(self, cmd: str, args=None) -> None:
        self.conn.send((cmd, args))

    def wait(self, timeout_s: float):
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"the vLLM process did not answer within {timeout_s}s")
        status, result = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"vLLM process failed:\n{result}")
        return result

    def call(self, cmd: str, args=None, timeout_s: float = 120):
        self.send(cmd, args)
        return self.wait(timeout_s)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("stop", timeout_s=30)
            except (TimeoutError, RuntimeError, OSError):
                pass
            self.proc.join(30)
            if self.proc.is_alive():
                self.proc.kill()
                self.proc.join(10)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_worker_extension_streams_buckets_into_vllm_cpu(tmp_path):
    """receive_policy_weights in a real vLLM (CPU) worker: every bucket received in order, one reload."""
    model_dir = build_tiny_gpt2(tmp_path / "gpt2")
    weights = perturbed_state_dict(model_dir)
    named = list(weights.items())
    seq = probe_sequence(model_dir)
    assert len(bucketize(named, BUCKET)) > 10
    engine = EngineProcess(model_dir, on_gpu=False, env={"VLLM_CPU_OMP_THREADS_BIND": "0"})
    try:
        before = engine.call("logprobs", seq)
        with pytest.raises(RuntimeError, match="needs a CUDA worker"):  # NCCL: GPU workers only
            engine.call("init_group", ("127.0.0.1", free_port(), 1, 2))
        with pytest.raises(RuntimeError, match="before init_weight_sync_group"):
            engine.call("receive", (weight_metadata(named), BUCKET))
        engine.call("replay_comm", (named, BUCKET))
        assert engine.call("receive", (weight_metadata(named), BUCKET)) == [len(named)]
        after = engine.call("logprobs", seq)
    finally:
        engine.stop()
    expected = hf_logprobs(model_dir, weights, seq)
    assert max_diff(after, expected) < 1e-4
    assert max_diff(after, before) > 1e-2


# ------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_nccl_broadcast_into_vllm_gpu(tmp_path):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if torch.cuda.device_count() < 2:
        # NCCL refuses two ranks of one communicator on the same GPU ("Duplicate GPU detected");
        # a learner sharing its GPU with the engine would need CUDA IPC instead
        pytest.skip("needs 2 CUDA devices: NCCL cannot put the learner and the vLLM worker on one GPU")
    from learner.nccl_sync import WeightBroadcaster

    model_dir = build_tiny_gpt2(tmp_path / "gpt2")
    weights = perturbed_state_dict(model_dir)
    named = [(name, t.to("cuda:0")) for name, t in weights.items()]
    seq = probe_sequence(model_dir)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    engine_gpu = visible.split(",")[1] if visible else "1"  # learner: this process's cuda:0
    engine = EngineProcess(model_dir, on_gpu=True, env={"CUDA_VISIBLE_DEVICES": engine_gpu})
    broadcaster = None
    try:
        before = engine.call("logprobs", seq)
        port = free_port()
        # collective: the worker joins (rank 1) while this process builds rank 0
        engine.send("init_group", ("127.0.0.1", port, 1, 2))
        broadcaster = WeightBroadcaster("127.0.0.1", port, world_size=2, device=0)
        engine.wait(120)
        # collective again: the worker receives while rank 0 broadcasts
        engine.send("receive", (weight_metadata(named), BUCKET))
        n_buckets = broadcaster.broadcast(named, BUCKET)
        assert engine.wait(120) == [len(named)]
        assert n_buckets > 10
        after = engine.call("logprobs", seq)
    finally:
        engine.stop()
        if broadcaster is not None:
            broadcaster.close()
    expected = hf_logprobs(model_dir, weights, seq)
    assert max_diff(after, expected) < 1e-4
    assert max_diff(after, before) > 1e-2
