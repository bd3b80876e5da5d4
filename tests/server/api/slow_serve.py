"""`toppings-serve` whose every engine step first sleeps STEP_S seconds, for tests that look at a
loaded server: requests stay in flight for a known number of steps however fast the tiny model
is, while everything else (flags, defaults, waitress, signals) is the real command.

    python -m tests.server.api.slow_serve STEP_S [toppings-serve arguments]
"""

from __future__ import annotations

import sys
import time

from toppings.server.cli import main
from toppings.server.model.llama import LlamaModel


def slow_steps(step_s: float) -> None:
    """Make every forward of LlamaModel (one per engine step) sleep step_s seconds first."""
    forward = LlamaModel.forward

    def slow_forward(self, *args, **kwargs):
        time.sleep(step_s)
        return forward(self, *args, **kwargs)

    LlamaModel.forward = slow_forward


if __name__ == "__main__":
    slow_steps(float(sys.argv[1]))
    sys.exit(main(sys.argv[2:]))
