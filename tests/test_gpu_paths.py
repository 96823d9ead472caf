"""The GPU paths' settings, checked where no GPU is needed: what the config gives vLLM and Ray for tensor
parallel engines, the reference's vLLM engine and the benchmarks' engines on CUDA, the learner ranks' GPUs,
and the combinations that cannot run, refused with the fields named."""

from __future__ import annotations

import importlib.util
import sys

import pytest

from services.config import load_config
from tests.conftest import ROOT


def _gpu_config(**overrides):
    """A config with GPUs for every role but the reward, merged with ``overrides``."""
    base = {"cluster": {"rollout": {"num_cpus": 1, "num_gpus": 1}, "reference": {"num_gpus": 0.5},
                        "learner": {"num_gpus": 1}}}
    for section, values in overrides.items():
        base.setdefault(section, {})
        for key, value in values.items():
            if isinstance(value, dict):
                base[section].setdefault(key, {}).update(value)
            else:
                base[section][key] = value
    return load_config(None, base)


@pytest.mark.parametrize("tp, executor", [(1, "uni"), (2, "mp"), (4, "mp")])
def test_tensor_parallel_engines_hold_their_gpus_in_one_bundle_and_run_the_mp_executor(tp, executor):
    from learner.cluster import _options, role_bundle
    from services.devices import vllm_device_args

    cfg = _gpu_config(rollout={"tensor_parallel_size": tp}, cluster={"rollout": {"num_gpus": tp}})
    args = cfg.rollout_vllm_engine_args()
    # named, never left to vLLM: inside tether's placement group it would pick its ray executor; each GPU
    # is the engine's own, so it takes 0.9 of it
    assert args == {"enforce_eager": True, "tensor_parallel_size": tp, "gpu_memory_utilization": 0.9,
                    "distributed_executor_backend": executor}
    # the engine's actor asks Ray for one bundle with all its GPUs, and takes them itself: the mp executor's
    # workers (one process per GPU) see the actor's CUDA_VISIBLE_DEVICES
    assert role_bundle(cfg.cluster.rollout) == {"CPU": 1, "GPU": tp}
    assert _options(cfg.cluster.rollout)["num_gpus"] == tp
    on_cuda = vllm_device_args("cuda", 64, 256, args)
    assert on_cuda["gpu_memory_utilization"] == 0.9 and "kv_cache_memory_bytes" not in on_cuda


@pytest.mark.parametrize("overrides, message", [
    ({"rollout": {"distributed_executor_backend": "ray"}},
     ("rollout.distributed_executor_backend='ray' is refused: vLLM's ray executor places its workers in the "
     "engine actor's placement group")),
    ({"rollout": {"tensor_parallel_size": 2, "distributed_executor_backend": "ray"},
      "cluster": {"rollout": {"num_gpus": 2}}},
     "rollout.distributed_executor_backend='ray' is refused"),
    ({"rollout": {"tensor_parallel_size": 2, "distributed_executor_backend": "uni"},
      "cluster": {"rollout": {"num_gpus": 2}}},
     ("rollout.distributed_executor_backend='uni' runs one worker on one GPU, but "
      "rollout.tensor_parallel_size=2")),
    ({"rollout": {"tensor_parallel_size": 2}, "cluster": {"rollout": {"num_gpus": 1}}},
     "rollout.tensor_parallel_size=2 needs that many GPUs per engine: cluster.rollout.num_gpus=1"),
    ({"rollout": {"tensor_parallel_size": 2}, "cluster": {"rollout": {"num_gpus": 3}}},
     ("rollout.tensor_parallel_size=2 runs one vLLM worker per GPU of the engine's bundle: "
     "cluster.rollout.num_gpus must be 2, got 3.0")),
])
def test_executors_and_bundles_that_cannot_run_are_refused_naming_the_fields(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _gpu_config(**overrides)


def test_tensor_parallel_mp_engine_is_accepted_explicitly():
    cfg = _gpu_config(rollout={"tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
                      cluster={"rollout": {"num_gpus": 2}})
    assert cfg.rollout_vllm_engine_args()["distributed_executor_backend"] == "mp"


def test_the_rollout_engine_takes_its_gpu_share_from_the_config():
    """0.9 of what the role reserved per GPU: all of a GPU of its own, a part of a shared one; a set value
    as it is; none on CPU."""
    assert _gpu_config().rollout_vllm_engine_args()["gpu_memory_utilization"] == 0.9
    shared = _gpu_config(cluster={"rollout": {"num_gpus": 0.3}})
    assert shared.rollout_vllm_engine_args()["gpu_memory_utilization"] == 0.27
    tp = _gpu_config(rollout={"tensor_parallel_size": 2}, cluster={"rollout": {"num_gpus": 2}})
    assert tp.rollout_vllm_engine_args()["gpu_memory_utilization"] == 0.9
    given = _gpu_config(rollout={"gpu_memory_utilization": 0.5})
    assert given.rollout_vllm_engine_args()["gpu_memory_utilization"] == 0.5
    assert "gpu_memory_utilization" not in load_config(None, {}).rollout_vllm_engine_args()


def test_reference_vllm_engine_takes_its_gpu_share_from_the_config():
    from services.devices import vllm_device_args

    shared = _gpu_config(reference={"backend": "vllm"})  # half a GPU
    args = shared.reference_vllm_engine_args()
    assert args == \
        {"enforce_eager": True, "distributed_executor_backend": "uni", "gpu_memory_utilization": 0.45}
    assert vllm_device_args("cuda", 64, 128, args)["gpu_memory_utilization"] == 0.45
    own = _gpu_config(reference={"backend": "vllm"}, cluster={"reference": {"num_gpus": 1}})
    assert own.reference_vllm_engine_args()["gpu_memory_utilization"] == 0.9  # not vLLM's 0.92
    given = _gpu_config(reference={"backend": "vllm", "gpu_memory_utilization": 0.2})
    assert given.reference_vllm_engine_args()["gpu_memory_utilization"] == 0.2
    # on CPU: the CPU build's KV cache in bytes, no GPU share
    on_cpu = load_config(None, {"reference": {"backend": "vllm"}})
    cpu_args = vllm_device_args("cpu", 64, 128, on_cpu.reference_vllm_engine_args())
    assert cpu_args["kv_cache_memory_bytes"] == 128 << 20 and "gpu_memory_utilization" not in cpu_args
    # an engine on CUDA without the config's share would take vLLM's 0.92 of the GPU: refused
    with pytest.raises(ValueError,
                       match="a vLLM engine on cuda needs gpu_memory_utilization from the config"):
        vllm_device_args("cuda", 64, 128, {"enforce_eager": True})


@pytest.mark.parametrize("overrides, message", [
    ({"reference": {"backend": "vllm", "gpu_memory_utilization": 0.6}},
     ("reference.gpu_memory_utilization=0.6 exceeds the GPU share the reference reserves, "
     "cluster.reference.num_gpus=0.5")),
    ({"reference": {"gpu_memory_utilization": 0.3}},
     "reference.gpu_memory_utilization=0.3 sizes backend 'vllm' on a GPU, but reference.backend='hf'"),
    ({"reference": {"backend": "vllm", "gpu_memory_utilization": 0.3},
      "cluster": {"reference": {"num_gpus": 0}}},
     "reference.gpu_memory_utilization=0.3 sizes vLLM on a GPU, but cluster.reference.num_gpus=0"),
])
def test_reference_gpu_share_that_cannot_fit_is_refused(overrides, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _gpu_config(**overrides)


def _benchmark(name: str):
    """A benchmark script as a module (benchmarks/ is not a package: its scripts import ``_bench``)."""
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_benchmark_engines_on_cuda_take_the_gpu_share_not_the_cpu_cache():
    from services.devices import vllm_device_args

    cfg = _gpu_config()
    alone = _benchmark("engine_in_service").alone_engine_spec(cfg, "/models/policy", 16)
    assert (alone.device, alone.engine_args) == ("cuda", cfg.rollout_vllm_engine_args())
    assert alone.max_model_len == cfg.task.max_prompt_tokens + 16 + 1
    llm_args = vllm_device_args(alone.device, alone.max_model_len, alone.kv_cache_mib, alone.engine_args)
    assert llm_args["gpu_memory_utilization"] == 0.9 and "kv_cache_memory_bytes" not in llm_args
    on_cpu = _benchmark("engine_in_service").alone_engine_spec(load_config(None, {}), "/models/policy", 16)
    assert on_cpu.device == "cpu"

    spec = {"model_dir": "/models/policy", "seed": 0, "max_model_len": 64, "kv_cache_mib": 512,
            "dtype": "float32"}
    rollout = _benchmark("rollout")
    for device in ("cuda", "cpu"):
        engine = rollout.vllm_engine_spec({**spec, "device": device})
        llm_args = vllm_device_args(device, 64, engine.kv_cache_mib, engine.engine_args)
        assert engine.device == device
        assert ("gpu_memory_utilization" in llm_args) == (device == "cuda")
        assert ("kv_cache_memory_bytes" in llm_args) == (device == "cpu")


@pytest.mark.parametrize("learner_gpus", [0.5, 1.5])
def test_a_fraction_of_a_gpu_per_learner_rank_is_refused_with_several_ranks(learner_gpus):
    with pytest.raises(ValueError, match=rf"cluster.learner.num_gpus={learner_gpus} with "
                                         r"learner.world_size=2: "
                                         "a fraction of a GPU per rank lets Ray place two ranks on one GPU"):
        _gpu_config(learner={"world_size": 2}, cluster={"learner": {"num_gpus": learner_gpus}})
    # one rank may share a GPU; several ranks with whole GPUs each are fine
    assert _gpu_config(cluster={"learner": {"num_gpus": learner_gpus}}).cluster.learner.num_gpus == \
        learner_gpus
    assert _gpu_config(learner={"world_size": 2}).learner.world_size == 2


def test_local_rank_is_the_ranks_gpu_as_cuda_numbers_it_in_the_actor():
    from learner.policy_model import local_gpu_index

    assert local_gpu_index(["3"], "3", "learner-rank-1") == 0  # Ray shows the rank only its own GPU
    assert local_gpu_index(["5", "6"], "5,6", "learner-rank-1") == 0
    assert local_gpu_index(["2"], None, "learner-rank-1") == 2  # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES
    assert local_gpu_index(["2"], "0,1,2,3", "learner-rank-1") == 2
    with pytest.raises(RuntimeError,
                       match="learner-rank-1: Ray assigned it GPU 2, but CUDA_VISIBLE_DEVICES='0,1'"):
        local_gpu_index(["2"], "0,1", "learner-rank-1")
    with pytest.raises(RuntimeError,
                       match="learner-rank-1: the config gives it GPUs, but Ray assigned it none"):
        local_gpu_index([], "", "learner-rank-1")


def test_deepspeeds_accelerator_is_set_by_each_roles_devices_not_the_drivers(monkeypatch):
    """A driver started with DS_ACCELERATOR=cpu (the CPU image's) outside a submitted job: a GPU role's
    actors get cuda, a CPU role's cpu, and the driver's value is not passed to every actor; inside a job
    that sets it, the job's own reaches its actors untouched."""
    from learner.cluster import _options, actor_env
    from services.config import RoleResources
    from services.private_api import RAY_JOB_CONFIG_ENV_VAR

    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.delenv(RAY_JOB_CONFIG_ENV_VAR, raising=False)
    assert "DS_ACCELERATOR" not in actor_env("run", "warning")
    env = lambda gpus: _options(RoleResources(num_gpus=gpus)).get("runtime_env", {}).get("env_vars", {})
    assert env(1)["DS_ACCELERATOR"] == "cuda" and env(0.5)["DS_ACCELERATOR"] == "cuda"
    assert env(0)["DS_ACCELERATOR"] == "cpu" and env(0)["CUDA_VISIBLE_DEVICES"] == ""
    monkeypatch.setenv(RAY_JOB_CONFIG_ENV_VAR, "{}")
    assert "DS_ACCELERATOR" not in env(1) and "DS_ACCELERATOR" not in env(0)


def test_the_learner_starts_after_the_engines_only_where_they_may_share_a_gpu():
    """A fractional layout (the 0.3/0.3/0.2 one of benchmarks/gpu.sh) may put a learner rank and an engine on
    one GPU: the engines start first there (vLLM profiles the free memory at its start); whole GPUs, or no
    GPU, keep the two starting together."""
    fractional = _gpu_config(cluster={"rollout": {"num_gpus": 0.3}, "learner": {"num_gpus": 0.3},
                                      "reference": {"num_gpus": 0.2}})
    assert fractional.learner_may_share_an_engines_gpu()
    assert not _gpu_config().learner_may_share_an_engines_gpu()  # whole GPUs for the rollout and the learner
    half = _gpu_config(cluster={"learner": {"num_gpus": 0.5}})  # and the reference half a GPU: they may share
    assert half.learner_may_share_an_engines_gpu()
    alone = _gpu_config(cluster={"learner": {"num_gpus": 0.5}, "reference": {"num_gpus": 1}})
    assert not alone.learner_may_share_an_engines_gpu()
    assert not load_config(None, {}).learner_may_share_an_engines_gpu()


def test_in_flight_updates_run_vllm_one_step_at_a_time():
    """With loads landing between decoding steps, no step is queued ahead of a load (vLLM's async scheduling,
    on by default on GPU, is turned off) and no prefix is cached across versions; off, vLLM keeps its
    defaults. (The in-flight job tests start real CPU engines with these arguments.)"""
    from actors.engines import in_flight_args

    assert in_flight_args("off") == {}
    for mode in ("keep_kv", "partial"):
        assert in_flight_args(mode) == {"enable_prefix_caching": False, "async_scheduling": False}


def test_an_actor_sees_only_its_own_gpus_where_ray_leaves_every_gpu_visible():
    """With RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES Ray leaves CUDA_VISIBLE_DEVICES unset, so every GPU
    is visible and vLLM and transformers would take GPU 0: the engines and the reference are shown their own
    instead; where Ray (or the user) set it, it stays."""
    from services.devices import visible_gpus

    assert visible_gpus(["2"], None) == "2"
    assert visible_gpus(["2", "3"], None) == "2,3"
    assert visible_gpus(["2"], "2") is None and visible_gpus(["2"], "0,1,2,3") is None
    assert visible_gpus([], None) is None  # outside an actor, or no GPU assigned
