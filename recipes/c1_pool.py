#!/usr/bin/env python3
"""Pool the c = 1 goal ratios of several recipes/c1_settle.sh calls.

Usage: python3 recipes/c1_pool.py DIR[:odd] ...
Each DIR holds bench-e2e-c1-leg<i>.json records; ':odd' keeps only the odd legs (the
switch-on legs of an A/B call). Prints each leg's ratios (wall: decode_tok_s, with the lazy
graph captures inside the steps; steady: decode_tok_s_steady, captures taken out) and the
pooled median, range and count of legs at or above the MTP goal (1.41x).
"""
import glob
import json
import re
import statistics
import sys


def legs(spec):
    d, _, flag = spec.partition(":")
    for path in sorted(glob.glob(f"{d}/bench-e2e-c1-leg*.json")):
        i = int(re.search(r"leg(\d+)\.json$", path).group(1))
        if flag == "odd" and i % 2 == 0:
            continue
        rows = {(x["drafter"], x["num_spec"]): x for x in json.load(open(path))["rows"]}
        yield d, i, rows


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    got = {"mtp": ([], []), "df2": ([], [])}
    print("| record | leg | MTP N=2 x | x steady | DFlash2 N=7 x | x steady |")
    print("|---|---|---|---|---|---|")
    for spec in sys.argv[1:]:
        for d, i, t in legs(spec):
            a = t[("none", 0)]
            cells = []
            for key, (kind, n) in (("mtp", ("mtp", 2)), ("df2", ("dflash2", 7))):
                b = t[(kind, n)]
                w = b["decode_tok_s"] / a["decode_tok_s"]
                s = b["decode_tok_s_steady"] / a["decode_tok_s_steady"]
                got[key][0].append(w)
                got[key][1].append(s)
                cells += [f"{w:.3f}", f"{s:.3f}"]
            print(f"| {d} | {i} | " + " | ".join(cells) + " |")
    for key, name in (("mtp", "MTP N=2"), ("df2", "DFlash2 N=7")):
        for v, how in zip(got[key], ("wall", "steady")):
            if v:
                at = sum(x >= 1.41 for x in v)
                print(f"{name} / none at c=1, {how}: median {statistics.median(v):.3f}, "
                      f"range {min(v):.3f}-{max(v):.3f}, {at} of {len(v)} legs >= 1.41")


if __name__ == "__main__":
    main()
