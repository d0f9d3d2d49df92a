"""A tiny byte-level BPE tokenizer built offline: the built-in default model's
tokenizer, and the one tests use (detokenizer, engine, server), with no download.

Special tokens: ``<pad>`` = 0, ``<s>`` (bos) = 1, ``</s>`` (eos) = 2. Encoding
with ``add_special_tokens=True`` prepends ``<s>``. The alphabet is printable
ASCII, ``\\n``/``\\t`` and the bytes of the training corpus (which includes
"héllo wörld 日本"), so any ASCII text and the corpus characters round-trip;
other bytes are not in the vocabulary and are dropped on encode. With the
default size there are few merges, so multi-byte characters such as "日" span
several tokens -- useful for testing incomplete UTF-8 handling.
"""

from __future__ import annotations

import json
import string

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

PAD, BOS, EOS = "<pad>", "<s>", "</s>"

CORPUS = [
    "Hello, my name is Alice and I like to write code.",
    "The quick brown fox jumps over the lazy dog.",
    "héllo wörld 日本 ça va? naïve café",
    "The capital of France is Paris. The capital of Japan is Tokyo 東京.",
    "def main():\n\treturn 42  # the answer",
    "Once upon a time, there was a little model that served tokens.",
    "0123456789 + - * / = < > ( ) [ ] { } ! ? ; : ' \" @ # $ % ^ & _ ~ ` |",
]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _byte_level_chars(text: str) -> list[str]:
    """The byte-level (GPT-2 style) characters that encode `text`'s UTF-8 bytes."""
    table = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins
    # ByteLevel.alphabet() is an unordered list; rebuild the byte -> char map the
    # GPT-2 way so we can pick the stand-ins for exactly the bytes we need.
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    mapping: dict[int, str] = {}
    extra = 0
    for b in range(256):
        if b in keep:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    assert set(mapping.values()) == set(table)
    return [mapping[b] for b in text.encode("utf-8")]


def _pad_vocab(tok: Tokenizer, vocab_size: int) -> Tokenizer:
    """Fill ids up to `vocab_size` with filler tokens ``<xN>`` that no merge produces, so
    any id a big-vocabulary model samples decodes to visible text instead of nothing."""
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for i in range(max(vocab.values()) + 1, vocab_size):
        vocab[f"<x{i}>"] = i
    return Tokenizer.from_str(json.dumps(spec))


def make_tiny_tokenizer(path: str | None = None, vocab_size: int = 256) -> PreTrainedTokenizerFast:
    """Train a tiny byte-level BPE tokenizer on CORPUS; exactly `vocab_size` ids (beyond
    what the corpus yields, filler tokens: a random model's text is meaningless anyway).

    Saved with ``save_pretrained(path)`` when `path` is given.
    """
    alphabet_text = string.printable + "".join(CORPUS)
    alphabet = sorted(set(_byte_level_chars(alphabet_text)))
    specials = [PAD, BOS, EOS]
    if vocab_size < len(alphabet) + len(specials):
        raise ValueError(
            f"vocab_size={vocab_size} is too small: the alphabet alone needs "
            f"{len(alphabet) + len(specials)} ids"
        )
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=alphabet,
        min_frequency=1,
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS * 4, trainer=trainer)
    if tok.get_vocab_size() < vocab_size:   # the corpus runs out of merges first
        tok = _pad_vocab(tok, vocab_size)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, 1)]
    )
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    hf.chat_template = CHAT_TEMPLATE
    if path is not None:
        hf.save_pretrained(path)
    return hf
