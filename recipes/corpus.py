#!/usr/bin/env python3
"""The training corpus: the Python sources of a site-packages directory.

    python recipes/corpus.py [--root DIR] [--json]      # print the manifest

Rule (fixed; recorded in every manifest as ``SPLIT_RULE``):

* Files: every regular file named ``*.py`` under ``root`` (``os.walk``, symlinks not
  followed), with ``relpath`` = its path relative to ``root`` with ``/`` separators.
  Skipped: files larger than 1 MiB (``MAX_FILE_BYTES``), empty files, files that are
  not valid UTF-8 (strict decode). A leading UTF-8 BOM is stripped.
* Exact duplicates (same bytes) are kept once, under the lexicographically smallest
  ``relpath`` (so a vendored copy cannot sit on both sides of the split).
* Split: ``held-out`` iff ``sha256(relpath.encode("utf-8")).digest()[0] < 8``
  (8/256 = 3.125 % of files), else ``train``.
* Order: ascending ``relpath`` (byte order of the UTF-8 string) in both splits.

The manifest records, per split, the file count, bytes (UTF-8), and a fingerprint:
sha256 over the lines ``relpath \\t sha256(content) \\n`` in split order.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import site
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

MAX_FILE_BYTES = 1 << 20
HELDOUT_FIRST_BYTE_LT = 8
SPLIT_RULE = (
    "*.py under site-packages, <= 1 MiB, non-empty, strict UTF-8 (BOM stripped); exact "
    "duplicate contents kept once under the smallest relpath; held-out iff "
    "sha256(relpath.encode('utf-8')).digest()[0] < 8 (relpath relative to site-packages, "
    "'/' separators), else train; both splits in ascending relpath order"
)


def default_root() -> str:
    """``site.getsitepackages()[0]``; if that holds (almost) no ``*.py`` (a distro layout
    where packages live in another directory), the site-packages that holds numpy."""
    root = site.getsitepackages()[0]
    if _count_py(root, stop=1000) >= 1000:
        return root
    try:
        import numpy

        alt = os.path.dirname(os.path.dirname(os.path.abspath(numpy.__file__)))
        if _count_py(alt, stop=1000) >= 1000:
            return alt
    except ImportError:
        pass
    return root


def _count_py(root: str, stop: int) -> int:
    n = 0
    if not os.path.isdir(root):
        return 0
    for _, _, files in os.walk(root):
        n += sum(1 for f in files if f.endswith(".py"))
        if n >= stop:
            break
    return n


def is_heldout(relpath: str) -> bool:
    return hashlib.sha256(relpath.encode("utf-8")).digest()[0] < HELDOUT_FIRST_BYTE_LT


def unit_hash(relpath: str, salt: str) -> float:
    """A deterministic uniform number in [0, 1) for a file (used for sampling)."""
    h = hashlib.sha256((salt + "\0" + relpath).encode("utf-8")).digest()
    return int.from_bytes(h[:8], "big") / 2.0**64


@dataclass
class Split:
    paths: list[str] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    nbytes: int = 0
    fingerprint: str = ""


@dataclass
class Corpus:
    root: str
    train: Split
    heldout: Split
    manifest: dict


def _list_files(root: str) -> list[tuple[str, str]]:
    out = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames.sort()
        for fn in filenames:
            if not fn.endswith(".py"):
                continue
            full = os.path.join(dirpath, fn)
            rel = os.path.relpath(full, root).replace(os.sep, "/")
            out.append((rel, full))
    out.sort(key=lambda x: x[0].encode("utf-8", "surrogateescape"))
    return out


def _read(full: str):
    """-> (bytes or None, reason)"""
    try:
        if os.path.islink(full) or not os.path.isfile(full):
            return None, "not_regular"
        size = os.path.getsize(full)
        if size > MAX_FILE_BYTES:
            return None, "too_big"
        if size == 0:
            return None, "empty"
        with open(full, "rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            return None, "too_big"
        if not data:
            return None, "empty"
        return data, "ok"
    except OSError:
        return None, "unreadable"


def load_corpus(root: str | None = None, workers: int = 16, log=print) -> Corpus:
    t0 = time.time()
    root = os.path.abspath(root or default_root())
    files = _list_files(root)
    skipped = {"too_big": 0, "empty": 0, "not_utf8": 0, "not_regular": 0, "unreadable": 0,
               "duplicate": 0}
    with ThreadPoolExecutor(max_workers=max(1, workers)) as ex:
        datas = list(ex.map(lambda rf: _read(rf[1]), files, chunksize=64))
    seen: set[bytes] = set()
    train, held = Split(), Split()
    lines = {"train": [], "heldout": []}
    for (rel, _), (data, why) in zip(files, datas):
        if data is None:
            skipped[why] += 1
            continue
        if rel.encode("utf-8", "surrogateescape") != rel.encode("utf-8", "replace"):
            skipped["not_utf8"] += 1  # undecodable file name
            continue
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            skipped["not_utf8"] += 1
            continue
        if text.startswith("\ufeff"):
            text = text[1:]
        if not text:
            skipped["empty"] += 1
            continue
        raw = text.encode("utf-8")
        digest = hashlib.sha256(raw).digest()
        if digest in seen:  # files are in ascending relpath order: first = smallest
            skipped["duplicate"] += 1
            continue
        seen.add(digest)
        name = "heldout" if is_heldout(rel) else "train"
        sp = held if name == "heldout" else train
        sp.paths.append(rel)
        sp.texts.append(text)
        sp.nbytes += len(raw)
        lines[name].append(f"{rel}\t{digest.hex()}\n")
    for name, sp in (("train", train), ("heldout", held)):
        sp.fingerprint = hashlib.sha256("".join(lines[name]).encode("utf-8")).hexdigest()
    manifest = {
        "root": root,
        "split_rule": SPLIT_RULE,
        "max_file_bytes": MAX_FILE_BYTES,
        "heldout_first_byte_lt": HELDOUT_FIRST_BYTE_LT,
        "files_seen": len(files),
        "skipped": skipped,
        "train": {"files": len(train.paths), "bytes": train.nbytes, "fingerprint": train.fingerprint},
        "heldout": {"files": len(held.paths), "bytes": held.nbytes, "fingerprint": held.fingerprint},
        "seconds": round(time.time() - t0, 2),
    }
    log(
        f"[corpus] {root}: {len(files)} .py files; train {len(train.paths)} files "
        f"{train.nbytes / 1e6:.1f} MB, held-out {len(held.paths)} files {held.nbytes / 1e6:.1f} MB; "
        f"skipped {skipped}; {manifest['seconds']} s"
    )
    return Corpus(root=root, train=train, heldout=held, manifest=manifest)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default=None, help="site-packages directory (default: this Python's)")
    ap.add_argument("--workers", type=int, default=16)
    ap.add_argument("--json", action="store_true", help="print the manifest as JSON")
    a = ap.parse_args(argv)
    c = load_corpus(a.root, a.workers, log=(lambda *x: None) if a.json else print)
    if a.json:
        json.dump(c.manifest, sys.stdout, indent=2)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
