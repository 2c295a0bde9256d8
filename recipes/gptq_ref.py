#!/usr/bin/env python3
"""Reference GPTQ (W4A16: INT4 symmetric, group 128) and the golden cases for speclab-quant.

What: a small, literal GPTQ in torch float64 -- Frantar et al. 2022, Algorithm 1, in the form
of the reference `GPTQ.fasterquant` loop that AutoGPTQ and llm-compressor
(`modifiers/quantization/gptq/gptq_quantize.py: quantize_weight`) use: dead columns, dampening
`percdamp * mean(diag(H))`, `cholesky -> cholesky_inverse -> cholesky(upper=True)`, blocks of
128 columns with column-wise error propagation inside the block and a lazy batch update of the
remaining columns. It writes `tests/fixtures/quant/gptq_golden.safetensors`, which
`quant/tests/gptq_golden.rs` checks the Rust implementation against.

Deliberate choices (identical in quant/src/gptq.rs):
- Scales follow docs/model.md §8's RTN rule so both quantizers write the same format:
  `scale = bf16(f32(amax) / 7)` (f32 division, round-to-nearest-even), 1.0 if amax == 0 (or if
  the bf16 underflows to 0). (llm-compressor's memoryless_minmax observer would use amax/7.5.)
- Dynamic groups (default): scales of group g are computed when column 128*g is reached, from
  `W[:, 128g : 128g+128]` as of the start of the current block (= the error-updated weights
  when block_size == group_size == 128), as `fasterquant`'s `find_params(W[:, i:i+groupsize])`.
- `static_groups`: all scales from the original W up front (llm-compressor's `observer(W)`,
  before dead-column zeroing). `act_order`: columns processed in decreasing diag(H) (stable:
  ties by lower index), with static groups (llm-compressor's actorder="weight"), so no g_idx.
- `q = clamp(round_half_even(w / scale), -8, 7)` in float64; the dequantized value `q*scale`
  feeds the error propagation. Everything is float64 (llm-compressor runs float32; `--f32`
  prints how many integers that changes).
- H = 2/n * X^T X over calibration rows (n = rows), float64. The scale of H does not change
  the result, only the proxy loss.

The golden file holds, per case `c`: `c.w` (bf16 [N, K]), `c.x` (bf16 [rows, K], calibration
inputs with correlated columns, some all-zero = dead), `c.q` (int8 [N, K]), `c.scale` (bf16
[N, K/128]), `c.packed` (int32 [N, K/8], from compressed_tensors' `pack_to_int32` when it is
installed, else from this file's packer, which the script checks against it), `c.rtn_q`,
`c.rtn_scale` (docs/model.md §8 RTN), and float64 scalars `c.proxy_loss`,
`c.rtn_proxy_loss`, `c.gptq_loss`. The per-case config is JSON in the metadata key `cases`.

Usage (CPU, a few seconds):
    /work/venv-vllm/bin/python recipes/gptq_ref.py --out tests/fixtures/quant/gptq_golden.safetensors
    /work/venv-vllm/bin/python recipes/gptq_ref.py --check tests/fixtures/quant/gptq_golden.safetensors
    /work/venv-vllm/bin/python recipes/gptq_ref.py --f32   # float32 vs float64 integer differences
Needs numpy, torch, safetensors; compressed_tensors optional (cross-check of the packing).
"""

import argparse
import json
import sys

import numpy as np
import torch
from safetensors.torch import load_file, save_file

GROUP = 128

# name, N, K, calibration rows, dead columns, block, act_order, static_groups, seed
CASES = [
    ("a_64x256", 64, 256, 384, [3, 130, 255], 128, False, False, 1),
    ("b_32x384_rankdef", 32, 384, 256, [0, 200], 128, False, False, 2),
    ("c_16x256_actorder", 16, 256, 256, [17], 128, True, False, 3),
    ("d_16x256_static", 16, 256, 256, [], 128, False, True, 4),
    ("e_16x256_block64", 16, 256, 256, [40], 64, False, False, 5),
]


def to_bf16_f64(a):
    return torch.from_numpy(np.asarray(a, dtype=np.float32)).to(torch.bfloat16).to(torch.float64)


def make_case(n, k, rows, dead, seed):
    """Seeded weights (bf16) and calibration inputs (bf16) with correlated columns."""
    rs = np.random.RandomState(seed)
    w = rs.normal(0.0, 1.0 / np.sqrt(k), size=(n, k))
    # a few outlier weights, so groups have different ranges and clamps happen
    idx = rs.randint(0, n * k, size=max(2, n * k // 500))
    w.flat[idx] *= 6.0
    # X = Z A + noise: rank-r latent mixing -> strongly correlated columns;
    # per-channel magnitudes spread over ~2 decades like LLM activations
    r = max(8, k // 8)
    z = rs.normal(size=(rows, r))
    a = rs.normal(size=(r, k)) / np.sqrt(r)
    x = z @ a + 0.1 * rs.normal(size=(rows, k))
    x *= np.exp(rs.uniform(np.log(0.1), np.log(10.0), size=(1, k)))
    x[:, dead] = 0.0
    return to_bf16_f64(w), to_bf16_f64(x)


def hessian(x):
    """H = 2/n X^T X, float64."""
    return 2.0 / x.shape[0] * (x.T @ x)


def scale_from_amax(amax):
    """bf16(f32(amax) / 7), 1.0 where amax == 0 or the bf16 underflows; returns bf16."""
    s = (amax.to(torch.float32) / 7).to(torch.bfloat16)
    return torch.where(s == 0, torch.ones_like(s), s)


def group_scales(w):
    n, k = w.shape
    return scale_from_amax(w.abs().reshape(n, k // GROUP, GROUP).amax(dim=2))


def rtn(w):
    """docs/model.md §8 quantize_rtn, in float32 as the doc says."""
    w32 = w.to(torch.float32)
    n, k = w.shape
    s = group_scales(w32)
    sf = s.to(torch.float32).repeat_interleave(GROUP, dim=1)
    q = torch.clamp(torch.round(w32 / sf), -8, 7).to(torch.int8)
    return q, s


def gptq(w, h, block=128, percdamp=0.01, act_order=False, static_groups=False, dtype=torch.float64):
    """Reference GPTQ; returns q (int8 [N, K], original column order), scale (bf16), loss."""
    n, k = w.shape
    assert k % GROUP == 0
    W = w.clone().to(dtype)
    H = h.clone().to(dtype)
    static = static_groups or act_order
    scale = group_scales(W) if static else torch.ones(n, k // GROUP, dtype=torch.bfloat16)
    if act_order:
        perm = torch.argsort(torch.diag(H), descending=True, stable=True)
    else:
        perm = torch.arange(k)
    W = W[:, perm]
    H = H[perm][:, perm]

    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0

    damp = percdamp * torch.mean(torch.diag(H))
    diag = torch.arange(k)
    H[diag, diag] += damp
    L = torch.linalg.cholesky(H)
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)

    Q = torch.zeros(n, k, dtype=torch.int8)
    loss = 0.0
    for i1 in range(0, k, block):
        i2 = min(i1 + block, k)
        cnt = i2 - i1
        W1 = W[:, i1:i2].clone()
        Err1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(cnt):
            col = i1 + i
            g = int(perm[col]) // GROUP
            if not static and col % GROUP == 0:
                # W (not W1): the block-start state, as fasterquant's find_params
                scale[:, g] = scale_from_amax(W[:, col:col + GROUP].abs().amax(dim=1))
            w_col = W1[:, i]
            d = Hinv1[i, i]
            s = scale[:, g].to(dtype)
            q = torch.clamp(torch.round(w_col / s), -8, 7)
            Q[:, col] = q.to(torch.int8)
            err = (w_col - q * s) / d
            loss += float(torch.sum(err * err)) / 2
            W1[:, i:] -= err.unsqueeze(1) @ Hinv1[i, i:].unsqueeze(0)
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]
    out = torch.zeros_like(Q)
    out[:, perm] = Q
    return out, scale, loss


def dequant(q, s):
    return q.to(torch.float64) * s.to(torch.float64).repeat_interleave(GROUP, dim=1)


def proxy_loss(w, w_hat, h):
    d = w - w_hat
    return float(torch.einsum("ij,jk,ik->", d, h, d)) / w.shape[0]


def pack_int4(q):
    """[N, K] int8 -> [N, K/8] int32, element 0 in the lowest nibble, stored as q + 8."""
    u = (q.to(torch.int64) + 8).reshape(q.shape[0], -1, 8)
    word = torch.zeros(u.shape[:2], dtype=torch.int64)
    for j in range(8):
        word |= u[:, :, j] << (4 * j)
    word = torch.where(word >= 2**31, word - 2**32, word)
    return word.to(torch.int32)


def ct_pack(q):
    try:
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    except ImportError:
        return None
    return pack_to_int32(q, 4)


def build():
    tensors, meta = {}, {}
    for name, n, k, rows, dead, block, act_order, static, seed in CASES:
        w, x = make_case(n, k, rows, dead, seed)
        h = hessian(x)
        q, s, loss = gptq(w, h, block=block, act_order=act_order, static_groups=static)
        rq, rs = rtn(w)
        pl = proxy_loss(w, dequant(q, s), h)
        rpl = proxy_loss(w, dequant(rq, rs), h)
        packed = pack_int4(q)
        ct = ct_pack(q)
        if ct is not None:
            assert torch.equal(ct, packed), f"{name}: packer disagrees with compressed_tensors"
        tensors.update({
            f"{name}.w": w.to(torch.bfloat16),
            f"{name}.x": x.to(torch.bfloat16),
            f"{name}.q": q,
            f"{name}.scale": s,
            f"{name}.packed": packed,
            f"{name}.rtn_q": rq,
            f"{name}.rtn_scale": rs,
            f"{name}.proxy_loss": torch.tensor([pl], dtype=torch.float64),
            f"{name}.rtn_proxy_loss": torch.tensor([rpl], dtype=torch.float64),
            f"{name}.gptq_loss": torch.tensor([loss], dtype=torch.float64),
        })
        meta[name] = {"n": n, "k": k, "rows": rows, "dead": dead, "block_size": block,
                      "dampening": 0.01, "act_order": act_order, "static_groups": static,
                      "packed_checked_with_compressed_tensors": ct is not None}
        print(f"{name}: proxy gptq {pl:.6g} rtn {rpl:.6g} ratio {pl / rpl:.4f}; "
              f"int changed vs rtn {(q != rq).float().mean():.3f}")
    return tensors, meta


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the golden safetensors here")
    ap.add_argument("--check", help="recompute and compare with this golden file")
    ap.add_argument("--f32", action="store_true", help="count float32-vs-float64 integer differences")
    args = ap.parse_args()
    torch.set_num_threads(1)  # deterministic summation order
    torch.manual_seed(0)
    tensors, meta = build()
    if args.out:
        save_file(tensors, args.out, metadata={
            "generator": "recipes/gptq_ref.py", "torch": torch.__version__,
            "cases": json.dumps(meta, sort_keys=True)})
        print(f"wrote {args.out}")
    if args.check:
        old = load_file(args.check)
        bad = [k for k in tensors if k not in old or not torch.equal(old[k], tensors[k])]
        if bad or set(old) != set(tensors):
            print(f"MISMATCH: {bad or sorted(set(old) ^ set(tensors))}")
            sys.exit(1)
        print(f"{args.check}: all {len(tensors)} tensors identical")
    if args.f32:
        for name, n, k, rows, dead, block, act_order, static, seed in CASES:
            w, x = make_case(n, k, rows, dead, seed)
            h = hessian(x)
            q64, s64, _ = gptq(w, h, block=block, act_order=act_order, static_groups=static)
            q32, s32, _ = gptq(w, h, block=block, act_order=act_order, static_groups=static,
                               dtype=torch.float32)
            diff = (q64 != q32)
            pl64 = proxy_loss(w, dequant(q64, s64), h)
            pl32 = proxy_loss(w, dequant(q32, s32), h)
            print(f"{name}: f32 vs f64 integers differing {int(diff.sum())}/{q64.numel()} "
                  f"(max |dq| {int((q64.int() - q32.int()).abs().max())}); proxy f32/f64 {pl32 / pl64:.6f}")


if __name__ == "__main__":
    main()
