"""Learner -> vLLM weight transfer through vLLM's own API (learner/weight_transfer.py).

CPU: the announcement (full shapes, tied weights once, ZeRO-3's ``ds_shape``), the ``WeightSource`` the
installed vLLM expects, vLLM's own trainer-side packing of it against the chunks a worker plans from the
announcement, the per-engine NCCL ranks, the config's refusal without GPUs, and the engine's side of the
protocol (init, start, finish) in a real rollout actor on vLLM's CPU build.
GPU (``-m gpu``): the real transfers into a vLLM engine in its own process: NCCL (two GPUs) and CUDA IPC
(one GPU shared by trainer and engine). They skip with the reason where CUDA or vLLM's CUDA build is absent.
"""

from __future__ import annotations

import math
import multiprocessing
import os
import socket
import traceback
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from actors.specs import EngineSpec, RolloutSpec
from learner.weight_transfer import announced_parameters, engine_init_infos, gathered_parameters

BUFFER = 300 << 10  # above the largest tensor (256 KiB); the tiny GPT-2 (~4.8 MB) goes over in ~16 chunks


def build_tiny_gpt2(path: Path) -> str:
    from services.models import build_char_tokenizer, build_gpt2, save_model_dir
    from services.tasks import get_task

    task = get_task("randomwalks")
    tokenizer = build_char_tokenizer(task.vocabulary)
    return str(save_model_dir(build_gpt2(tokenizer, task.model_config, seed=0), tokenizer, path))


def perturbed_model(model_dir: str):
    """The policy after a fake update (tied embeddings stay tied)."""
    from services.models import load_causal_lm

    model = load_causal_lm(model_dir, "float32")
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


@pytest.fixture(scope="module")
def tiny_gpt2(tmp_path_factory) -> str:
    return build_tiny_gpt2(tmp_path_factory.mktemp("gpt2") / "gpt2")


# ------------------------------------------------------------------------------------------- CPU


def test_announcement_is_the_hf_state_dict_with_tied_weights_once(tiny_gpt2):
    from services.models import load_causal_lm

    model = load_causal_lm(tiny_gpt2, "float32")
    state = model.state_dict()
    announced = announced_parameters(model)
    assert [n for n, _, _ in announced] == [n for n, _ in model.named_parameters()]
    assert all(shape == list(state[name].shape) and dtype == "float32" for name, dtype, shape in announced)
    assert set(state) - {n for n, _, _ in announced} == {"lm_head.weight"}  # tied to the embedding
    assert {dtype for _, dtype, _ in announced_parameters(model, torch.bfloat16)} == {"bfloat16"}


def test_announcement_reads_zero3_ds_shape_not_the_empty_partition():
    """A ZeRO-3 parameter outside a gather holds an empty tensor; its full shape is ``ds_shape``."""
    layer = torch.nn.Linear(6, 4)
    for p in layer.parameters():
        p.ds_shape = p.shape
        p.data = torch.empty(0)
    assert announced_parameters(layer) == [("weight", "float32", [4, 6]), ("bias", "float32", [4])]


def test_vllm_packs_the_source_into_the_chunks_a_worker_plans_from_the_announcement(tiny_gpt2):
    """The trainer packs from the tensors it gathers; the worker sizes its buffers from the metadata.
    Both must cut the stream at the same tensors, and unpacking gives the weights back exactly."""
    from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors, unpack_tensor

    from learner.weight_transfer import parameter_source

    model = perturbed_model(tiny_gpt2)
    source = parameter_source(model, zero3=False)
    meta = source.metadata()
    assert [(m.name, str(m.dtype).removeprefix("torch."), list(m.shape)) for m in meta] == \
        announced_parameters(model)
    # vLLM's own check that iteration agrees with the metadata, name by name (what its NCCL sender runs)
    checked = list(NCCLTrainerWeightTransferEngine._checked_iter(source, meta))
    assert [n for n, _ in checked] == [m.name for m in meta]

    stream = iter(gathered_parameters(model, zero3=False))
    sent = []
    while (chunk := pack_tensors(stream, lambda item: item[1], BUFFER)) is not None:
        sent.append(chunk)
    # the worker's plan (packed_nccl_broadcast_consumer): add metadata entries until past the buffer size
    planned, current, size = [], [], 0
    for m in meta:
        current.append(m.name)
        size += math.prod(m.shape) * m.dtype.itemsize
        if size > BUFFER:
            planned.append(current)
            current, size = [], 0
    planned += [current] if current else []
    assert [c.names for c in sent] == planned and len(planned) > 10
    state = dict(model.named_parameters())
    for chunk in sent:
        assert chunk.packed_tensor.numel() == sum(chunk.tensor_sizes)
        for name, tensor in unpack_tensor(chunk.packed_tensor, chunk.names, chunk.shapes, chunk.dtypes,
                                          chunk.tensor_sizes):
            assert torch.equal(tensor, state[name].detach()), name


def embedding_model() -> torch.nn.Module:
    """A model whose embedding (512 x 64: 128 KiB in fp32, 64 KiB in bf16) is its largest parameter."""
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(512, 64), torch.nn.Linear(64, 16))


def test_packed_buffer_holds_the_largest_parameter_where_the_bucket_does_not():
    """SmolLM2-135M's embedding is 108 MiB in fp32, above the 64 MiB learner.sync_bucket_mib: vLLM's IPC
    packer refuses it ("exceeds buffer_size_bytes", ``packed_ipc_producer``) and its NCCL packer warns with
    the same test (``pack_tensors``, run here on CPU). In small: a 128 KiB embedding against a 64 KiB
    bucket."""
    import warnings

    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    from learner.weight_transfer import largest_parameter, packed_buffer_bytes, parameter_source

    model, bucket = embedding_model(), 64 << 10
    assert largest_parameter(announced_parameters(model)) == ("0.weight", 128 << 10)
    assert packed_buffer_bytes(announced_parameters(model), bucket) == 128 << 10
    # 64 KiB fits exactly
    assert packed_buffer_bytes(announced_parameters(model, torch.bfloat16), bucket) == bucket
    # a bucket that holds every tensor
    assert packed_buffer_bytes(announced_parameters(model), 1 << 20) == 1 << 20
    assert packed_buffer_bytes(announced_parameters(torch.nn.Linear(1 << 20, 1, bias=False)),
                               bucket) == 4 << 20

    def pack_all(buffer_bytes: int) -> list[str]:
        stream, names = iter(parameter_source(model, zero3=False)), []
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # vLLM's "exceeds buffer_size_bytes" warning fails the pack
            while (chunk := pack_tensors(stream, lambda item: item[1], buffer_bytes)) is not None:
                names += chunk.names
        return names

    with pytest.raises(UserWarning,
                       match=r"Tensor '0\.weight' has size 131072 bytes, which exceeds buffer_size_bytes"):
        pack_all(bucket)
    assert pack_all(packed_buffer_bytes(announced_parameters(model), bucket)) == \
        ["0.weight", "1.weight", "1.bias"]


def test_every_engine_worker_gets_its_own_nccl_rank():
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, worker_init_payload

    from learner.weight_transfer import trainer_init_info

    info = trainer_init_info("nccl", 0, "127.0.0.1", 29511, world_size=1 + 3 * 2, buffer_bytes=BUFFER)
    assert (info.world_size, info.packed, info.packed_buffer_size_bytes, info.is_sender) == \
        (7, True, BUFFER, True)
    # what vLLM's sender gives every worker (rank_offset 1, as for one engine), then tether's per-engine split
    payload = worker_init_payload(NCCLWeightTransferInitInfo(
        master_address=info.master_address, master_port=info.master_port, rank_offset=1,
        world_size=info.world_size, packed=True, packed_buffer_size_bytes=BUFFER))
    per_engine = engine_init_infos(payload, engines=3, workers_per_engine=2)
    parsed = [NCCLWeightTransferInitInfo(**p) for p in per_engine]  # the worker parses them as these
    ranks = [p.rank_offset + worker for p in parsed for worker in range(2)]
    assert ranks == [1, 2, 3, 4, 5, 6]  # rank 0 is the learner
    assert engine_init_infos({"packed": True}, engines=2, workers_per_engine=1) == [{"packed": True}] * 2
    assert trainer_init_info("ipc", 1, "", 0, 1, BUFFER).is_sender is False
    with pytest.raises(ValueError, match="unknown weight-transfer backend"):
        trainer_init_info("gloo", 0, "", 0, 2, BUFFER)  # type: ignore[arg-type]


def test_ipc_needs_every_engine_on_a_learner_gpu():
    from learner.weight_transfer import check_ipc_colocation

    ranks = [("node-a", ["0"]), ("node-a", ["1"])]
    check_ipc_colocation([("node-a", ["1"]), ("node-a", ["0"])], ranks)
    for engine in (("node-a", ["2"]), ("node-b", ["0"]), ("node-a", [])):
        with pytest.raises(ValueError, match="engine 1 has GPU"):
            check_ipc_colocation([("node-a", ["0"]), engine], ranks)


@pytest.mark.parametrize("backend", ["nccl", "ipc"])
def test_config_refuses_gpu_weight_transfer_without_gpus(backend):
    from pydantic import ValidationError

    from services.config import load_config

    with pytest.raises(ValidationError, match=f"weight_sync='{backend}' is vLLM's GPU weight transfer"):
        load_config(None, {"learner": {"weight_sync": backend}})
    gpus = {"rollout": {"num_gpus": 0.5}, "learner": {"num_gpus": 0.5}}
    assert load_config(None, {"learner": {"weight_sync": backend}, "cluster": gpus}).learner.weight_sync == \
        backend
    with pytest.raises(ValidationError, match="rollout.engine='vllm'"):
        load_config(None, {"learner": {"weight_sync": backend}, "cluster": gpus, "rollout": {"engine": "hf"}})


@pytest.mark.integration
def test_rollout_actor_runs_the_engine_side_of_vllms_protocol_on_cpu(ray_head, tiny_model_dir):
    """A rollout actor built with vLLM's weight transfer (here IPC, whose setup needs no GPU) takes the
    calls ``EngineClient`` makes: init, start and finish, through the real ``LLM`` methods. An update
    with nothing received fails at finish naming the parameters it did not load (vLLM itself would keep the
    old weights with a warning), and the weights stay (the probe does not move). The receive itself needs
    CUDA."""
    import ray

    from actors.engines import WeightLoadError
    from actors.rollout import RolloutActor
    from learner.cluster import start_actor
    from learner.weight_transfer import EngineClient
    from services.config import RoleResources

    ray.init(address=ray_head.address, log_to_driver=False)
    try:
        spec = RolloutSpec(tiny_model_dir, EngineSpec("vllm", 0, 32, 64, "float32", 0, weight_transfer="ipc"))
        actor = start_actor(RolloutActor, "rollout", 0, RoleResources(num_cpus=0.1), None, 0,
                            spec, tag="transfer")
        sequences, prompt_lengths = [[1, 3, 5, 7, 9, 11], [2, 4, 6, 8]], [1, 2]
        before = ray.get(actor.probe.remote(sequences, prompt_lengths))
        client = EngineClient([actor], workers_per_engine=1, timeout_s=120)
        client.init_weight_transfer_engine({"packed": True})
        client.start_weight_update()
        with pytest.raises(WeightLoadError, match=r"rollout-0: the weight transfer did not load (\d+) of the "
                                                  r"engine's parameters \(transformer\.h\.0\."):
            client.finish_weight_update()
        after = ray.get(actor.probe.remote(sequences, prompt_lengths))
        node, gpus = ray.get(actor.gpu_location.remote())
        ray.kill(actor)
    finally:
        ray.shutdown()
    assert max(abs(a - b) for x, y in zip(before, after) for a, b in zip(x, y)) < 1e-6
    assert node and gpus == []  # a CPU actor: no GPU to share, so IPC is refused before any transfer
    with pytest.raises(ValueError, match="engine 0 has GPU"):
        from learner.weight_transfer import check_ipc_colocation

        check_ipc_colocation([(node, gpus)], [(node, gpus)])


class BusyEngine:
    """A process that blocks its main thread as an engine does in an NCCL receive; it answers ``alive`` on a
    thread of its own, as a ``RolloutActor`` does (both ``Answering``)."""

    def receive(self, seconds: float) -> None:
        import time

        time.sleep(seconds)


def test_a_weight_transfer_names_an_engine_that_dies_restarts_or_never_finishes(ray_head):
    """The driver's watch over a transfer whose broadcast waits on the engines (``watch_transfer``): an
    engine busy receiving still answers that it is alive, so a transfer that does not finish is named at
    learner.weight_sync_timeout_s with every engine alive; one that dies, or restarts, is named at once."""
    import time

    import ray

    from actors.base import Answering
    from learner.cluster import ClusterError, start_actor
    from learner.group import watch_transfer
    from services.config import RoleResources

    ray.init(address=ray_head.address, log_to_driver=False)
    engine_class = type("BusyEngine", (Answering, BusyEngine), {})
    hold = ray.remote(lambda: time.sleep(600))
    try:
        engines = [start_actor(engine_class, "rollout", i, RoleResources(num_cpus=0.01), None, max_restarts=1,
                               tag="watch") for i in range(2)]
        processes = ray.get([e.alive.remote() for e in engines])
        send = hold.remote()  # a rank's send that the broadcast holds
        busy = [e.receive.remote(30) for e in engines]
        started = time.monotonic()
        with pytest.raises(ClusterError, match=r"did not finish within 3s \(learner.weight_sync_timeout_s\); "
                                               r"every engine is alive$"):
            watch_transfer([send], engines, processes, timeout_s=3, poll_s=0.5)
        assert time.monotonic() - started < 15
        ray.kill(engines[1], no_restart=False)  # Ray restarts it: another process
        with pytest.raises(ClusterError, match=r"rollout engine 1 \(actor rollout-1\) restarted during"):
            watch_transfer([send], engines, processes, timeout_s=60, poll_s=0.5)
        ray.kill(engines[0], no_restart=True)
        with pytest.raises(ClusterError, match=r"rollout engine 0 \(actor rollout-0\) died during the weight "
                                               "transfer"):
            watch_transfer([send], engines, processes, timeout_s=60, poll_s=0.5)
        assert time.monotonic() - started < 60
        ray.cancel(send, force=True)
        del busy
        ray.kill(engines[1])
    finally:
        ray.shutdown()


# ------------------------------------------------------------ GPU: a vLLM engine in its own process


def hf_logprobs(model, seq: list[int]) -> list[float]:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([seq], device=model.device)).logits[0, :-1].float()
    return torch.log_softmax(logits, -1)[torch.arange(len(seq) - 1), torch.tensor(seq[1:])].tolist()


def probe_sequence(model_dir: str) -> list[int]:
    from services.models import load_tokenizer

    return load_tokenizer(model_dir)("bcdefghijklmnopqrstu|")["input_ids"]


def _engine_main(conn, model_dir: str, backend: str) -> None:
    """Child process: a CUDA vLLM LLM with vLLM's weight transfer, driven over ``conn``."""
    try:
        from vllm import LLM, SamplingParams, TokensPrompt
        from vllm.config import WeightTransferConfig

        llm = LLM(model=model_dir, enforce_eager=True, dtype="float32", seed=0, max_model_len=32,
                  gpu_memory_utilization=0.2, weight_transfer_config=WeightTransferConfig(backend=backend))
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
            result = None
            if cmd == "logprobs":
                params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
                out = llm.generate([TokensPrompt(prompt_token_ids=args)], params, use_tqdm=False)[0]
                result = [out.prompt_logprobs[i][args[i]].logprob for i in range(1, len(args))]
            elif cmd == "init":
                llm.init_weight_transfer_engine({"init_info": args})
            elif cmd == "start":
                llm.start_weight_update()
            elif cmd == "update":
                llm.update_weights({"update_info": args})
            elif cmd == "finish":
                llm.finish_weight_update()
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
    """A vLLM engine in a spawned process; also vLLM's ``VLLMWeightSyncClient`` for it."""

    def __init__(self, model_dir: str, backend: str, env: dict[str, str]) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        with env_vars(VLLM_ENABLE_V1_MULTIPROCESSING="0", **env):
            self.proc = ctx.Process(target=_engine_main, args=(child, model_dir, backend))
            self.proc.start()
        child.close()
        try:
            self.wait(300)
        except BaseException:
            self.stop()
            raise

    def wait(self, timeout_s: float):
        if not self.conn.poll(timeout_s):
            raise TimeoutError(f"the vLLM process did not answer within {timeout_s}s")
        status, result = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"vLLM process failed:\n{result}")
        return result

    def call(self, cmd: str, args=None, timeout_s: float = 120):
        self.conn.send((cmd, args))
        return self.wait(timeout_s)

    # the VLLMWeightSyncClient protocol
    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.call("init", init_info)

    def start_weight_update(self) -> None:
        self.call("start")

    def update_weights(self, update_info) -> None:
        self.call("update", update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.call("finish")

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


def require_vllm_cuda(gpus: int) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} CUDA devices, this machine has {torch.cuda.device_count()}")
    try:
        from vllm.platforms import current_platform
    except ImportError as err:
        pytest.skip(f"needs vLLM's CUDA build (the gpu extra): {err}")
    if not current_platform.is_cuda():
        pytest.skip("needs vLLM's CUDA build (the gpu extra); this vLLM is "
                    f"a {type(current_platform).__name__} build")


def max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


@pytest.mark.gpu
def test_ipc_packer_takes_the_largest_parameter_in_the_announced_buffer():
    """vLLM's IPC packer (a CUDA buffer) refuses the 128 KiB embedding in a 64 KiB bucket and packs the whole
    model in the buffer ``packed_buffer_bytes`` announces."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    packed_tensor = pytest.importorskip("vllm.distributed.weight_transfer.packed_tensor")
    from learner.weight_transfer import packed_buffer_bytes, parameter_source

    model, bucket = embedding_model().to("cuda"), 64 << 10

    def pack_all(buffer_bytes: int) -> list[str]:
        chunks = packed_tensor.packed_ipc_producer(iter(parameter_source(model, zero3=False)), "gpu-0",
                                                   lambda item: item[1], buffer_bytes)
        return [name for chunk in chunks for name in chunk.names]

    with pytest.raises(ValueError,
                       match=r"Tensor '0\.weight' has size 131072 bytes, which exceeds buffer_size_bytes"):
        pack_all(bucket)
    assert pack_all(packed_buffer_bytes(announced_parameters(model), bucket)) == \
        ["0.weight", "1.weight", "1.bias"]


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["nccl", "ipc"])
def test_vllm_weight_transfer_into_a_cuda_engine(tmp_path, backend):
    """NCCL: learner on cuda:0, engine on a second GPU (NCCL refuses two ranks on one GPU).
    IPC: learner and engine share cuda:0."""
    require_vllm_cuda(2 if backend == "nccl" else 1)
    from vllm.distributed.weight_transfer import WeightTransferTrainerFactory

    from learner.weight_transfer import parameter_source, trainer_init_info

    model_dir = build_tiny_gpt2(tmp_path / "gpt2")
    model = perturbed_model(model_dir).to("cuda:0")
    seq = probe_sequence(model_dir)
    env = {}
    if backend == "nccl":
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[1] if visible else "1"
    engine = EngineProcess(model_dir, backend, env)
    trainer = None
    try:
        before = engine.call("logprobs", seq)
        info = trainer_init_info(backend, 0, "127.0.0.1", free_port(), 2, BUFFER)
        # NCCL: the engine joins the group (in a thread of vLLM's) while this process opens rank 0
        trainer = WeightTransferTrainerFactory.trainer_init(info, client=engine,
                                                            source=parameter_source(model, zero3=False))
        trainer.send_weights()
        after = engine.call("logprobs", seq)
    finally:
        if trainer is not None:
            trainer.shutdown()
        engine.stop()
    expected = hf_logprobs(model, seq)
    assert max_diff(after, expected) < 1e-4
    assert max_diff(after, before) > 1e-2

