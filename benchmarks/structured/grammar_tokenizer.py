"""The tokenizer every grammar backend is measured with: a byte-level BPE with real
merges, trained here on generated English, JSON and code-like text (no hub downloads,
so the benchmark runs offline) and cached under the temporary directory."""
from __future__ import annotations

import json
import os
import random
import tempfile
from typing import Any

CORPUS_VERSION = 1          # bump when the generated training text changes
EOS = "<|endoftext|>"

_ENGLISH = (
    "the of and to a in is it you that he was for on are with as I his they be at one "
    "have this from or had by not word but what some we can out other were all there "
    "when up use your how said an each she which do their time if will way about many "
    "then them write would like so these her long make thing see him two has look more "
    "day could go come did number sound no most people my over know water than call "
    "first who may down side been now find any new work part take get place made live "
    "where after back little only round man year came show every good me give our under "
    "name very through just form sentence great think say help low line differ turn "
    "cause much mean before move right boy old too same tell does set three want air "
    "well also play small end put home read hand port large spell add even land here "
    "must big high such follow act why ask men change went light kind off need house "
    "picture try us again animal point mother world near build self earth father head "
    "stand own page should country found answer school grow study still learn plant "
    "cover food sun four between state keep eye never last let thought city tree cross "
    "farm hard start might story saw far sea draw left late run while press close night "
    "real life few north open seem together next white children begin got walk example "
    "ease paper group always music those both mark often letter until mile river car "
    "feet care second book carry took science eat room friend began idea fish mountain "
    "stop once base hear horse cut sure watch color face wood main enough plain girl "
    "usual young ready above ever red list though feel talk bird soon body dog family "
    "direct pose leave song measure door product black short numeral class wind question "
    "happen complete ship area half rock order fire south problem piece told knew pass "
    "since top whole king space heard best hour better true during hundred five remember "
    "step early hold west ground interest reach fast verb sing listen six table travel "
    "less morning ten simple several vowel toward war lay against pattern slow center "
    "love person money serve appear road map rain rule govern pull cold notice voice "
    "unit power town fine certain fly fall lead cry dark machine note wait plan figure "
    "star box noun field rest correct able pound done beauty drive stood contain front "
    "teach week final gave green quick develop ocean warm free minute strong special "
    "mind behind clear tail produce fact street inch multiply nothing course stay wheel "
    "full force blue object decide surface deep moon island foot system busy test record "
    "boat common gold possible plane stead dry wonder laugh thousand ago ran check game "
    "shape equate miss brought heat snow tire bring yes distant fill east paint language "
    "among grand ball yet wave drop heart present heavy dance engine position arm wide "
    "sail material size vary settle speak weight general ice matter circle pair include "
    "divide syllable felt perhaps pick sudden count square reason length represent art "
    "subject region energy hunt probable bed brother egg ride cell believe fraction "
    "forest sit race window store summer train sleep prove lone leg exercise wall catch "
    "mount wish sky board joy winter sat written wild instrument kept glass grass cow "
    "job edge sign visit past soft fun bright gas weather month million bear finish "
    "happy hope flower clothe strange gone jump baby eight village meet root buy raise "
    "solve metal whether push seven paragraph third shall held hair describe cook floor "
    "either result burn hill safe cat century consider type law bit coast copy phrase "
    "silent tall sand soil roll temperature finger industry value fight lie beat excite "
    "natural view sense ear else quite broke case middle kill son lake moment scale loud "
    "spring observe child straight consonant nation dictionary milk speed method organ "
    "pay age section dress cloud surprise quiet stone tiny climb cool design poor lot "
    "experiment bottom key iron single stick flat twenty skin smile crease hole trade "
    "melody trip office receive row mouth exact symbol die least trouble shout except "
    "wrote seed tone join suggest clean break lady yard rise bad blow oil blood touch "
    "grew cent mix team wire cost lost brown wear garden equal sent choose fell fit flow "
    "fair bank collect save control decimal gentle woman captain practice separate "
    "difficult doctor please protect noon whose locate ring character insect caught "
    "period indicate radio spoke atom human history effect electric expect crop modern "
    "element hit student corner party supply bone rail imagine provide agree thus "
    "capital chair danger fruit rich thick soldier process operate guess necessary sharp "
    "wing create neighbor wash bat rather crowd corn compare poem string bell depend "
    "meat rub tube famous dollar stream fear sight thin triangle planet hurry chief "
    "colony clock mine tie enter major fresh search send yellow gun allow print dead "
    "spot desert suit current lift rose continue block chart hat sell success company "
    "subtract event particular deal swim term opposite wife shoe shoulder spread arrange "
    "camp invent cotton born determine quart nine truck noise level chance gather shop "
    "stretch throw shine property column molecule select wrong gray repeat require broad "
    "prepare salt nose plural anger claim continent oxygen sugar death pretty skill "
    "women season solution magnet silver thank branch match suffix especially fig afraid "
    "huge sister steel discuss forward similar guide experience score apple bought led "
    "pitch coat mass card band rope slip win dream evening condition feed tool total "
    "basic smell valley nor double seat arrive master track parent shore division sheet "
    "substance favor connect post spend chord fat glad original share station dad bread "
    "charge proper bar offer segment slave duck instant market degree populate chick "
    "dear enemy reply drink occur support speech nature range steam motion path liquid "
    "log meant quotient teeth shell neck").split()
_ONSETS = ("b c d f g h j k l m n p r s t v w z bl br ch cl cr dr fl fr gl gr pl pr sc "
           "sh sk sl sm sn sp st str sw th tr tw wh").split()
_NUCLEI = "a e i o u y ai au ea ee ei ie io oa oo ou ue".split()
_CODAS = ["", "", "", "n", "r", "s", "t", "l", "m", "nd", "ng", "nt", "rd", "rt", "st",
          "ck", "ll", "ss", "x", "th", "sh", "tion", "ment", "ness", "ing", "ed", "er"]


def _synthetic_words(rng: random.Random, n: int) -> list[str]:
    words = set()
    while len(words) < n:
        syllables = rng.choice((1, 2, 2, 3))
        words.add("".join(rng.choice(_ONSETS) + rng.choice(_NUCLEI) + rng.choice(_CODAS)
                          for _ in range(syllables)))
    return sorted(words)


class _Words:
    """Zipf-distributed draws over real English words, then synthetic ones."""

    def __init__(self, rng: random.Random, n_synthetic: int = 40000):
        self.rng = rng
        self.words = _ENGLISH + _synthetic_words(rng, n_synthetic)
        cum, total = [], 0.0
        for rank in range(len(self.words)):
            total += 1.0 / (rank + 2.7)
            cum.append(total)
        self.cum = cum

    def draw(self, k: int = 1) -> list[str]:
        return self.rng.choices(self.words, cum_weights=self.cum, k=k)

    def ident(self) -> str:
        parts = self.draw(self.rng.choice((1, 2, 2, 3)))
        style = self.rng.random()
        if style < 0.5:
            return "_".join(parts)
        if style < 0.8:
            return parts[0] + "".join(p.capitalize() for p in parts[1:])
        return "".join(p.capitalize() for p in parts)


def _sentence(w: _Words) -> str:
    rng = w.rng
    words = w.draw(rng.randint(4, 22))
    words[0] = words[0].capitalize()
    for i in range(1, len(words) - 1):
        if rng.random() < 0.06:
            words[i] += ","
        elif rng.random() < 0.03:
            words[i] = words[i].capitalize()
        elif rng.random() < 0.03:
            words[i] = str(rng.choice((rng.randint(0, 100), rng.randint(1900, 2030))))
    end = rng.choices((".", "?", "!", ":"), weights=(85, 8, 4, 3))[0]
    return " ".join(words) + end


def _json_value(w: _Words, depth: int) -> Any:
    rng = w.rng
    r = rng.random()
    if depth < 3 and r < 0.12:
        return {w.ident(): _json_value(w, depth + 1) for _ in range(rng.randint(1, 5))}
    if depth < 3 and r < 0.22:
        return [_json_value(w, depth + 1) for _ in range(rng.randint(0, 4))]
    if r < 0.45:
        return " ".join(w.draw(rng.randint(1, 6)))
    if r < 0.62:
        return rng.randint(-1000, 100000)
    if r < 0.72:
        return round(rng.uniform(-100, 1000), rng.randint(1, 4))
    if r < 0.8:
        return rng.choice((True, False, None))
    if r < 0.9:
        return (f"{rng.randint(2000, 2030)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
                + (f"T{rng.randint(0, 23):02d}:{rng.randint(0, 59):02d}:00Z"
                   if rng.random() < 0.5 else ""))
    return f"{w.draw()[0]}.{w.draw()[0]}@{w.draw()[0]}.{rng.choice(('com', 'org', 'io'))}"


def _json_doc(w: _Words) -> str:
    rng = w.rng
    doc = {w.ident(): _json_value(w, 1) for _ in range(rng.randint(2, 9))}
    style = rng.random()
    if style < 0.4:
        return json.dumps(doc, separators=(",", ":"))
    if style < 0.7:
        return json.dumps(doc)
    return json.dumps(doc, indent=rng.choice((2, 4)))


def _code_block(w: _Words) -> str:
    rng = w.rng
    f, a, b, c = (w.ident() for _ in range(4))
    n = rng.randint(0, 512)
    if rng.random() < 0.6:   # python-like
        lines = [f"def {f}({a}, {b}={n}):",
                 f'    """{_sentence(w)}"""',
                 f"    {c} = {a}.get({json.dumps(w.draw()[0])}, [])",
                 f"    for i in range(len({c})):",
                 f"        if {c}[i] >= {b}:",
                 f"            {c}[i] += {rng.randint(1, 9)}",
                 f"    return {{{json.dumps(w.draw()[0])}: {c}, \"total\": sum({c})}}"]
    else:                    # javascript-like
        lines = [f"function {f}({a}, {b}) {{",
                 f"  // {_sentence(w)}",
                 f"  const {c} = {a}.map((x) => x * {n});",
                 f"  if ({c}.length === 0 && {b} !== null) {{",
                 f"    return {{ error: \"{' '.join(w.draw(3))}\" }};",
                 "  }",
                 f"  return {c}.filter((x) => x > {b}).join(\", \");",
                 "}"]
    return "\n".join(lines)


def corpus(seed: int = 0, n_chars: int = 6_000_000) -> list[str]:
    """Deterministic training text: paragraphs of English, JSON documents, code."""
    w = _Words(random.Random(seed))
    rng, out, size = w.rng, [], 0
    while size < n_chars:
        r = rng.random()
        if r < 0.5:
            text = " ".join(_sentence(w) for _ in range(rng.randint(2, 8)))
        elif r < 0.8:
            text = _json_doc(w)
        else:
            text = _code_block(w)
        out.append(text)
        size += len(text)
    return out


def make_bpe_tokenizer(path: str, vocab_size: int, seed: int = 0,
                       n_chars: int | None = None) -> Any:
    """A byte-level BPE (GPT-2 style pre-tokenizer and decoder, EOS `<|endoftext|>`)
    trained on `corpus`, saved at `path` as a PreTrainedTokenizerFast and loaded from
    there when it exists."""
    from transformers import PreTrainedTokenizerFast
    if os.path.exists(os.path.join(path, "tokenizer.json")):
        return PreTrainedTokenizerFast.from_pretrained(path)
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    if n_chars is None:   # enough distinct text for the merges of a large vocabulary
        n_chars = max(400_000, min(8_000_000, vocab_size * 200))
    tok.train_from_iterator(corpus(seed, n_chars), trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS, bos_token=EOS,
                                 unk_token=None)
    os.makedirs(path, exist_ok=True)
    hf.save_pretrained(path)
    return PreTrainedTokenizerFast.from_pretrained(path)


def tokenizer_dir(vocab_size: int, seed: int = 0) -> str:
    return os.path.join(tempfile.gettempdir(),
                        f"jaxserve-bench-bpe-v{CORPUS_VERSION}-{vocab_size}-s{seed}")
