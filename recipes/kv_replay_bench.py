#!/usr/bin/env python3
"""Time vLLM 0.33.0's ``KVCacheManager`` on a long operation trace.

Replay (times only the replay loop: files are parsed and the manager is built
before the clock starts)::

    python recipes/kv_replay_bench.py --layout L.json --ops O.jsonl
    # -> {"ops": 100000, "seconds": 1.23, "ops_per_sec": 81300.0}

Generate the 100K-operation benchmark trace (GLM-5.3-Flash + DFlash2 wedge
layout, upstream cap, many concurrent requests; deterministic for a seed)::

    python recipes/kv_replay_bench.py --gen 100000 --seed 0 \\
        --out-layout tests/golden/kv/bench/glm53_dflash2_upstream.layout.json \\
        --out-ops tests/golden/kv/bench/glm53_dflash2_upstream_100k.ops.jsonl

Layout / ops / output formats: docs/kv-replay-format.md. The replay loop is
``recipes/kv_golden.py``'s ``Replayer.apply`` (one vLLM call per op plus the
output object, as ``speclab kv replay`` produces).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import kv_golden as kg  # noqa: E402

BENCH_PARAMS = dict(
    mnbt=8192,  # max_num_batched_tokens (= max_in_flight_tokens, 1 batch in flight)
    k=7,  # DFlash2 draft tokens
    prompt=(32, 2000),
    p_long=0.01,
    p_edge=0.002,
    max_outputs=64,
    max_live=40,
    max_running=32,
    p_add=0.95,
    initial=24,
    p_short_chunk=0.05,
    p_preempt=0.02,
    p_abort=0.005,
)


def gen(n: int, seed: int, out_layout: str, out_ops: str, out_results: str | None):
    layout = kg.glm_layout("upstream")
    sim = kg.Sim("bench_glm53_dflash2_upstream", layout, BENCH_PARAMS, seed)
    sim.run(n)
    ops = sim.ops[:n]  # every prefix of a valid trace is a valid trace
    results = sim.results[:n]
    for path in (out_layout, out_ops, out_results):
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(out_layout, "w") as f:
        json.dump(layout, f, indent=1)
        f.write("\n")
    c = dict(separators=(",", ":"))
    with open(out_ops, "w") as f:
        for op in ops:
            f.write(json.dumps(op, **c) + "\n")
    if out_results:
        with open(out_results, "w") as f:
            for r in results:
                f.write(json.dumps(r, **c) + "\n")
    st = sim.stats
    print(f"wrote {len(ops)} ops ({os.path.getsize(out_ops)} bytes): "
          f"{st['allocs']} allocs, {st['fails']} failed, {st['preempts']} preempts, "
          f"{st['exceptions']} vLLM exceptions", file=sys.stderr)


def bench(layout_path: str, ops_path: str, repeat: int) -> dict:
    layout = kg.load_layout(layout_path)
    ops = kg.load_ops(ops_path)
    best = None
    for _ in range(repeat):
        rp = kg.Replayer(layout)
        apply = rp.apply
        t0 = time.perf_counter()
        for i, op in enumerate(ops):
            apply(i, op)
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    return {"ops": len(ops), "seconds": round(best, 6),
            "ops_per_sec": round(len(ops) / best, 1)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layout", help="layout JSON (or a golden JSON)")
    ap.add_argument("--ops", help="ops JSONL")
    ap.add_argument("--repeat", type=int, default=1, help="report the best of N runs")
    ap.add_argument("--gen", type=int, metavar="N", help="generate an N-op trace")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-layout")
    ap.add_argument("--out-ops")
    ap.add_argument("--out-results", help="also write vLLM's outputs (JSONL)")
    a = ap.parse_args()
    if a.gen:
        if not (a.out_layout and a.out_ops):
            ap.error("--gen needs --out-layout and --out-ops")
        gen(a.gen, a.seed, a.out_layout, a.out_ops, a.out_results)
        return 0
    if not (a.layout and a.ops):
        ap.error("need --layout and --ops (or --gen)")
    print(json.dumps(bench(a.layout, a.ops, a.repeat)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
