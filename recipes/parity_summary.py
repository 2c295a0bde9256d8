#!/usr/bin/env python3
"""Print a gpu_check record's parity lines whose name contains one of the given words
(and every failing line), then the pass count; exit 1 when a line fails or none exist.

    python3 recipes/parity_summary.py gpu_check.json sampler sampled

Used by the device recipes (sample_check.sh, df2_sample_check.sh). Standard library only.
"""
import json
import sys


def main() -> int:
    path, words = sys.argv[1], sys.argv[2:]
    try:
        d = json.load(open(path))
    except (OSError, ValueError) as e:
        print(f"gpu_check parity: no record ({e})")
        return 1
    lines = d.get("parity") or []
    bad = [l for l in lines if not l.get("pass")]
    for l in lines:
        if any(w in l["name"] for w in words) or not l.get("pass"):
            state = "ok" if l["pass"] else "FAIL"
            print(f"{l['name']}: {l['value']:g} (bound {l['bound']:g}) {state}")
    print(f"gpu_check parity: {len(lines) - len(bad)} of {len(lines)} lines pass")
    return 1 if bad or not lines else 0


if __name__ == "__main__":
    sys.exit(main())
