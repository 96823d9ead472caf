"""How an actor finds its model on its own node: a shared path, a hub id from the HF cache, or files the
driver shipped through the object store (cached by content hash). A role without GPUs sees none, and the Ray
settings of a cluster are its own."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from services.model_source import ModelNotFoundError, ModelSource, content_hash


def test_a_path_no_node_has_is_named_with_the_node():
    with pytest.raises(ModelNotFoundError, match=r"node .*: model.path '/nonexistent/model' is not a directory"):
        ModelSource.configured("/nonexistent/model").resolve("rollout-0")


def test_a_directory_without_config_is_refused(tmp_path):
    with pytest.raises(ModelNotFoundError, match="not a Hugging Face model directory"):
        ModelSource.configured(str(tmp_path)).resolve()


def test_hub_id_resolves_offline_from_the_hf_cache_or_is_named(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(ModelNotFoundError, match=r"Hub id 'tether-tests/walker' cannot be resolved from the local HF cache"):
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
    from learner.config import RoleResources

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
                                env={**base, "RAY_AUTH_MODE": "token", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1"})
    assert json.loads(on_cluster.stdout) == {"RAY_USAGE_STATS_ENABLED": "0"}
    alone = subprocess.run([sys.executable, "-c", show], capture_output=True, text=True, check=True, env=base)
    assert json.loads(alone.stdout) == {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled",
                                        "RAY_USAGE_STATS_ENABLED": "0"}


def test_vllm_settings_are_config_fields():
    from learner.config import load_config

    cfg = load_config(None, {"rollout": {"enforce_eager": False, "gpu_memory_utilization": 0.8,
                                         "tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
                             "cluster": {"rollout": {"num_gpus": 2}}})
    assert cfg.rollout.vllm_engine_args() == {"enforce_eager": False, "tensor_parallel_size": 2,
                                              "gpu_memory_utilization": 0.8, "distributed_executor_backend": "mp"}
    assert (cfg.device("rollout"), cfg.device("learner")) == ("cuda", "cpu")
    with pytest.raises(ValueError, match="rollout.tensor_parallel_size=2 needs that many GPUs per engine"):
        load_config(None, {"rollout": {"tensor_parallel_size": 2}})
    assert load_config(None, {"learner": {"dtype": "bfloat16"}}).probe_tolerance > \
        load_config(None, {}).probe_tolerance == 1e-4
