"""`python -m jaxserve.plan`: the planner's command line (jaxserve/cli/plan.py)."""
from __future__ import annotations

from jaxserve.cli.plan import main

if __name__ == "__main__":
    main()
