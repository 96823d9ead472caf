"""tether's remote reward service: a reward model, function or judge served over HTTP + JSON so it can
run outside the training job (``reward.kind: remote`` makes a job's reward actors use it).

* ``server``: ``serve(reward_fn, ...)``, FastAPI on uvicorn in a background thread; ``connections``: the
  HTTP connection handling it runs with (per-client bounds, slow-client eviction, JSON parse errors);
* ``client``: ``RewardClient``, what the reward actors call;
* ``cli``: ``python -m services.reward_service`` (``__main__``), a task's reward, a function, a reward model
  or a judge (``judge``) in one command.

Nothing on the ground floor of ``services`` imports this package; it reads the ground floor (the config,
the tasks, the reward models).
"""

from services.reward_service.cli import build_reward, judged_reward, main, parse_args, per_sample
from services.reward_service.client import RewardClient, RewardServiceError
from services.reward_service.server import (
           MIN_TOKEN_CHARS,
           RewardServer,
           build_app,
           check_token,
           is_loopback,
           serve,
)

__all__ = ["MIN_TOKEN_CHARS", "RewardClient", "RewardServer", "RewardServiceError", "build_app",
           "build_reward", "check_token", "is_loopback", "judged_reward", "main", "parse_args", "per_sample",
           "serve"]
