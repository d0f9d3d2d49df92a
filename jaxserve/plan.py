"""`python -m jaxserve.plan`: the planner's command line (jaxserve/planning/plan.py)."""
from jaxserve.planning.plan import main

if __name__ == "__main__":
    main()
