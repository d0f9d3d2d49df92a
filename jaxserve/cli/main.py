"""The `jaxserve` command: `jaxserve serve MODEL [flags]` as `vllm serve`, and the other
entry points under one name (each is also `python -m jaxserve.<module>`)."""
from __future__ import annotations

import importlib
import sys

import jaxserve

# subcommand -> (module with main(argv), what it does)
_COMMANDS = {
    "serve": ("jaxserve.cli.serve", "start the OpenAI-compatible server (as `vllm serve`)"),
    "generate": ("jaxserve.cli.generate", "generate text offline from the command line"),
    "plan": ("jaxserve.cli.plan", "plan a model's memory on a mesh, or compile it for a TPU"),
    "convert": ("jaxserve.cli.convert", "convert a checkpoint to the tree the engine runs"),
    "bench": ("jaxserve.cli.bench", "benchmark a server or the engine (as `vllm bench`)"),
}


def _usage() -> str:
    lines = ["usage: jaxserve [--version] {" + ",".join(_COMMANDS) + "} ...", "",
             "jaxserve: a JAX/XLA serving engine for large language models.", "",
             "commands:"]
    lines += [f"  {name:<10} {what}" for name, (_, what) in _COMMANDS.items()]
    lines += ["", "`jaxserve COMMAND --help` lists a command's flags."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        sys.exit(0 if argv else 2)
    if argv[0] in ("-V", "--version"):
        print(f"jaxserve {jaxserve.__version__}")
        return
    command, rest = argv[0], argv[1:]
    if command not in _COMMANDS:
        print(_usage(), file=sys.stderr)
        print(f"\njaxserve: error: unknown command {command!r}", file=sys.stderr)
        sys.exit(2)
    module = importlib.import_module(_COMMANDS[command][0])
    if command == "serve":
        module.main(rest, prog="jaxserve serve")
    else:
        module.main(rest)


if __name__ == "__main__":
    main()
