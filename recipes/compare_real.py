#!/usr/bin/env python3
"""Compare a real-manifest record of the CPU engine with its `-cuda` twin leg by leg:
status (admitted / WEDGED ...), output digests, acceptance. Standard library only.

    python3 recipes/compare_real.py runs/quality-spot.json runs/quality-spot-cuda.json"""
import json
import sys


def legs(path):
    d = json.load(open(path))
    return {l["id"]: l for l in d["legs"]}


def main(cpu_path, gpu_path):
    a, b = legs(cpu_path), legs(gpu_path)
    same = 0
    print("| leg | CPU status | GPU status | outputs | accepted drafts CPU / GPU | equal |")
    print("|---|---|---|---|---|---|")
    for k in a:
        la, lb = a[k], b.get(k)
        if lb is None:
            print(f"| {k} | {la.get('status')} | missing | | | no |")
            continue
        ra, rb = la.get("real") or {}, lb.get("real") or {}
        da, db = ra.get("output_digests"), rb.get("output_digests")
        eq = la.get("status") == lb.get("status") and da == db
        same += eq
        n = sum(x == y for x, y in zip(da or [], db or []))
        acc = (ra.get("num_accepted_tokens"), rb.get("num_accepted_tokens"))
        print(f"| {k} | {la.get('status')} | {lb.get('status')} | {n} of {len(da or [])} request digests equal | accepted {acc[0]} / {acc[1]} | {'yes' if eq else 'NO'} |")
    print(f"\n{same} of {len(a)} legs equal")
    return same == len(a)


if __name__ == "__main__":
    ok = True
    args = sys.argv[1:]
    for i in range(0, len(args), 2):
        ok &= main(args[i], args[i + 1])
    sys.exit(0 if ok else 1)
