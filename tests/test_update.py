"""The update (``learner.update``) as one function over a training engine: driven here by the plain-torch
engine (``learner.engine.TorchEngine``: one process, the real model and optimizer, no Ray or DeepSpeed), and
the step it takes equal to the one DeepSpeed's engine takes on the same rows."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT


def config(**ppo):
    from services.config import load_config

    return load_config(None, {"rollout": {"batch_size": 16, "chunk_size": 8, "samples_per_prompt": 2,
                                          "max_new_tokens": 6},
                              "ppo": {"advantage": "grpo", "minibatch_size": 8, "epochs": 2, "lr": 3e-3,
                                      **ppo}})


def sampled_batch(engine, n: int = 16, seed: int = 0):
    """``n`` responses in groups of 2 whose engine log-probs are the policy's own, scored 1 where the
    response's first token is even, 0 elsewhere, with the initial policy as the reference (``collect_chunk``'s
    fields)."""
    from learner.update import RankScoring, collect_chunk
    from services.experience import make_batch

    g = torch.Generator().manual_seed(seed)
    prompts = [[1 + i // 2] for i in range(n)]
    responses = [torch.randint(1, 20, (int(k),), generator=g).tolist()
                 for k in torch.randint(2, 7, (n,), generator=g)]
    batch = make_batch(prompts, responses, [[0.0] * len(r) for r in responses], [0] * n, list(range(n)), 0, 0,
                       0.0, 6, group_index=[i // 2 for i in range(n)])
    batch.rollout_logprobs = engine.forward(batch, grad=False)[0] * batch.action_mask
    scores = torch.tensor([float(r[0] % 2 == 0) for r in responses])
    collect_chunk(engine, RankScoring(engine, None, None), batch, 0, False, scores,
                  batch.rollout_logprobs.clone(), None)
    return batch


def better_and_worse(engine, batch, before):
    """(how far the policy's log-likelihood moved on each response since ``before``, the better and the worse
    responses of the groups whose two scores differ)."""
    moved = engine.forward(batch, grad=False)[0].mul(batch.action_mask).sum(-1) - before
    pair_scores = batch.scores.reshape(-1, 2)
    split = (pair_scores[:, 0] != pair_scores[:, 1]).repeat_interleave(2)
    return moved, split & (batch.scores == 1), split & (batch.scores == 0)


def test_the_update_moves_the_policy_toward_the_better_responses_of_each_group(tiny_model_dir):
    from learner.engine import TorchEngine
    from learner.plan import RankSpec
    from learner.update import update

    cfg = config()
    engine = TorchEngine.build(tiny_model_dir, RankSpec.of(cfg, tiny_model_dir))
    batch = sampled_batch(engine)
    before = batch.old_logprobs.sum(-1)
    spec = RankSpec.of(cfg, tiny_model_dir)
    result = update(engine, spec.algorithm, spec.update, batch, 0.05, 1)
    assert result.ppo["optimizer_steps"] == 2 * 2  # epochs x minibatches of 8
    assert result.sums["trained_episodes"] == 16 and result.lr == pytest.approx(3e-3)
    # the policy's log-likelihood moves up on the better response of each group, relative to the worse one
    moved, better, worse = better_and_worse(engine, batch, before)
    assert better.sum() >= 3 and (moved[better].mean() - moved[worse].mean()) > 1.0, (moved, batch.scores)
    # the KL the controller reads is the reward's penalty: the reference is the policy that sampled, so 0
    assert result.sums["penalty_sum"] == pytest.approx(0.0, abs=1e-5)
    # each trained episode's row of episodes.jsonl: its prompt, score, KL, length
    from learner.records import UpdateResult

    episodes = UpdateResult.combine([result]).episodes
    assert len(episodes) == 16 and [e["prompt_index"] for e in episodes] == batch.prompt_index.tolist()
    assert [e["score"] for e in episodes] == batch.scores.tolist()
    assert [e["length"] for e in episodes] == batch.action_mask.sum(-1).tolist()
    assert sum(e["kl"] for e in episodes) == pytest.approx(result.sums["penalty_sum"], abs=1e-9)


DEEPSPEED_STEP = """
import os, socket, torch
from learner.engine import DeepSpeedEngine, TorchEngine
from learner.plan import RankSpec
from learner.update import update
from tests.test_update import config, sampled_batch

with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
spec = RankSpec.of(config(), MODEL)
engines = {"deepspeed": DeepSpeedEngine.build(MODEL, spec, 0, 1, torch.device("cpu")),
           "torch": TorchEngine.build(MODEL, spec)}
results = {}
for name, engine in engines.items():
    results[name] = update(engine, spec.algorithm, spec.update, sampled_batch(engine), 0.05, 1)
gap = max(float((a - b).abs().max()) for a, b in zip(engines["deepspeed"].policy.parameters(),
                                                      engines["torch"].policy.parameters(), strict=True))
print("parameter gap", gap)
print("loss", results["deepspeed"].ppo["loss"], results["torch"].ppo["loss"])
print("grad_norm", results["deepspeed"].ppo["grad_norm"], results["torch"].ppo["grad_norm"])
"""


def test_deepspeed_and_the_plain_torch_engine_take_the_same_steps(tiny_model_dir):
    """ZeRO-0 in fp32 on one rank (gloo, in a process of its own: DeepSpeed's process group stays for the
    process)."""
    proc = subprocess.run([sys.executable, "-c", DEEPSPEED_STEP.replace("MODEL", repr(tiny_model_dir))],
                          cwd=ROOT, check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines()
                 if line.startswith(("parameter", "loss", "grad_norm")))
    assert float(lines["parameter"].split()[-1]) < 1e-6, proc.stdout
    for name in ("loss", "grad_norm"):
        deepspeed, plain = (float(x) for x in lines[name].split())
        assert deepspeed == pytest.approx(plain, rel=1e-6), proc.stdout
