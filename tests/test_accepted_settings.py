"""Every setting the config accepts computes what it says, or is refused with the reason (issue 11,
sections 2, 3 and 5): top-p, the reward model's label, randomwalks on every seed, batch vs horizon, chunks
from a restarted engine, and PPO statistics exact over ranks. Pure functions, the config and transformers
models built locally, plus one short job (integration). The Ray-level checks of the last two are in
tests/test_collectives.py and tests/test_pipeline.py."""

from __future__ import annotations

import json
import math
import warnings
from collections import deque
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from actors.specs import RewardSpec
from services.config import load_config

# ---------------------------------------------------------------------------------- section 2: top-p


def test_top_p_below_one_is_refused_with_the_reason():
    with pytest.raises(ValidationError, match=r"rollout.top_p=0.9 is refused: the learner's and the "
                                              r"reference's log-probs are taken on the full softmax.*did not "
                                              r"produce the samples"):
        load_config(None, {"rollout": {"top_p": 0.9}})
    assert load_config(None, {"rollout": {"top_p": 1.0}}).rollout.top_p == 1.0


# ------------------------------------------------------------------------ section 5: batch vs horizon


def test_batch_larger_than_the_horizon_is_refused_naming_both_fields():
    with pytest.raises(ValidationError, match=r"rollout.batch_size=128 exceeds kl.horizon=100"):
        load_config(None, {"kl": {"horizon": 100}})
    assert load_config(None, {"kl": {"horizon": 128}}).kl.horizon == 128  # equal is what the controller takes
    # a fixed controller never divides by the horizon
    load_config(None, {"kl": {"horizon": 100, "controller": "fixed", "target": None}})


def test_reference_threads_are_refused_for_the_vllm_backend():
    with pytest.raises(ValidationError, match=r"reference.torch_threads=2 sets the threads of backend 'hf'; "
                                              r"backend 'vllm' runs vLLM's CPU worker"):
        load_config(None, {"reference": {"backend": "vllm", "torch_threads": 2}})
    assert load_config(None, {"reference": {"torch_threads": 2}}).reference.torch_threads == 2


def test_the_committed_configs_still_validate():
    root = Path(__file__).resolve().parents[1]
    paths = (sorted((root / "deploy" / "configs").glob("*.yaml"))
             + sorted((root / "tests" / "configs").glob("*.yaml")))
    assert paths
    for path in paths:
        load_config(path)


# ------------------------------------------------------------------- section 3: reward-model labels


def _classifier_dir(path, num_labels: int, id2label: dict[int, str] | None = None) -> str:
    """A tiny GPT-2 sequence classifier with random init and its char tokenizer, saved to ``path``."""
    from transformers import GPT2Config, GPT2ForSequenceClassification

    from services.models import build_char_tokenizer
    from services.tasks import get_task

    tokenizer = build_char_tokenizer(get_task("randomwalks").vocabulary)
    torch.manual_seed(0)
    extra = {"id2label": id2label, "label2id": {v: k for k, v in id2label.items()}} if id2label else {}
    config = GPT2Config(vocab_size=len(tokenizer), n_layer=1, n_embd=16, n_head=2, n_positions=32,
                        num_labels=num_labels, pad_token_id=tokenizer.pad_token_id, **extra)
    GPT2ForSequenceClassification(config).eval().save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


SST2 = {0: "NEGATIVE", 1: "POSITIVE"}


def test_label_index_by_name_or_index():
    from services.reward_models import reward_label_index

    assert reward_label_index("POSITIVE", SST2, "m") == 1
    assert reward_label_index(1, SST2, "m") == 1
    assert reward_label_index("1", SST2, "m") == 1  # a CLI value arrives as text
    assert reward_label_index(0, SST2, "m") == 0
    assert reward_label_index(None, {0: "LABEL_0"}, "m") == 0  # one label: nothing to choose
    assert reward_label_index("0", {"0": "LABEL_0"}, "m") == 0  # config.json keys are text
    with pytest.raises(ValueError, match=r"m has 2 labels \(0='NEGATIVE', 1='POSITIVE'\): set reward.label"):
        reward_label_index(None, SST2, "m")
    for bad in ("positive", 2, -1, "LABEL_1"):
        with pytest.raises(ValueError, match=r"reward.label=.* is not a label of m; its labels are "
                                             r"0='NEGATIVE', 1='POSITIVE'"):
            reward_label_index(bad, SST2, "m")


def test_reward_label_config_field():
    assert load_config(None, {"reward": {"kind": "model", "model_path": "/m",
                                         "label": "POSITIVE"}}).reward.label == "POSITIVE"
    assert load_config(None, {"reward": {"kind": "model", "model_path": "/m", "label": 1}}).reward.label == 1
    with pytest.raises(ValidationError, match=r"reward.label='POSITIVE' is set but reward.kind='function'"):
        load_config(None, {"reward": {"label": "POSITIVE"}})


def test_two_label_classifier_scores_the_chosen_label(tmp_path):
    """The actor reads the logit of reward.label; without it a two-label model is refused, by the driver's
    check (config.json of a local dir) and by the actor itself."""
    from actors.reward import RewardActor, check_reward_label

    model_dir = _classifier_dir(tmp_path / "sst2", 2, SST2)
    assert check_reward_label(model_dir, "POSITIVE") == 1
    # the actor checks paths the driver lacks
    assert check_reward_label(str(tmp_path / "not-here"), None) is None
    with pytest.raises(ValueError, match=r"reward model .*sst2 \(reward.model_path\) has 2 labels "
                                         r"\(0='NEGATIVE', 1='POSITIVE'\)"):
        check_reward_label(model_dir, None)
    with pytest.raises(ValueError, match=r"has 2 labels \(0='NEGATIVE', 1='POSITIVE'\)"):
        RewardActor(0, RewardSpec("randomwalks", {}, model_dir, kind="model", model_path=model_dir))

    prompts, completions = ["b", "ki", "u"], ["cda", "ja", "tsr"]
    from transformers import AutoModelForSequenceClassification

    from services.models import load_tokenizer

    model = AutoModelForSequenceClassification.from_pretrained(model_dir).eval()
    tokenizer = load_tokenizer(model_dir)
    with torch.no_grad():
        expected = torch.stack([model(**tokenizer(p + c, return_tensors="pt")).logits[0]
                                for p, c in zip(prompts, completions, strict=True)])
    for label, column in (("POSITIVE", 1), ("NEGATIVE", 0), (1, 1), ("0", 0)):
        actor = RewardActor(0, RewardSpec("randomwalks", {}, model_dir, kind="model", model_path=model_dir,
                                          label=label))
        scores = actor.scorer.reward_model(prompts, completions)
        assert scores == pytest.approx(expected[:, column].tolist(), abs=1e-5), label
    assert not torch.allclose(expected[:, 0], expected[:, 1])  # the two columns differ: the test can tell


def test_missing_label_fails_the_job_before_any_actor(cache_dir, tmp_path):
    from tests.conftest import run_cli

    model_dir = _classifier_dir(tmp_path / "sst2", 2, SST2)
    runs = tmp_path / "runs"
    runs.mkdir()
    proc = run_cli(["--run.output_dir", str(runs), "--model.cache_dir", cache_dir, "--run.seed", "1",
                    "--model.sft_steps", "60", "--model.sft_batch_size", "50", "--reward.kind", "model",
                    "--reward.model_path", model_dir, "--cluster.address", "127.0.0.1:1"])
    assert proc.returncode == 1
    assert "has 2 labels (0='NEGATIVE', 1='POSITIVE'): set reward.label" in proc.stderr
    assert "actors ready" not in proc.stdout
    assert not any(runs.iterdir())  # no run directory was created


def test_single_label_model_needs_no_label(tmp_path):
    from actors.reward import RewardActor, check_reward_label

    model_dir = _classifier_dir(tmp_path / "one", 1)
    assert check_reward_label(model_dir, None) == 0
    actor = RewardActor(0, RewardSpec("randomwalks", {}, model_dir, kind="model", model_path=model_dir))
    assert actor.scorer.reward_model.label_index == 0


# ------------------------------------------------------------------ section 5: randomwalks on any seed


def _shortest_walk(adjacency, start: int) -> str | None:
    """A shortest path start -> 'a' as letters (BFS written independently of the task's), or None."""
    from services.walk_graph import GOAL, LETTERS

    parent, queue = {start: None}, deque([start])
    while queue:
        node = queue.popleft()
        if node == GOAL:
            path = []
            while node is not None:
                path.append(LETTERS[node])
                node = parent[node]
            return "".join(reversed(path))
        for nxt in range(len(adjacency)):
            if adjacency[node][nxt] and nxt not in parent:
                parent[nxt] = node
                queue.append(nxt)
    return None


def test_randomwalks_is_defined_on_every_seed():
    """200 seeds: prompts are non-empty, only starts that can reach 'a' in fewer than MAX_LENGTH nodes,
    the left-out ones are named in a warning, and optimality is finite in [0, 1] for every sample the
    reward can see (a shortest walk scores 1)."""
    from services.tasks.randomwalks import LETTERS, MAX_LENGTH, RandomWalksTask

    seeds_with_left_out = 0
    for seed in range(200):
        task = RandomWalksTask(seed=seed)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            prompts = task.prompts()
        assert prompts, f"seed {seed}: no prompts"
        adjacency = task.graph.adjacency.tolist()
        for start in prompts:
            walk = _shortest_walk(adjacency, LETTERS.index(start))
            assert walk is not None and len(walk) < MAX_LENGTH, (seed, start)
            assert task.reward([start], [walk[1:]]) == [1.0], (seed, start, walk)
        left_out = sorted(set(LETTERS[1:]) - set(prompts))
        for start in left_out:
            walk = _shortest_walk(adjacency, LETTERS.index(start))
            assert walk is None or len(walk) >= MAX_LENGTH, (seed, start)
        if left_out:
            seeds_with_left_out += 1
            assert len(caught) == 1 and f"{len(left_out)} of 20 start nodes ({''.join(left_out)})" in \
                str(caught[0].message), (seed, [str(w.message) for w in caught])
        else:
            assert not caught
        # every start letter (prompts or not), the goal, junk and the SFT walks: finite, and in [0, 1] except
        # from the goal itself (trlX's quirk reads another start's best there; no prompt starts at 'a')
        samples = [p + c for p in LETTERS for c in ("", "a", "bcdefghij", "zz")] + ["", "|", "?a"] + \
            task.sft_corpus()[:100]
        scores = task.reward(samples, [""] * len(samples))
        assert all(math.isfinite(s) for s in scores), seed
        assert all(0.0 <= s <= 1.0 for x, s in zip(samples, scores, strict=True)
                   if not x.startswith("a")), seed
        assert math.isfinite(task.evaluate(prompts, [""] * len(prompts))["optimality"])
    assert seeds_with_left_out > 0  # the 200 seeds do cover the case


@pytest.mark.integration
def test_job_on_a_seed_with_left_out_starts_trains_and_logs_exact_ppo_stats(ray_head, cache_dir, tmp_path):
    """task.seed=3 leaves 18 of 20 starts out (it used to die at the evaluation before training); the job
    evaluates, trains, and logs every ppo_* statistic, explained variance included."""
    from tests.conftest import ROOT, run_job

    proc = run_job(["--config", str(ROOT / "tests" / "configs" / "small.yaml"), "--task.seed", "3",
                    "--cluster.address", ray_head.address, "--model.cache_dir", cache_dir,
                    "--run.output_dir", str(tmp_path), "--run.name", "seed3"])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "randomwalks task.seed=3: 18 of 20 start nodes" in proc.stderr
    summary = json.loads((tmp_path / "seed3" / "summary.json").read_text())
    assert (math.isfinite(summary["eval_start"]["optimality"])
            and math.isfinite(summary["eval_final"]["optimality"]))
    records = [json.loads(line)
               for line in Path(tmp_path / "seed3" / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 2
    for record in records:
        for key in ("loss", "policy_loss", "value_loss", "entropy", "clipfrac", "approx_kl", "vf_clipfrac",
                    "explained_variance"):
            assert math.isfinite(record[f"ppo_{key}"]), key
        assert record["ppo_optimizer_steps"] == 4 * 32 // 16


def test_randomwalks_default_seed_is_trlx_graph():
    """Seeds whose first graph has a task keep trlX's draws: the default one keeps all 20 starts."""
    from services.tasks.randomwalks import RandomWalksTask

    task = RandomWalksTask()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert task.prompts() == list("bcdefghijklmnopqrstu")


# ------------------------------------------------------------------ section 5: stale chunks


def test_admission_refuses_another_version_or_beta():
    from learner.records import Admission
    from services.experience import concat_batches, make_batch

    def chunk(version, beta):
        return make_batch([[1], [2]], [[3], [4, 5]], [[0.0], [0.0, 0.0]], [0, 0], [0, 1], 22, version, beta,
                          4)

    def stale_rows(batch, version, beta):
        return Admission(version, beta).refuses(batch.policy_version, batch.kl_coef)

    current = chunk(3, 0.05)
    assert not stale_rows(current, 3, 0.05).any()
    # the stamp is float32: a beta that rounds to it is the same beta
    assert not stale_rows(current, 3, float(torch.tensor(0.05, dtype=torch.float32))).any()
    assert stale_rows(chunk(0, 0.0), 3, 0.05).all()  # a restarted engine: version 0, beta 0
    assert stale_rows(chunk(3, 0.0), 3, 0.05).all()  # right weights, beta not yet set
    assert stale_rows(chunk(2, 0.05), 3, 0.05).all()
    mixed = concat_batches([current, chunk(0, 0.0)])
    assert stale_rows(mixed, 3, 0.05).tolist() == [False, False, True, True]


# ------------------------------------------------------------------ section 5: PPO statistics


def _moments(values, returns, mask):
    from learner.ppo import explained_variance_moments

    return explained_variance_moments(values, returns, mask).tolist()


def test_explained_variance_from_moments_is_exact_over_parts():
    from learner.ppo import explained_variance_from_moments
    from tests.batch_statistics import explained_variance

    g = torch.Generator().manual_seed(0)
    returns, values = torch.randn(10, 7, generator=g), torch.randn(10, 7, generator=g)
    mask = (torch.arange(7)[None, :] < torch.tensor([7, 3, 0, 5, 1, 7, 2, 6, 4, 7])[:, None]).float()
    whole = explained_variance(values, returns, mask)
    parts = torch.tensor(_moments(values[:3], returns[:3], mask[:3]), dtype=torch.float64) + \
        torch.tensor(_moments(values[3:], returns[3:], mask[3:]), dtype=torch.float64)
    assert explained_variance_from_moments(parts) == pytest.approx(whole, rel=1e-12)
    # against the textbook formula on the masked entries
    r, v = returns[mask.bool()].double(), values[mask.bool()].double()
    assert whole == pytest.approx(float(1 - (r - v).var() / r.var()), rel=1e-12)
    assert explained_variance(returns, returns, mask) == pytest.approx(1.0)
    assert math.isnan(explained_variance(values, torch.full_like(returns, 0.3), mask))  # no variance


def test_ppo_stats_from_sums_weight_tokens_and_steps():
    """Two ranks with unequal tokens: token statistics weigh every token once (not each rank's mean), and
    losses are the mean over steps of the global loss (the ranks' shares averaged)."""
    from learner.ppo import ppo_stats_from_sums

    # rank 0: 30 tokens over two steps with entropy 1.0; rank 1: 10 tokens with entropy 3.0
    rank0 = {"stats": {"entropy": [30.0, 30.0], "loss": [2.0 + 4.0, 2.0]}, "optimizer_steps": 2,
             "explained_variance_moments": [3.0, 1.0, 2.0, 0.0, 1.0]}
    rank1 = {"stats": {"entropy": [30.0, 10.0], "loss": [0.0 + 2.0, 2.0]}, "optimizer_steps": 2,
             "explained_variance_moments": [2.0, 2.0, 3.0, 1.0, 1.0]}
    stats = ppo_stats_from_sums([rank0, rank1])
    assert stats["entropy"] == pytest.approx(60.0 / 40.0)  # the per-rank-mean average would say 2.0
    assert stats["loss"] == pytest.approx(((2.0 + 0.0) / 2 + (4.0 + 2.0) / 2) / 2)
    assert stats["optimizer_steps"] == 2
    # moments: n=5, sum R=3, sum R^2=5, sum e=1, sum e^2=2
    var_r, var_e = (5 - 9 / 5) / 4, (2 - 1 / 5) / 4
    assert stats["explained_variance"] == pytest.approx(1 - var_e / var_r)
    empty = {"stats": {"entropy": [0.0, 0.0]}, "optimizer_steps": 1, "explained_variance_moments": [0.0] * 5}
    assert math.isnan(ppo_stats_from_sums([empty])["entropy"])
    with pytest.raises(ValueError):
        ppo_stats_from_sums([])
