"""The image encoder's programs at Qwen3.6-27B's size, compiled for TPU by libtpu's
deviceless compiler (no TPU needed): per bucket, the compile time and the per-device
memory of the compiled program (arguments, output, temporaries).

    python -m benchmarks.multimodal.encoder_tpu_compile [--target tpu-v6e] [--mesh 1x8] \\
        [--buckets 16,65536] [--json FILE]

The tower: transformers' Qwen3_5VisionConfig defaults (27 layers, hidden 1152, 16 heads,
MLP 4304, patches of 16, 2x2 merge: ~0.45 B parameters, the size docs/VISION.md gives the
Qwen3.5/3.6 towers) projecting into the 27B's 5120-wide text embeddings; the processor's
limit 16,777,216 pixels an image (16,384 tokens, 65,536 patches: the largest bucket); a
step's token budget of --max-num-batched-tokens. Random weights written by transformers
(tests/checkpoints.py), served in bfloat16, the tower replicated on the mesh's devices as
the engine places it (runner/image_encoder.py). --tiny: the tests' tiny tower instead
(seconds; the benchmark's own test).
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

TEXT_HIDDEN = 5120                 # Qwen3.6-27B's hidden size
MAX_PIXELS = 16_777_216            # the published processor's longest_edge
MIN_PIXELS = 65_536


def make_checkpoint(path: Path, tiny: bool) -> str:
    """A Qwen3.5 vision-language checkpoint whose tower has the published size (--tiny:
    the tests' tiny one) and whose processor allows the published largest image."""
    from tests.checkpoints import make_tiny_vision_serving_checkpoint
    vision = None if tiny else {"depth": 27, "hidden_size": 1152, "num_heads": 16,
                                "intermediate_size": 4304, "out_hidden_size": TEXT_HIDDEN}
    make_tiny_vision_serving_checkpoint("qwen3_5", path, vision=vision)
    if not tiny:
        pfile = path / "preprocessor_config.json"
        pcfg = json.loads(pfile.read_text())
        pcfg.update(size={"longest_edge": MAX_PIXELS, "shortest_edge": MIN_PIXELS},
                    max_pixels=MAX_PIXELS, min_pixels=MIN_PIXELS)
        pfile.write_text(json.dumps(pcfg, indent=2))
    return str(path)


def compile_buckets(model_dir: str, *, target: str, mesh: str, num_batched_tokens: int,
                    hidden_size: int, buckets: set[int] | None) -> dict[str, Any]:
    from jaxserve.build.vision import load_vision
    from jaxserve.config.media import MediaConfig
    from jaxserve.multimodal.front import ImageFront
    from jaxserve.runner.image_encoder import ImageEncoder
    from sharding.tpu_targets import abstract_tpu_mesh

    parts, fig = load_vision(ImageFront.for_model(model_dir, MediaConfig()), jnp.bfloat16,
                             num_batched_tokens, hidden_size)
    devices = abstract_tpu_mesh(target, mesh)
    encoder = ImageEncoder(parts, hidden_size=hidden_size, dtype=jnp.bfloat16, mesh=devices,
                           abstract=True)
    rows = []
    for program in encoder.programs():
        if buckets and program.tokens not in buckets:
            continue
        t0 = time.perf_counter()
        with jax.set_mesh(devices):
            compiled = program.fn.lower(*program.args()).compile()
        seconds = time.perf_counter() - t0
        mem = compiled.memory_analysis()
        rows.append({"patches": program.tokens, "compile_s": round(seconds, 2),
                     "argument_bytes": mem.argument_size_in_bytes,
                     "output_bytes": mem.output_size_in_bytes,
                     "alias_bytes": mem.alias_size_in_bytes,
                     "temp_bytes": mem.temp_size_in_bytes})
        print(f"bucket {program.tokens:6d} patches: compiled in {seconds:6.1f} s, temporaries "
              f"{mem.temp_size_in_bytes / 2**20:8.1f} MiB, arguments "
              f"{mem.argument_size_in_bytes / 2**30:.3f} GiB", flush=True)
    return {"target": target, "mesh": mesh, "num_batched_tokens": num_batched_tokens,
            "hidden_size": hidden_size, "num_params": fig.num_params,
            "weight_bytes": fig.weight_bytes, "cache_rows": fig.cache_rows,
            "cache_bytes": fig.cache_bytes, "planner_activation_bytes": fig.activation_bytes,
            "max_tokens": fig.max_tokens, "buckets": list(fig.buckets), "programs": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="tpu-v6e")
    ap.add_argument("--mesh", default="1x8")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--buckets", default="", help="patch counts to compile (default: all)")
    ap.add_argument("--tiny", action="store_true", help="the tests' tiny tower")
    ap.add_argument("--json", default=None, help="write the results here")
    args = ap.parse_args(argv)
    buckets = {int(b) for b in args.buckets.split(",") if b}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        model_dir = make_checkpoint(Path(tmp) / "qwen3_5_vl", args.tiny)
        print(f"checkpoint written in {time.perf_counter() - t0:.1f} s", flush=True)
        out = compile_buckets(model_dir, target=args.target, mesh=args.mesh,
                              num_batched_tokens=args.max_num_batched_tokens,
                              hidden_size=64 if args.tiny else TEXT_HIDDEN, buckets=buckets)
    out["tower"] = "tiny" if args.tiny else "qwen3.6-27b"
    print(f"tower {out['num_params'] / 1e6:.1f} M params ({out['weight_bytes'] / 2**30:.3f} GiB "
          f"a device), encoder cache {out['cache_rows']} rows ({out['cache_bytes'] / 2**30:.3f} "
          f"GiB), planner's activation reserve {out['planner_activation_bytes'] / 2**30:.3f} GiB")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
