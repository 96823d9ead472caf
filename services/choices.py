"""The config's enumerated KL loss forms as plain data: ``services.config`` reads them from here, so that
loading the config (the driver, the pre-flight checks) never imports torch through ``learner.kl``."""

from __future__ import annotations

from typing import Literal

LossForm = Literal["kl_to_go", "response_k2", "grpo_token_k3"]
GRPO_TOKEN_K3_WARNING = (
    "kl.loss_form='grpo_token_k3' (GRPO's per-token k3 in the loss) has the expected gradient of the reverse "
    "KL(pi_ref || pi) per token, not of the response KL, and as a token mean its beta and kl.target do not "
    "mean what they mean with kl.placement='reward'; use it only to reproduce GRPO"
)
