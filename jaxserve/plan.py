"""`python -m jaxserve.plan`: the planner's command line (jaxserve/planning/plan_cli.py)."""
from jaxserve.planning.plan_cli import main

if __name__ == "__main__":
    main()
