"""The run's storage: checkpoints sealed only when every rank's shard is there, resumable on another number
of learner ranks, resumable as the config grows, and a Hugging Face export that transformers and vLLM load
with the learner's log-probs. Only local paths and file:// URIs can be tested here (no object store)."""

from __future__ import annotations

import json

import pytest
import torch

from actors.specs import EngineSpec, RolloutSpec
from learner import checkpoint
from services.storage import RunStorage
from tests.conftest import train

ray = pytest.importorskip("ray")


# ==================================================================== storage and manifests (no Ray)


def test_storage_reads_and_writes_local_paths_and_file_uris(tmp_path):
    for url in (str(tmp_path / "plain"), f"file://{tmp_path}/uri"):
        run = RunStorage(url).child("run")
        run.write_text("a\n", "metrics.jsonl")
        run.append_text("b\n", "metrics.jsonl")
        run.write_text("x", "samples", "iteration-0001.md")
        assert run.read_text("metrics.jsonl") == "a\nb\n"
        assert run.files() == ["metrics.jsonl", "samples/iteration-0001.md"]
        assert run.size("metrics.jsonl") == 4 and run.size("missing") is None
        assert run.display("metrics.jsonl") == \
            str(tmp_path / url.rsplit("/", 1)[-1] / "run" / "metrics.jsonl")
        run.check_writable("driver: ")
        probe = run.write_probe()
        RunStorage(run.url).read_probe(probe, "node x: ")
        run.remove(probe)
        with pytest.raises(Exception, match="node x: cannot see"):
            run.read_probe(probe, "node x: ")


def test_curves_draw_on_their_thread_once_per_records_and_raise_a_drawings_error(tmp_path):
    from learner.rundir import Curves

    run = RunStorage(str(tmp_path)).child("run")
    records = [{"iteration": i, "reward_mean": 0.1 * i, "score_mean": 0.2 * i, "kl_response_mean": 1.0,
                "kl_coef": 0.05} for i in (1, 2)]
    curves = Curves(run, 6.0, {"optimality": 0.4})
    curves.draw(records)
    curves.draw(records)  # the same records: nothing more to draw
    curves.wait()
    assert len(curves.drawings) == 1 and run.size("curves.png") > 0

    broken = Curves(run, 6.0, None)
    # no reward_mean: the drawing fails on its thread, the error comes at wait()
    broken.draw([{"iteration": 1}])
    with pytest.raises(KeyError, match="reward_mean"):
        broken.wait()


def _sealed(tmp_path, shards):
    run = RunStorage(f"file://{tmp_path}").child("run")
    ckpt = checkpoint.begin(run, 3)
    reported = []
    for name, data in shards.items():
        ckpt.write_bytes(data, name)
        import hashlib

        reported.append({name: {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}})
    return run, ckpt, reported


def test_commit_refuses_a_missing_or_different_shard_naming_it(tmp_path):
    state = {"iteration": 3, "config": {}}
    run, ckpt, reported = _sealed(tmp_path, {"learner/a.pt": b"aaaa", "learner/b.pt": b"bb"})
    (tmp_path / "run" / "checkpoints" / "iter-000003" / "learner" / "b.pt").unlink()
    with pytest.raises(checkpoint.CheckpointError, match=r"rank 1's file .*learner/b\.pt is missing"):
        checkpoint.commit(run, ckpt, reported, state, keep=2)
    assert not run.exists("checkpoints", "latest") and not ckpt.exists("manifest.json")
    with pytest.raises(checkpoint.CheckpointError, match="manifest.json is missing"):
        checkpoint.verify(ckpt)  # never resumable without its seal

    ckpt.write_bytes(b"b", "learner/b.pt")  # a shard of another size than the rank reported
    with pytest.raises(checkpoint.CheckpointError,
                       match=r"learner/b\.pt has 1 bytes in the storage, the rank wrote 2"):
        checkpoint.commit(run, ckpt, reported, state, keep=2)

    ckpt.write_bytes(b"bb", "learner/b.pt")
    checkpoint.commit(run, ckpt, reported, state, keep=2)
    assert run.read_text("checkpoints", "latest").strip() == "iter-000003"
    assert checkpoint.verify(checkpoint.resolve(run, "latest")) == state
    manifest = checkpoint.read_manifest(ckpt)
    assert sorted(manifest) == ["driver.json", "learner/a.pt", "learner/b.pt"]


def test_old_checkpoint_missing_a_new_key_at_its_default_is_compatible(tmp_path):
    from services.config import load_config

    cfg = load_config(None, {})
    saved = cfg.model_dump(mode="json")
    del saved["ppo"]["max_grad_norm"]  # a field the old version did not have
    checkpoint.check_compatible(saved, cfg, RunStorage(tmp_path))
    changed = load_config(None, {"ppo": {"max_grad_norm": cfg.ppo.max_grad_norm * 2}})
    with pytest.raises(checkpoint.CheckpointError, match=r"ppo.max_grad_norm: None -> "):
        checkpoint.check_compatible(saved, changed, RunStorage(tmp_path))


# ==================================================================== learner groups on a real Ray


def _group_config(world_size: int, zero_stage: int, dtype: str = "float32"):
    from services.config import load_config

    return load_config(None, {
        "rollout": {"batch_size": 16, "chunk_size": 8, "max_new_tokens": 6},
        "ppo": {"minibatch_size": 16, "epochs": 1, "lr": 1e-3},
        "learner": {"world_size": world_size, "zero_stage": zero_stage, "dtype": dtype},
        "cluster": {"learner": {"num_cpus": 0.1}, "rollout": {"num_cpus": 0.1}},
    })


def _batch():
    """Two chunks of 8 with different response lengths; fixed reference log-probs and scores."""
    from services.experience import make_batch

    g = torch.Generator().manual_seed(0)
    chunks, refs, scores = [], [], []
    for c in range(2):
        prompts = [[int(x)] for x in torch.randint(1, 21, (8,), generator=g)]
        responses = [torch.randint(0, 21, (6,), generator=g).tolist() for _ in range(8)]
        chunks.append(ray.put(make_batch(prompts, responses, [[0.0] * 6] * 8, [1] * 8, list(range(8)), 22, 0,
                                         0.05, 6)))
        refs.append(ray.put(torch.full((8, 6), -3.0)))
        scores.append(ray.put(torch.linspace(c, 1 - c, 8)))
    return chunks, refs, scores


def _weights(group) -> dict:
    return ray.get(group.policy_weights()).tensors()


def _probe_set():
    sequences = [[p] + [(3 * i + 2 * k) % 21 for k in range(6)] for i, p in enumerate((1, 2, 7, 12))]
    return sequences, [1] * len(sequences)


@pytest.mark.integration
@pytest.mark.parametrize(("stage", "dtype"),
                         [(0, "float32"), (2, "float32"), (3, "float32"), (0, "bfloat16")])
def test_checkpoint_of_two_ranks_resumes_on_one(rank_pool, tiny_model_dir, tmp_path, stage, dtype):
    """2 ranks train, checkpoint to a file:// storage; 1 rank resumes with the same weights, and one more
    update on the same batch gives the weights the 2-rank group reaches."""
    chunks, refs, scores = _batch()
    run = RunStorage(f"file://{tmp_path}").child("run")
    two = rank_pool.group(_group_config(2, stage, dtype), tiny_model_dir, tag="ckpt")
    train(two, chunks, refs, scores, kl_coef=0.05, iteration=1)
    ckpt = checkpoint.begin(run, 1)
    files = two.save(ckpt.url)
    assert bool(files[1]) == (stage > 0), files  # rank 1 wrote its own shard; in ZeRO-0 rank 0 holds all
    checkpoint.commit(run, ckpt, files, {"iteration": 1, "config": {}}, keep=2)
    saved = _weights(two)
    train(two, chunks, refs, scores, kl_coef=0.05, iteration=2)
    expected = _weights(two)

    one = rank_pool.group(_group_config(1, stage, dtype), tiny_model_dir, tag="ckpt")
    ckpt = checkpoint.resolve(run, "latest")
    checkpoint.verify(ckpt)
    one.load(ckpt.url, checkpoint.read_manifest(ckpt), saved_world_size=2)
    resumed = _weights(one)
    for name, tensor in saved.items():
        assert torch.equal(resumed[name], tensor), name
    train(one, chunks, refs, scores, kl_coef=0.05, iteration=2)
    after = _weights(one)
    moved = max(float((expected[n] - saved[n]).abs().max()) for n in saved)
    assert moved > 1e-4  # the update changed the weights, so the comparison below means something
    # bf16 weights: a last-bit difference in the fp32 sum of the two ranks' gradients can flip a rounding
    rtol, atol = (1e-4, 1e-5) if dtype == "float32" else (2 ** -7, 1e-3)
    worst = {n: float((after[n] - t).abs().max()) for n, t in expected.items()}
    print(f"max |1-rank resumed - 2-rank| per tensor after one update: {max(worst.values()):.3g}")
    for name, tensor in expected.items():
        torch.testing.assert_close(after[name], tensor, rtol=rtol, atol=atol, msg=name)


@pytest.mark.integration
def test_resume_refuses_a_corrupt_shard_naming_it(rank_pool, tiny_model_dir, tmp_path):
    run = RunStorage(str(tmp_path)).child("run")
    group = rank_pool.group(_group_config(1, 2), tiny_model_dir, tag="ckpt-corrupt")
    ckpt = checkpoint.begin(run, 1)
    checkpoint.commit(run, ckpt, group.save(ckpt.url), {"iteration": 1, "config": {}}, keep=2)
    manifest = checkpoint.read_manifest(ckpt)
    victim = next(n for n in manifest if n.endswith("optim_states.pt"))
    data = bytearray(ckpt.read_bytes(victim))
    data[-10] ^= 0xFF  # same size, other content: only the sha256 the rank checks can tell
    ckpt.write_bytes(bytes(data), victim)
    checkpoint.verify(ckpt)
    with pytest.raises(checkpoint.CheckpointError, match=f"{ckpt.display(victim)} is corrupt"):
        group.load(ckpt.url, manifest, saved_world_size=1)


@pytest.mark.integration
def test_hf_export_loads_in_transformers_and_vllm_with_the_learners_logprobs(rank_pool,
                                                                             tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from actors.rollout import RolloutActor
    from learner.cluster import start_actor

    cfg = _group_config(2, 3)
    group = rank_pool.group(cfg, tiny_model_dir, tag="export")
    train(group, *_batch(), kl_coef=0.05, iteration=1)  # trained weights, not the initial ones
    export = RunStorage(f"file://{tmp_path}").child("run", "export")
    group.export_hf(export.url)
    sequences, prompt_lengths = _probe_set()
    learner_logprobs = group.probe(sequences, prompt_lengths)
    files = export.files()
    assert "model.safetensors" in files and "config.json" in files and "tokenizer.json" in files, files
    assert AutoTokenizer.from_pretrained(export.path()).vocab_size == \
        AutoTokenizer.from_pretrained(tiny_model_dir).vocab_size

    model = AutoModelForCausalLM.from_pretrained(export.path(), dtype=torch.float32).eval()
    with torch.no_grad():
        for seq, p, expected in zip(sequences, prompt_lengths, learner_logprobs, strict=True):
            logits = model(torch.tensor([seq])).logits[0, p - 1:-1].float()
            got = torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq[p:]).unsqueeze(-1)).squeeze(-1)
            assert max(abs(a - b) for a, b in zip(got.tolist(), expected)) < 1e-4

    engine = start_actor(RolloutActor, "rollout", 0, cfg.cluster.rollout, None, 0,
                         RolloutSpec(export.path(), EngineSpec("vllm", 0, 32, 64, "float32", 0)))
    try:
        vllm_logprobs = ray.get(engine.probe.remote(sequences, prompt_lengths))
    finally:
        ray.kill(engine)
    for got, expected in zip(vllm_logprobs, learner_logprobs, strict=True):
        assert max(abs(a - b) for a, b in zip(got, expected)) < 1e-4


# ==================================================================== a job with its storage as a file:// URI


@pytest.mark.integration
def test_job_on_a_file_uri_without_a_start_evaluation_resumes_on_fewer_ranks_and_exports(ray_head,
                                                                                         cache_dir, tmp_path):
    from tests.conftest import run_job
    from tests.test_reliability import SMALL

    def job(*extra):
        return run_job(["--cluster.address", ray_head.address, "--model.cache_dir", cache_dir,
                        "--run.output_dir", f"file://{tmp_path}", "--run.name", "uri", *SMALL,
                        *extra], timeout_s=600)

    first = job("--run.iterations", "2", "--learner.world_size", "2", "--learner.zero_stage", "2",
                "--no-checkpoint.export_hf", "--no-run.eval_before_training")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "eval before training" not in first.stdout
    run_dir = tmp_path / "uri"
    manifest = json.loads((run_dir / "checkpoints" / "iter-000002" / "manifest.json").read_text())
    assert any("zero_pp_rank_1_" in name for name in manifest)  # rank 1's shard is sealed in
    assert not (run_dir / "export").exists()

    resumed = job("--run.iterations", "3", "--learner.world_size", "1", "--learner.zero_stage", "2",
                  "--run.resume", "latest")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in records] == [1, 2, 3]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "iter-000003"
    for name in ("config.yaml", "config.before-resume.yaml", "summary.json", "curves.png",
                 "samples/iteration-0002.md", "samples/iteration-0003.md", "export/model.safetensors",
                 "export/config.json", "export/tokenizer.json"):
        assert (run_dir / name).is_file(), name
    # run.eval_before_training off in the first job, kept by the resume: no start to compare with
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["eval_start"] == {} and 0 <= summary["eval_final"]["optimality"] <= 1
    assert not (run_dir / "samples" / "iteration-0000.md").exists() and \
        "eval before training" not in resumed.stdout
    assert not any(p.name.startswith(".") for p in run_dir.rglob("*"))  # no temp or probe files left behind
