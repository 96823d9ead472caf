"""What the reward service serves, named in one command (services/reward_service/cli.py): a user's
function (``--function``), a sequence-classification reward model (``--model``) with dynamic batching, and
the options refused at start. The judge (``--judge``) shares the batching and the judge code of
tests/test_judge.py and tests/test_sentiment_task.py."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, GPT2Model

from actors.specs import RewardSpec
from services.reward_service import (
    RewardClient,
    RewardServiceError,
    build_reward,
    main,
    parse_args,
    per_sample,
    serve,
)
from tests.dataset_rewards import letter_distance
from tests.test_reward_model import PAIRS, make_reward_model

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def classifier_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("classifier")
    make_reward_model(path)
    return str(path)


def test_a_function_is_served_per_sample_with_its_rows_fields():
    prompts, completions = ["b", "c", "d"], ["cde", "x", ""]
    fields = [{"answer": "c"}, {"answer": "u"}, {"answer": "a"}]
    with serve(per_sample(letter_distance, "tests.dataset_rewards:letter_distance")) as service:
        client = RewardClient(service.url)
        assert client.score(prompts, completions, fields) == [letter_distance(p, c, **f) for p, c, f in
                                                              zip(prompts, completions, fields, strict=True)]
        with pytest.raises(RewardServiceError) as err:
            client.score(prompts, completions, [{"answer": "c"}, {}, {"answer": "a"}])
        assert err.value.status == 400
        assert err.value.message == ("sample 1: tests.dataset_rewards:letter_distance needs the fields "
                                     "['answer']; this sample lacks ['answer']")
        with pytest.raises(RewardServiceError, match=r"has field\(s\) \['weight'\] it does not take"):
            client.score(["b"], ["c"], [{"answer": "c", "weight": 2}])


@pytest.fixture(scope="module")
def not_classifiers(tmp_path_factory):
    """A causal LM, and a bare transformer whose config names no architecture: neither has a trained head."""
    config = GPT2Config(vocab_size=32, n_layer=1, n_embd=32, n_head=2, n_positions=16)
    causal = tmp_path_factory.mktemp("causal")
    GPT2LMHeadModel(config).save_pretrained(causal)
    bare = tmp_path_factory.mktemp("bare")
    GPT2Model(config).save_pretrained(bare)
    saved = json.loads((bare / "config.json").read_text())
    del saved["architectures"]
    (bare / "config.json").write_text(json.dumps(saved))
    return {"causal": str(causal), "bare": str(bare)}


@pytest.mark.parametrize("argv, message", [
    (["--function", "tests.dataset_rewards:nowhere"],
     "--function='tests.dataset_rewards:nowhere': module 'tests.dataset_rewards' has no attribute 'nowhere'"),
    (["--function", "tests.dataset_rewards:not_a_function"],
     "--function='tests.dataset_rewards:not_a_function' is a int, not a function"),
    (["--function", "tests.dataset_rewards"], "must be given as 'package.module:function'"),
    (["--function", "os.path:join"],
     "cannot be called as os.path:join(prompt=..., completion=..., **fields)"),
    (["--model", "{causal}"], "is a GPT2LMHeadModel, not a sequence classifier"),
    (["--model", "{bare}"], "has no trained classification head (score.weight missing"),
    (["--model", "{classifier}", "--label", "POSITIVE"],
     "reward.label='POSITIVE' is not a label of reward model"),
    (["--model", "{classifier}", "--max-batch-tokens", "0"], "max_batch_tokens must be a positive integer"),
    (["--judge", "{judge_file}"], "reward.judge.template has no {{response}} field"),
    (["--judge", "{missing}"], "config file {missing} does not exist"),
])
def test_what_cannot_be_served_is_refused_at_start(argv, message, not_classifiers, classifier_dir,
                                                   tmp_path, capsys):
    judge_file = tmp_path / "judge.yaml"
    judge_file.write_text("model_path: judge\ntemplate: 'Rate {prompt}'\nunparseable_score: 0\n")
    paths = {**not_classifiers, "classifier": classifier_dir, "judge_file": judge_file,
             "missing": tmp_path / "no.yaml"}
    assert main([a.format(**paths) for a in argv] + ["--port", "0"]) == 2
    assert message.format(**paths) in capsys.readouterr().err


def test_a_job_refuses_a_reward_model_that_is_not_a_classifier_before_any_actor(not_classifiers,
                                                                                classifier_dir):
    from actors.reward import check_reward_label

    with pytest.raises(ValueError,
                       match=r"\(reward.model_path\) is a GPT2LMHeadModel, not a sequence classifier"):
        check_reward_label(not_classifiers["causal"], None)
    assert check_reward_label(classifier_dir, None) == 0


def test_options_of_another_kind_are_refused(capsys):
    for argv, message in ((["--task", "randomwalks", "--label", "1"], "--label applies to --model"),
                          (["--function", "a:b", "--task-seed", "3"], "--task-seed applies to --task"),
                          (["--task", "randomwalks", "--model", "m"], "not allowed with argument")):
        with pytest.raises(SystemExit) as exit_:
            parse_args(argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_a_served_model_scores_as_the_job_scores_it_in_process(classifier_dir):
    """``--model`` scores what ``reward.kind: model`` scores in a reward actor, to float precision."""
    from actors.reward import RewardActor

    prompts, completions = [p for p, _ in PAIRS], [c for _, c in PAIRS]
    in_process = RewardActor(0, RewardSpec("randomwalks", {}, classifier_dir, kind="model",
                                           model_path=classifier_dir))
    reward, served = build_reward(parse_args(["--model", classifier_dir, "--device", "cpu"]))
    assert served.startswith(f"reward model {classifier_dir} on cpu")
    with serve(reward) as service:
        remote = RewardClient(service.url).score(prompts, completions)
    assert remote == pytest.approx(in_process.scorer.reward_model(prompts, completions), rel=1e-5, abs=1e-6)


def test_requests_that_arrive_together_are_scored_in_one_forward(classifier_dir):
    """Three requests that arrive while the model scores a fourth wait together and share the next forward,
    with the scores each gets alone."""
    reward, _ = build_reward(parse_args(["--model", classifier_dir, "--device", "cpu"]))
    model = reward.score_batch.__self__  # the SequenceClassifierReward it batches for
    alone = {c: model([p], [c])[0] for p, c in PAIRS}
    forward_rows, first_forward_may_end = [], threading.Event()

    def hold_the_first_forward(module, args, kwargs):
        forward_rows.append(kwargs["input_ids"].shape[0])
        if len(forward_rows) == 1:
            assert first_forward_may_end.wait(60)

    handle = model.model.register_forward_pre_hook(hold_the_first_forward, with_kwargs=True)
    answers = {}
    try:
        with serve(reward, max_concurrent=8) as service:
            def ask(i: int) -> None:
                answers[i] = RewardClient(service.url, timeout_s=60).score([PAIRS[i][0]] * 2,
                                                                           [PAIRS[i][1]] * 2)

            threads = [threading.Thread(target=ask, args=(0,))]
            threads[0].start()
            deadline = time.monotonic() + 60
            while not forward_rows and time.monotonic() < deadline:
                time.sleep(0.01)
            threads += [threading.Thread(target=ask, args=(i,)) for i in (1, 2, 3)]
            for thread in threads[1:]:
                thread.start()
            # all three queued behind the first
            while len(reward._waiting) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            first_forward_may_end.set()
            for thread in threads:
                thread.join(60)
    finally:
        first_forward_may_end.set()
        handle.remove()
    assert forward_rows == [2, 6] and reward.forwards == 2
    for i in range(4):
        assert answers[i] == pytest.approx([alone[PAIRS[i][1]]] * 2, rel=1e-5, abs=1e-6)


def test_a_batch_is_cut_at_its_token_budget(classifier_dir):
    """One request longer than ``--max-batch-tokens`` is scored in forwards within the budget, and gets the
    same scores in order."""
    reward, _ = build_reward(parse_args(["--model", classifier_dir, "--device", "cpu",
                                         "--max-batch-tokens", "8"]))
    model = reward.score_batch.__self__
    prompts, completions = [p for p, _ in PAIRS], [c for _, c in PAIRS]
    tokens = [model.count_tokens(p, c) for p, c in PAIRS]
    rows = []
    handle = model.model.register_forward_pre_hook(lambda m, a, k: rows.append(k["input_ids"].shape[0]),
                                                   with_kwargs=True)
    try:
        scores = reward(prompts, completions)
    finally:
        handle.remove()
    assert max(tokens) > 8 and sum(tokens) > 8
    assert sum(rows) == len(PAIRS) and len(rows) > 1 and reward.forwards == len(rows)
    assert scores == pytest.approx(model(prompts, completions), rel=1e-5, abs=1e-6)


def test_a_model_error_fails_only_the_requests_in_its_forward(classifier_dir):
    reward, _ = build_reward(parse_args(["--model", classifier_dir, "--device", "cpu"]))
    with pytest.raises(Exception, match="index out of range|out of bounds"):
        reward(["b" * 100], ["c"])  # longer than the classifier's 64 positions
    assert reward(["b"], ["c"]) == pytest.approx(reward.score_batch.__self__(["b"], ["c"]))


def test_a_sample_that_cannot_be_counted_fails_its_request_alone(classifier_dir):
    reward, _ = build_reward(parse_args(["--model", classifier_dir, "--device", "cpu"]))
    with pytest.raises(TypeError):
        reward([None], ["c"])  # not text: the tokenizer refuses it
    assert reward(["b"], ["c"]) == pytest.approx(reward.score_batch.__self__(["b"], ["c"]))


def test_scores_of_a_served_model_keep_their_order_under_concurrency(classifier_dir):
    reward, _ = build_reward(parse_args(["--model", classifier_dir, "--device", "cpu"]))
    expected = reward.score_batch.__self__([p for p, _ in PAIRS], [c for _, c in PAIRS])
    with serve(reward, max_concurrent=8) as service:
        results = [None] * 6

        def ask(i: int) -> None:
            order = PAIRS[i % 5:] + PAIRS[:i % 5]
            results[i] = (order, RewardClient(service.url, timeout_s=60).score([p for p, _ in order],
                                                                                [c for _, c in order]))

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    by_pair = dict(zip(PAIRS, expected, strict=True))
    for order, scores in results:
        assert scores == pytest.approx([by_pair[pair] for pair in order], rel=1e-5, abs=1e-6)
    assert torch.isfinite(torch.tensor(expected)).all()
