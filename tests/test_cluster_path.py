"""How an actor finds its model on its own node: a shared path, a hub id from the HF cache, or files the
driver shipped through the object store (cached by content hash). A role without GPUs sees none, and the Ray
settings of a cluster are its own."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from actors.specs import EngineSpec
from services.model_source import ModelNotFoundError, ModelSource, content_hash


def test_a_path_no_node_has_is_named_with_the_node():
    with pytest.raises(ModelNotFoundError,
                       match=r"node .*: model.path '/nonexistent/model' is not a directory"):
        ModelSource.configured("/nonexistent/model").resolve("rollout-0")


def test_a_directory_without_config_is_refused(tmp_path):
    with pytest.raises(ModelNotFoundError, match="not a Hugging Face model directory"):
        ModelSource.configured(str(tmp_path)).resolve()


def test_hub_id_resolves_offline_from_the_hf_cache_or_is_named(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelNotFoundError,
                       match=r"Hub id 'tether-tests/walker' cannot be resolved from the local HF cache"):
        ModelSource.configured("tether-tests/walker").check()
    # the HF cache's own layout: refs/main names the snapshot that holds the files
    repo = tmp_path / "hub" / "models--tether-tests--walker"
    commit = "0" * 40
    shutil.copytree(tiny_model_dir, repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    source = ModelSource.configured("tether-tests/walker")
    assert source.check() == "cached"
    resolved = Path(source.resolve("reference-0"))
    assert resolved == repo / "snapshots" / commit
    from services.models import load_tokenizer

    assert len(load_tokenizer(resolved)) == len(load_tokenizer(tiny_model_dir))


def test_driver_made_files_are_shipped_and_cached_by_content_hash(ray_client, tiny_model_dir, tmp_path):
    made = tmp_path / "driver" / "sft"
    shutil.copytree(tiny_model_dir, made)
    node_cache = tmp_path / "node-cache"
    source = ModelSource.produced(made, str(node_cache))
    assert source.check() == "local"  # this node sees the driver's directory with that content
    assert source.resolve() == str(made)

    source.ship()
    shutil.rmtree(made)  # now this node is one that never had the driver's files
    assert source.check() == "ship"
    target = Path(source.resolve("learner-rank-0"))
    assert target == node_cache / "models" / source.content_hash
    assert content_hash(target) == source.content_hash
    assert sorted(p.name for p in target.iterdir() if p.name != ".tether-content-hash") == \
        sorted(p.name for p in Path(tiny_model_dir).iterdir() if p.name != ".tether-content-hash")
    assert source.check() == "local"  # cached now: a second actor on this node does not ship again

    unshipped = ModelSource(str(made), source.content_hash, str(tmp_path / "elsewhere"))
    with pytest.raises(ModelNotFoundError, match="is not on this node and was not shipped"):
        unshipped.resolve("reward-0")


class EnvironmentProbe:
    def visible_devices(self) -> str | None:
        return os.environ.get("CUDA_VISIBLE_DEVICES")


def test_a_role_without_gpus_sees_none(ray_client):
    from learner.cluster import start_actor
    from services.config import RoleResources

    actor = start_actor(EnvironmentProbe, "probe", 0, RoleResources(num_cpus=0.01, num_gpus=0), None)
    try:
        assert ray_client.get(actor.visible_devices.remote()) == ""
    finally:
        ray_client.kill(actor)


def test_a_role_given_gpus_on_a_node_without_cuda_is_named():
    from actors.engines import check_device

    if __import__("torch").cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(RuntimeError, match="role rollout-0: the config gives this role GPUs"):
        check_device("cuda", "rollout-0")


def test_ray_settings_reach_actors_only_where_the_environment_does_not_set_them():
    """A cluster with token auth or several nodes keeps its own RAY_AUTH_MODE and
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER; tether's loopback defaults fill in only what is unset."""
    import json
    import subprocess
    import sys

    show = "import json, learner.cluster as c; print(json.dumps(c.RAY_ENV_DEFAULTED))"
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    on_cluster = subprocess.run([sys.executable, "-c", show], capture_output=True, text=True, check=True,
                                env={**base, "RAY_AUTH_MODE": "token",
                                     "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"})
    assert json.loads(on_cluster.stdout) == {"RAY_USAGE_STATS_ENABLED": "0"}
    alone = subprocess.run([sys.executable, "-c", show], capture_output=True, text=True, check=True, env=base)
    assert json.loads(alone.stdout) == {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
                                        "RAY_USAGE_STATS_ENABLED": "0"}


def test_the_local_ray_s_polled_raylet_wait_is_ray_s_own_again_after_the_start():
    """connect() replaces Ray's private services.get_node for the local ray.init alone (the job with a local
    Ray in test_bad_input starts through it); afterwards, and after an error inside, Ray's own is back."""
    from ray._private import services

    from services.private_api import raylet_wait_by_polling

    ray_get_node = services.get_node
    with pytest.raises(RuntimeError, match="inside"), raylet_wait_by_polling():
        assert services.get_node is not ray_get_node
        raise RuntimeError("inside")
    assert services.get_node is ray_get_node


def test_vllm_settings_are_config_fields():
    from services.config import load_config

    cfg = load_config(None, {"rollout": {"enforce_eager": False, "gpu_memory_utilization": 0.8,
                                         "tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
                             "cluster": {"rollout": {"num_gpus": 2}}})
    assert cfg.rollout_vllm_engine_args() == {"enforce_eager": False, "tensor_parallel_size": 2,
                                              "gpu_memory_utilization": 0.8,
                                              "distributed_executor_backend": "mp"}
    assert (cfg.device("rollout"), cfg.device("learner")) == ("cuda", "cpu")
    with pytest.raises(ValueError, match="rollout.tensor_parallel_size=2 needs that many GPUs per engine"):
        load_config(None, {"rollout": {"tensor_parallel_size": 2}})
    assert load_config(None, {"learner": {"dtype": "bfloat16"}}).probe_tolerance > \
        load_config(None, {}).probe_tolerance == 1e-4


def _executor_vllm_runs(engine_args: dict) -> str:
    """The executor vLLM's own ParallelConfig settles on for these engine arguments, where it is built."""
    from vllm.config import ParallelConfig

    return ParallelConfig(**{key: engine_args[key]
                             for key in ("tensor_parallel_size", "distributed_executor_backend")
                             if key in engine_args}).distributed_executor_backend


def test_a_tensor_parallel_engine_in_a_placement_group_gets_the_executor_the_config_names(ray_client):
    """Inside a placement group, as every tether actor is, vLLM left to choose takes its ray executor, which
    would take its workers' GPUs from tether's bundles; the config names 'mp' for tensor_parallel_size > 1."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from services.config import load_config

    cfg = load_config(None, {"rollout": {"tensor_parallel_size": 2}, "cluster": {"rollout": {"num_gpus": 2}}})
    group = ray_client.util.placement_group([{"CPU": 0.01}])
    try:
        ray_client.get(group.ready())
        in_group = ray_client.remote(num_cpus=0, max_retries=0)(_executor_vllm_runs).options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group))
        left_to_vllm = {"tensor_parallel_size": 2}
        assert ray_client.get(in_group.remote(left_to_vllm)) == "ray"
        assert ray_client.get(in_group.remote(cfg.rollout_vllm_engine_args())) == "mp"
    finally:
        ray_client.util.remove_placement_group(group)


class TensorParallelProbe:
    """A tensor-parallel vLLM engine built as a rollout actor builds it, inside this actor."""

    def run(self, model_dir: str, engine_args: dict) -> dict:
        import torch

        from actors.engines import SamplingSettings, VLLMEngine
        from services.models import load_causal_lm

        engine = VLLMEngine(model_dir, EngineSpec("vllm", 0, 32, 64, "float32", None, "cpu", engine_args))
        sequence = [1, 2, 3, 4, 5, 6]
        generated = engine.generate([[1, 2, 3]] * 2, SamplingSettings(max_new_tokens=4), [1, 2])
        torch.manual_seed(0)
        policy = load_causal_lm(model_dir)
        with torch.no_grad():  # new weights, as after a PPO step
            for parameter in policy.parameters():
                parameter.add_(0.05 * torch.randn_like(parameter))
            logprobs = torch.log_softmax(policy(input_ids=torch.tensor([sequence])).logits[0, :-1], -1)
        weights = policy.state_dict()
        # every worker's sync check: one tensor left out is named, the whole weights leave nothing unloaded
        partial = engine.load_weights({k: v for k, v in weights.items() if k != "transformer.ln_f.weight"})
        missing = engine.load_weights(weights)
        return {"executor": type(engine.llm.llm_engine.engine_core.engine_core.model_executor).__name__,
                "partial": partial, "missing": missing,
                "generated": [len(g.response_ids) for g in generated],
                "engine": engine.score([sequence], [2])[0],
                "learner": [logprobs[i - 1, sequence[i]].item() for i in range(2, len(sequence))]}


def test_a_tensor_parallel_engine_runs_its_workers_from_its_actor_in_a_placement_group(ray_client,
                                                                                       tiny_model_dir):
    """tensor_parallel_size 2 with the executor the config names ('mp'), in an actor placed in a placement
    group as every tether engine is: vLLM's CPU build runs its two workers as processes of the actor, they
    generate, and new weights loaded through them give the learner's log-probs (a sync that leaves a
    parameter out is named by the workers' check)."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from services.config import RolloutConfig

    group = ray_client.util.placement_group([{"CPU": 0.01}])
    try:
        ray_client.get(group.ready())
        # the CPU build binds each worker's OpenMP threads: one core per tensor-parallel rank
        probe = ray_client.remote(TensorParallelProbe).options(
            num_cpus=0, scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group),
            runtime_env={"env_vars": {"VLLM_CPU_OMP_THREADS_BIND": "0|1",
                                      "CUDA_VISIBLE_DEVICES": ""}}).remote()
        engine_args = RolloutConfig(tensor_parallel_size=2).vllm_engine_args()
        found = ray_client.get(probe.run.remote(tiny_model_dir, engine_args))
        ray_client.kill(probe)
    finally:
        ray_client.util.remove_placement_group(group)
    assert found["executor"] == "MultiprocExecutor" and all(n > 0 for n in found["generated"])
    assert found["partial"] == ["transformer.ln_f.weight"] and found["missing"] == []
    assert max(abs(a - b) for a, b in zip(found["engine"], found["learner"], strict=True)) < 1e-4


def test_preflight_names_the_node_and_port_an_engine_cannot_reach_for_the_weight_transfer(ray_client,
                                                                                          tmp_path):
    from learner.cluster import ClusterSpec, Placement, RendezvousStandIn, _check_node, preflight, rank0_reach
    from services.config import load_config
    from services.storage import RunStorage
    from tests.conftest import free_port

    nccl = load_config(None, {"learner": {"weight_sync": "nccl"},
                              "cluster": {"rollout": {"num_gpus": 1}, "learner": {"num_gpus": 1}}})
    # who reaches rank 0's node for what: with nccl every engine's node, rank 0's own too; ranks away from it
    actors_on = {"a": [("rollout", 0), ("learner", 0)], "b": [("rollout", 1), ("reward", 0)],
                 "c": [("learner", 1)]}
    assert rank0_reach(True, actors_on, "a") == {"a": {"weight_transfer"}, "b": {"weight_transfer"},
                                                 "c": {"rendezvous"}}
    assert rank0_reach(False, actors_on, "a") == {"a": set(), "b": set(), "c": {"rendezvous"}}

    storage = RunStorage(str(tmp_path)).child("run")
    storage.makedirs()
    # the whole pre-flight of an nccl job on this head (CPU bundles stand in for the GPU ones): it passes
    group = ray_client.util.placement_group([{"CPU": 0.01}] * 4)
    try:
        ray_client.get(group.ready())
        logged = []
        preflight(ClusterSpec.of(nccl),
                  Placement(group, {"rollout": [0], "reference": [1], "reward": [2], "learner": [3]}), [],
                  storage, log=logged.append)
        assert logged and logged[-1].startswith("pre-flight: models and run storage ok on")
    finally:
        ray_client.util.remove_placement_group(group)

    # an engine's node check against a port nothing listens on, and against one that listens
    probe = storage.write_probe()
    check = ray_client.remote(num_cpus=0, max_retries=0)(_check_node)
    closed = ("127.0.0.1", free_port())
    found = ray_client.get(check.remote([], storage, probe, None, closed))
    assert found["node"] and found["problems"] == [
        (f"cannot reach learner rank 0's node at 127.0.0.1 port {closed[1]} (opened by pre-flight) for "
        f"vLLM's weight transfer (learner.weight_sync='nccl'), whose store waits 300 s for an engine: "
        f"[Errno 111] Connection refused")]
    stand_in = ray_client.remote(RendezvousStandIn).options(num_cpus=0).remote()
    try:
        listening = ray_client.get(stand_in.address.remote())
        assert ray_client.get(check.remote([], storage, probe, None, listening))["problems"] == []
    finally:
        ray_client.kill(stand_in)
