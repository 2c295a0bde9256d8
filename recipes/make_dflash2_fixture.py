#!/usr/bin/env python3
"""Write a seeded `dflash2-micro` drafter over the committed micro target, plus goldens.

    python recipes/make_dflash2_fixture.py --seed 0 --out tests/fixtures/dflash2

writes (see docs/dflash2.md §13):

    OUT/config.json, OUT/model.safetensors   the drafter (bf16), init scheme "fixture"
    OUT/golden.safetensors                   reference outputs for 2 prompts, v1 and v2,
                                             two draft steps each

The target is tests/fixtures/model/ (bf16 checkpoint), loaded with recipes/model.py.
Before writing goldens it checks: a chunk-prefilled + committed cache drafts exactly
like a cache built from the whole context at once, with and without window eviction;
the batched training forward reproduces the inference block logits for the same
anchors; the selector's teacher-forced scores equal the walk's realized scores; q is a
distribution on the candidates; every discrete decision is far from a tie.

``--device cuda`` runs everything on a GPU in f32 with TF32 off (for cross-checks; the
committed goldens are CPU ones). ``--check DIR`` recomputes the goldens and compares them
with DIR's instead of writing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import dflash2 as D  # noqa: E402
import model as M  # noqa: E402

PRESET = "dflash2-micro"
PROMPT_LENGTHS = (13, 30)  # the second is longer than the window (16): eviction; 29 put a
# top-k boundary 7e-6 from a tie, see docs/dflash2.md §13
FORCED_ACCEPT = 3  # drafts "accepted" at the first verification (docs §13)
PREFILL_CHUNK = 5  # the prefilled cache is built from [5 positions], [rest]
MIN_MARGIN = 1e-3  # every discrete decision at least this far from a tie
TOL = 1e-5  # max|a - b| / max(1, max|b|) for the consistency checks
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_prompts(tcfg: dict, seed: int) -> list[list[int]]:
    rng = np.random.RandomState(seed + 2000)
    n_regular = tcfg["vocab_size"] - M.NUM_SPECIAL
    return [[tcfg["bos_token_id"]] + [int(t) for t in rng.randint(0, n_regular, size=n - 1)] for n in PROMPT_LENGTHS]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max()) / max(1.0, float(b.abs().max()))


def margin(row: torch.Tensor) -> float:
    v = torch.topk(row, 2).values
    return float(v[0] - v[1])


def step_keys(prefix: str, r: dict, mode: str) -> dict:
    g = {
        f"{prefix}.hidden": r["hidden"],
        f"{prefix}.logits": r["logits"],
        f"{prefix}.tokens": r["tokens"].to(torch.int32),
        f"{prefix}.q": r["q"],
        f"{prefix}.margin": r["margin"],
    }
    if mode == "v2":
        g.update(
            {
                f"{prefix}.cand_ids": r["cand_ids"].to(torch.int32),
                f"{prefix}.cand_unary": r["cand_unary"],
                f"{prefix}.edge_scores": r["edge_scores"],
                f"{prefix}.choice": r["choice"].to(torch.int32),
                f"{prefix}.realized": r["realized"],
                f"{prefix}.topk_gap": r["topk_gap"],
            }
        )
    return g


def run(args) -> tuple[dict, dict, dict, dict]:
    dev = args.device
    if dev == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    tdir = os.path.join(ROOT, "tests/fixtures/model")
    tcfg, tt = M.load_checkpoint(tdir)
    target = M.Model(tcfg, tt, device=dev)

    cfg = D.make_config(PRESET)
    tensors = D.init_weights(cfg, args.seed, scheme="fixture")
    if args.out and not args.check:
        D.save_checkpoint(args.out, cfg, tensors)
        cfg, tensors = D.load_checkpoint(args.out)  # goldens from the bytes on disk
    dr = D.Drafter(cfg, tensors, tt["model.embed_tokens.weight"], tt["lm_head.weight"], device=dev)
    ids = D.dcfg(cfg, "target_layer_ids")
    N = cfg["block_size"] - 1
    A = FORCED_ACCEPT

    golden, checks, stats = {}, {}, {"min_margin": {}}

    def chk(name, value):
        checks[name] = max(checks.get(name, 0.0), value)

    def note_margin(kind, value):
        stats["min_margin"][kind] = min(stats["min_margin"].get(kind, float("inf")), float(value))

    prompts = make_prompts(tcfg, args.seed)
    for p, prompt in enumerate(prompts):
        T = len(prompt)
        tcache = target.new_cache()
        to = target.forward(prompt, tcache, collect=True)
        feats = D.target_features(to["hidden_states"], ids)  # [T, F]
        anchor0 = int(torch.argmax(to["logits"][-1]))
        note_margin("target_greedy", margin(to["logits"][-1]))
        golden[f"prompt{p}.tokens"] = torch.tensor(prompt, dtype=torch.int32)
        golden[f"prompt{p}.features"] = feats
        golden[f"prompt{p}.anchor"] = torch.tensor([anchor0], dtype=torch.int32)

        # one-shot cache (whole prompt at once) for the step-0 cross-check
        c_one = dr.new_cache()
        dr.append_context(c_one, feats)
        if p == 0:
            for l in range(cfg["num_hidden_layers"]):
                golden[f"prompt0.ctx_k.layer{l}"] = c_one.k[l]
                golden[f"prompt0.ctx_v.layer{l}"] = c_one.v[l]
            golden["prompt0.ctx_pos"] = c_one.pos.to(torch.int32)

        for mode in ("v1", "v2"):
            pre = f"{mode}.prompt{p}"
            # the "prefilled" cache: chunked prefill, then the commit after verification
            cache = dr.new_cache()
            dr.append_context(cache, feats[:PREFILL_CHUNK])
            dr.append_context(cache, feats[PREFILL_CHUNK:])
            assert cache.length == T and cache.pos.numel() == min(T, cfg["sliding_window"] - 1)
            s0 = dr.draft_block(cache, anchor0, mode, collect=True)
            s0b = dr.draft_block(c_one, anchor0, mode)
            chk("step0_chunked_vs_oneshot", rel(s0["logits"], s0b["logits"]))
            assert torch.equal(s0["tokens"], s0b["tokens"])
            drafts = s0["tokens"].tolist()
            golden.update(step_keys(f"{pre}.step0", s0, mode))
            golden[f"{pre}.step0.anchor"] = torch.tensor([anchor0, T], dtype=torch.int32)
            if p == 0:
                golden[f"{pre}.step0.layer_out"] = s0["layer_out"]

            # verify with the target (rows of positions T .. T+N), force A accepted
            vcache = tcache.clone()
            vo = target.forward([anchor0] + drafts, vcache, collect=True)
            vfeats = D.target_features(vo["hidden_states"], ids)[: A + 1]  # positions T..T+A
            bonus = int(torch.argmax(vo["logits"][A]))
            note_margin("target_greedy", margin(vo["logits"][A]))
            golden[f"{pre}.verify.accepted"] = torch.tensor([A], dtype=torch.int32)
            golden[f"{pre}.verify.features"] = vfeats
            # greedy acceptance the target would actually give (informational)
            tgt_greedy = vo["logits"][:N].argmax(-1).tolist()
            real_acc = 0
            while real_acc < N and drafts[real_acc] == tgt_greedy[real_acc]:
                real_acc += 1
            stats.setdefault("real_greedy_accepted", {})[pre] = real_acc

            dr.append_context(cache, vfeats)
            assert cache.length == T + A + 1
            s1 = dr.draft_block(cache, bonus, mode)
            golden.update(step_keys(f"{pre}.step1", s1, mode))
            golden[f"{pre}.step1.anchor"] = torch.tensor([bonus, T + A + 1], dtype=torch.int32)

            # same context, built at once (with / without eviction)
            all_feats = torch.cat([feats, vfeats])
            for evict in (True, False):
                c2 = dr.new_cache()
                dr.append_context(c2, all_feats, evict=evict)
                s1b = dr.draft_block(c2, bonus, mode)
                chk(f"step1_committed_vs_recomputed{'' if evict else '_noevict'}", rel(s1["logits"], s1b["logits"]))
                assert torch.equal(s1["tokens"], s1b["tokens"]), (pre, evict)
                if mode == "v2":
                    assert torch.equal(s1["cand_ids"], s1b["cand_ids"]) and torch.equal(s1["choice"], s1b["choice"])

            # the batched training forward reproduces both steps' block logits
            seq = prompt + [anchor0] + drafts[:A] + [bonus]
            fz = torch.cat([all_feats, torch.zeros(1, all_feats.shape[1], device=all_feats.device)])
            batch = {"tokens": torch.tensor([seq], device=dev), "features": fz.unsqueeze(0)}
            anchors = torch.tensor([[T, T + A + 1]], device=dev)
            with torch.no_grad():
                h = dr.train_block_hidden(batch, anchors, mode)[0]  # [2, B, H]
            chk("train_forward_vs_inference", max(rel(dr.logits(h[0]), s0["logits"]), rel(dr.logits(h[1]), s1["logits"])))

            for s, r in ((0, s0), (1, s1)):
                note_margin(f"{mode}_draft", float(r["margin"].min()))
                qsum = r["q"].sum(-1)
                chk("q_sums_to_one", float((qsum - 1).abs().max()))
                if mode == "v2":
                    note_margin("v2_topk_boundary", float(r["topk_gap"].min()))
                    # q lives on the candidates only
                    off = r["q"].clone()
                    off.scatter_(1, r["cand_ids"], 0.0)
                    assert float(off.abs().max()) == 0.0
                    # teacher-forced scores (training path) with the drafted prefix = realized
                    anc = int(golden[f"{pre}.step{s}.anchor"][0])
                    pred = torch.tensor([anc] + r["tokens"][:-1].tolist(), device=r["hidden"].device).view(-1, 1)
                    tf = dr.edge_scores(r["cand_ids"], r["cand_unary"], r["hidden"][1:], pred).squeeze(-2)
                    chk("selector_teacher_forced_vs_walk", rel(tf, r["realized"]))
                    # every walk step at most k-way: choices index the candidates
                    assert torch.equal(r["cand_ids"].gather(1, r["choice"].view(-1, 1).to(r["cand_ids"].device)).view(-1).cpu(), r["tokens"].cpu())
    for name, v in checks.items():
        if name == "q_sums_to_one":
            assert v < 1e-5, (name, v)
        else:
            assert v < TOL, (name, v)
    for kind, v in stats["min_margin"].items():
        assert v > MIN_MARGIN, f"{kind} margin {v} too close to a tie"
    golden = {k: v.detach().cpu().contiguous() for k, v in golden.items()}
    return cfg, tensors, golden, {"checks_max_rel_diff": checks, "stats": stats}


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read())
    return h.hexdigest()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--check", default=None, help="compare with the goldens in this directory instead of writing")
    args = ap.parse_args(argv)
    assert args.out or args.check, "give --out or --check"
    cfg, tensors, golden, meta = run(args)
    meta.update(
        preset=PRESET,
        seed=args.seed,
        torch=torch.__version__,
        numpy=np.__version__,
        device=args.device,
        forced_accept=FORCED_ACCEPT,
        prompt_lengths=list(PROMPT_LENGTHS),
        target_fixture="tests/fixtures/model/model.safetensors",
        target_sha256=sha256(os.path.join(ROOT, "tests/fixtures/model/model.safetensors")),
    )
    print(json.dumps(meta, indent=1, sort_keys=True))
    if args.check:
        from safetensors.torch import load_file

        ref = load_file(os.path.join(args.check, "golden.safetensors"))
        assert set(ref) == set(golden), sorted(set(ref) ^ set(golden))[:5]
        worst = 0.0
        for k, v in golden.items():
            if v.dtype == torch.int32:
                assert torch.equal(v, ref[k]), k
            else:
                worst = max(worst, rel(v, ref[k]))
        _, ck = D.load_checkpoint(args.check)
        same_ckpt = all(torch.equal(ck[k], tensors[k]) for k in ck) and set(ck) == set(tensors)
        print(f"check vs {args.check}: integer goldens identical, worst float rel diff {worst:.2e}, "
              f"checkpoint {'byte-identical' if same_ckpt else 'DIFFERENT'}")
        assert worst < 1e-4 and same_ckpt
        return
    from safetensors.torch import save_file

    save_file(golden, os.path.join(args.out, "golden.safetensors"), metadata={"speclab": json.dumps(meta, sort_keys=True)})
    total = 0
    for f in ("config.json", "model.safetensors", "golden.safetensors"):
        n = os.path.getsize(os.path.join(args.out, f))
        total += n
        print(f"{f:20s} {n:>10,d} bytes")
    print(f"{'total':20s} {total:>10,d} bytes ({total / 2**20:.2f} MiB), {len(golden)} golden tensors")


if __name__ == "__main__":
    main()
