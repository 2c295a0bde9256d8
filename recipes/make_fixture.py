#!/usr/bin/env python3
"""Write a seeded checkpoint of speclab's GLM-5.3-Flash twin plus goldens.

    python recipes/make_fixture.py --preset micro --seed 0 --out tests/fixtures/model

writes (see docs/model.md §12):

    OUT/config.json, OUT/model.safetensors             bf16 checkpoint (fp32 A_log, dt_bias,
                                                        e_score_correction_bias)
    OUT/w4a16/config.json, OUT/w4a16/model.safetensors  routed experts INT4 pack-quantized
    OUT/golden.safetensors                              reference outputs of both

and checks, before writing goldens: prefill == token-by-token decode == chunked
(speculative-verify-style) prefill, snapshot/rollback of the caches, MTP prefill ==
MTP step-by-step, INT4 packing == compressed-tensors (when installed), the ignore list
quantizes exactly the routed experts, greedy margins and router gaps far from ties.

``--preset glm53-flash`` writes config.json files only (no weights).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import model as M  # noqa: E402

N_GREEDY = 16
PROMPT_LENGTHS = (11, 17, 24)
# Discrete decisions must be this far from a tie in the goldens (an f32 port differs
# from the reference by ~1e-5 in logits).
MIN_MARGIN = 1e-3
MIN_ROUTER_GAP = 1e-4
PREFILL_DECODE_TOL = 1e-4


def make_prompts(cfg: dict, seed: int) -> list[list[int]]:
    """Prompt p: bos then random regular ids (numpy legacy RandomState: a frozen stream)."""
    rng = np.random.RandomState(seed + 1000)
    n_regular = cfg["vocab_size"] - M.NUM_SPECIAL
    return [
        [cfg["bos_token_id"]] + [int(t) for t in rng.randint(0, n_regular, size=n - 1)]
        for n in PROMPT_LENGTHS
    ]


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())


def check_decode_paths(model: M.Model, prompt: list[int], label: str) -> dict:
    """Prefill vs decode vs chunked vs rollback; MTP prefill vs MTP steps."""
    T = len(prompt)
    res = {}
    c_pre = model.new_cache()
    pre = model.forward(prompt, c_pre)
    # token by token
    c_dec = model.new_cache()
    dec = torch.cat([model.forward([t], c_dec)["logits"] for t in prompt])
    res["prefill_vs_decode"] = max_abs(pre["logits"], dec)
    # chunked, as a speculative verify would run: [5], [3], [rest]
    c_ch = model.new_cache()
    parts = [prompt[:5], prompt[5:8], prompt[8:]]
    ch = torch.cat([model.forward(p, c_ch)["logits"] for p in parts if p])
    res["prefill_vs_chunked"] = max_abs(pre["logits"], ch)
    # rollback: snapshot after 8 tokens, run 4 bogus "draft" tokens, restore, continue
    c_rb = model.new_cache()
    a = model.forward(prompt[:8], c_rb)["logits"]
    snap = c_rb.clone()
    model.forward([1, 2, 3, 4], c_rb)
    c_rb = snap
    b = model.forward(prompt[8:], c_rb)["logits"]
    res["prefill_vs_rollback"] = max_abs(pre["logits"], torch.cat([a, b]))
    # final states agree
    st = 0.0
    for x, y in zip(c_pre.layers, c_dec.layers):
        for k in x:
            st = max(st, max_abs(x[k], y[k]))
    res["state_prefill_vs_decode"] = st
    # MTP: prefill over all positions vs one position at a time
    nxt = prompt[1:] + [int(torch.argmax(pre["logits"][-1]))]
    m_pre = model.mtp_forward(pre["hidden"], nxt, c_pre)["logits"]
    m_dec = torch.cat(
        [model.mtp_forward(pre["hidden"][t : t + 1], [nxt[t]], c_dec)["logits"] for t in range(T)]
    )
    res["mtp_prefill_vs_decode"] = max_abs(m_pre, m_dec)
    scale = float(pre["logits"].abs().max())
    for k, v in res.items():
        print(f"  [{label}] {k:26s} max|diff| = {v:.3e}  (logits max|.| {scale:.2f})")
        assert v < PREFILL_DECODE_TOL * max(1.0, scale), f"{label} {k}: {v}"
    return res


def check_packing_against_compressed_tensors(w: torch.Tensor) -> str:
    try:
        from compressed_tensors.compressors.pack_quantized.helpers import (
            pack_to_int32,
            unpack_from_int32,
        )
        from compressed_tensors.quantization import QuantizationArgs
        from compressed_tensors.quantization.lifecycle.forward import quantize
    except Exception as e:  # noqa: BLE001  (absent, or another version's layout)
        return f"compressed_tensors 0.17 helpers not importable ({type(e).__name__}); cross-check skipped"
    packed, scale, shape = M.quantize_rtn(w)
    q = M.unpack_int4(packed, shape.tolist())
    ref = pack_to_int32(q, 4)
    assert ref.dtype == torch.int32 and torch.equal(ref, packed), "pack_to_int32 mismatch"
    back = unpack_from_int32(packed, 4, torch.Size(shape.tolist()))
    assert torch.equal(back.to(torch.int8), q), "unpack_from_int32 mismatch"
    # quantize with compressed-tensors' own quantize() at our scale (f32 inputs)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=128)
    q_ct = quantize(
        x=w.to(torch.float32), scale=scale.to(torch.float32), zero_point=None, args=args, dtype=torch.int8
    )
    n_diff = int((q_ct.to(torch.int8) != q).sum())
    assert n_diff == 0, f"compressed-tensors quantize() disagrees on {n_diff} elements"
    import compressed_tensors

    return f"compressed_tensors {compressed_tensors.__version__}: pack/unpack/quantize identical"


def check_quantization_config(qcfg: dict) -> str:
    try:
        import compressed_tensors
        from compressed_tensors.quantization import QuantizationConfig
    except Exception as e:  # noqa: BLE001
        return f"compressed_tensors not importable ({type(e).__name__}); config check skipped"
    body = {k: v for k, v in qcfg.items() if k not in ("version", "sparsity_config", "transform_config")}
    try:
        parsed = QuantizationConfig.model_validate(body)
    except Exception as e:  # noqa: BLE001
        return f"compressed_tensors {compressed_tensors.__version__}: WARNING does not validate: {e}"
    dumped = parsed.model_dump(exclude=["quant_method"])
    ours = {k: v for k, v in body.items() if k != "quant_method"}
    if json.dumps(dumped, sort_keys=True) != json.dumps(ours, sort_keys=True):
        return (
            f"compressed_tensors {compressed_tensors.__version__}: WARNING model_dump differs: "
            f"{json.dumps(dumped, sort_keys=True)}"
        )
    return f"compressed_tensors {compressed_tensors.__version__}: QuantizationConfig round-trips exactly"


def check_ignore_matching(cfg: dict, qcfg: dict) -> None:
    names = M.quantized_module_names(cfg, qcfg)
    try:
        from compressed_tensors.utils.match import match_name
    except Exception:  # noqa: BLE001
        return
    ct = [n for n in M.linear_module_names(cfg) if not any(match_name(n, t) for t in qcfg["ignore"])]
    assert ct == names, "compressed_tensors match_name disagrees with ours"


def golden_for(model: M.Model, prompts, label: str, G: dict, stats: dict) -> None:
    cfg = model.cfg
    min_margin, min_gap, bias_changed, n_sel = float("inf"), float("inf"), 0, 0
    for p, prompt in enumerate(prompts):
        cache = model.new_cache()
        out = model.forward(prompt, cache, collect=True)
        gen = model.generate_greedy(prompt, N_GREEDY)
        assert torch.allclose(gen["logits"][0], out["logits"][-1], atol=0, rtol=0)
        nxt = prompt[1:] + [gen["tokens"][0]]
        mtp = model.mtp_forward(out["hidden"], nxt, cache, collect=True)
        key = f"{label}.prompt{p}"
        G[f"{key}.logits"] = out["logits"]
        G[f"{key}.mtp_logits"] = mtp["logits"]
        G[f"{key}.greedy"] = torch.tensor(gen["tokens"], dtype=torch.int32)
        margins = M.top2_margin(gen["logits"])
        G[f"{key}.greedy_margin"] = margins
        G[f"{key}.logits_margin"] = M.top2_margin(out["logits"])
        G[f"{key}.mtp_margin"] = M.top2_margin(mtp["logits"])
        if p == 0:
            G[f"{key}.hidden_states"] = out["hidden_states"]
            G[f"{key}.final_hidden"] = out["hidden"]
            G[f"{key}.continuation_logits"] = gen["logits"]
            G[f"{key}.router_topk_ids"] = torch.stack(out["router"]["router_topk_ids"]).to(torch.int32)
            G[f"{key}.router_topk_weights"] = torch.stack(out["router"]["router_topk_weights"])
            G[f"{key}.mtp_router_topk_ids"] = mtp["router"]["router_topk_ids"][0].to(torch.int32)
        min_margin = min(min_margin, float(margins.min()))
        for gaps in out["router"]["router_gap"] + mtp["router"]["router_gap"]:
            if gaps is not None:
                min_gap = min(min_gap, float(gaps.min()))
        for bc in out["router"]["bias_changed"] + mtp["router"]["bias_changed"]:
            bias_changed += int(bc.sum())
            n_sel += bc.numel()
        print(
            f"  [{label}] prompt{p} T={len(prompt)} greedy={gen['tokens']} "
            f"min greedy margin {float(margins.min()):.3f}"
        )
    stats[label] = dict(min_greedy_margin=min_margin, min_router_gap=min_gap,
                        bias_changed_selection=f"{bias_changed}/{n_sel}")
    print(f"  [{label}] min greedy margin {min_margin:.4f}, min router k/k+1 gap {min_gap:.2e}, "
          f"e_score_correction_bias changed the selection for {bias_changed}/{n_sel} token-layers")
    assert min_margin > MIN_MARGIN, f"{label}: greedy near-tie ({min_margin})"
    assert min_gap > MIN_ROUTER_GAP, f"{label}: router near-tie ({min_gap})"
    assert bias_changed > 0, "bias never changes the selection: golden would not test it"


def diagnostics(model: M.Model, prompt) -> None:
    """Print how much each block contributes (init sanity, not a contract)."""
    cache = model.new_cache()
    W, cfg, eps = model.W, model.cfg, model.eps
    x = W["model.embed_tokens.weight"][torch.tensor(prompt, device=model.device)]
    for i in range(cfg["num_hidden_layers"]):
        P = f"model.layers.{i}"
        a = M.rmsnorm(x, W[f"{P}.input_layernorm.weight"], eps)
        if M.layer_kind(cfg, i) == "full_attention":
            da = model._full_attention(P, a, cache.layers[i], 0)
        else:
            da = model._kda(P, a, cache.layers[i])
        x2 = x + da
        f = M.rmsnorm(x2, W[f"{P}.post_attention_layernorm.weight"], eps)
        df = model._ffn(i, f, None)
        print(f"  layer {i} {M.layer_kind(cfg, i):16s} |x| {x.norm(dim=-1).mean():6.2f}  "
              f"|attn| {da.norm(dim=-1).mean():6.2f}  |ffn| {df.norm(dim=-1).mean():6.2f}")
        x = x2 + df


def file_size(path: str) -> int:
    return os.path.getsize(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="micro", choices=M.PRESET_NAMES)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument("--no-golden", action="store_true", help="checkpoints and checks only")
    ap.add_argument("--device", default="cpu", help="torch device for the reference forward (default cpu; "
                    "the committed goldens are CPU f32; cuda runs f32 with TF32 off)")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_num_threads(min(8, os.cpu_count() or 1))

    cfg = M.make_config(args.preset)
    qcfg_full = dict(cfg, quantization_config=M.quantization_config(cfg))
    print(f"preset {args.preset}: {M.count_params(cfg):,} parameters")
    print("quantization_config check:", check_quantization_config(qcfg_full["quantization_config"]))
    check_ignore_matching(cfg, qcfg_full["quantization_config"])

    if args.preset == "glm53-flash":
        os.makedirs(os.path.join(args.out, "w4a16"), exist_ok=True)
        for d, c in ((args.out, cfg), (os.path.join(args.out, "w4a16"), qcfg_full)):
            with open(os.path.join(d, "config.json"), "w") as f:
                json.dump(c, f, indent=2, sort_keys=True)
                f.write("\n")
        n_q = len(M.quantized_module_names(cfg, qcfg_full["quantization_config"]))
        print(f"config only; quantized Linear modules: {n_q:,}")
        return

    tensors = M.init_weights(cfg, args.seed)
    M.save_checkpoint(args.out, cfg, tensors)
    qcfg, qtensors = M.quantize_checkpoint(cfg, tensors)
    M.save_checkpoint(os.path.join(args.out, "w4a16"), qcfg, qtensors)

    # sample expert cross-check against compressed-tensors
    first_moe = cfg["first_k_dense_replace"]
    w = tensors[f"model.layers.{first_moe}.mlp.experts.0.down_proj.weight"]
    print("packing check:", check_packing_against_compressed_tensors(w))

    # reload from disk: goldens are computed from exactly what was written
    cfg_b, t_b = M.load_checkpoint(args.out)
    cfg_q, t_q = M.load_checkpoint(os.path.join(args.out, "w4a16"))
    m_b, m_q = M.Model(cfg_b, t_b, args.device), M.Model(cfg_q, t_q, args.device)
    rel = []
    for name in M.quantized_module_names(cfg, qcfg["quantization_config"]):
        a, b = m_b.W[name + ".weight"], m_q.W[name + ".weight"]
        rel.append(float((a - b).norm() / a.norm()))
    print(f"INT4 RTN relative weight error (Frobenius): mean {np.mean(rel):.4f}, max {np.max(rel):.4f} "
          f"over {len(rel)} tensors")

    prompts = make_prompts(cfg, args.seed)
    print("block contributions (bf16, prompt 0):")
    diagnostics(m_b, prompts[0])
    print("prefill / decode / chunked / rollback / MTP checks:")
    checks = {}
    for label, m in (("bf16", m_b), ("w4a16", m_q)):
        for p, prompt in enumerate(prompts):
            checks[f"{label}.prompt{p}"] = check_decode_paths(m, prompt, f"{label} p{p}")
    if args.no_golden:
        return

    G, stats = {}, {}
    for p, prompt in enumerate(prompts):
        G[f"prompt{p}.tokens"] = torch.tensor(prompt, dtype=torch.int32)
    print("goldens:")
    for label, m in (("bf16", m_b), ("w4a16", m_q)):
        golden_for(m, prompts, label, G, stats)
    d = max_abs(G["bf16.prompt0.logits"], G["w4a16.prompt0.logits"])
    print(f"  bf16 vs w4a16 prompt0 logits max|diff| = {d:.3f}")

    from safetensors.torch import save_file

    # one metadata key: safetensors writes several keys in hash order (not reproducible)
    meta = {
        "preset": args.preset,
        "seed": args.seed,
        "n_greedy": N_GREEDY,
        "generator": "recipes/make_fixture.py",
        "contract": "docs/model.md",
        "torch": torch.__version__,
        "device": args.device,
        "checks_max_abs_diff": {k: {kk: float(f"{vv:.3e}") for kk, vv in v.items()} for k, v in checks.items()},
        "stats": stats,
    }
    save_file(
        {k: v.detach().cpu().contiguous() for k, v in sorted(G.items())},
        os.path.join(args.out, "golden.safetensors"),
        metadata={"speclab": json.dumps(meta, sort_keys=True)},
    )

    print("files:")
    total = 0
    for root, _, files in os.walk(args.out):
        for fn in sorted(files):
            pth = os.path.join(root, fn)
            total += file_size(pth)
            print(f"  {os.path.relpath(pth, args.out):28s} {file_size(pth):>10,} B")
    print(f"  total {total:,} B = {total / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
