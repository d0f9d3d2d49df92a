"""jaxserve's entry points, in one home: the `jaxserve` command (main.py) and its
subcommands serve, generate, plan, convert and bench, each also `python -m
jaxserve.<name>` at its old path (thin aliases for command lines: jaxserve/generate.py,
convert.py, plan.py, console.py, api/__main__.py); code imports them from here."""
