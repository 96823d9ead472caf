"""The KL's gradient in each placement, by exact enumeration on a small autoregressive policy.

A tabular softmax policy over the vocabulary {0, 1, EOS} writes responses of up to 3 tokens (15 of them).
Every expectation below is the probability-weighted sum over all of them, so the checks are exact (float64),
with no sampling noise.
"""

import warnings

import pytest
import torch
from pydantic import ValidationError

from learner.advantages import compute_advantages
from learner.kl import (
    EXACT_LOSS_FORMS,
    grpo_token_k3_loss,
    kl_estimate,
    kl_logprob_roles,
    kl_loss_aggregation,
    kl_penalized_rewards,
    response_kl_loss,
)
from learner.policy_losses import policy_loss
from learner.ppo import AGGREGATIONS, gae_advantages, loss_denominator
from services.config import KLConfig, PPOConfig, load_config
from tests.batch_statistics import kl_stats, sequence_kl

VOCAB, EOS, MAX_LEN = 3, 2, 3
PREFIXES = [(), (0,), (1,), (0, 0), (0, 1), (1, 0), (1, 1)]  # the contexts a response can continue from
CONTEXT = {prefix: i for i, prefix in enumerate(PREFIXES)}


def all_responses() -> list[tuple[int, ...]]:
    """Every response the policy can write: it stops at EOS or after MAX_LEN tokens."""
    out: list[tuple[int, ...]] = []

    def grow(prefix: tuple[int, ...]) -> None:
        for token in range(VOCAB):
            response = (*prefix, token)
            if token == EOS or len(response) == MAX_LEN:
                out.append(response)
            else:
                grow(response)

    grow(())
    return out


RESPONSES = all_responses()
N = len(RESPONSES)
IDS = torch.tensor([list(y) + [EOS] * (MAX_LEN - len(y)) for y in RESPONSES])  # [N, T]
CONTEXTS = torch.tensor([[CONTEXT[y[:t]] if t < len(y) else 0 for t in range(MAX_LEN)] for y in RESPONSES])
MASK = torch.tensor([[1.0 if t < len(y) else 0.0 for t in range(MAX_LEN)] for y in RESPONSES],
                    dtype=torch.float64)


def token_logprobs_of(table: torch.Tensor) -> torch.Tensor:
    """[N, T] log pi(y_t | y_<t) of every response under the logits ``table`` [contexts, VOCAB]; 0 after
    the response ends."""
    return table.log_softmax(-1)[CONTEXTS, IDS] * MASK


def tables(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(policy logits with grad, reference logits, behaviour logits a PPO step or two away)."""
    g = torch.Generator().manual_seed(seed)
    theta = torch.randn(len(PREFIXES), VOCAB, generator=g, dtype=torch.float64).requires_grad_()
    ref = torch.randn(len(PREFIXES), VOCAB, generator=g, dtype=torch.float64)
    behaviour = theta.detach() + 0.5 * torch.randn(len(PREFIXES), VOCAB, generator=g, dtype=torch.float64)
    return theta, ref, behaviour


def response_kl(theta: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Exact response KL ``E_{y~pi}[sum_t log pi(y_t|y<t) / pi_ref(y_t|y<t)]`` (differentiable in theta)."""
    logp = token_logprobs_of(theta)
    return (logp.sum(-1).exp() * (logp - token_logprobs_of(ref)).sum(-1)).sum()


def expected(per_response, theta: torch.Tensor, ref_table: torch.Tensor,
             behaviour: torch.Tensor) -> torch.Tensor:
    """``E_{y~behaviour}[per_response(logp, old_logp, ref_logp, mask)]`` with each response as a [1, T]
    batch, weighted by its probability under the behaviour policy that sampled it (a constant)."""
    logp, ref = token_logprobs_of(theta), token_logprobs_of(ref_table)
    old = token_logprobs_of(behaviour).detach()
    weights = old.sum(-1).exp()
    assert float(weights.sum()) == pytest.approx(1.0, abs=1e-12)
    rows = [slice(i, i + 1) for i in range(N)]
    return sum(weights[i] * per_response(logp[r], old[r], ref[r], MASK[r]) for i, r in enumerate(rows))


def gradient(scalar: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    return torch.autograd.grad(scalar, theta)[0]


# ---------------------------------------------------------------- kl.placement: loss


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("on_policy", [True, False], ids=["on-policy", "off-policy"])
@pytest.mark.parametrize("form", EXACT_LOSS_FORMS)
def test_accepted_loss_forms_have_the_response_kl_gradient(form, on_policy, seed):
    """Off-policy: the behaviour policy sampled the rows, the gradient is taken at another policy (a PPO
    epoch after its first step); the prefix importance weights keep the form exact there too."""
    theta, ref_table, behaviour = tables(seed)
    if on_policy:
        behaviour = theta.detach()
    want = gradient(response_kl(theta, ref_table), theta)
    assert float(want.norm()) > 0.1  # a gradient the comparison can see
    loss = expected(lambda logp, old, ref, mask: response_kl_loss(logp, old, ref, mask, form),
                    theta, ref_table, behaviour)
    assert float((gradient(loss, theta) - want).abs().max()) < 1e-6
    # its value is the current policy's response KL in nats (importance-weighted when off-policy)
    assert float(loss.detach()) == pytest.approx(float(response_kl(theta, ref_table).detach()), abs=1e-9)


def test_without_the_importance_weights_an_off_policy_minibatch_is_not_exact():
    """Why ``response_kl_loss`` takes the behaviour log-probs: treating the rows as the current policy's
    samples (old = current) is exact only at the behaviour policy."""
    theta, ref_table, behaviour = tables(0)
    want = gradient(response_kl(theta, ref_table), theta)
    loss = expected(lambda logp, old, ref, mask: response_kl_loss(logp, logp.detach(), ref, mask, "kl_to_go"),
                    theta, ref_table, behaviour)
    assert float((gradient(loss, theta) - want).norm() / want.norm()) > 0.05


def async_expectation(per_response, theta, proximal_table, behaviour_table, ref_table) -> torch.Tensor:
    """``E_{y~engine}[per_response(logp, proximal, behaviour, ref, mask)]`` over every response, each a [1, T]
    batch weighted by its probability under the engine's (behaviour) policy, which sampled it."""
    logp, ref = token_logprobs_of(theta), token_logprobs_of(ref_table)
    proximal, behaviour = (token_logprobs_of(proximal_table).detach(),
                           token_logprobs_of(behaviour_table).detach())
    weights = behaviour.sum(-1).exp()
    return sum(weights[i] * per_response(logp[i:i + 1], proximal[i:i + 1], behaviour[i:i + 1], ref[i:i + 1],
                                         MASK[i:i + 1]) for i in range(N))


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("form", EXACT_LOSS_FORMS)
def test_async_kl_loss_weighs_against_the_engine_that_sampled_the_rows(form, seed):
    """Issue 23, bias 1: rollout.mode async with kl.placement loss. The engine (an older version, logits 0.5
    away) sampled the rows; the learner's proximal policy (its forward at collection) is the current policy at
    the first minibatch. The roles the rank takes (``kl_logprob_roles``) give the KL term the engine's
    log-probs as its old policy, and the expected gradient is exactly the response KL's, by enumeration; the
    proximal log-probs there (what the rank passed before) miss it by far."""
    theta, ref_table, engine = tables(seed)
    proximal = theta.detach()
    want = gradient(response_kl(theta, ref_table), theta)

    def roles_term(logp, prox, behaviour, ref, mask):
        _, sampler = kl_logprob_roles(prox, behaviour, off_policy=True)
        return response_kl_loss(logp, sampler, ref, mask, form)

    got = gradient(async_expectation(roles_term, theta, proximal, engine, ref_table), theta)
    assert float((got - want).abs().max()) < 1e-6
    proximal_as_sampler = async_expectation(lambda logp, prox, behaviour, ref, mask:
                                            response_kl_loss(logp, prox, ref, mask, form),
                                            theta, proximal, engine, ref_table)
    assert float((gradient(proximal_as_sampler, theta) - want).norm() / want.norm()) > 0.3
    # sync: the learner's own log-probs are the sampler's (same version)
    prox, behaviour = token_logprobs_of(proximal), token_logprobs_of(engine)
    assert kl_logprob_roles(prox, behaviour, off_policy=False)[1] is prox


@pytest.mark.parametrize("seed", [0, 1])
def test_per_token_forms_in_the_loss_have_the_wrong_gradient(seed):
    """What the refused old form ``beta * sum_t k(r_t)`` computes, summed per response so that only the
    gradient's direction is at stake: k1 has expected gradient 0, k3 that of the reverse KL per token, and
    k2 misses the later tokens' log-ratios. GRPO's form (kept to reproduce it) is not exact either."""
    theta, ref_table, _ = tables(seed)
    on_policy = theta.detach()
    want = gradient(response_kl(theta, ref_table), theta)

    def token_form(k):
        return lambda logp, old, ref, mask: (kl_estimate(logp, ref, k) * mask).sum()

    got = {k: gradient(expected(token_form(k), theta, ref_table, on_policy), theta)
           for k in ("k1", "k2", "k3")}
    assert float(got["k1"].abs().max()) < 1e-12  # no KL regularisation at all
    for k in ("k2", "k3"):
        assert float((got[k] - want).norm() / want.norm()) > 0.05, k
    # k3's is the per-token reverse KL's: E_{y<t ~ pi}[-sum_a pi_ref(a | y<t) grad log pi(a | y<t)]
    log_pi = theta.detach().log_softmax(-1)
    reached = torch.stack([sum((log_pi[CONTEXT[c[:s]], c[s]] for s in range(len(c))), torch.tensor(0.0,
                           dtype=torch.float64)).exp() for c in PREFIXES])  # pi(context is reached)
    reverse = -(reached[:, None] * ref_table.softmax(-1) * theta.log_softmax(-1)).sum()
    assert float((got["k3"] - gradient(reverse, theta)).abs().max()) < 1e-9
    with pytest.warns(UserWarning, match="grpo_token_k3"):
        grpo = expected(lambda logp, old, ref, mask: grpo_token_k3_loss(logp, ref, mask), theta, ref_table,
                        on_policy)
    assert float((gradient(grpo, theta) - want).norm() / want.norm()) > 0.05


# ---------------------------------------------------------------- kl.placement: reward

BETA = 0.3


def scores_of() -> torch.Tensor:
    """[N] a fixed score per response (what a reward model would say)."""
    return torch.linspace(-1.0, 2.0, N, dtype=torch.float64).roll(5)


def reward_placement_gradient(theta, ref_table, estimator: str, to_go: bool) -> torch.Tensor:
    """Expected REINFORCE gradient of the KL-penalised rewards as the learner builds them
    (``kl_penalized_rewards``; with ``to_go``, the returns to go from ``gae_advantages`` at gamma = lam = 1
    and no critic): ``E[sum_t grad logp_t * A_t]``, or ``E[grad log pi(y) * (score - beta * KL_b)]``."""
    logp, ref = token_logprobs_of(theta), token_logprobs_of(ref_table)
    old = logp.detach()  # on-policy: the policy sampled the responses
    rewards, _ = kl_penalized_rewards(scores_of(), old, ref, MASK, BETA, estimator)  # [N, T]
    if to_go:
        advantages, _ = gae_advantages(rewards, torch.zeros_like(rewards), MASK, gamma=1.0, lam=1.0)
        per_response = (logp * advantages * MASK).sum(-1)
    else:
        per_response = logp.sum(-1) * rewards.sum(-1)
    return gradient((old.sum(-1).exp() * per_response).sum(), theta)


def penalised_return_gradient(theta, ref_table) -> torch.Tensor:
    """Exact gradient of ``E_pi[score] - beta * KL(pi || pi_ref)`` (the response KL)."""
    probability = token_logprobs_of(theta).sum(-1).exp()
    return gradient((probability * scores_of()).sum() - BETA * response_kl(theta, ref_table), theta)


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("to_go", [False, True], ids=["whole-return", "return-to-go"])
def test_k1_in_the_reward_gives_the_unbiased_policy_gradient_of_the_penalised_return(seed, to_go):
    theta, ref_table, _ = tables(seed)
    want = penalised_return_gradient(theta, ref_table)
    assert float(want.norm()) > 0.1
    got = reward_placement_gradient(theta, ref_table, "k1", to_go)
    assert float((got - want).abs().max()) < 1e-6


@pytest.mark.parametrize("estimator", ["k2", "k3"])
def test_k2_and_k3_in_the_reward_are_biased(estimator):
    """Documented as biased choices (README's KL table): k2's mean is not the KL, and k3's is, but its
    pathwise gradient is missing from the policy gradient (``E[grad k3] != 0``)."""
    for seed in (0, 1, 2):
        theta, ref_table, _ = tables(seed)
        want = penalised_return_gradient(theta, ref_table)
        got = reward_placement_gradient(theta, ref_table, estimator, to_go=False)
        assert float((got - want).norm() / want.norm()) > 0.01, (estimator, seed)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_async_reward_penalty_from_the_proximal_policy_gives_the_penalised_return_gradient(seed):
    """Issue 23, bias 2: rollout.mode async with the KL in the reward. Rows sampled by the engine, weighted by
    the exact sequence importance weight pi_prox(y) / pi_engine(y); REINFORCE with the returns to go (GAE at
    gamma = lambda = 1, no critic, unwhitened) through the PPO surrogate at the first step. With the penalty
    built from the log-probs the rank's roles give (the proximal policy's) the expected gradient is that of
    ``E[score] - beta * KL(pi || pi_ref)``, by enumeration; from the engine's (what the rank took before) it
    is not. The controller is fed the KL that penalty took: the README's identity holds."""
    theta, ref_table, engine = tables(seed)
    logp, ref = token_logprobs_of(theta), token_logprobs_of(ref_table)
    prox, behaviour = logp.detach(), token_logprobs_of(engine)
    # P_engine(y) * importance weight
    weight = behaviour.sum(-1).exp() * (prox.sum(-1) - behaviour.sum(-1)).exp()
    want = penalised_return_gradient(theta, ref_table)
    assert float(want.norm()) > 0.1

    def estimate(penalised: torch.Tensor) -> torch.Tensor:
        rewards, _ = kl_penalized_rewards(scores_of(), penalised, ref, MASK, BETA)
        advantages, _ = compute_advantages("gae", rewards, MASK, values=torch.zeros_like(rewards), gamma=1.0,
                                           lam=1.0, whiten_advantages=False)
        loss, _ = policy_loss(token_logprobs_of(theta), prox, advantages, MASK, denominator=1.0,
                              importance_weights=weight[:, None].expand_as(MASK))
        return -gradient(loss, theta)

    penalised, _ = kl_logprob_roles(prox, behaviour, off_policy=True)
    assert float((estimate(penalised) - want).abs().max()) < 1e-6
    assert float((estimate(behaviour) - want).norm() / want.norm()) > 0.05
    rewards, _ = kl_penalized_rewards(scores_of(), penalised, ref, MASK, BETA)
    penalty = -((rewards * MASK).sum(-1) - scores_of()) / BETA
    assert kl_stats(penalised, ref, MASK)["response_mean"] == pytest.approx(float(penalty.mean()), abs=1e-12)



# ---------------------------------------------------------------- aggregation: per response, global count


def test_loss_term_is_the_per_response_mean_over_all_responses_including_empty_ones():
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-0.2, -3.0, -1.0], [-0.1, -0.1, -0.1]], dtype=torch.float64)
    ref = torch.tensor([[-1.5, -1.0, -0.5], [-0.7, -2.0, -4.0], [-2.0, -2.0, -2.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0]])  # row 2 is an empty response
    for form in EXACT_LOSS_FORMS:
        term = response_kl_loss(logp, logp, ref, mask, form)
        # at the behaviour policy the value is the controller's statistic: mean_b KL_b over all 3 rows
        assert float(term) == pytest.approx(float(sequence_kl(logp, ref, mask).mean()))
        assert float(term) == pytest.approx((-0.5 - 0.5 + 0.0) / 3)


def placement_gradients(logp_values, ref, mask, aggregation, form="kl_to_go", beta=0.1):
    """(reward placement, loss placement) gradients in the log-probs at the first PPO step of a batch with
    score 0, as the rank builds them: the policy term of ``ppo.loss_aggregation`` on GAE(1, 1) advantages (no
    critic, unwhitened) of the KL-penalised rewards; or no KL in the rewards and beta times the KL term, its
    gradient over ``kl_loss_aggregation``'s count."""
    B = mask.shape[0]
    logp = logp_values.clone().requires_grad_()
    rewards, _ = kl_penalized_rewards(torch.zeros(B, dtype=ref.dtype), logp.detach(), ref, mask, beta)
    advantages, _ = compute_advantages("gae", rewards, mask, values=torch.zeros_like(rewards), gamma=1.0,
                                       lam=1.0, whiten_advantages=False)
    count = loss_denominator(mask, aggregation)
    policy, _ = policy_loss(logp, logp.detach(), advantages, mask, PPOConfig(clip_range=0.2), aggregation,
                            count)
    in_reward = gradient(policy, logp)
    term = response_kl_loss(logp, logp.detach(), ref, mask, form, B,
                            loss_denominator(mask, kl_loss_aggregation(aggregation)))
    return in_reward, gradient(beta * term, logp)


@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_both_placements_weigh_the_kl_against_the_policy_term_alike(aggregation):
    """Issue 23, bias 3: score 0, B = 4 responses of L = 16 tokens, GAE(1, 1) unwhitened. By hand, each
    placement's gradient in logp[b, t] is ``beta * G[b, t] / (B * L)`` (token_mean: over the B * L tokens;
    sequence_mean: 1 / L per row, 1 / B over rows; seq_mean_token_sum_norm: over B * T, T = L) with the KL to
    go ``G[b, t] = sum_{t' >= t} r[b, t']``; the KL term in the loss was divided by B alone: L = 16 times
    that."""
    g = torch.Generator().manual_seed(5)
    B, L, beta = 4, 16, 0.1
    logp = -torch.rand(B, L, generator=g, dtype=torch.float64) * 3
    ref = -torch.rand(B, L, generator=g, dtype=torch.float64) * 3
    mask = torch.ones(B, L, dtype=torch.float64)
    r = (logp - ref).tolist()
    by_hand = torch.tensor([[beta * sum(r[b][t:]) / (B * L) for t in range(L)] for b in range(B)],
                           dtype=torch.float64)
    in_reward, in_loss = placement_gradients(logp, ref, mask, aggregation, beta=beta)
    assert torch.allclose(in_reward, by_hand, rtol=1e-12, atol=1e-15)
    assert torch.allclose(in_loss, by_hand, rtol=1e-12, atol=1e-15)
    ratio = (in_loss.norm() / in_reward.norm()).item()
    assert ratio == pytest.approx(1.0, abs=1e-12)
    # response_k2: its per-response gradient R_b * grad log pi(y), over the same count
    _, k2 = placement_gradients(logp, ref, mask, aggregation, "response_k2", beta)
    returns = [sum(row) for row in r]
    assert torch.allclose(k2, torch.tensor([[beta * returns[b] / (B * L)] * L for b in range(B)],
                                           dtype=torch.float64), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean_token_sum_norm"])
def test_with_unequal_lengths_the_placements_agree_where_the_policy_term_weighs_tokens_alike(aggregation):
    """Rows of 16, 9, 3 and 0 tokens: every token weighs the same in these aggregations, so the two placements
    give one gradient. ``sequence_mean`` weighs each row's tokens by 1 / its length in the policy term, and so
    the reward's KL; the loss term keeps the exact gradient of the response KL over the tokens instead."""
    g = torch.Generator().manual_seed(6)
    logp = -torch.rand(4, 16, generator=g, dtype=torch.float64) * 3
    ref = -torch.rand(4, 16, generator=g, dtype=torch.float64) * 3
    mask = (torch.arange(16) < torch.tensor([16, 9, 3, 0])[:, None]).to(torch.float64)
    in_reward, in_loss = placement_gradients(logp, ref, mask, aggregation)
    assert torch.allclose(in_loss, in_reward, rtol=1e-12, atol=1e-15)
    # its value (ppo_kl_loss) stays the nats per response, as the controller's statistic counts them
    term = response_kl_loss(logp, logp, ref, mask, "kl_to_go", 4, loss_denominator(mask, "token_mean"))
    assert float(term) == pytest.approx(float(sequence_kl(logp, ref, mask).mean()), abs=1e-12)
    assert kl_loss_aggregation("sequence_mean") == "token_mean"
    with pytest.raises(ValueError, match="unknown loss aggregation 'per_row'"):
        kl_loss_aggregation("per_row")  # type: ignore[arg-type]


@pytest.mark.parametrize("form", EXACT_LOSS_FORMS)
def test_two_ranks_with_their_share_of_the_global_count_give_the_one_rank_gradient(form):
    """Each rank divides by (global responses) / W; DeepSpeed averages the W gradients."""
    g = torch.Generator().manual_seed(3)
    logp = torch.randn(6, 4, generator=g, dtype=torch.float64).requires_grad_()
    old = logp.detach() + 0.1 * torch.randn(6, 4, generator=g, dtype=torch.float64)
    ref = torch.randn(6, 4, generator=g, dtype=torch.float64)
    mask = (torch.arange(4) < torch.tensor([4, 1, 0, 3, 2, 4])[:, None]).to(torch.float64)
    whole = gradient(response_kl_loss(logp, old, ref, mask, form), logp)
    shards = [slice(0, 2), slice(2, 6)]  # unequal shares: the count is global, not per rank
    ranks = sum(gradient(response_kl_loss(logp[s], old[s], ref[s], mask[s], form, 6 / 2), logp)
                for s in shards) / 2
    assert torch.allclose(ranks, whole, atol=1e-12)


def test_bad_input_to_the_loss_term_fails_loudly():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="form must be one of"):
        response_kl_loss(x, x, x, torch.ones(2, 3), "grpo_token_k3")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"old_logprobs shape \(2, 4\) != logprobs shape \(2, 3\)"):
        response_kl_loss(x, torch.zeros(2, 4), x, torch.ones(2, 3))
    with pytest.raises(ValueError, match="ref_logprobs shape"):
        response_kl_loss(x, x, torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="mask has shape"):
        response_kl_loss(x, x, x, torch.ones(2, 2))
    with pytest.raises(ValueError, match="old_logprobs has 6 non-finite"):
        response_kl_loss(x, torch.full((2, 3), float("nan")), x, torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"proximal_logprobs \(2, 3\) and "
                                         r"behaviour_logprobs \(2, 4\) must share"):
        kl_logprob_roles(x, torch.zeros(2, 4), off_policy=True)


# ---------------------------------------------------------------- the config accepts only what is right


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("placement, loss_form, message", [
    ("loss", None, (r"kl.placement='loss' needs kl.loss_form.*k1: 0 in expectation; k3: the reverse KL's; "
                    r"k2: misses later tokens")),
    ("reward", "kl_to_go", r"kl.loss_form='kl_to_go' is set but kl.placement='reward' ignores it"),
    ("reward", "response_k2", r"kl.loss_form='response_k2' is set but kl.placement='reward' ignores it"),
    ("reward", "grpo_token_k3", r"kl.loss_form='grpo_token_k3' is set but kl.placement='reward' ignores it"),
    ("loss", "token_k1", r"kl.loss_form\n  Input should be 'kl_to_go', 'response_k2' or 'grpo_token_k3'"),
])
def test_refused_combinations_name_the_fields(estimator, placement, loss_form, message):
    """The old per-token form (``placement: loss`` alone, with any estimator) and a loss form the reward
    placement would ignore are refused when the config is parsed."""
    kl = {"placement": placement, "estimator": estimator, "loss_form": loss_form}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # grpo_token_k3's own warning
        with pytest.raises(ValidationError, match=message):
            load_config(overrides={"kl": kl})


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("loss_form", EXACT_LOSS_FORMS)
def test_exact_loss_forms_are_accepted_with_every_estimator_and_no_warning(estimator, loss_form):
    """The estimator still sets the controller's statistic (the per-response sum); the loss form alone
    sets the gradient."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = load_config(overrides={"kl": {"placement": "loss", "loss_form": loss_form,
                                            "estimator": estimator}})
    assert (cfg.kl.placement, cfg.kl.loss_form, cfg.kl.estimator) == ("loss", loss_form, estimator)
    assert KLConfig().loss_form is None  # the default placement, the reward, has no loss form


def test_grpo_token_k3_is_accepted_with_a_warning_about_its_gradient():
    with pytest.warns(UserWarning, match=r"grpo_token_k3.*reverse KL\(pi_ref \|\| pi\)"
                                         r".*only to reproduce GRPO"):
        KLConfig(placement="loss", loss_form="grpo_token_k3", controller="fixed", target=None)
