"""The LLM judge's template and answer rule (services/reward_service/judge.py) and its settings
(reward.judge): what a template may name, how an answer is read, and the settings refused at start. The judge
model itself runs in tests/test_sentiment_task.py (SmolLM2 on vLLM, in a reward actor)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.config import JudgeConfig, load_config
from services.judge_template import check_template_fields, template_fields
from services.reward_service.judge import AnswerRule

TEMPLATE = "Question: {prompt}\nAnswer: {response}\nScore from 0 to 10:"


def judge(**overrides) -> dict:
    return {"model_path": "judge-model", "template": TEMPLATE, "score_range": [0, 10],
            "unparseable_score": -1.0, **overrides}


def test_a_template_names_its_fields_in_order():
    assert template_fields(TEMPLATE) == ["prompt", "response"]
    assert template_fields("{response} against {answer}; {{literal}}") == ["response", "answer"]


@pytest.mark.parametrize("template, message", [
    ("Rate {}: {response}", "use named fields only"),
    ("Rate {0}: {response}", "the field {0}"),
    ("Rate {row.answer}: {response}", "the field {row.answer}"),
    ("Rate {row[0]}: {response}", "the field {row[0]}"),
    ("Rate {response", "not a valid format string"),
    ("Rate } {response}", "not a valid format string"),
    ("Rate {prompt}", "no {response} field"),
])
def test_a_template_str_format_cannot_fill_by_name_is_refused(template, message):
    with pytest.raises(ValueError, match="reward.judge.template") as err:
        template_fields(template)
    assert message in str(err.value)


def test_unknown_template_fields_are_named_with_what_the_task_gives():
    check_template_fields("{prompt} {response} {answer}", ["answer"], "task 'dataset'")
    with pytest.raises(ValueError) as err:
        check_template_fields("{response} {answer} {weight}", [],
                              "task 'randomwalks' (task.reward_fields=[])")
    assert str(err.value) == ("reward.judge.template has unknown field(s) {answer}, {weight}: task "
                              "'randomwalks' (task.reward_fields=[]) gives only {prompt}, {response}")


@pytest.mark.parametrize("answer, score", [
    ("7", 7.0), ("I give it 8/10.", 8.0), ("Score: 9.5 out of 10", 9.5), ("-3 points", None), ("10", 10.0),
    ("0.0", 0.0), ("11", None), ("it is great", None), ("", None), (".5", 0.5),
])
def test_a_number_rule_reads_the_first_number_within_its_range(answer, score):
    assert AnswerRule("number", score_range=(0.0, 10.0))(answer) == score


def test_a_number_rule_without_a_range_takes_any_finite_number_and_a_pattern_picks_the_number():
    assert AnswerRule("number")("-3 points") == -3.0
    assert AnswerRule("number")("1e999") == 1.0  # the first number as written: exponents are not read
    rule = AnswerRule("number", pattern=r"score:\s*(\d+)")
    assert rule("3 steps, so SCORE: 6") == 6.0  # the pattern is searched in any case
    assert rule("3 steps") is None


@pytest.mark.parametrize("answer, score", [
    ("Yes.", 1.0), ("no, it is not", 0.0), ("YES", 1.0), ("maybe", 0.5), ("Not sure: yes or no", 1.0),
    ("yesterday", None), ("nope", None), ("It's a definite no", 0.0), ("no-yes", 0.0), ("", None),
])
def test_a_label_rule_reads_the_first_label_as_a_whole_word_in_any_case(answer, score):
    assert AnswerRule("labels", labels={"yes": 1.0, "no": 0.0, "maybe": 0.5})(answer) == score


def test_where_two_labels_start_at_one_place_the_longer_is_read():
    rule = AnswerRule("labels", labels={"good": 1.0, "good enough": 0.5})
    assert rule("good enough I think") == 0.5
    assert rule("good") == 1.0


def test_a_label_pattern_reads_its_group():
    rule = AnswerRule("labels", pattern=r"verdict:\s*(\w+)", labels={"PASS": 1.0, "FAIL": -1.0})
    assert rule("fail early; Verdict: pass") == 1.0
    assert rule("Verdict: unclear") is None


def test_judge_settings_that_cannot_read_an_answer_are_refused():
    JudgeConfig.model_validate(judge())
    cases = [
        (judge(parse="labels", score_range=None), "needs reward.judge.labels"),
        (judge(parse="labels", labels={"yes": 1}), "score_range bounds parse 'number'"),
        (judge(labels={"yes": 1}), "reward.judge.labels is set but reward.judge.parse='number'"),
        (judge(score_range=[10, 0]), "low < high"),
        (judge(pattern="(unclosed"), "is not a regular expression"),
        (judge(pattern=r"(\d+) of (\d+)"), "has 2 groups"),
        (judge(unparseable_score=float("nan")), "finite"),
        (judge(template="Rate {prompt}"), "no {response} field"),
        ({k: v for k, v in judge().items() if k != "unparseable_score"}, "unparseable_score"),
    ]
    for settings, message in cases:
        with pytest.raises(ValidationError) as err:
            JudgeConfig.model_validate(settings)
        assert message in str(err.value), (settings, str(err.value))


def test_a_job_with_a_judge_checks_the_template_against_the_tasks_fields():
    cfg = load_config(None, {"reward": {"kind": "judge", "judge": judge()}})
    assert cfg.reward.judge.temperature == 0.0  # greedy by default
    with pytest.raises(ValidationError, match=r"unknown field\(s\) \{answer\}: task 'randomwalks'"):
        load_config(None, {"reward": {"kind": "judge", "judge": judge(template="{response} vs {answer}")}})
    with pytest.raises(ValidationError, match="reward.kind='judge' needs reward.judge"):
        load_config(None, {"reward": {"kind": "judge"}})
    with pytest.raises(ValidationError, match="reward.judge is set but reward.kind='function'"):
        load_config(None, {"reward": {"judge": judge()}})
    with pytest.raises(ValidationError, match="cluster.reward.num_gpus=0 runs it on CPU"):
        load_config(None, {"reward": {"kind": "judge", "judge": judge(gpu_memory_utilization=0.3)}})


def test_the_judge_takes_its_share_of_the_reward_actors_gpu():
    settings = JudgeConfig.model_validate(judge())
    assert "gpu_memory_utilization" not in settings.engine_args(0.0)
    assert settings.engine_args(0.5)["gpu_memory_utilization"] == 0.45
    assert JudgeConfig.model_validate(judge(gpu_memory_utilization=0.2)) \
        .engine_args(0.5)["gpu_memory_utilization"] == 0.2
