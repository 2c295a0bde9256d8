#!/usr/bin/env python3
"""Byte-level BPE tokenizer for speclab's reference checkpoint (HF ``tokenizers``).

    python recipes/train_tokenizer.py --preset tiny --out tokenizer.json [--root SITE] \
        [--sample-mb 48]

Layout (docs/model.md §9/§10): ids ``0 .. V-9`` are the BPE vocabulary (256 byte symbols
plus merges), then 8 special tokens at the last ids of the vocab, exactly where
``make_config(preset)`` puts them::

    V-8 <|bos|>   V-7 <|eos|>   V-6 <|pad|>   V-5 <|mask|> (DFlash2 MASK)
    V-4 .. V-1 <|reserved_0|> .. <|reserved_3|>

Pre-tokenizer and decoder: GPT-2 byte-level (``ByteLevel(add_prefix_space=False)``,
its regex split), no normalizer, so ``decode(encode(s)) == s`` for every string.
Post-processor: ``TemplateProcessing("<|bos|> $A")``, as the engine's tokenizer fixture
(``tests/fixtures/tokenizer/make.py``): ``encode(text, add_special_tokens=True)`` is
``<|bos|>`` + ids, the prompt format. Training data is encoded with
``add_special_tokens=False`` and packed as ``<|bos|> text <|eos|>`` per document. Trained on a deterministic sample of the
train split (files with ``corpus.unit_hash(relpath, "tokenizer") < fraction``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SPECIAL_TOKENS = (
    "<|bos|>",
    "<|eos|>",
    "<|pad|>",
    "<|mask|>",
    "<|reserved_0|>",
    "<|reserved_1|>",
    "<|reserved_2|>",
    "<|reserved_3|>",
)


def special_ids(cfg: dict) -> dict[str, int]:
    return {
        "<|bos|>": cfg["bos_token_id"],
        "<|eos|>": cfg["eos_token_id"],
        "<|pad|>": cfg["pad_token_id"],
        "<|mask|>": cfg["mask_token_id"],
    }


def sample_texts(paths: list[str], texts: list[str], sample_bytes: int, salt: str = "tokenizer"):
    """Deterministic sample of about ``sample_bytes`` (whole files, chosen by hash)."""
    import corpus

    total = sum(len(t) for t in texts) or 1
    frac = min(1.0, sample_bytes / total)
    return [t for p, t in zip(paths, texts) if corpus.unit_hash(p, salt) < frac]


def _added(tok_cls, content: str):
    try:
        return tok_cls(content, special=True, normalized=False)
    except TypeError:  # tokenizers < 0.14 has no `special` argument
        return tok_cls(content, normalized=False)


def train_tokenizer(texts: list[str], cfg: dict, log=print, min_frequency: int = 2):
    """Train on ``texts`` -> ``tokenizers.Tokenizer`` with the special ids of ``cfg``."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    t0 = time.time()
    V = cfg["vocab_size"]
    n_special = len(SPECIAL_TOKENS)
    n_regular = V - n_special
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=n_regular,
        min_frequency=min_frequency,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )

    def batches(bs=256):
        for i in range(0, len(texts), bs):
            yield texts[i : i + bs]

    tok.train_from_iterator(batches(), trainer=trainer, length=len(texts))
    got = tok.get_vocab_size(with_added_tokens=False)
    if got < n_regular:
        # A tiny corpus cannot fill the vocab: pad with inert added tokens so the special
        # tokens still land on the ids the config expects (never on a real corpus).
        log(f"[tokenizer] WARNING: BPE vocab {got} < {n_regular}; padding with unused tokens")
        tok.add_tokens([_added(AddedToken, f"<|unused_{i}|>") for i in range(n_regular - got)])
    assert tok.get_vocab_size(with_added_tokens=True) == n_regular, tok.get_vocab_size()
    tok.add_special_tokens([_added(AddedToken, s) for s in SPECIAL_TOKENS])
    bos = cfg["bos_token_id"]
    tok.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A", special_tokens=[("<|bos|>", bos)]
    )
    check_tokenizer(tok, cfg)
    log(f"[tokenizer] trained BPE vocab {V} ({n_regular} + {n_special} special) on "
        f"{len(texts)} files / {sum(len(t) for t in texts) / 1e6:.1f} MB in {time.time() - t0:.1f} s")
    return tok


def check_tokenizer(tok, cfg: dict) -> None:
    V = cfg["vocab_size"]
    assert tok.get_vocab_size(with_added_tokens=True) == V, (tok.get_vocab_size(), V)
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == V - len(SPECIAL_TOKENS) + i, (s, tok.token_to_id(s))
    for s, i in special_ids(cfg).items():
        assert tok.token_to_id(s) == i, (s, i)
    probe = "def f(x):\n    return x ** 2  # \u00e9\u4e2d \U0001F600\n\t<|eos|>"
    enc = tok.encode(probe, add_special_tokens=False)
    assert tok.decode(enc.ids, skip_special_tokens=False) == probe, "byte-level round trip failed"
    assert cfg["eos_token_id"] in enc.ids and cfg["bos_token_id"] not in enc.ids
    assert max(enc.ids) < V
    with_bos = tok.encode(probe).ids  # add_special_tokens=True: the prompt format
    assert with_bos == [cfg["bos_token_id"]] + enc.ids, "post-processor must prepend <|bos|>"


def load_tokenizer(path: str, cfg: dict | None = None):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(path)
    if cfg is not None:
        check_tokenizer(tok, cfg)
    return tok


def main(argv=None) -> int:
    import corpus
    import model as M

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=M.PRESET_NAMES)
    ap.add_argument("--root", default=None)
    ap.add_argument("--sample-mb", type=float, default=48.0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    cfg = M.make_config(a.preset)
    c = corpus.load_corpus(a.root)
    texts = sample_texts(c.train.paths, c.train.texts, int(a.sample_mb * 1e6))
    tok = train_tokenizer(texts, cfg)
    tok.save(a.out)
    held = c.heldout.texts
    t0 = time.time()
    n = sum(len(e.ids) for e in tok.encode_batch(held, add_special_tokens=False))
    nbytes = sum(len(t.encode("utf-8")) for t in held)
    print(json.dumps({"heldout_tokens": n, "heldout_bytes": nbytes, "bytes_per_token": nbytes / n,
                      "encode_s": round(time.time() - t0, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
