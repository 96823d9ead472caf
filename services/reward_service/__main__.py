"""``python -m services.reward_service``: the reward service's command line (``cli``)."""

import sys

from services.reward_service.cli import main

sys.exit(main())
