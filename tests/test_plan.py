"""Resolve once, then run: the settings reach actors, ranks, the fleet, the learner group and the weight sync
only through their specs (``learner.plan``). Read from the source, with the checks shown to fail on code made
for them."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest

from actors.specs import EngineSpec, ReferenceSpec, RewardSpec, RolloutSpec

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("actors", "learner", "services")
# the plan and what runs it: the config itself, the plan, the cluster's reservation and pre-flight, the run
# directory and a resume's checks, the driver's setup and entry point
PLAN_PHASE = {"services/config.py", "learner/plan.py", "learner/cluster.py", "learner/rundir.py",
              "learner/checkpoint.py", "learner/loop.py", "learner/main.py", "learner/algorithm.py"}
MAX_CONSTRUCTOR_ARGUMENTS = 6
MAX_FILE_LINES = 600  # a file longer than this holds more than one job


def takes_the_whole_config(source: str) -> list[str]:
    """The functions of ``source`` with a parameter annotated ``JobConfig``."""
    return [node.name for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
            for a in node.args.args + node.args.kwonlyargs
            if a.annotation is not None and "JobConfig" in ast.unparse(a.annotation)]


def wide_constructors(source: str) -> list[tuple[str, int]]:
    """(class, arguments) of every ``__init__`` in ``source`` taking more than six arguments besides self."""
    wide = []
    for cls in ast.walk(ast.parse(source)):
        if isinstance(cls, ast.ClassDef):
            for init in (n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"):
                count = len(init.args.args) - 1 + len(init.args.kwonlyargs)
                if count > MAX_CONSTRUCTOR_ARGUMENTS:
                    wide.append((cls.name, count))
    return wide


def layer_files():
    return sorted(p for layer in LAYERS for p in (ROOT / layer).rglob("*.py"))


def test_below_the_plan_no_function_takes_the_whole_config():
    found = {str(p.relative_to(ROOT)): names for p in layer_files()
             if (names := takes_the_whole_config(p.read_text()))}
    assert set(found) <= PLAN_PHASE, {k: v for k, v in found.items() if k not in PLAN_PHASE}
    assert "learner/fleet.py" not in found and "learner/group.py" not in found  # built from their specs
    made = ("from services.config import JobConfig\n\n"
            "class Fleet:\n    def __init__(self, cfg: JobConfig) -> None: ...\n")
    assert takes_the_whole_config(made) == ["__init__"]


def test_no_constructor_takes_more_than_six_arguments():
    wide = {str(p.relative_to(ROOT)): w for p in layer_files() if (w := wide_constructors(p.read_text()))}
    assert wide == {}
    made = "class Engine:\n    def __init__(self, a, b, c, d, e, f, *, g=0) -> None: ...\n"
    assert wide_constructors(made) == [("Engine", 7)]


def test_no_file_of_the_layers_is_over_600_lines():
    long = {str(p.relative_to(ROOT)): n for p in layer_files()
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert long == {}


@pytest.mark.parametrize("actor", ["actors.rollout:RolloutActor", "actors.reference:ReferenceActor",
                                   "actors.reference:TeacherActor", "actors.reward:RewardActor",
                                   "actors.environment:EnvironmentWorker"])
def test_every_actor_is_built_from_its_index_and_spec(actor):
    import ray

    from services.errors import load_object

    cls = load_object(actor, "actor")
    # ray.remote appends _ray_trace_ctx to the class's own method signatures; made here so the check does not
    # depend on whether an earlier test in this process made the actor remote (CI's order did, the local one
    # not).
    ray.remote(cls)
    init = getattr(cls.__init__, "__wrapped__", cls.__init__)
    params = [p for p in inspect.signature(init).parameters if p != "_ray_trace_ctx"]
    assert params == ["self", "index", "spec"]


def test_the_plan_gives_each_engine_its_seed_core_and_the_learners_dtype():
    from actors.engines import SamplingSettings
    from learner.plan import Models, SyncSpec, fleet_spec
    from services.config import load_config
    from services.devices import cpu_binding

    cfg = load_config(None, {"rollout": {"num_engines": 2}, "learner": {"dtype": "bfloat16"},
                             "run": {"seed": 7}, "reward": {"num_actors": 2},
                             "reference": {"placement": "actor"}})
    spec = fleet_spec(cfg, Models("/models/policy"), SamplingSettings(), 0, 40)
    assert [r.engine for r in spec.rollouts] == [
        EngineSpec("vllm", 7 + i, 40, cfg.rollout.kv_cache_mib, "bfloat16", i, "cpu",
                   cfg.rollout_vllm_engine_args())
        for i in range(2)]
    assert all(isinstance(r, RolloutSpec) and r.model == "/models/policy" for r in spec.rollouts)
    assert spec.references == (ReferenceSpec("/models/policy", "hf", "bfloat16", 40, 128,
                                             cfg.rollout.temperature,
                                             engine_args=cfg.reference_vllm_engine_args()),)
    assert spec.rewards == (RewardSpec("randomwalks", cfg.task.options(), "/models/policy"),) * 2
    assert spec.roles == [("rollout", 0), ("rollout", 1), ("reference", 0), ("reward", 0), ("reward", 1)]
    assert (spec.teachers, spec.environments, spec.engine_restarts) == ((), (), cfg.run.actor_max_restarts)
    threads = load_config(None, {"rollout": {"num_engines": 2, "engine_threads": 2}})
    threaded = fleet_spec(threads, Models("/m"), SamplingSettings(), 0, 40).rollouts
    assert [r.engine.cpu_threads for r in threaded] == [2, 2]
    assert [cpu_binding(e.cpu_core, e.cpu_threads) for e in (r.engine for r in spec.rollouts)] == ["0", "1"]
    assert [cpu_binding(i, 2) for i in range(2)] == ["0-1", "2-3"]  # each engine cores of its own
    nccl = load_config(None, {"learner": {"weight_sync": "nccl"}, "rollout": {"gpu_memory_utilization": 0.3},
                              "cluster": {"rollout": {"num_gpus": 1}, "learner": {"num_gpus": 1}}})
    # NCCL takes none back
    assert fleet_spec(nccl, Models("/m"), SamplingSettings(), 0, 40).engine_restarts == 0
    assert SyncSpec.of(nccl).transfer == "nccl"


@pytest.mark.parametrize("settings, in_learner, actors", [
    ({}, True, 0),  # the default job: both roles on CPU
    ({"reference": {"placement": "actor"}}, False, 1),
    ({"reference": {"num_actors": 2}}, False, 2),  # a reference setting changed: its actors
    ({"reference": {"torch_threads": 2}}, False, 1),
    ({"cluster": {"reference": {"num_cpus": 1}}}, False, 1),
    ({"cluster": {"learner": {"num_gpus": 1}}}, False, 1),  # the learner on a GPU, the reference on CPU
    ({"learner": {"lora": {"rank": 8, "reference": "actor"}}}, False, 1),  # LoRA's 'actor' asks for one
    ({"learner": {"lora": {"rank": 8}}}, False, 0),  # LoRA's base: the ranks' own forward, no copy
    ({"reference": {"placement": "learner"},
      "learner": {"dtype": "bfloat16", "max_tokens_per_microbatch": 64}},
     True, 0),
])
def test_the_reference_is_a_copy_in_each_learner_rank_where_auto_or_asked(settings, in_learner, actors):
    from learner.cluster import role_counts
    from learner.plan import RankSpec
    from services.config import load_config

    cfg = load_config(None, settings)
    rank = RankSpec.of(cfg, "/models/policy")
    assert (cfg.reference_copy_in_learner, role_counts(cfg)["reference"]) == (in_learner, actors)
    if in_learner:
        # the initial policy, scored as a reference actor would: the learner's dtype, device, packing
        assert rank.reference == \
            ReferenceSpec("/models/policy", "hf", cfg.learner.dtype, temperature=1.0, device="cpu",
                          max_tokens_per_microbatch=cfg.learner.max_tokens_per_microbatch)
    else:
        assert rank.reference is None


@pytest.mark.parametrize("settings, machine_cpus, threads", [
    ({}, 2, 2),  # the default job on a local Ray: the machine's cores while the engine idles
    ({"learner": {"world_size": 2}, "ppo": {"minibatch_size": 32}}, 4, 2),  # shared by the ranks
    ({"learner": {"world_size": 4}, "ppo": {"minibatch_size": 32}}, 2, 1),
    ({}, None, None),  # a joined cluster: its nodes are shared, Ray's default
    ({"rollout": {"mode": "async"}}, 2, None),  # the engines generate while the ranks update
    ({"cluster": {"learner": {"num_gpus": 1}}}, 2, None),
    ({"learner": {"torch_threads": 3}}, None, 3),  # as set, anywhere
    ({"learner": {"torch_threads": 1}}, 2, 1),
])
def test_learner_threads_take_an_own_machine_s_cores_in_a_sync_job_on_cpu(settings, machine_cpus, threads):
    from learner.plan import RankSpec
    from services.config import load_config

    assert RankSpec.of(load_config(None, settings), "/models/policy",
                       machine_cpus=machine_cpus).torch_threads == threads


@pytest.mark.parametrize("settings, in_learner", [
    ({}, True),  # the default job: the task's function, both roles on CPU
    ({"reward": {"placement": "actor"}}, False),
    ({"reward": {"num_actors": 2}}, False),  # a setting that asks for reward actors
    ({"cluster": {"reward": {"num_cpus": 1}}}, False),
    ({"cluster": {"learner": {"num_gpus": 1}}}, False),
    ({"reward": {"kind": "model", "model_path": "/models/classifier"}}, False),  # a model keeps its actor
])
def test_the_reward_function_runs_in_the_learner_ranks_where_auto_or_asked(settings, in_learner):
    from learner.cluster import role_counts
    from learner.plan import RankSpec
    from services.config import load_config

    cfg = load_config(None, settings)
    assert (cfg.reward_in_learner, role_counts(cfg)["reward"]) == \
        (in_learner, 0 if in_learner else cfg.reward.num_actors)
    # built from the task's reward-actor options, as a reward actor is
    expected = RewardSpec("randomwalks", {"seed": 3}, "/models/policy") if in_learner else None
    assert RankSpec.of(cfg, "/models/policy", {"seed": 3}).reward == expected
