"""Incremental detokenization: jaxserve's hand-written window decoder against
`tokenizers.decoders.DecodeStream`, per output token.

    python -m benchmarks.step.detokenizer --output-dir benchmarks/results

Tokenizers (all built offline, no hub downloads; the larger two cached in the temp dir):
- "tiny": the test tokenizer (jaxserve.checkpoints.tiny_tokenizer, byte-level BPE, 256 ids);
- "bpe-32k": a byte-level BPE (GPT-2 / Llama 3 / Qwen style) with 32000 ids trained on
  English, JSON and code (benchmarks/structured/grammar_tokenizer.py);
- "sp-32k": a SentencePiece-style BPE (Llama 2 / Mistral / Gemma style: "▁" for spaces,
  byte-fallback <0xNN> tokens, a decoder that strips the leading space) with 32000 ids
  trained on the same text.
The stream: --num-tokens ids of the encoding of English, JSON and code paragraphs, each
followed by multi-byte text (accents, CJK, Cyrillic, Greek, emoji: several tokens per
character in these vocabularies), an eos special token between paragraphs every ~400
ids; 5 prompt ids of context. Checked but not timed: the same ids with the eos at exactly
every 400th id, inside a character's bytes where it falls.

Each decoder turns the stream into text one id per `update` (what a streaming request
costs, per token); also timed: lazy mode (a request that neither streams nor has stop
strings: every id recorded, one decode at the end). Decoders:
- "hand-written": jaxserve.engine.detokenizer.IncrementalDetokenizer;
- "DecodeStream": the bare `DecodeStream.step(tokenizer, id)` loop (text pieces only:
  no stop strings, no held-back tail at the end: the floor of what the library costs);
- "DecodeStream-backed": `StreamDetokenizer` below, IncrementalDetokenizer with the
  window decodes done by DecodeStream and what the engine needs on top (stop strings,
  the tail flushed by finalize, lazy mode).
Every decoder's text is checked against a full decode (`text_after`: the text `ids` add
after the context), with special tokens skipped and kept ("raises" where it raises).
Medians of --repeats interleaved runs.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from typing import Any

from tokenizers.decoders import DecodeStream

from benchmarks.shared.results_io import markdown_table, write_results
from jaxserve.engine.detokenizer import IncrementalDetokenizer

MULTIBYTE = ["héllo wörld, ça va? naïve café", "日本語のテキストと東京タワー",
             "привет мир, как дела", "emoji 🙂🚀 and 👩‍💻 done", "Ελληνικά γράμματα"]
EOS_EVERY = 400


class StreamDetokenizer(IncrementalDetokenizer):
    """IncrementalDetokenizer whose window decodes are tokenizers' DecodeStream (fast
    tokenizers only). DecodeStream holds text ending in U+FFFD until a later id
    completes it and never flushes it, so the ids it holds are tracked here: finalize
    decodes them after the ids of its last emission (the same window algorithm)."""

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int] | None, **kw: Any):
        super().__init__(tokenizer, prompt_token_ids, **kw)
        self._backend = tokenizer.backend_tokenizer
        context = self._window[:self._read_offset]
        self._stream = DecodeStream(ids=context, skip_special_tokens=self.skip_special_tokens)
        self._last_emitted: list[int] = list(context)   # ids of the stream's last text
        self._held: list[int] = []                      # ids fed since then

    def _advance(self, final: bool) -> str | None:
        new = self._window[self._read_offset:]
        self._read_offset = len(self._window)
        text = self._stream.step(self._backend, new) if new else None
        if text is not None:
            self._last_emitted, self._held = self._held + new, []
        else:
            self._held += new
            if not (final and self._held):
                return None
            base = self._decode_fn(self._last_emitted, self.skip_special_tokens)
            text = self._decode_fn(self._last_emitted + self._held,
                                   self.skip_special_tokens)[len(base):]
            self._held = []
            if not text:
                return None
        self.output_text += text
        return self._check_stop(len(text))


def make_sp_tokenizer(path: str, vocab_size: int, texts: list[str]) -> Any:
    """A SentencePiece-style BPE (Metaspace, byte fallback, <unk> <s> </s>), saved at
    `path` as a PreTrainedTokenizerFast and loaded from there when it exists."""
    from transformers import PreTrainedTokenizerFast
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        return PreTrainedTokenizerFast.from_pretrained(path)
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    specials = ["<unk>", "<s>", "</s>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                           normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never",
                                                 split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                     decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 256, special_tokens=specials,
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    # The 256 byte tokens take the last ids, as regular (not special) tokens.
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    tok = Tokenizer.from_str(json.dumps(spec))
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                 eos_token="</s>")
    os.makedirs(path, exist_ok=True)
    hf.save_pretrained(path)
    return PreTrainedTokenizerFast.from_pretrained(path)


def tokenizers_by_name(names: list[str]) -> dict[str, Any]:
    from benchmarks.structured.grammar_tokenizer import corpus, make_bpe_tokenizer, tokenizer_dir
    from jaxserve.checkpoints.tiny_tokenizer import make_tiny_tokenizer
    out = {}
    for name in names:
        if name == "tiny":
            out[name] = make_tiny_tokenizer()
        elif name == "bpe-32k":
            out[name] = make_bpe_tokenizer(tokenizer_dir(32000), 32000)
        elif name == "sp-32k":
            out[name] = make_sp_tokenizer(
                os.path.join(tempfile.gettempdir(), "jaxserve-bench-sp-32000-s0"), 32000,
                corpus(0, 6_400_000))
        else:
            raise SystemExit(f"unknown tokenizer {name!r}")
    return out


def token_stream(tok: Any, num_tokens: int, seed: int = 1, eos_anywhere: bool = False
                 ) -> list[int]:
    """num_tokens ids: English / JSON / code paragraphs, each followed by multi-byte text,
    and an eos id after the paragraph that passes each EOS_EVERY ids. eos_anywhere: the
    eos goes in at exactly every EOS_EVERY ids instead, inside a character's bytes where
    it falls there (a model can sample that)."""
    from benchmarks.structured.grammar_tokenizer import corpus
    ids: list[int] = []
    since_eos = 0
    for i, text in enumerate(corpus(seed, 40 * num_tokens)):
        piece = tok.encode(f"{text} {MULTIBYTE[i % len(MULTIBYTE)]}\n", add_special_tokens=False)
        ids += piece
        since_eos += len(piece)
        if since_eos >= EOS_EVERY and not eos_anywhere:
            ids.append(tok.eos_token_id)
            since_eos = 0
        if len(ids) >= num_tokens:
            break
    if eos_anywhere:
        ids = [t for i in range(0, len(ids), EOS_EVERY)
               for t in ids[i:i + EOS_EVERY] + [tok.eos_token_id]]
    return ids[:num_tokens]


def text_after(tok: Any, context: list[int], ids: list[int], skip: bool) -> str:
    """What `ids` add to the text after `context` in one full decode: with a tokenizer that
    strips a leading space (SentencePiece), what a detokenizer given `context` must emit."""
    return tok.decode(context + ids, skip_special_tokens=skip)[
        len(tok.decode(context, skip_special_tokens=skip)):]


def same_text(run: Callable[[], str], want: str) -> bool | str:
    """Whether run() gives `want`; the error's text if it raises (DecodeStream raises when
    a new id changes text it already returned)."""
    try:
        return run() == want
    except Exception as e:   # noqa: BLE001 -- recorded, the other decoders still run
        return f"{type(e).__name__}: {e}"


def run_updates(make: Callable[[], Any], ids: list[int]) -> str:
    """One id per update, then finalize (lazy mode: `make` builds a lazy detokenizer)."""
    detok = make()
    for t in ids:
        detok.update([t])
    return detok.finalize()


def run_bare_stream(tok: Any, context: list[int], ids: list[int], skip: bool) -> str:
    stream, backend, pieces = DecodeStream(ids=context, skip_special_tokens=skip), \
        tok.backend_tokenizer, []
    for t in ids:
        text = stream.step(backend, t)
        if text is not None:
            pieces.append(text)
    return "".join(pieces)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output-dir", required=True)
    ap.add_argument("--tokenizers", default="tiny,bpe-32k,sp-32k")
    ap.add_argument("--num-tokens", type=int, default=4000)
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)

    rows, checks = [], {}
    for name, tok in tokenizers_by_name(args.tokenizers.split(",")).items():
        ids = token_stream(tok, args.num_tokens)
        context = tok.encode("The answer:", add_special_tokens=False)[-5:]
        hand = lambda lazy=False, skip=True: IncrementalDetokenizer(  # noqa: E731
            tok, context, skip_special_tokens=skip, incremental=not lazy)
        backed = lambda lazy=False, skip=True: StreamDetokenizer(  # noqa: E731
            tok, context, skip_special_tokens=skip, incremental=not lazy)
        cases: dict[tuple[str, str], Callable[[], str]] = {
            ("streaming", "hand-written"): lambda: run_updates(hand, ids),
            ("streaming", "DecodeStream"): lambda: run_bare_stream(tok, context, ids, True),
            ("streaming", "DecodeStream-backed"): lambda: run_updates(backed, ids),
            ("lazy", "hand-written"): lambda: run_updates(lambda: hand(lazy=True), ids),
            ("lazy", "DecodeStream-backed"): lambda: run_updates(lambda: backed(lazy=True), ids),
        }
        # Correctness first: skipped and kept special tokens, every decoder.
        anywhere = token_stream(tok, args.num_tokens, eos_anywhere=True)
        for skip, ids_ in itertools.product((True, False), (ids, anywhere)):
            want = text_after(tok, context, ids_, skip)
            runs = {"hand-written": lambda: run_updates(lambda: hand(skip=skip), ids_),
                    "hand-written lazy": lambda: run_updates(lambda: hand(lazy=True, skip=skip),
                                                             ids_),
                    "DecodeStream": lambda: run_bare_stream(tok, context, ids_, skip),
                    "DecodeStream-backed": lambda: run_updates(lambda: backed(skip=skip), ids_),
                    "DecodeStream-backed lazy": lambda: run_updates(
                        lambda: backed(lazy=True, skip=skip), ids_)}
            where = f"eos every {EOS_EVERY} ids" if ids_ is anywhere else "eos between paragraphs"
            checks[f"{name}, {where}, skip_special_tokens={skip}"] = {
                k: same_text(run, want) for k, run in runs.items()}
        times: dict[tuple[str, str], list[float] | None] = {k: [] for k in cases}
        for _ in range(args.repeats):
            for key, fn in cases.items():
                if times[key] is None:   # raised on this stream: not timed
                    continue
                t0 = time.perf_counter()
                try:
                    fn()
                except Exception:   # noqa: BLE001 -- the checks table records the error
                    times[key] = None
                    continue
                times[key].append(time.perf_counter() - t0)
        base = {mode: statistics.median(ts) for (mode, dec), ts in times.items()
                if dec == "hand-written" and ts}
        for (mode, dec), ts in times.items():
            if ts is None:
                print(name, mode, dec, "raises: not timed", flush=True)
                continue
            med = statistics.median(ts)
            rows.append({"tokenizer": name, "vocab": len(tok), "mode": mode, "decoder": dec,
                         "us_per_token": med / len(ids) * 1e6, "runs_s": ts,
                         "vs_hand_written": base[mode] / med})
            print(rows[-1]["tokenizer"], mode, dec, f"{rows[-1]['us_per_token']:.2f} us/token",
                  flush=True)
    table = markdown_table(
        ["tokenizer", "mode", "decoder", "us / token", "speed vs hand-written"],
        [[r["tokenizer"], r["mode"], r["decoder"], r["us_per_token"],
          f"{r['vs_hand_written']:.2f}x"] for r in rows])
    table += "\n\n" + markdown_table(
        ["stream", *next(iter(checks.values()))],
        [[k, *({True: "same", False: "DIFFERENT"}.get(ok, "raises") for ok in v.values())]
         for k, v in checks.items()])
    write_results(args.output_dir, "detokenizer", benchmark="detokenizer",
                  argv=sys.argv[1:] if argv is None else argv,
                  config={"tokenizers": args.tokenizers.split(","),
                          "num_tokens": args.num_tokens, "repeats": args.repeats,
                          "eos_every": EOS_EVERY, "multibyte": MULTIBYTE},
                  results={"rows": rows, "text_equals_full_decode": checks}, table=table,
                  notes=["us / token: median over --repeats runs of one stream, one id per "
                         "update (lazy: all ids recorded, decoded at finalize)",
                         "text compared with one full decode of context + stream, minus the "
                         "context's text"])


if __name__ == "__main__":
    main()
