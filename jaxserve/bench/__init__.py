"""`jaxserve bench serve|throughput|latency`: vLLM's `bench` subcommands, with their
flags, printed lines and JSON, so a pip user benchmarks a server (jaxserve's or
vLLM's) or the offline engine with the same command. benchmarks/ (a source folder, not
installed) builds its comparisons on these modules."""
