"""``python -m ddpkit``: what torchrun starts in each worker of ``ddpkit train``."""

import sys

from ddpkit.app.cli import main

sys.exit(main())
