"""`jaxserve bench {serve,throughput,latency} [flags]`."""
from __future__ import annotations

import importlib
import sys

# subcommand -> (module with main(argv, prog), what it measures)
COMMANDS = {
    "serve": ("jaxserve.bench.serve", "load a running server (as `vllm bench serve`)"),
    "throughput": ("jaxserve.bench.throughput", "offline throughput (as `vllm bench throughput`)"),
    "latency": ("jaxserve.bench.latency", "offline batch latency (as `vllm bench latency`)"),
}


def usage() -> str:
    lines = ["usage: jaxserve bench {" + ",".join(COMMANDS) + "} ...", "", "benchmarks:"]
    lines += [f"  {name:<11} {what}" for name, (_, what) in COMMANDS.items()]
    lines += ["", "`jaxserve bench BENCHMARK --help` lists its flags."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        sys.exit(0 if argv else 2)
    if argv[0] not in COMMANDS:
        print(usage(), file=sys.stderr)
        print(f"\njaxserve bench: error: unknown benchmark {argv[0]!r}", file=sys.stderr)
        sys.exit(2)
    module = importlib.import_module(COMMANDS[argv[0]][0])
    module.main(argv[1:], prog=f"jaxserve bench {argv[0]}")


if __name__ == "__main__":
    main()
