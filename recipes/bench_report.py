#!/usr/bin/env python3
"""Markdown tables of the committed device records, for findings/cuda-engine-h200.md and
findings/bench-moe.md (every figure there comes from these records through this script).

    python3 recipes/bench_report.py e2e runs/bench-e2e-h200.json
    python3 recipes/bench_report.py moe runs/bench-moe.json [findings/bench-moe-gbs.svg]
    python3 recipes/bench_report.py trace runs/<dir>/bench_moe_trace.json[.xz]
    python3 recipes/bench_report.py moeab runs/<moe_ab dir> 0:1 [2:3 ...]   # legs base:new
    python3 recipes/bench_report.py layer runs/<dir>/bench_moe.json   # the layer around the experts
Standard library only."""
import json
import os
import sys


def load(path):
    """A record, plain JSON or xz-compressed (`.json.xz`: the traced records under runs/,
    compressed to keep the tree small enough to carry to the device)."""
    if str(path).endswith(".xz"):
        import lzma
        with lzma.open(path, "rt") as f:
            return json.load(f)
    return json.load(open(path))


def e2e(path):
    d = load(path)
    rows = d["rows"]
    an = d.get("anchors", {})
    eager = {r["batch"]: r["decode_tok_s"] for r in an.get("e2e_ref", {}).get("rows", [])}
    graph = {r["batch"]: r["graph_tok_s"] for r in an.get("e2e_graph", {}).get("rows", [])}
    # Records without the anchors' JSON: the per-row anchor figures `bench e2e --anchors` stored.
    for r in rows:
        if r.get("anchor_eager_tok_s") is not None:
            eager.setdefault(r["concurrency"], r["anchor_eager_tok_s"])
        if r.get("anchor_graph_tok_s") is not None:
            graph.setdefault(r["concurrency"], r["anchor_graph_tok_s"])
    print(f"Record `{path}` (commit {d.get('git_commit')}): copy {d['copy_gb_s']:.0f} GB/s, "
          f"weights {d['weight_bytes'] / 1e6:.1f} MB, launch {d['launch_us_eager']:.2f} us eager / "
          f"{d['launch_us']:.2f} us in a graph; all outputs equal: {d['outputs_all_match']}.\n")
    # Records since 2026-12-06 also hold the steady rate (the lazy graph captures' host
    # time taken out: decode_tok_s_steady, speedup_vs_none_steady); older ones print "-".
    print("| c | drafter | graphs | tok/s | us/step (fwd / draft / host) | kernels | tau | x none | steady tok/s, x none | x eager ref | x graph ref |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        name = r["drafter"] + (f" N={r['num_spec']}" if r["num_spec"] else "")
        c = r["concurrency"]
        xe = r["decode_tok_s"] / eager[c] if c in eager else float("nan")
        xg = r["decode_tok_s"] / graph[c] if c in graph else float("nan")
        st = r.get("decode_tok_s_steady")
        sx = r.get("speedup_vs_none_steady")
        steady = f"{st:,.0f}, {sx:.2f}" if st is not None and sx is not None else "-"
        print(f"| {c} | {name} | {'on' if r['graphs'] else 'off'} | {r['decode_tok_s']:,.0f} | "
              f"{r['us_per_step']:.0f} ({r['forward_us_per_step']:.0f} / {r['draft_us_per_step']:.0f} / "
              f"{r['host_us_per_step']:.0f}) | {r['kernels_per_step']:.0f} | {r['tau']:.2f} | "
              f"{r['speedup_vs_none']:.2f} | {steady} | {xe:.1f} | {xg:.2f} |")
    print("\nBest drafter per concurrency (graphs on):\n")
    print("| c | none tok/s | best | its tok/s | x none | PyTorch eager | PyTorch graph |")
    print("|---|---|---|---|---|---|---|")
    for c in sorted({r["concurrency"] for r in rows}):
        on = [r for r in rows if r["concurrency"] == c and r["graphs"]]
        if not on:
            continue
        base = next(r for r in on if r["drafter"] == "none")
        best = max(on, key=lambda r: r["decode_tok_s"])
        bn = best["drafter"] + (f" N={best['num_spec']}" if best["num_spec"] else "")
        print(f"| {c} | {base['decode_tok_s']:,.0f} | {bn} | {best['decode_tok_s']:,.0f} | "
              f"{best['speedup_vs_none']:.2f} | {eager.get(c, float('nan')):,.1f} | {graph.get(c, float('nan')):,.0f} |")


def svg_plot(rows, floor_frac, out):
    """GB/s against M (log2) per routing, beside the copy bandwidth; plain SVG."""
    W, H, L, B = 640, 400, 60, 40
    ms = sorted({r["m"] for r in rows})
    ymax = max(max(r["gb_s"] for r in rows), floor_frac) * 1.1
    def x(m):
        i = ms.index(m)
        return L + i * (W - L - 20) / max(1, len(ms) - 1)
    def y(v):
        return H - B - v / ymax * (H - B - 20)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="11">',
             f'<rect width="{W}" height="{H}" fill="white"/>',
             f'<line x1="{L}" y1="{H-B}" x2="{W-20}" y2="{H-B}" stroke="black"/>',
             f'<line x1="{L}" y1="20" x2="{L}" y2="{H-B}" stroke="black"/>']
    for m in ms:
        parts.append(f'<text x="{x(m)}" y="{H-B+15}" text-anchor="middle">{m}</text>')
    for v in range(0, int(ymax) + 1, 1000):
        parts.append(f'<text x="{L-5}" y="{y(v)+4}" text-anchor="end">{v}</text>')
    parts.append(f'<line x1="{L}" y1="{y(floor_frac)}" x2="{W-20}" y2="{y(floor_frac)}" stroke="gray" stroke-dasharray="4"/>')
    parts.append(f'<text x="{W-22}" y="{y(floor_frac)-4}" text-anchor="end" fill="gray">copy bandwidth (the INT4 byte floor)</text>')
    parts.append(f'<line x1="{L}" y1="{y(0.7*floor_frac)}" x2="{W-20}" y2="{y(0.7*floor_frac)}" stroke="red" stroke-dasharray="2"/>')
    parts.append(f'<text x="{W-22}" y="{y(0.7*floor_frac)-4}" text-anchor="end" fill="red">70% goal</text>')
    colors = {"uniform": "blue", "zipf": "green", "sequence": "purple", "grouped_mm bf16": "orange"}
    series = {}
    for r in rows:
        series.setdefault(r["routing"], []).append((r["m"], r["gb_s"]))
    for i, (k, pts) in enumerate(series.items()):
        pts.sort()
        pl = " ".join(f"{x(m):.1f},{y(v):.1f}" for m, v in pts)
        col = colors.get(k, "black")
        parts.append(f'<polyline points="{pl}" fill="none" stroke="{col}" stroke-width="2"/>')
        parts.append(f'<text x="{L+10}" y="{32+14*i}" fill="{col}">{k}</text>')
    parts.append(f'<text x="{W/2}" y="{H-8}" text-anchor="middle">M (tokens)</text>')
    parts.append(f'<text x="14" y="{H/2}" transform="rotate(-90 14 {H/2})" text-anchor="middle">GB/s of expert bytes</text>')
    parts.append("</svg>")
    open(out, "w").write("\n".join(parts))


def moe(path, svg=None):
    b = load(path)
    a = b.get("anchors", {})
    # A device call's record keeps its PyTorch anchors beside it (recipes/moe_bench.sh).
    side = os.path.join(os.path.dirname(path), "gpu_anchors.json")
    if not a and os.path.exists(side):
        a = load(side)
        print(f"(anchors from `{side}`, the same call)")
    anc = {r["M"]: r for r in a.get("moe_bf16", [])}
    print(f"Record `{path}` (commit {b.get('git_commit')}): {b['device']}, copy {b['copy_gb_s']:.0f} GB/s "
          f"(torch's copy {a.get('copy_GBps', float('nan')):.0f} GB/s); all reference checks pass: {b['all_pass']}.\n")
    defines = b.get("kernel_defines") or []
    print(f"Kernel defines: {' '.join(defines) or 'none (exact activations)'}; rel err against the kernels' "
          f"function / the exact model, worst row: {max(r['max_rel_err'] for r in b['rows']):.1e} / "
          f"{max(r.get('max_rel_err_exact', r['max_rel_err']) for r in b['rows']):.1e}.\n")
    # Records since 2026-12-07: the events around two empty launches made as the experts call's.
    # Only 25ffefd's records timed them unqueued, so theirs can hold the host's enqueue time.
    if "empty_call_us" in b:
        how = ("not queued: can hold the host's enqueue time" if b.get("git_commit") == "25ffefd"
               else "queued behind a spin kernel: the single call's cost before any work")
        print(f"Two empty launches between events ({how}): {b['empty_call_us']:.1f} us.\n")
    # Records since 2026-12-06 also time the experts in chains of back-to-back calls.
    ch = "experts_us_chained" in b["rows"][0]
    print("| routing | M | experts | experts us | floor us | GB/s | % copy |" + (" chained us (% copy) |" if ch else "")
          + " layer us | grouped_mm bf16 us | x grouped_mm | check |")
    print("|---|---|---|---|---|---|---|" + ("---|" if ch else "") + "---|---|---|---|")
    for r in b["rows"]:
        g = anc.get(r["m"], {}).get("grouped_mm_us")
        xg = g / r["experts_us"] if g else float("nan")
        chc = f" {r['experts_us_chained']:.1f} ({100 * r['frac_copy_chained']:.0f}%) |" if ch else ""
        print(f"| {r['routing']} | {r['m']} | {r['distinct_experts']:.1f} | {r['experts_us']:.1f} | {r['floor_us']:.1f} | "
              f"{r['gb_s']:.0f} | {100 * r['frac_copy']:.0f}% |{chc} {r['layer_us']:.1f} | "
              f"{(g if g else float('nan')):.1f} | {xg:.2f} | {'ok' if r['pass'] else 'FAIL'} |")
    if svg:
        rows = list(b["rows"])
        # The anchor's bytes are bf16 weights: its GB/s over the same expert set is 4x the INT4 bytes' rate.
        for mm, an in anc.items():
            u = next((r for r in b["rows"] if r["m"] == mm and r["routing"] == "uniform"), None)
            if u and an.get("grouped_mm_us"):
                rows.append({"routing": "grouped_mm bf16", "m": mm,
                             "gb_s": u["gb_s"] * u["experts_us"] / an["grouped_mm_us"]})
        svg_plot(rows, b["copy_gb_s"], svg)
        print(f"\n(plot: {svg}; the grouped_mm line is the INT4 expert bytes of the uniform row over"
              " grouped_mm's time, i.e. what INT4 would need to match it)")


def trace(path):
    """Where a traced bench moe record's time goes (W4_TRACE=1, cuda/src/w4trace.rs): per
    row, the medians over its traced calls of each phase, us from the call's first release."""
    b = load(path)
    print(f"Record `{path}` (commit {b.get('git_commit')}): {b['device']}, copy {b['copy_gb_s']:.0f} GB/s; "
          f"defines {' '.join(b.get('kernel_defines') or [])}.\n")
    print("Phases, median over the traced calls (us from the first release): split done; gate/up "
          "released first (blocks), walk median / max, epilogue median / max, done last; down released "
          "first / last, walk median / max, epilogue median / max, done last; the traced span against the timed call (events) and the floor.\n")
    print("| routing | M | split done | gate/up rel. (blocks) | gate/up walk med / max | gate/up epi med / max | gate/up done | "
          "down rel. first / last (blocks) | down walk med / max | down epi med / max | down done | span | timed | floor |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    med = lambda v: sorted(v)[len(v) // 2]
    for r in b["rows"]:
        calls = r.get("trace") or []
        if not calls:
            continue
        k = lambda c, name: next((x for x in c["kernels"] if x["kernel"] == name), None)
        def f(name, get):
            v = [get(k(c, name)) for c in calls if k(c, name)]
            return med(v) if v else float("nan")
        sp, gu, dn = "moe_split_x", "moe_gate_up_w4", "moe_down_w4"
        print(f"| {r['routing']} | {r['m']} | {f(sp, lambda x: x['done']['max']):.1f} | "
              f"{f(gu, lambda x: x['released']['min']):.1f} ({f(gu, lambda x: x['blocks']):.0f}) | "
              f"{f(gu, lambda x: x['walk']['med']):.1f} / {f(gu, lambda x: x['walk']['max']):.1f} | "
              f"{f(gu, lambda x: x['epilogue']['med']):.1f} / {f(gu, lambda x: x['epilogue']['max']):.1f} | "
              f"{f(gu, lambda x: x['done']['max']):.1f} | "
              f"{f(dn, lambda x: x['released']['min']):.1f} / {f(dn, lambda x: x['released']['max']):.1f} "
              f"({f(dn, lambda x: x['blocks']):.0f}) | "
              f"{f(dn, lambda x: x['walk']['med']):.1f} / {f(dn, lambda x: x['walk']['max']):.1f} | "
              f"{f(dn, lambda x: x['epilogue']['med']):.1f} / {f(dn, lambda x: x['epilogue']['max']):.1f} | "
              f"{f(dn, lambda x: x['done']['max']):.1f} | {med([c['span_us'] for c in calls]):.1f} | "
              f"{r['experts_us']:.1f} | {r['floor_us']:.1f} |")
    # Records since the per-SM walks (sm_walk_us): are the slow SMs the same call after call?
    rows = [r for r in b["rows"] if r.get("trace") and "sm_walk_us" in r["trace"][0]["kernels"][0]]
    if not rows:
        return
    print("\nPer-SM mean walk (us), and its Pearson correlation between the traced calls (pairs of "
          "calls, SMs that ran blocks in both): near 1, the same SMs are slow every call.\n")
    print("| routing | M | kernel | SM mean walk min / median / max | correlation between calls |")
    print("|---|---|---|---|---|")
    def pearson(a, b):
        pts = [(x, y) for x, y in zip(a, b) if x > 0 and y > 0]
        if len(pts) < 3:
            return float("nan")
        mx = sum(x for x, _ in pts) / len(pts); my = sum(y for _, y in pts) / len(pts)
        sxy = sum((x - mx) * (y - my) for x, y in pts)
        sx = sum((x - mx) ** 2 for x, _ in pts) ** 0.5; sy = sum((y - my) ** 2 for _, y in pts) ** 0.5
        return sxy / (sx * sy) if sx > 0 and sy > 0 else float("nan")
    for r in rows:
        for name in ("moe_gate_up_w4", "moe_down_w4"):
            per = [next((k["sm_walk_us"] for k in c["kernels"] if k["kernel"] == name), []) for c in r["trace"]]
            flat = sorted(v for p in per for v in p if v > 0)
            if not flat:
                continue
            cors = [pearson(per[i], per[j]) for i in range(len(per)) for j in range(i + 1, len(per))]
            print(f"| {r['routing']} | {r['m']} | {name} | {flat[0]:.1f} / {flat[len(flat) // 2]:.1f} / {flat[-1]:.1f} | "
                  f"{' / '.join(f'{c:.2f}' for c in cors)} |")


def moeab(d, pairs):
    """Legs of one recipes/moe_ab.sh call (`<d>/leg<round>_<i>.json[.xz]`) compared in pairs
    (base, new): experts us per (routing, M <= 64), the median over rounds, and how many
    rows the new leg was faster on and by how much (single calls). A row whose draws took
    other K splits in the two legs (the records' `ks`) is marked `split`; the counts are
    given for those rows and for the rest (whose change is the call's noise) apart."""
    import glob
    import statistics
    t, ks = {}, {}
    for f in sorted(glob.glob(os.path.join(d, "leg*_*.json*"))):
        leg = int(os.path.basename(f).split("_")[1].split(".")[0])
        for r in load(f)["rows"]:
            if r["m"] <= 64:
                k = (r["routing"], r["m"])
                t.setdefault(leg, {}).setdefault(k, []).append(r["experts_us"])
                ks.setdefault(leg, {})[k] = r.get("ks")
    for b, n in pairs:
        for leg in (b, n):
            if leg not in t:
                sys.exit(f"{d}: no leg {leg} (files leg<round>_{leg}.json[.xz]; legs here: {sorted(t)})")
        if set(t[b]) != set(t[n]):
            sys.exit(f"{d}: legs {b} and {n} hold different (routing, M) rows")
    diffs = {True: [], False: []}
    print("| routing | M | " + " | ".join(f"leg {b} -> leg {n}" for b, n in pairs) + " |")
    print("|---|---|" + "---|" * len(pairs))
    for k in sorted(t[pairs[0][0]], key=lambda k: (k[0], k[1])):
        cells = []
        for b, n in pairs:
            x, y = statistics.median(t[b][k]), statistics.median(t[n][k])
            moved = ks[b][k] != ks[n][k]
            diffs[moved].append(100 * (y / x - 1))
            mark = ", split" if moved else ""
            cells.append(f"{x:.1f} -> {y:.1f} ({diffs[moved][-1]:+.1f}%{mark})")
        print(f"| {k[0]} | {k[1]} | " + " | ".join(cells) + " |")
    print()
    for moved, what in [(True, "rows whose K splits differ"), (False, "rows with the same splits")]:
        v = diffs[moved]
        if v:
            print(f"{what}: new leg faster on {sum(x < 0 for x in v)} of {len(v)}; "
                  f"change {min(v):+.1f}% to {max(v):+.1f}%")
    every = diffs[True] + diffs[False]
    print(f"all rows: new leg faster on {sum(v < 0 for v in every)} of {len(every)} rows; "
          f"change {min(every):+.1f}% to {max(every):+.1f}%")


def layer(path):
    """The layer as step.rs runs it against the routed experts, per row, and the layer's
    launches timed alone (`layer_parts`, records since 2026-12-06), with the layer's bytes
    (routed experts + bf16 shared expert + router) over `layer_us` against the copy."""
    d = load(path)
    rows = [r for r in d["rows"] if "layer_parts" in r]
    if not rows:
        sys.exit(f"{path}: no row has layer_parts (records before 2026-12-06 lack them)")
    print(f"Record `{path}` (commit {d.get('git_commit')}): {d['device']}, copy "
          f"{d['copy_gb_s']:.0f} GB/s. Parts are single launches, each with its own launch latency.\n")
    parts = ["router_us", "topk_us", "align_us", "shared_swiglu_us", "shared_down_us",
             "combine_us"]
    print("| routing | M | experts us | layer us | layer / experts | layer % copy | "
          + " | ".join(p[:-3].replace("_", " ") + " alone" for p in parts) + " |")
    print("|---|---|---|---|---|---|" + "---|" * len(parts))
    for r in rows:
        frac = r["layer_gb_s"] / d["copy_gb_s"]
        cells = " | ".join(f"{r['layer_parts'][p]:.1f}" for p in parts)
        print(f"| {r['routing']} | {r['m']} | {r['experts_us']:.1f} | {r['layer_us']:.1f} | "
              f"{r['layer_us'] / r['experts_us']:.2f} | {100 * frac:.0f}% | {cells} |")


if __name__ == "__main__":
    if sys.argv[1] == "e2e":
        e2e(sys.argv[2])
    elif sys.argv[1] == "trace":
        trace(sys.argv[2])
    elif sys.argv[1] == "layer":
        layer(sys.argv[2])
    elif sys.argv[1] == "moeab":
        moeab(sys.argv[2], [tuple(map(int, p.split(":"))) for p in sys.argv[3:]])
    else:
        moe(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)
