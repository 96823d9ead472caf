"""Integration tests on a real local Ray: vLLM (CPU build) and HF engines, the reference and reward
actors, and DeepSpeed learner ranks on gloo. No mocks: every number comes from the real components."""

from __future__ import annotations

import pytest
import torch

from actors.specs import EngineSpec, ReferenceSpec, RewardSpec, RolloutSpec
from tests.conftest import chunk_refs, train

pytestmark = pytest.mark.integration

ray = pytest.importorskip("ray")


def small_config(**overrides):
    from services.config import load_config

    base = {
        "rollout": {"batch_size": 16, "chunk_size": 8, "max_new_tokens": 9},
        "ppo": {"minibatch_size": 8, "epochs": 2, "lr": 1e-3},
        "cluster": {"learner": {"num_cpus": 0.1}, "rollout": {"num_cpus": 0.1}},
    }
    return load_config(None, {**base, **overrides})


def kill(*actors):
    for actor in actors:
        ray.kill(actor)


@pytest.fixture(scope="module")
def roles(ray_client, tiny_model_dir):
    """One vLLM and one HF rollout actor, a reference, a reward actor and a 1-rank learner."""
    from actors.reference import ReferenceActor
    from actors.reward import RewardActor
    from actors.rollout import RolloutActor
    from learner.cluster import start_actor
    from learner.group import LearnerGroup
    from learner.plan import RankSpec

    cfg = small_config()
    res = cfg.cluster.rollout
    vllm_engine = start_actor(RolloutActor, "rollout", 0, res, None, 0,
                              RolloutSpec(tiny_model_dir, EngineSpec("vllm", 0, 32, 64, "float32", 0)))
    hf_engine = start_actor(RolloutActor, "rollout", 1, res, None, 1,
                            RolloutSpec(tiny_model_dir, EngineSpec("hf", 0, 32)))
    reference = start_actor(ReferenceActor, "reference", 0, res, None, 0, ReferenceSpec(tiny_model_dir))
    reward = start_actor(RewardActor, "reward", 0, res, None, 0,
                         RewardSpec("randomwalks", {}, tiny_model_dir))
    group = LearnerGroup(RankSpec.of(cfg, tiny_model_dir), None)
    ray.get([a.ready.remote() for a in (vllm_engine, hf_engine, reference, reward)])
    yield {"vllm": vllm_engine, "hf": hf_engine, "reference": reference, "reward": reward, "learner": group}
    kill(vllm_engine, hf_engine, reference, reward, *group.ranks)


def probe_set():
    prompts = [[1], [2, 5], [7], [12]]
    sequences = [p + [(3 * i + 2 * k) % 21 for k in range(6)] for i, p in enumerate(prompts)]
    return sequences, [len(p) for p in prompts]


def test_one_iteration_syncs_weights_and_keeps_exact_kl_books(roles, tiny_model_dir):
    from actors.engines import SamplingSettings
    from services.experience import concat_batches, response_forward
    from services.models import load_causal_lm
    from tests.batch_statistics import kl_stats

    engines = {"vllm": roles["vllm"], "hf": roles["hf"]}
    ray.get([a.set_state.remote(0, 0.1) for a in engines.values()])
    sequences, prompt_lengths = probe_set()
    before = {k: ray.get(a.probe.remote(sequences, prompt_lengths)) for k, a in engines.items()}
    initial = roles["learner"].probe(sequences, prompt_lengths)
    for name, got in before.items():  # both engines start from the learner's weights
        assert max(abs(a - b) for g, e in zip(got, initial) for a, b in zip(g, e)) < 1e-4, name

    sampling = SamplingSettings(1.0, 1.0, 9)
    prompts = [[i % 20 + 1] for i in range(16)]
    chunks = [
        roles["vllm"].generate.remote(prompts[:8], list(range(8)), list(range(8)), sampling, 22),
        roles["hf"].generate.remote(prompts[8:], list(range(8, 16)), list(range(8, 16)), sampling, 22),
    ]
    ref_logprobs = [roles["reference"].score.remote(c) for c in chunks]
    scores = [roles["reward"].score.remote(c, i) for i, c in enumerate(chunks)]
    result = train(roles["learner"], chunks, ref_logprobs, scores, kl_coef=0.1, iteration=1)

    # chunks carry the state their actor had when it generated them
    batch = concat_batches(ray.get(chunks))
    assert set(batch.policy_version.tolist()) == {0}
    assert torch.allclose(batch.kl_coef, torch.full((16,), 0.1))

    # KL bookkeeping: the learner's response_mean equals kl_stats recomputed here from the same chunks
    ref = torch.cat(ray.get(ref_logprobs))
    with torch.no_grad():
        old_logprobs, _, _ = response_forward(load_causal_lm(tiny_model_dir), batch)
    expected = kl_stats(old_logprobs * batch.response_mask, ref, batch.response_mask)
    got = result.kl
    assert got["num_responses"] == 16
    assert got["response_mean"] == pytest.approx(expected["response_mean"], abs=1e-4)
    assert got["token_mean"] == pytest.approx(expected["token_mean"], abs=1e-4)
    assert result.sums["score_sum"] == pytest.approx(float(torch.cat(ray.get(scores)).sum()), abs=1e-5)

    # weight sync: after the update, each engine's probe log-probs equal the learner's and moved
    weights = roles["learner"].policy_weights()
    ray.get([a.update_weights.remote(weights, 1, 0.2) for a in engines.values()])
    after_learner = roles["learner"].probe(sequences, prompt_lengths)
    for name, actor in engines.items():
        after = ray.get(actor.probe.remote(sequences, prompt_lengths))
        assert max(abs(a - b) for g, e in zip(after, after_learner) for a, b in zip(g, e)) < 1e-4, name
        assert max(abs(a - b) for g, e in zip(after, before[name]) for a, b in zip(g, e)) > 1e-3, name
        assert ray.get(actor.get_state.remote())["policy_version"] == 1
        new_chunk = ray.get(actor.generate.remote(prompts[:2], [0, 1], [5, 6], sampling, 22))
        assert new_chunk.policy_version.tolist() == [1, 1]
        assert torch.allclose(new_chunk.kl_coef, torch.tensor([0.2, 0.2]))

    # reference.placement learner (what the small config resolves on CPU): the rank's own copy scores as the
    # reference actor does, and it is the initial policy, not the weights the update moved
    references = [roles["reference"].score.remote(c) for c in chunks]
    by_actor = roles["learner"].evaluation_kl(chunk_refs(chunks, references))
    by_rank = roles["learner"].evaluation_kl(chunk_refs(chunks))
    assert by_rank["response_mean"] == pytest.approx(by_actor["response_mean"], abs=1e-5)
    assert abs(by_rank["response_mean"]) > 1e-6  # the current weights against themselves would give 0
    # reward.placement learner (what the small config resolves on CPU too): the ranks' evaluation of the
    # chunks, in slot order, is the reward actor's, samples kept included
    assert roles["learner"].evaluate_rewards(dict(enumerate(chunks)), 2) == ray.get(
        [roles["reward"].evaluate.remote(c, i, 2) for i, c in enumerate(chunks)])


def test_a_sync_that_leaves_a_parameter_unloaded_fails_naming_it(roles):
    """One tensor of the learner's weights not sent: vLLM's layerwise reload would keep (or garble) that
    layer and only log a warning, and in bf16 the probe could not tell. Each engine names the parameter and
    the sync fails, in either engine, before the version is taken; the whole weights then load."""
    from actors.engines import WeightLoadError
    from services.weights import HostWeights

    weights = ray.get(roles["learner"].policy_weights()).tensors()
    dropped = "transformer.h.0.mlp.c_fc.weight"
    partial = ray.put(HostWeights({k: v for k, v in weights.items() if k != dropped}, torch.float32))
    for name in ("vllm", "hf"):
        engine = roles[name]
        state = ray.get(engine.get_state.remote())
        version, kl_coef = state["policy_version"], state["kl_coef"]
        with pytest.raises(WeightLoadError) as failure:
            ray.get(engine.update_weights.remote(partial, version + 1, kl_coef))
        message = str(failure.value)
        assert "the sync of version" in message and \
            "did not load 1 of the engine's parameters" in message, name
        assert dropped in message, name
        # the version was not taken
        assert ray.get(engine.get_state.remote())["policy_version"] == version, name
        ray.get(engine.update_weights.remote(ray.put(HostWeights(weights, torch.float32)), version, kl_coef))


def test_reward_errors_name_task_chunk_and_sample(roles):
    from services.experience import make_batch

    ray.get(roles["reward"].ready.remote())
    # a prompt and completion that decode to text the tokenizer can produce
    batch = make_batch([[1], [2]], [[3, 22], []], [[0.0, 0.0], []], [0, 0], [0, 1], 22, 0, 0.0, 9)
    scores = ray.get(roles["reward"].score.remote(batch, 7))
    assert scores.shape == (2,)  # an empty response is scored, never a crash


def test_a_slow_reward_scores_a_chunk_while_the_engine_generates_the_next(roles, tiny_model_dir):
    """Reward calls run on the reward actors while the engines generate (the driver starts them on the chunks'
    refs at once, ``Fleet.score``): a reward service that holds its first call until the engine has generated
    the chunks after it gets them all, each scored as the task scores it. A judge scores in the same place."""
    import threading

    from actors.engines import SamplingSettings
    from actors.reward import RewardActor
    from learner.cluster import start_actor
    from services.config import RewardConfig
    from services.reward_service import serve
    from services.tasks import get_task

    task = get_task("randomwalks")
    first_call_held, release, calls = threading.Event(), threading.Event(), []

    def slow_reward(prompts: list[str], completions: list[str]) -> list[float]:
        calls.append((list(prompts), list(completions)))
        if len(calls) == 1:
            first_call_held.set()
            release.wait(120)
        return task.reward(prompts, completions)

    with serve(slow_reward, timeout_s=300) as service:
        remote = RewardConfig(kind="remote", url=service.url, timeout_s=300, max_retries=0)
        reward = start_actor(RewardActor, "reward", 1, small_config().cluster.reward, None, 1,
                             RewardSpec("randomwalks", {}, tiny_model_dir, "remote", remote=remote))
        engine, sampling = roles["vllm"], SamplingSettings(1.0, 1.0, 9)

        def chunk(i: int):
            return engine.generate.remote([[1 + (i + j) % 20] for j in range(8)], list(range(8)),
                                          [100 * i + j for j in range(8)], sampling, 22)

        chunks = [chunk(0)]
        scored = [reward.score.remote(chunks[0], 0)]
        assert first_call_held.wait(120), "the first chunk's reward call never reached the service"
        chunks += [chunk(i) for i in (1, 2, 3)]
        # before they are generated
        scored += [reward.score.remote(ch, i) for i, ch in enumerate(chunks[1:], 1)]
        ray.get(chunks[1:], timeout=120)  # generated while the reward call of chunk 0 is held
        assert len(calls) == 1 and not release.is_set()
        release.set()
        scores = ray.get(scored, timeout=120)
        ray.kill(reward)
    assert len(calls) == 4 and all(len(call[1]) == 8 for call in calls)
    for (prompts, completions), got in zip(calls, scores, strict=True):  # one actor: its calls in order
        assert got.tolist() == pytest.approx(task.reward(prompts, completions))


def _fixed_batch(n: int, t: int, seed: int):
    from services.experience import make_batch

    g = torch.Generator().manual_seed(seed)
    prompts = [[int(x)] for x in torch.randint(1, 21, (n,), generator=g)]
    responses = [torch.randint(0, 21, (t,), generator=g).tolist() for _ in range(n)]
    return make_batch(prompts, responses, [[0.0] * t] * n, [1] * n, list(range(n)), 22, 0, 0.05, t)


@pytest.mark.parametrize("stage", [2, 3])
def test_zero_two_ranks_match_one_rank(rank_pool, tiny_model_dir, stage):
    batch = _fixed_batch(16, 6, seed=0)
    chunks = [ray.put(batch[:8]), ray.put(batch[8:])]
    refs = [ray.put(torch.full((8, 6), -3.0)), ray.put(torch.full((8, 6), -3.0))]
    scores = [ray.put(torch.linspace(0, 1, 8)), ray.put(torch.linspace(1, 0, 8))]
    losses = {}
    for world_size, zero_stage in ((1, 0), (2, stage)):
        cfg = small_config(
            ppo={"minibatch_size": 16, "epochs": 1, "lr": 1e-3},
            learner={"world_size": world_size, "zero_stage": zero_stage},
            rollout={"batch_size": 16, "chunk_size": 8, "max_new_tokens": 6},
        )
        group = rank_pool.group(cfg, tiny_model_dir, tag="zero")
        result = train(group, chunks, refs, scores, kl_coef=0.05, iteration=1)
        losses[world_size] = {k: sum(r.ppo[k] for r in result.ranks) / len(result.ranks)
                              for k in ("loss", "policy_loss", "value_loss")}
    for key in ("loss", "policy_loss", "value_loss"):
        assert losses[2][key] == pytest.approx(losses[1][key], rel=1e-4, abs=1e-5), key


def test_vllm_reference_backend_matches_hf(ray_client, tiny_model_dir, roles):
    """reference.backend='vllm' (prompt_logprobs) scores like the transformers forward (the default)."""
    from actors.engines import SamplingSettings
    from actors.reference import ReferenceActor
    from learner.cluster import start_actor

    spec = ReferenceSpec(tiny_model_dir, "vllm", "float32", 32, 64,
                         engine_args=small_config().reference_vllm_engine_args())  # as Fleet starts it
    vllm_reference = start_actor(ReferenceActor, "reference", 1,
                                 small_config().cluster.reference, None, 1, spec)
    try:
        chunk = roles["vllm"].generate.remote([[3], [4, 5], [9]], [0, 1, 2], [1, 2, 3],
                                              SamplingSettings(1.0, 1.0, 9), 22)
        hf_scores, vllm_scores = ray.get([roles["reference"].score.remote(chunk),
                                          vllm_reference.score.remote(chunk)])
    finally:
        kill(vllm_reference)
    assert hf_scores.shape == vllm_scores.shape
    assert torch.allclose(hf_scores, vllm_scores, atol=1e-4)


def test_chunk_from_an_engine_restarted_after_the_version_check_is_regenerated(roles, tiny_model_dir):
    """A real engine restart between the driver's version check and ``generate``: the chunk comes back at
    version 0, the learner reports it lost (never trains on it), and the one generated after the re-sync
    is kept."""
    import time

    from actors.engines import SamplingSettings
    from actors.rollout import RolloutActor
    from learner.cluster import start_actor
    from learner.records import Admission

    group, sampling = roles["learner"], SamplingSettings(1.0, 1.0, 9)
    prompts = [[i % 20 + 1] for i in range(8)]
    engine = start_actor(RolloutActor, "rollout", 2, small_config().cluster.rollout, None, 2,
                         RolloutSpec(tiny_model_dir, EngineSpec("hf", 0, 32)), max_restarts=1)

    def generate_and_collect():
        chunk = engine.generate.remote(prompts, list(range(8)), list(range(8)), sampling, 22)
        lost = group.collect(chunk_refs([chunk], [roles["reference"].score.remote(chunk)],
                                        [roles["reward"].score.remote(chunk, 0)]), Admission(3, 0.2))
        return ray.get(chunk), lost

    try:
        weights = group.policy_weights()
        ray.get(engine.update_weights.remote(weights, 3, 0.2))  # up to date at the driver's check
        ray.kill(engine, no_restart=False)
        state: dict = {}
        for _ in range(600):  # ray.kill acts after a while; then calls fail until the restarted one answers
            try:
                state = ray.get(engine.get_state.remote())
            except ray.exceptions.RayActorError:
                state = {}
            if state.get("policy_version") == 0:
                break
            time.sleep(0.2)
        assert state == {"name": "rollout-2", "policy_version": 0, "kl_coef": 0.0}
        chunk, lost = generate_and_collect()
        assert chunk.policy_version.tolist() == [0] * 8 and lost == [0]
        ray.get(engine.update_weights.remote(weights, 3, 0.2))  # what WeightSync.bring_up_to_date does
        chunk, lost = generate_and_collect()
        assert chunk.policy_version.tolist() == [3] * 8 and lost == []
        result = group.update(0.2, iteration=1)
    finally:
        kill(engine)
    assert result.trained_episodes == 8 and result.policy_versions == [3]


def test_on_cpu_the_engines_lead_every_other_actor_and_none_goes_below_where_it_started(roles):
    """Every thread of the reference, reward and learner processes yields the cores to the rollout engines'
    generation: the thread that runs an engine's methods is ``ENGINE_LEAD`` steps above them, raised from
    where Ray started it (the head's workers at its niceness 15; these actors get no driver's niceness, so
    that is their ordinary one) where the node lets a process raise its own; the others stay there."""
    import os
    import threading

    from actors.base import ENGINE_LEAD
    from tests.conftest import may_raise_priority

    def calling_thread(self) -> tuple[int, int]:
        return os.getpid(), os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    def niceness(actor) -> tuple[int, set[int]]:
        pid, caller = ray.get(actor.__ray_call__.remote(calling_thread))
        return caller, {os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir(f"/proc/{pid}/task")}

    engines = [niceness(roles[name]) for name in ("vllm", "hf")]
    assert len({caller for caller, _ in engines}) == 1, engines
    engine = engines[0][0]
    lead = ENGINE_LEAD if may_raise_priority() else 0
    for _, threads in engines:  # every thread of each engine's process raised
        assert threads == {engine}, engines
    for name in ("reference", "reward", "learner"):
        actor = roles[name].ranks[0] if name == "learner" else roles[name]
        caller, threads = niceness(actor)
        assert caller == engine + lead and threads == {caller}, (name, engine, caller, threads)


def test_a_role_built_outside_an_actor_leaves_its_callers_priority(ray_client, tiny_model_dir):
    """Built as a plain object (tests, tools), a role runs in its caller's process: the caller, and what it
    starts later (a Ray head, a job), keep their priority."""
    import os

    from actors.reference import ReferenceActor
    from actors.reward import RewardActor

    before = os.getpriority(os.PRIO_PROCESS, 0)
    RewardActor(0, RewardSpec("randomwalks", {}, tiny_model_dir))
    ReferenceActor(0, ReferenceSpec(tiny_model_dir))
    assert os.getpriority(os.PRIO_PROCESS, 0) == before


def test_an_eager_engine_on_cpu_compiles_nothing(roles):
    """vLLM's eager engine still torch.compiles its sampler's log-prob rank helper on the first call that
    returns log-probs: a C++ build, or a second from the inductor cache, in the first generation. On CPU the
    engine runs it eagerly: after generating and scoring, dynamo has traced no frame in the engine's
    process."""
    from actors.engines import SamplingSettings

    engine = roles["vllm"]
    batch = ray.get(engine.generate.remote([[1, 2], [3]], [0, 1], [5, 6],
                                           SamplingSettings(max_new_tokens=4), 0))
    sequences, prompt_lengths = probe_set()
    ray.get(engine.probe.remote(sequences, prompt_lengths))

    def traced_frames(self) -> int:
        from torch._dynamo.utils import counters

        return sum(counters["frames"].values())

    assert batch.response_lengths.sum() > 0
    assert ray.get(engine.__ray_call__.remote(traced_frames)) == 0


# ---------------------------------------------------------------- LoRA and packing on the learner ranks


@pytest.mark.integration
def test_adapter_only_sync_on_a_llama_the_engine_generates_with_the_learners_adapter(ray_client,
                                                                                     tiny_llama_dir,
                                                                                     rank_pool):
    """learner.lora on a model vLLM takes adapters for: each sync ships the adapter alone, the engine
    generates and scores with it, and its log-probs equal the learner's (the probe) after an update that moved
    them; the same adapter loaded again changes nothing. The engine's base weights are never touched."""
    from actors.engines import SamplingSettings
    from actors.rollout import RolloutActor
    from learner.cluster import start_actor
    cfg = small_config(learner={"lora": {"rank": 8, "sync": "adapter"}},
                       ppo={"minibatch_size": 8, "epochs": 2, "lr": 3e-2})
    engine = start_actor(RolloutActor, "rollout", 0, cfg.cluster.rollout, None, 0,
                         RolloutSpec(tiny_llama_dir, EngineSpec("vllm", 0, 32, 64, "float32", 0,
                                                                lora_rank=cfg.engine_lora_rank)), tag="llama")
    try:
        assert ray.get(engine.takes_adapters.remote())
        group = rank_pool.group(cfg, tiny_llama_dir, tag="lora")
        sequences, prompt_lengths = probe_set()
        before = ray.get(engine.probe.remote(sequences, prompt_lengths))
        assert max(abs(a - b) for g, e in zip(before, group.probe(sequences, prompt_lengths))
                   for a, b in zip(g, e)) < 1e-4
        full = ray.get(group.policy_weights(adapter=False))
        chunks = [engine.generate.remote([[i % 20 + 1] for i in range(8)], list(range(8)), list(range(8)),
                                         SamplingSettings(1.0, 1.0, 9), 22)]
        scores = [ray.put(torch.linspace(0, 1, 8))]
        # the base model as the reference
        result = train(group, chunks, None, scores, kl_coef=0.05, iteration=1)
        # the batch came from the base policy
        assert result.kl["response_mean"] == pytest.approx(0.0, abs=1e-6)
        adapter = ray.get(group.policy_weights(adapter=True))
        # rank 8 on layers 64 wide: a fifth of this tiny model (SmolLM2-135M, all-linear at rank 16: 3.6%)
        assert adapter.adapter_config["r"] == 8 and adapter.nbytes < full.nbytes / 4
        assert all("lora_A" in name or "lora_B" in name for name in adapter.tensors())
        for _ in range(2):  # a restarted engine's re-sync loads the same version again
            ray.get(engine.update_weights.remote(adapter, 1, 0.05))
            after = ray.get(engine.probe.remote(sequences, prompt_lengths))
            learner = group.probe(sequences, prompt_lengths)
            assert max(abs(a - b) for g, e in zip(after, learner) for a, b in zip(g, e)) < 1e-4
            assert max(abs(a - b) for g, e in zip(after, before) for a, b in zip(g, e)) > 1e-3
        chunk = ray.get(engine.generate.remote([[3], [5]], [0, 1], [7, 8], SamplingSettings(1.0, 1.0, 9), 22))
        assert chunk.policy_version.tolist() == [1, 1]
    finally:
        kill(engine)


@pytest.mark.integration
@pytest.mark.parametrize("stage", [2, 3])
def test_lora_on_two_zero_ranks_matches_one_rank(rank_pool, tiny_model_dir, stage):
    """Only the adapters train, on every ZeRO stage: two ranks (ZeRO-2 or ZeRO-3, which partitions the frozen
    base weights too) take the step one rank takes, and the base model scored as the reference is the same."""
    batch = _fixed_batch(16, 6, seed=0)
    chunks = [ray.put(batch[:8]), ray.put(batch[8:])]
    scores = [ray.put(torch.linspace(0, 1, 8)), ray.put(torch.linspace(1, 0, 8))]
    results = {}
    for world_size, zero_stage in ((1, 0), (2, stage)):
        cfg = small_config(ppo={"minibatch_size": 16, "epochs": 1, "lr": 1e-2},
                           learner={"world_size": world_size, "zero_stage": zero_stage, "lora": {"rank": 8}},
                           rollout={"batch_size": 16, "chunk_size": 8, "max_new_tokens": 6})
        group = rank_pool.group(cfg, tiny_model_dir, tag="lora-zero")
        first = train(group, chunks, None, scores, kl_coef=0.05, iteration=1)
        # after a step: a KL, a moved policy
        second = train(group, chunks, None, scores, kl_coef=0.05, iteration=2)
        results[world_size] = (first.kl["response_mean"], second.kl["response_mean"],
                               sum(r.ppo["loss"] for r in second.ranks) / len(second.ranks))
    assert results[1][0] == pytest.approx(0.0, abs=1e-6) and abs(results[1][1]) > 1e-4
    assert results[2] == pytest.approx(results[1], rel=1e-4, abs=1e-6)


def step_of(group, chunks, refs, scores, iteration: int = 1):
    result = train(group, chunks, refs, scores, kl_coef=0.05, iteration=iteration)
    weights = ray.get(group.policy_weights()).tensors()
    # the gradient's norm before clipping, each step: what the micro-batches accumulated
    losses = {k: sum(r.ppo[k] for r in result.ranks) / len(result.ranks)
              for k in ("loss", "policy_loss", "value_loss", "grad_norm")}
    return result, losses, weights


@pytest.mark.integration
def test_packed_training_equals_padded_training_and_two_zero3_ranks_equal_one(rank_pool, tiny_model_dir):
    """One PPO update (GAE, 2 epochs of one minibatch: the same rows a step on one rank or two) on ragged
    rows: padded, packed with a budget that makes
    several micro-batches per step, and packed over two ZeRO-3 ranks whose micro-batch counts differ (fillers)
    give the same KL books and losses (1e-5 relative), the same gradient norms and the same weights after the
    update (1e-4 relative). The same for one optimizer step per batch (1 epoch of one minibatch), whose own
    forward gives the old log-probs: packed, its micro-batches' graphs all go into the one backward, on one
    rank and on two ZeRO-2 ranks."""
    from services.experience import plan_micro_batches, sequence_lengths
    from services.models import load_causal_lm
    from tests.test_packing import ragged_batch

    batch = ragged_batch(16, seed=5)
    # at a budget of 12 tokens the two chunks make 4 and 6 micro-batches: on two ranks the first takes 2
    # fillers
    assert [len(plan_micro_batches(sequence_lengths(c), 12)) for c in (batch[:8], batch[8:])] == [4, 6]
    chunks = [ray.put(batch[:8]), ray.put(batch[8:])]
    refs = [ray.put(-3.0 * batch[:8].response_mask), ray.put(-3.0 * batch[8:].response_mask)]
    scores = [ray.put(torch.linspace(0, 1, 8)), ray.put(torch.linspace(1, 0, 8))]
    initial = load_causal_lm(tiny_model_dir).state_dict()
    for epochs, layouts in ((2, (("padded", 1, 0, None), ("packed", 1, 0, 12), ("packed-zero3", 2, 3, 12))),
                            (1, (("padded", 1, 0, None), ("packed", 1, 0, 12), ("packed-zero2", 2, 2, 12)))):
        runs = {}
        for name, world_size, zero_stage, budget in layouts:
            cfg = small_config(ppo={"minibatch_size": 16, "epochs": epochs, "lr": 1e-3},
                               learner={"world_size": world_size, "zero_stage": zero_stage,
                                        "max_tokens_per_microbatch": budget},
                               rollout={"batch_size": 16, "chunk_size": 8, "max_new_tokens": 7})
            group = rank_pool.group(cfg, tiny_model_dir, tag="packing")
            assert ray.get(group.ranks[0].__ray_call__.remote(lambda rank: rank.single_step)) == (epochs == 1)
            runs[name] = step_of(group, chunks, refs, scores)
        padded_result, padded_losses, padded_weights = runs.pop("padded")
        assert padded_result.kl["response_mean"] != 0.0
        # it moved
        assert max(float((padded_weights[k] - initial[k]).abs().max()) for k in padded_weights) > 1e-3
        for name, (result, losses, weights) in runs.items():
            assert result.kl["response_mean"] == \
                pytest.approx(padded_result.kl["response_mean"], rel=1e-5), name
            for key, value in padded_losses.items():
                assert losses[key] == pytest.approx(value, rel=1e-5, abs=1e-7), (epochs, name, key)
            # Adam moves a weight by about lr whatever its gradient's size: near-zero gradients turn fp32
            # rounding into differences of a fraction of lr, so the weights are compared with the update, the
            # gradients above
            for key, tensor in padded_weights.items():
                diff, moved = float((weights[key] - tensor).abs().max()), \
                    float((tensor - initial[key]).abs().max())
                assert diff <= 1e-2 * max(moved, 1e-6), (epochs, name, key, diff, moved)
