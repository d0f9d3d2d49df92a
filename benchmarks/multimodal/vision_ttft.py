"""Time to first token on CPU: a text prompt vs the same-length prompt holding one image,
and the image again (an encoder-cache and prefix-cache hit), against transformers.

    python -m benchmarks.multimodal.vision_ttft [--model DIR] [--size 448] [--repeats 3]
        [--prefix-caching] [--turns N] [--json]

Model: the tests' tiny Qwen3.5 vision-language checkpoint
(tests.checkpoints.make_tiny_vision_serving_checkpoint("qwen3_5"), float32, 4096
positions), written once
to $TMPDIR/jaxserve-bench-qwen35-vl (or --model DIR), served with the image processor's
max_pixels raised to --size² (--mm-processor-kwargs), so a --size x --size noise image
is (--size / 32)² image tokens. Each request is greedy, 1 output token.

Cases, each --repeats times after WARM untimed rounds (medians reported), one request
at a time:
- text: a text-only chat whose prompt has as many tokens as the image chat's;
- image: the chat with a new image each time (encoded, no prefix hit);
- image again: the same image as the run before (an encoder-cache hit; with prefix
  caching off, the default here, every case computes its whole prompt; with
  --prefix-caching the text and the repeated image are prefix hits too);
- transformers: the full model's `generate(max_new_tokens=1)` on the image chat
  (preprocessed pixels given; wall time of the call).
TTFT is RequestOutput.metrics.time_to_first_token (arrival to first token).

--turns N: instead, one conversation of N turns that keeps its first turn's image (each turn
resends the history with the last reply and a new question, TURN_TOKENS out a turn): the
first turn's TTFT and the later turns' median, and the encoder cache's hit rate over the
turns' image spans (each span the step reached: a hit, or an image encoded). With prefix
caching on a later turn's image is a prefix hit, which never reaches the encoder.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import numpy as np

from jaxserve import LLM, SamplingParams
from tests.checkpoints import make_tiny_vision_serving_checkpoint, model_class
from tests.image_server import data_url, noise_image

ONE_TOKEN = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
# Untimed rounds first: the first runs of the programs after warmup are several times
# slower on XLA:CPU (measured here: 2.3 s, 0.38 s, then 0.05 s for a 448x448 image).
WARM = 3


def image_chat(image) -> list[dict]:
    return [{"role": "user", "content": [
        {"type": "text", "text": "Describe this image: "},
        {"type": "image_url", "image_url": {"url": data_url(image)}}]}]


def text_chat(llm: LLM, num_tokens: int) -> list[dict]:
    """A text-only chat whose prompt has num_tokens tokens (the tiny tokenizer: one
    token per character after the template's own)."""
    base = len(llm.engine.inputs.render_chat_mm([{"role": "user", "content": ""}])[0])
    return [{"role": "user", "content": "x" * max(num_tokens - base, 1)}]


def ttft(llm: LLM, messages: list[dict]) -> float:
    return llm.chat(messages, ONE_TOKEN, use_tqdm=False)[0].metrics.time_to_first_token


def transformers_seconds(path: str, ids: list[int], image) -> float:
    import torch
    from transformers import AutoImageProcessor
    model = model_class("qwen3_5").from_pretrained(path, dtype=torch.float32).eval()
    proc = AutoImageProcessor.from_pretrained(path, backend="pil",
                                              max_pixels=image.size[0] * image.size[1])
    input_ids = torch.tensor([ids])
    t0 = time.perf_counter()
    px = proc(images=[image], return_tensors="pt")
    with torch.no_grad():
        model.generate(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                       pixel_values=px["pixel_values"], image_grid_thw=px["image_grid_thw"],
                       mm_token_type_ids=(input_ids == model.config.image_token_id).int(),
                       max_new_tokens=1, do_sample=False)
    return time.perf_counter() - t0


TURN_TOKENS = 8


def serve(path: str, size: int, prefix_caching: bool) -> LLM:
    return LLM(path, dtype="float32", max_model_len=2048, max_num_seqs=4,
               max_num_batched_tokens=2048, mm_processor_kwargs={"max_pixels": size * size},
               enable_prefix_caching=prefix_caching)


def conversation(path: str, size: int, turns: int, prefix_caching: bool = False) -> dict:
    llm = serve(path, size, prefix_caching)
    for seed in range(WARM):         # untimed, as in run()
        ttft(llm, image_chat(noise_image(size, size, 1000 + seed)))
    enc = llm.engine.scheduler.encoder
    encoded, hits = enc.num_encoded, enc.num_hits
    reply = SamplingParams(temperature=0.0, max_tokens=TURN_TOKENS, ignore_eos=True)
    messages, times = image_chat(noise_image(size, size, 0)), []
    for turn in range(turns):
        out = llm.chat(messages, reply, use_tqdm=False)[0]
        times.append(out.metrics.time_to_first_token)
        messages = messages + [{"role": "assistant", "content": out.outputs[0].text},
                               {"role": "user", "content": f"And what else, {turn}?"}]
    encoded, hits = enc.num_encoded - encoded, enc.num_hits - hits
    return {"image_size": size, "prefix_caching": prefix_caching, "turns": turns,
            "ttft_ms": {"first turn": round(1000 * times[0], 2),
                        "later turns": round(1000 * statistics.median(times[1:]), 2)},
            "images_encoded": encoded, "encoder_cache_hits": hits,
            # None: no step reached the image (a prefix hit held it), nothing looked up
            "encoder_hit_rate": round(hits / (hits + encoded), 3) if hits + encoded else None}


def run(path: str, size: int, repeats: int, prefix_caching: bool = False) -> dict:
    # Without prefix caching every case computes its whole prompt (the repeated image is
    # an encoder-cache hit only).
    llm = serve(path, size, prefix_caching)
    images = [noise_image(size, size, seed) for seed in range(repeats + WARM)]
    ids, mm = llm.engine.inputs.render_chat_mm(image_chat(images[0]))
    text = text_chat(llm, len(ids))
    for image in images[:WARM]:      # untimed: XLA:CPU's first runs of each program are slow
        ttft(llm, text)
        ttft(llm, image_chat(image))
    cases: dict[str, list[float]] = {"text": [], "image": [], "image again": []}
    for image in images[WARM:]:
        cases["text"].append(ttft(llm, text))
        cases["image"].append(ttft(llm, image_chat(image)))
        cases["image again"].append(ttft(llm, image_chat(image)))
    cases["transformers"] = [transformers_seconds(path, ids, images[0]) for _ in range(repeats)]
    stats = llm.engine.scheduler.encoder
    return {"image_size": size, "prefix_caching": prefix_caching, "prompt_tokens": len(ids), "image_tokens": mm.images[0].length,
            "ttft_ms": {k: round(1000 * statistics.median(v), 2) for k, v in cases.items()},
            "images_encoded": stats.num_encoded, "encoder_cache_hits": stats.num_hits}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=os.path.join(tempfile.gettempdir(),
                                                   "jaxserve-bench-qwen35-vl"))
    p.add_argument("--size", type=int, default=448)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--prefix-caching", action="store_true",
                   help="serve with prefix caching on (the engine's default)")
    p.add_argument("--turns", type=int, default=0, help="a conversation of this many turns")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if not os.path.exists(os.path.join(args.model, "config.json")):
        make_tiny_vision_serving_checkpoint("qwen3_5", args.model, max_position_embeddings=4096)
    np.random.seed(0)
    if args.turns:
        out = conversation(args.model, args.size, args.turns, args.prefix_caching)
    else:
        out = run(args.model, args.size, args.repeats, args.prefix_caching)
    if args.json:
        print(json.dumps(out))
        return
    if args.turns:
        print(f"{out['image_size']}x{out['image_size']} image, {out['turns']} turns, prefix "
              f"caching {'on' if out['prefix_caching'] else 'off'}: TTFT first turn "
              f"{out['ttft_ms']['first turn']:.2f} ms, later turns (median) "
              f"{out['ttft_ms']['later turns']:.2f} ms; images encoded {out['images_encoded']}, "
              f"encoder cache hits {out['encoder_cache_hits']} (hit rate "
              f"{'-' if out['encoder_hit_rate'] is None else out['encoder_hit_rate']})")
        return
    print(f"{out['image_size']}x{out['image_size']} image: {out['image_tokens']} image tokens "
          f"of a {out['prompt_tokens']}-token prompt, prefix caching "
          f"{'on' if out['prefix_caching'] else 'off'}")
    for case, ms in out["ttft_ms"].items():
        print(f"  {case:>13}: {ms:8.2f} ms")
    print(f"  images encoded {out['images_encoded']}, encoder cache hits "
          f"{out['encoder_cache_hits']}")


if __name__ == "__main__":
    main()
