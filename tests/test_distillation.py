"""On-policy distillation (``distill.*``): the teacher's per-token reverse KL as a penalty, by exact
enumeration on the small autoregressive policy of ``tests/test_kl_loss.py`` (15 responses, float64), golden
values for the group estimators, and the refused settings.

Each credit is exactly the gradient of its own objective: ``reward_to_go`` that of the sequence-level reverse
KL ``KL(pi(y|x) || teacher(y|x))``, ``token`` that of the per-state reverse KLs summed along the student's own
states (which it does not differentiate: how a token changes the later states is left out).

The job (a teacher actor scores every chunk, the student's KL to it falls, resume is exact) is tested with a
LoRA student in ``tests/test_lora.py``, sharing that job's start.
"""

import pytest
import torch
from pydantic import ValidationError

from learner.advantages import compute_advantages
from learner.kl import kl_penalized_rewards, teacher_penalties
from services.config import load_config
from tests.test_kl_loss import (
    BETA,
    CONTEXT,
    EOS,
    MASK,
    MAX_LEN,
    PREFIXES,
    VOCAB,
    gradient,
    penalised_return_gradient,
    response_kl,
    scores_of,
    tables,
    token_logprobs_of,
)

COEF = 0.7


def teacher_table(seed: int) -> torch.Tensor:
    return torch.randn(len(PREFIXES), VOCAB, generator=torch.Generator().manual_seed(100 + seed),
                       dtype=torch.float64)


def expected_gradient(theta, ref_table, teacher, credit: str, estimator: str = "gae") -> torch.Tensor:
    """``E_{y~pi}[sum_t grad log pi(y_t) * A_t]`` over every response, with the advantages the learner builds:
    the KL-penalised rewards of the reference, the teacher's penalties at ``credit``, GAE at gamma = lam = 1
    without a critic or whitening (the returns to go), or REINFORCE's whole return (``estimator``
    'return')."""
    logp = token_logprobs_of(theta)
    old = logp.detach()
    rewards, _ = kl_penalized_rewards(scores_of(), old, token_logprobs_of(ref_table), MASK, BETA)
    penalties = teacher_penalties(old, token_logprobs_of(teacher), MASK, COEF)
    advantages, _ = compute_advantages("gae", rewards, MASK, values=torch.zeros_like(rewards),
                                       gamma=1.0, lam=1.0, whiten_advantages=False, teacher=penalties,
                                       teacher_credit=credit)
    return gradient((old.sum(-1).exp() * (logp * advantages * MASK).sum(-1)).sum(), theta)


def state_probabilities(theta: torch.Tensor) -> torch.Tensor:
    """[contexts] the probability that the student's response reaches each prefix and continues from it."""
    probs = theta.detach().softmax(-1)
    reach = torch.zeros(len(PREFIXES), dtype=torch.float64)
    for prefix, i in CONTEXT.items():
        p = 1.0
        for t, token in enumerate(prefix):
            p *= float(probs[CONTEXT[prefix[:t]], token])
        reach[i] = p if len(prefix) < MAX_LEN and EOS not in prefix else 0.0
    return reach


def per_state_kl(theta: torch.Tensor, teacher: torch.Tensor) -> torch.Tensor:
    """[contexts] KL(pi(.|s) || teacher(.|s)) at each state (differentiable in theta)."""
    logp, logq = theta.log_softmax(-1), teacher.log_softmax(-1)
    return (logp.exp() * (logp - logq)).sum(-1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reward_to_go_credit_is_the_gradient_of_the_sequence_reverse_kl(seed):
    theta, ref_table, _ = tables(seed)
    teacher = teacher_table(seed)
    distill = gradient(-COEF * response_kl(theta, teacher), theta)
    assert float(distill.norm()) > 0.05
    want = penalised_return_gradient(theta, ref_table) + distill
    got = expected_gradient(theta, ref_table, teacher, "reward_to_go")
    assert float((got - want).abs().max()) < 1e-9


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_token_credit_is_the_gradient_of_the_per_state_reverse_kl_along_the_students_states(seed):
    theta, ref_table, _ = tables(seed)
    teacher = teacher_table(seed)
    per_state = gradient(-COEF * (state_probabilities(theta) * per_state_kl(theta, teacher)).sum(), theta)
    want = penalised_return_gradient(theta, ref_table) + per_state
    got = expected_gradient(theta, ref_table, teacher, "token")
    assert float((got - want).abs().max()) < 1e-9
    # the two credits differ: the sequence KL also counts how a token moves the later states
    sequence = expected_gradient(theta, ref_table, teacher, "reward_to_go")
    assert float((got - sequence).norm() / sequence.norm()) > 0.05


def test_both_credits_vanish_at_the_teacher():
    """The student equal to the teacher: no penalty, so the task's gradient alone, for both credits."""
    theta, ref_table, _ = tables(0)
    for credit in ("token", "reward_to_go"):
        got = expected_gradient(theta, ref_table, theta.detach(), credit)
        assert float((got - penalised_return_gradient(theta, ref_table)).abs().max()) < 1e-12, credit


def test_group_estimators_keep_the_teacher_outside_their_baselines_and_normalisation():
    """Golden values, one group of 4 whose scores tie, 2 tokens each, no reference KL: GRPO gives no score
    signal, so the advantages are the teacher's terms alone: each token's own (token) or their sum to go
    (reward_to_go), never divided by a group's std. RLOO's leave-one-out baseline takes the penalties in the
    return (reward_to_go) or leaves them to each token (token)."""
    logp = torch.tensor([[-1.0, -2.0], [-0.5, -0.5], [-2.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    teacher_logp = torch.tensor([[-1.5, -1.0], [-0.5, -1.5], [-1.0, -1.0], [-1.0, -3.0]], dtype=torch.float64)
    mask = torch.ones(4, 2, dtype=torch.float64)
    penalties = teacher_penalties(logp, teacher_logp, mask, 0.5)  # -0.5 * (logp - teacher_logp)
    assert penalties.tolist() == [[-0.25, 0.5], [0.0, -0.5], [0.5, 0.0], [0.0, -1.0]]
    rewards, _ = kl_penalized_rewards(torch.ones(4, dtype=torch.float64), logp, logp, mask, 0.0)
    groups = torch.zeros(4, dtype=torch.long)
    zero_kl = torch.zeros_like(rewards)
    grpo = {credit: compute_advantages("grpo", rewards, mask, group_index=groups, kl_rewards=zero_kl,
                                       teacher=penalties, teacher_credit=credit)[0]
            for credit in ("token", "reward_to_go")}
    assert grpo["token"].tolist() == [[-0.25, 0.5], [0.0, -0.5], [0.5, 0.0], [0.0, -1.0]]
    assert grpo["reward_to_go"].tolist() == [[0.25, 0.5], [-0.5, -0.5], [0.5, 0.0], [-1.0, -1.0]]
    rloo = {credit: compute_advantages("rloo", rewards, mask, group_index=groups, teacher=penalties,
                                       teacher_credit=credit)[0]
            for credit in ("token", "reward_to_go")}
    assert rloo["token"].tolist() == [[-0.25, 0.5], [0.0, -0.5], [0.5, 0.0], [0.0, -1.0]]
    # returns 1 + [0.25, -0.5, 0.5, -1.0]; each less the mean of the other three
    returns = [1.25, 0.5, 1.5, 0.0]
    want = [r - (sum(returns) - r) / 3 for r in returns]
    assert rloo["reward_to_go"][:, 0].tolist() == pytest.approx(want, abs=1e-12)
    assert rloo["reward_to_go"][:, 1].tolist() == pytest.approx(want, abs=1e-12)


def test_bad_teacher_input_fails_loudly():
    logp, mask = torch.zeros(2, 3), torch.ones(2, 3)
    with pytest.raises(ValueError, match="distill.coef must be a finite positive number"):
        teacher_penalties(logp, logp, mask, 0.0)
    with pytest.raises(ValueError, match="shape"):
        teacher_penalties(logp, torch.zeros(2, 4), mask, 1.0)
    with pytest.raises(ValueError, match="unknown distill.credit 'sequence'"):
        compute_advantages("rloo", logp, mask, group_index=torch.zeros(2, dtype=torch.long), teacher=logp,
                           teacher_credit="sequence")


@pytest.mark.parametrize(("overrides", "message"), [
    ({"distill": {"coef": 0.5}}, "distill.coef is set but distill.teacher_path is not"),
    ({"distill": {"task_reward": False}}, "distill.task_reward is set but distill.teacher_path is not"),
    ({"distill": {"teacher_path": "/teacher", "task_reward": False}, "ppo": {"advantage": "grpo"},
      "rollout": {"samples_per_prompt": 8, "dynamic_sampling": True}}, "every group would be dropped"),
    ({"distill": {"teacher_path": "/teacher", "coef": 0}}, "distill.coef"),
    ({"distill": {"teacher_path": "/teacher", "credit": "sequence"}}, "distill.credit"),
])
def test_refused_distillation_settings_name_the_field(overrides, message):
    with pytest.raises(ValidationError, match=message):
        load_config(overrides=overrides)


def test_a_teacher_with_another_vocabulary_is_refused_naming_the_field(tmp_path, tiny_model_dir):
    from actors.reference import check_teacher
    from services.models import load_tokenizer

    student = load_tokenizer(tiny_model_dir)
    check_teacher(tiny_model_dir, student)  # the same vocabulary
    check_teacher(str(tmp_path / "a-hub-id-or-a-node-path"), student)  # not here: the actors load it
    other = load_tokenizer(tiny_model_dir)
    other.add_tokens(["<tool>"])
    other.save_pretrained(tmp_path / "teacher")
    (tmp_path / "teacher" / "config.json").write_text(
        (__import__("pathlib").Path(tiny_model_dir) / "config.json").read_text())
    with pytest.raises(ValueError, match=r"distill.teacher_path\) has another vocabulary than the policy's"):
        check_teacher(str(tmp_path / "teacher"), student)
