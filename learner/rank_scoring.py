"""What a learner rank scores itself where no actor of that role starts: the reference (``reference.placement``
learner: the rank's own frozen copy of the initial policy; LoRA's base reference: the policy with its adapters off)
and the reward (``reward.placement`` learner: the task's function). A mixin of ``LearnerRank``, whose engine and
forward LoRA's base reference runs on."""

from __future__ import annotations

from typing import TYPE_CHECKING

from actors.reference import ReferenceModel
from actors.reward import RewardScorer

if TYPE_CHECKING:
    from torch import Tensor

    from learner.plan import RankSpec
    from services.experience import RolloutBatch


class ScoresInRank:
    reference: ReferenceModel | None
    rewarder: RewardScorer | None

    def _set_up_scoring(self, spec: RankSpec, device: str) -> None:
        where = f"learner-rank-{self.rank}"
        # the initial policy, frozen, on this rank's device: a resume loads its checkpoint into the engine alone
        self.reference = spec.reference and ReferenceModel(spec.reference, device, where)
        self.rewarder = spec.reward and RewardScorer(spec.reward, "cpu", where)

    def _reference_logprobs(self, chunk: RolloutBatch) -> Tensor:
        """[B, T] the reference's log-probs of the sampled tokens where no reference actor scores them, as one would:
        at the rollout temperature, 0 off the action mask. The rank's own copy of the initial policy
        (reference.placement learner), or the base model (LoRA's base reference: the adapters disabled)."""
        if self.reference is not None:
            return self.reference.score(chunk)
        with self.engine.module.lm.disable_adapter():
            logprobs, _, _ = self._forward(chunk, grad=False)
        return logprobs * chunk.action_mask

    def evaluate_rewards(self, chunk_refs: list, slots: list[int], keep_samples: int) -> list[tuple[int, dict]]:
        """reward.placement learner: (slot, the task's eval metrics as sums and the first samples as text) of each of
        this rank's evaluation chunks, as a reward actor's ``evaluate`` gives them."""
        import ray

        return [(slot, self.rewarder.evaluate(ray.get(ref), slot, keep_samples))
                for ref, slot in zip(chunk_refs, slots, strict=True)]
