#!/usr/bin/env python3
"""Train speclab's reference target checkpoint (target + MTP) in one wall-clock budget.

    PYTHONUNBUFFERED=1 python3 recipes/train_target.py --preset tiny --budget-s 540 --out $OUT

Phases (each timed, printed, and recorded in ``train_log.json``):

1. corpus     read the ``*.py`` files of site-packages, split train / held-out by
              ``sha256(relpath)[0] < 8`` (``recipes/corpus.py``).
2. tokenizer  byte-level BPE on a sample of the train split (``recipes/train_tokenizer.py``),
              special tokens at the ids ``make_config(preset)`` expects.
3. data       held-out eval windows, GPTQ calibration windows (train split), held-out
              prompts + their true continuations; the train split is tokenized in a
              background thread while the model is built and trained (documents packed
              as ``<|bos|> text <|eos|>``).
4. train      ``recipes/model.py``'s architecture with a GPU-friendly forward (below);
              AdamW, warmup + cosine on wall-clock progress, grad clip, next-token CE +
              ``--mtp-weight`` x MTP CE, DeepSeek-V3 aux-loss-free router bias updates
              plus a tiny sequence-wise balance loss. Stops at its deadline.
5. eval       held-out CE / perplexity / top-1 of the bf16-rounded checkpoint in fp32
              (the numbers the Rust engine should reproduce), MTP CE and MTP top-1
              agreement with the target's greedy next-next token; parity of this
              file's forward against ``recipes/model.py``'s ``Model`` on held-out prompts
              (logits, MTP logits, greedy continuations).
6. export     ``save_checkpoint`` (bf16, fp32 A_log / dt_bias / e_score_correction_bias),
              tokenizer.json, data.safetensors, train_log.json -> a tar split into
              ``ckpt.tar.partNN`` (<= --part-mib MiB each) in --out, plus train_log.json.

Unpack and verify here:  ``python3 recipes/train_target.py --unpack DIR --dest models/tiny``

The training forward computes exactly docs/model.md's function. KDA uses a chunked form
of the gated delta rule (WY / UT transform, per-channel decay) that is algebraically
identical to the per-token recurrence; all its exponents are <= 0 (pairwise decays
``exp(G_t - G_s)``, ``s <= t``), so nothing overflows however strong the decay is. It runs
in fp32 outside autocast, as do norms, RoPE, the router and the losses; Linear layers
run under bf16 autocast during training. Routed experts are evaluated densely (every
expert on every token, weighted by the sparse top-k combine weights, which are exactly
zero off the top-k), which equals the sparse sum. ``--selftest`` checks all of this
against ``recipes/model.py`` on random weights.
"""

from __future__ import annotations

import time

T_START = time.time()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import hashlib  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import tarfile  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402

def available_cpus() -> int:
    """CPUs this process may use: affinity mask, capped by a cgroup v2/v1 CPU quota."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 2
    for path in ("/sys/fs/cgroup/cpu.max",):
        try:
            quota, period = open(path).read().split()[:2]
            if quota != "max":
                n = min(n, max(1, int(int(quota) / int(period))))
        except (OSError, ValueError):
            pass
    try:
        q = int(open("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read())
        p = int(open("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read())
        if q > 0 and p > 0:
            n = min(n, max(1, q // p))
    except (OSError, ValueError):
        pass
    return max(1, n)


N_CPUS = available_cpus()
if "RAYON_NUM_THREADS" not in os.environ:  # leave cores for the training thread
    os.environ["RAYON_NUM_THREADS"] = str(max(1, N_CPUS - 2))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import corpus  # noqa: E402
import model as M  # noqa: E402
import train_tokenizer as TT  # noqa: E402

LOG_LINES: list[str] = []


def log(*a):
    s = " ".join(str(x) for x in a)
    LOG_LINES.append(f"{time.time() - T_START:7.1f} {s}")
    print(f"[{time.time() - T_START:6.1f}s] {s}", flush=True)


class Clock:
    def __init__(self, budget_s: float):
        self.budget = budget_s
        self.deadline = T_START + budget_s
        self.phases: dict[str, float] = {}

    def elapsed(self) -> float:
        return time.time() - T_START

    def left(self) -> float:
        return self.deadline - time.time()

    @contextlib.contextmanager
    def phase(self, name: str):
        t = time.time()
        log(f"== phase {name} (elapsed {self.elapsed():.1f}s of {self.budget:.0f}s)")
        try:
            yield
        finally:
            dt = time.time() - t
            self.phases[name] = round(self.phases.get(name, 0.0) + dt, 2)
            log(f"== phase {name} done in {dt:.1f}s (elapsed {self.elapsed():.1f}s)")


# ======================================================================================
# Chunked KDA (exactly the recurrence of docs/model.md §4, computed chunk-parallel)
# ======================================================================================


def kda_chunked(q, k, v, glog, beta, chunk: int = 16, S0=None):
    """Gated delta rule with channel-wise decay, chunked. All fp32.

    q, k, v, glog: [B, T, h, d] (q already l2-normed and scaled, k l2-normed);
    beta: [B, T, h]; S0: [B, h, d, d] (key, value) or None (zeros).
    Per token:  S = diag(a_t) S; u = v_t - S^T k_t; S += b_t k_t u^T; o_t = S^T q_t,
    a_t = exp(glog_t). Returns (o [B, T, h, d], S_final [B, h, d, d]).

    Within a chunk (positions 1..C, G_t = sum_{s<=t} glog_s, gamma_t = exp(G_t)):
      (I + A) U = V - K~ S0,  A[t,s] = b_s sum_c k_t k_s exp(G_t - G_s)  (s < t),
      K~_t = gamma_t * k_t;   O = Q~ S0 + Mx U,  Mx[t,s] = b_s sum_c q_t k_s exp(G_t - G_s)
      (s <= t), Q~_t = gamma_t * q_t;  S_C = diag(gamma_C) S0 + sum_s (exp(G_C - G_s) * b_s k_s) U_s^T.
    With U = Tv - W S0 (Tv = (I+A)^-1 V, W = (I+A)^-1 K~) every chunk's map S0 -> S_C is
    affine, S_C = Ast S0 + Bst, so the sequential part is one batched matmul per chunk.
    """
    B, T, h, d = q.shape
    C = int(chunk)
    pad = (-T) % C
    if pad:  # padded steps: k = v = q = 0, decay 1, beta 0: they change nothing
        q, k, v, glog = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, glog))
        beta = F.pad(beta, (0, 0, 0, pad))
    n = (T + pad) // C

    def r(x):
        return x.reshape(B, n, C, h, d).permute(0, 3, 1, 2, 4)  # [B, h, n, C, d]

    q, k, v, g = r(q), r(k), r(v), r(glog)
    b = beta.reshape(B, n, C, h).permute(0, 3, 1, 2)  # [B, h, n, C]
    G = g.cumsum(dim=3)
    dev = q.device
    incl = torch.ones(C, C, dtype=torch.bool, device=dev).tril()
    strict = torch.ones(C, C, dtype=torch.bool, device=dev).tril(-1)
    D = G.unsqueeze(4) - G.unsqueeze(3)  # [B,h,n,t,s,d] = G_t - G_s
    P = torch.exp(D.masked_fill(~incl.view(C, C, 1), float("-inf")))  # 0 for s > t
    kb = k * b.unsqueeze(-1)  # b_s k_s
    R = P * kb.unsqueeze(3)  # R[t,s,c] = exp(G_t-G_s)[c] b_s k_s[c]
    A = (R @ k.unsqueeze(-1)).squeeze(-1).masked_fill(~strict, 0.0)  # [B,h,n,t,s]
    Mx = (R @ q.unsqueeze(-1)).squeeze(-1)  # already 0 for s > t
    gam = torch.exp(G)
    eye = torch.eye(C, dtype=q.dtype, device=dev)
    sol = torch.linalg.solve_triangular(
        A + eye, torch.cat([v, k * gam], dim=-1), upper=False, unitriangular=True
    )
    Tv, W = sol[..., :d], sol[..., d:]
    Qe = q * gam - Mx @ W  # [B,h,n,C,d]
    Ov = Mx @ Tv
    KT = (k * torch.exp(G[..., -1:, :] - G) * b.unsqueeze(-1)).transpose(-1, -2)  # [B,h,n,d,C]
    Ast = torch.diag_embed(gam[..., -1, :]) - KT @ W  # [B,h,n,d,d]
    Bst = KT @ Tv
    S = torch.zeros(B, h, d, d, dtype=q.dtype, device=dev) if S0 is None else S0
    # unbind once: per-chunk slicing would make autograd scatter n full-size gradients
    As = Ast.permute(2, 0, 1, 3, 4).reshape(n, B * h, d, d).unbind(0)
    Bs = Bst.permute(2, 0, 1, 3, 4).reshape(n, B * h, d, d).unbind(0)
    S = S.reshape(B * h, d, d)
    prev = []
    for i in range(n):
        prev.append(S)
        S = torch.baddbmm(Bs[i], As[i], S)
    Sprev = torch.stack(prev, dim=1).view(B, h, n, d, d)
    S = S.view(B, h, d, d)
    o = Qe @ Sprev + Ov
    o = o.permute(0, 2, 3, 1, 4).reshape(B, n * C, h, d)[:, :T]
    return o, S


# ======================================================================================
# Training model
# ======================================================================================


def rmsnorm(x, w, eps):
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * w.float()


def l2norm(x):
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def _key(name: str) -> str:
    return name.replace(".", "__")


class TrainModel(nn.Module):
    """docs/model.md's model with batched, autocast-friendly training forward.

    Parameters are fp32 masters named as in the checkpoint, except routed experts,
    stacked per MoE layer: ``{M}.experts.gate_up`` [E*2*Im, H] (expert e: rows
    e*2*Im .. : gate_proj then up_proj), ``{M}.experts.down`` [H, E*Im].
    ``e_score_correction_bias`` is a non-trainable parameter (aux-loss-free updates).
    """

    def __init__(self, cfg: dict, tensors: dict[str, torch.Tensor] | None = None, seed: int = 0,
                 chunk: int = 16):
        super().__init__()
        M.validate_config(cfg)
        self.cfg = cfg
        self.chunk = chunk
        self.eps = float(cfg["rms_norm_eps"])
        self.L = cfg["num_hidden_layers"]
        self.E, self.topk = cfg["n_routed_experts"], cfg["num_experts_per_tok"]
        self.Im = cfg["moe_intermediate_size"]
        self.mtp_idx = M.mtp_layer_index(cfg)
        self.params = nn.ParameterDict()
        canon = tensors if tensors is not None else self._init_canonical(seed)
        self._load_canonical(canon)
        self.moe_layers = [i for i in range(self.L + cfg["num_nextn_predict_layers"]) if M.is_moe_layer(cfg, i)]
        self._rope = {}
        self.stats = None  # filled during forward when a dict
        self.kda_fn = kda_chunked  # may be swapped for a torch.compile'd version in training

    # -- parameters -----------------------------------------------------------------
    def P(self, name: str) -> torch.Tensor:
        return self.params[_key(name)]

    def _init_canonical(self, seed: int) -> dict[str, torch.Tensor]:
        """Training init (GPT-2-like; Kimi init for A_log / dt_bias / conv)."""
        cfg = self.cfg
        gen = torch.Generator().manual_seed(seed)
        n_layers = self.L + cfg["num_nextn_predict_layers"]
        out_std = 0.02 / math.sqrt(2 * n_layers)
        out = {}
        for name, shape, dtype in M.tensor_specs(cfg):
            leaf = name.split(".")[-1]
            mod = name.rsplit(".", 1)[0]
            if leaf == "A_log":
                t = torch.log(torch.empty(shape).uniform_(1.0, 16.0, generator=gen))
            elif leaf == "dt_bias":
                dt = torch.exp(torch.empty(shape, dtype=torch.float64).uniform_(
                    math.log(1e-3), math.log(1e-1), generator=gen))
                t = (dt + torch.log(-torch.expm1(-dt))).float()
            elif leaf == "e_score_correction_bias":
                t = torch.zeros(shape)
            elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                t = torch.ones(shape)
            elif mod.endswith("conv1d"):
                t = torch.empty(shape).uniform_(-0.5, 0.5, generator=gen)  # Conv1d default, fan_in 4
            else:
                std = 0.02
                if mod.endswith("o_proj") or mod.endswith("down_proj"):
                    std = out_std
                t = torch.randn(shape, generator=gen) * std
            out[name] = t.to(torch.float32)
        return out

    def _load_canonical(self, tensors: dict[str, torch.Tensor]) -> None:
        cfg = self.cfg
        E = self.E
        specs = M.tensor_specs(cfg)
        names = {n for n, _, _ in specs}
        missing = names - set(tensors)
        assert not missing, f"missing tensors: {sorted(missing)[:5]}"
        expert_re = ".mlp.experts."
        for name, shape, _ in specs:
            if expert_re in name:
                continue
            t = tensors[name].detach().to(torch.float32).clone()
            assert tuple(t.shape) == tuple(shape), (name, t.shape, shape)
            self.params[_key(name)] = nn.Parameter(t, requires_grad=not name.endswith("e_score_correction_bias"))
        for i in range(self.L + cfg["num_nextn_predict_layers"]):
            if not M.is_moe_layer(cfg, i):
                continue
            Mp = f"model.layers.{i}.mlp"
            gu, dn = [], []
            for e in range(E):
                gu += [tensors[f"{Mp}.experts.{e}.gate_proj.weight"], tensors[f"{Mp}.experts.{e}.up_proj.weight"]]
                dn.append(tensors[f"{Mp}.experts.{e}.down_proj.weight"])
            self.params[_key(f"{Mp}.experts.gate_up")] = nn.Parameter(torch.cat(gu, 0).float().clone())
            self.params[_key(f"{Mp}.experts.down")] = nn.Parameter(torch.cat(dn, 1).float().clone())

    @torch.no_grad()
    def export_tensors(self) -> dict[str, torch.Tensor]:
        """Canonical checkpoint tensors (CPU; bf16, fp32 where docs/model.md §7 says)."""
        cfg = self.cfg
        Im = self.Im
        out = {}
        for name, shape, dtype in M.tensor_specs(cfg):
            if ".mlp.experts." in name:
                Mp, rest = name.split(".experts.")
                e, proj = rest.split(".")[0], rest.split(".")[1]
                e = int(e)
                if proj == "down_proj":
                    t = self.P(f"{Mp}.experts.down")[:, e * Im:(e + 1) * Im]
                else:
                    j = 0 if proj == "gate_proj" else 1
                    t = self.P(f"{Mp}.experts.gate_up")[(2 * e + j) * Im:(2 * e + j + 1) * Im]
            else:
                t = self.P(name)
            assert tuple(t.shape) == tuple(shape), (name, t.shape, shape)
            out[name] = t.detach().to("cpu", torch.float32).to(dtype).contiguous()
        return out

    # -- blocks ---------------------------------------------------------------------
    def _rope_tables(self, T: int, device):
        key = (T, str(device))
        if key not in self._rope:
            d = self.cfg["head_dim"]
            cos, sin = M.rope_tables(torch.arange(T, device=device), d, float(self.cfg["rope_theta"]))
            self._rope[key] = (cos, sin)
        return self._rope[key]

    def _full_attention(self, Pfx: str, a, amp: bool):
        c = self.cfg
        B, T, H = a.shape
        nh, nkv, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        q = F.linear(a, self.P(f"{Pfx}.self_attn.q_proj.weight")).float().view(B, T, nh, d)
        k = F.linear(a, self.P(f"{Pfx}.self_attn.k_proj.weight")).float().view(B, T, nkv, d)
        v = F.linear(a, self.P(f"{Pfx}.self_attn.v_proj.weight")).view(B, T, nkv, d)
        cos, sin = self._rope_tables(T, a.device)
        cos, sin = cos.view(1, T, 1, d), sin.view(1, T, 1, d)
        q = q * cos + M.rotate_half(q) * sin
        k = k * cos + M.rotate_half(k) * sin
        G = nh // nkv
        q = q.transpose(1, 2)
        k = k.transpose(1, 2).repeat_interleave(G, dim=1)
        v = v.transpose(1, 2).repeat_interleave(G, dim=1)
        if amp:
            q, k, v = q.to(torch.bfloat16), k.to(torch.bfloat16), v.to(torch.bfloat16)
        else:
            v = v.float()
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=d ** -0.5)
        o = o.transpose(1, 2).reshape(B, T, nh * d)
        return F.linear(o, self.P(f"{Pfx}.self_attn.o_proj.weight"))

    def _short_conv(self, x, w):
        # x [B, T, C] fp32, w [C, 1, kc]: y[t] = sum_j w[:, j] * xpad[t + j], zero left pad
        kc = w.shape[-1]
        T = x.shape[1]
        xp = F.pad(x, (0, 0, kc - 1, 0))
        w = w.float()
        y = w[:, 0, 0] * xp[:, 0:T]
        for j in range(1, kc):
            y = y + w[:, 0, j] * xp[:, j:j + T]
        return F.silu(y)

    def _kda(self, Pfx: str, a):
        c = self.cfg
        A = f"{Pfx}.linear_attn"
        B, T, H = a.shape
        nl, dl = c["linear_num_heads"], c["linear_head_dim"]
        lin = lambda x, n: F.linear(x, self.P(f"{A}.{n}.weight"))  # noqa: E731
        q = self._short_conv(lin(a, "q_proj").float(), self.P(f"{A}.q_conv1d.weight"))
        k = self._short_conv(lin(a, "k_proj").float(), self.P(f"{A}.k_conv1d.weight"))
        v = self._short_conv(lin(a, "v_proj").float(), self.P(f"{A}.v_conv1d.weight"))
        q = l2norm(q.view(B, T, nl, dl)) * (dl ** -0.5)
        k = l2norm(k.view(B, T, nl, dl))
        v = v.view(B, T, nl, dl)
        f = lin(lin(a, "f_a_proj"), "f_b_proj").float()
        glog = -torch.exp(self.P(f"{A}.A_log")).view(1, 1, nl, 1) * F.softplus(
            (f + self.P(f"{A}.dt_bias")).view(B, T, nl, dl)
        )
        beta = torch.sigmoid(lin(a, "b_proj").float())
        with torch.autocast(device_type=a.device.type, enabled=False):
            o, _ = self.kda_fn(q, k, v, glog, beta, self.chunk)
        gout = lin(lin(a, "g_a_proj"), "g_b_proj").float().view(B, T, nl, dl)
        o = rmsnorm(o, self.P(f"{A}.o_norm.weight"), self.eps) * torch.sigmoid(gout)
        return F.linear(o.reshape(B, T, nl * dl), self.P(f"{A}.o_proj.weight"))

    def _swiglu(self, x, pfx):
        g = F.linear(x, self.P(f"{pfx}.gate_proj.weight"))
        u = F.linear(x, self.P(f"{pfx}.up_proj.weight"))
        return F.linear(F.silu(g) * u, self.P(f"{pfx}.down_proj.weight"))

    def _moe(self, i: int, f):
        c = self.cfg
        Mp = f"model.layers.{i}.mlp"
        B, T, H = f.shape
        E, k, Im = self.E, self.topk, self.Im
        x = f.reshape(B * T, H)
        with torch.autocast(device_type=f.device.type, enabled=False):
            s = torch.sigmoid(x.float() @ self.P(f"{Mp}.gate.weight").float().T)  # [N, E]
        bias = self.P(f"{Mp}.gate.e_score_correction_bias")
        sel = torch.topk((s + bias).detach(), k, dim=-1).indices  # [N, k]
        w = torch.gather(s, 1, sel)
        if c["norm_topk_prob"]:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        w = w * float(c["routed_scaling_factor"])
        comb = torch.zeros_like(s).scatter(1, sel, w)  # [N, E], zero off the top-k
        gu = F.linear(x, self.P(f"{Mp}.experts.gate_up")).view(B * T, E, 2, Im)
        act = F.silu(gu[:, :, 0]) * gu[:, :, 1]  # [N, E, Im]
        act = act * comb.unsqueeze(-1).to(act.dtype)
        routed = F.linear(act.reshape(B * T, E * Im), self.P(f"{Mp}.experts.down"))
        out = routed + self._swiglu(x, f"{Mp}.shared_experts")
        if self.stats is not None:
            with torch.no_grad():
                cnt = torch.zeros(E, device=f.device, dtype=torch.float32)
                cnt.index_add_(0, sel.reshape(-1), torch.ones(sel.numel(), device=f.device))
            self.stats.setdefault("load", {})[i] = cnt
            # DeepSeek-V3 sequence-wise balance loss: sum_i f_i P_i per sequence
            sel_oh = torch.zeros_like(s).scatter(1, sel, 1.0).view(B, T, E)
            fi = sel_oh.mean(dim=1) * (E / k)  # [B, E]
            pi = (s / (s.sum(dim=-1, keepdim=True) + 1e-20)).view(B, T, E).mean(dim=1)
            self.stats["aux"] = self.stats.get("aux", 0.0) + (fi.detach() * pi).sum(-1).mean()
        return out.view(B, T, H)

    def _layer(self, i: int, x, amp: bool):
        Pfx = f"model.layers.{i}"
        a = rmsnorm(x, self.P(f"{Pfx}.input_layernorm.weight"), self.eps)
        if M.layer_kind(self.cfg, i) == "full_attention":
            x = x + self._full_attention(Pfx, a, amp).float()
        else:
            x = x + self._kda(Pfx, a).float()
        f = rmsnorm(x, self.P(f"{Pfx}.post_attention_layernorm.weight"), self.eps)
        if M.is_moe_layer(self.cfg, i):
            return x + self._moe(i, f).float()
        return x + self._swiglu(f, f"{Pfx}.mlp").float()

    # -- public ---------------------------------------------------------------------
    def hidden(self, tokens, amp: bool):
        """tokens [B, T] -> final (post-norm) hidden [B, T, H] fp32."""
        x = self.P("model.embed_tokens.weight")[tokens].float()
        for i in range(self.L):
            x = self._layer(i, x, amp)
        return rmsnorm(x, self.P("model.norm.weight"), self.eps)

    def logits(self, h):
        return F.linear(h, self.P("lm_head.weight"))

    def mtp_hidden(self, h, next_tokens, amp: bool):
        """h [B, T, H] final hidden at positions 0..T-1, next_tokens [B, T] -> MTP m."""
        N = self.mtp_idx
        Pfx = f"model.layers.{N}"
        e = rmsnorm(self.P("model.embed_tokens.weight")[next_tokens], self.P(f"{Pfx}.enorm.weight"), self.eps)
        hh = rmsnorm(h, self.P(f"{Pfx}.hnorm.weight"), self.eps)
        x = F.linear(torch.cat([e, hh], dim=-1), self.P(f"{Pfx}.eh_proj.weight")).float()
        x = self._layer(N, x, amp)
        return rmsnorm(x, self.P(f"{Pfx}.shared_head.norm.weight"), self.eps)

    def losses(self, win, amp: bool, with_mtp: bool = True, keep_logits: bool = False):
        """win [B, T+2] token ids. Target: positions 0..T-1 predict win[:, 1:T+1];
        MTP at t (h_t, win[t+1]) predicts win[:, t+2]."""
        T = win.shape[1] - 2
        inp, tgt, tgt2 = win[:, :T], win[:, 1:T + 1], win[:, 2:T + 2]
        h = self.hidden(inp, amp)
        lg = self.logits(h)
        out = {"ce": F.cross_entropy(lg.reshape(-1, lg.shape[-1]).float(), tgt.reshape(-1))}
        if keep_logits:
            out["logits"] = lg
        if with_mtp and self.mtp_idx is not None:
            ml = self.logits(self.mtp_hidden(h, tgt, amp))
            out["mtp"] = F.cross_entropy(ml.reshape(-1, ml.shape[-1]).float(), tgt2.reshape(-1))
            if keep_logits:
                out["mtp_logits"] = ml
        return out


# ======================================================================================
# Data
# ======================================================================================


def encode_docs(tok, texts, bos: int, eos: int) -> list[np.ndarray]:
    """Each text -> int32 [bos] + ids + [eos]."""
    out = []
    for e in tok.encode_batch(texts, add_special_tokens=False):
        a = np.empty(len(e.ids) + 2, dtype=np.int32)
        a[0] = bos
        a[1:-1] = e.ids
        a[-1] = eos
        out.append(a)
    return out


def windows_from(docs: list[np.ndarray], L: int, n: int | None = None) -> np.ndarray:
    s = np.concatenate(docs) if docs else np.zeros(0, np.int32)
    m = len(s) // L
    if n is not None:
        m = min(m, n)
    return s[: m * L].reshape(m, L).copy()


class TrainStream:
    """Tokenizes the train split in a background thread (files in a fixed hash order),
    as windows of L tokens; the trainer draws shuffled windows, epoch by epoch, from
    what is ready."""

    def __init__(self, tok, paths, texts, L, bos, eos, max_bytes: int, chunk_bytes: int = 8_000_000):
        order = sorted(range(len(paths)), key=lambda j: corpus.unit_hash(paths[j], "train-order"))
        sel, tot = [], 0
        for j in order:
            if max_bytes and tot >= max_bytes:
                break
            sel.append(j)
            tot += len(texts[j])
        self.texts = [texts[j] for j in sel]
        self.n_files, self.n_chars = len(sel), tot
        self.tok, self.L, self.bos, self.eos = tok, L, bos, eos
        self.chunk_bytes = chunk_bytes
        self.ready: list[np.ndarray] = []
        self.lock = threading.Lock()
        self.done = False
        self.error = None
        self.tokens = 0
        self.files_done = 0
        self.t_done = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self):
        self.t0 = time.time()
        self.thread.start()

    def _run(self):
        try:
            i = 0
            carry = np.zeros(0, np.int32)
            while i < len(self.texts):
                j, nb = i, 0
                while j < len(self.texts) and nb < self.chunk_bytes:
                    nb += len(self.texts[j])
                    j += 1
                docs = encode_docs(self.tok, self.texts[i:j], self.bos, self.eos)
                s = np.concatenate([carry] + docs)
                m = len(s) // self.L
                w = s[: m * self.L].reshape(m, self.L)
                carry = s[m * self.L:].copy()
                with self.lock:
                    self.ready.append(w.copy())
                    self.tokens += int(s.size - carry.size)
                    self.files_done = j
                i = j
        except BaseException as ex:  # noqa: BLE001
            self.error = "".join(traceback.format_exception(ex))
        finally:
            self.done = True
            self.t_done = time.time() - self.t0

    def take(self) -> list[np.ndarray]:
        with self.lock:
            r, self.ready = self.ready, []
        return r


class WindowPool:
    """Windows on the device; each epoch visits every window once in a random order;
    windows that arrive mid-epoch join the unvisited part. The index queue lives on the
    device, so drawing a batch never synchronises with the GPU."""

    def __init__(self, stream: TrainStream, device, seed: int):
        self.stream, self.device = stream, device
        self.gen = torch.Generator().manual_seed(seed)
        self.win = None
        self.queue = torch.zeros(0, dtype=torch.long, device=device)
        self.epoch = 0
        self.served = 0

    def _perm(self, n: int) -> torch.Tensor:
        return torch.randperm(n, generator=self.gen).to(self.device)

    def _absorb(self) -> int:
        new = self.stream.take()
        if not new:
            return 0
        t = torch.from_numpy(np.concatenate(new)).to(self.device)
        n0 = 0 if self.win is None else self.win.shape[0]
        self.win = t if self.win is None else torch.cat([self.win, t])
        rest = torch.cat([self.queue, torch.arange(n0, n0 + t.shape[0], device=self.device)])
        self.queue = rest[self._perm(rest.numel())]
        return t.shape[0]

    def wait_for(self, n: int, timeout: float):
        t = time.time()
        while (self.win is None or self.win.shape[0] < n) and time.time() - t < timeout:
            self._absorb()
            if self.stream.done and not self.stream.ready:
                break
            time.sleep(0.05)
        self._absorb()

    def next(self, B: int):
        if self.queue.numel() < B:
            self._absorb()
        if self.queue.numel() < B:
            if self.win is None:
                raise RuntimeError("no training windows available")
            self.epoch += 1
            self.queue = torch.cat([self.queue, self._perm(self.win.shape[0])])
        idx, self.queue = self.queue[:B], self.queue[B:]
        self.served += B
        return self.win[idx].long()

    def size(self) -> int:
        return 0 if self.win is None else int(self.win.shape[0])

    def poll(self) -> int:
        """Absorb windows tokenized since the last call (they join the unvisited part)."""
        return self._absorb() if self.stream.ready else 0


def build_fixed_sets(tok, cfg, args, held_paths, held_texts, train_paths, train_texts):
    """Held-out eval windows, held-out prompts (+ true continuations), train-split GPTQ
    calibration windows. Tokenizes only what it needs, in fixed hash orders."""
    bos, eos = cfg["bos_token_id"], cfg["eos_token_id"]
    # eval: held-out docs in 'eval' hash order, packed, first eval_seqs windows
    order = sorted(range(len(held_paths)), key=lambda j: corpus.unit_hash(held_paths[j], "eval"))
    need = args.eval_seqs * args.eval_len
    docs, used, ntok, nbytes = [], 0, 0, 0
    while used < len(order) and ntok < need:
        batch = order[used:used + 64]
        enc = encode_docs(tok, [held_texts[j] for j in batch], bos, eos)
        for j, e in zip(batch, enc):
            if ntok >= need:
                break
            docs.append(e)
            ntok += len(e)
            nbytes += len(held_texts[j].encode("utf-8"))
            used += 1
    eval_w = windows_from(docs, args.eval_len, args.eval_seqs)
    bpt = nbytes / max(1, ntok - 2 * len(docs))
    # prompts: the other held-out docs in 'prompt' hash order, long enough
    pl, cl = args.prompt_len, args.cont_len
    rest = sorted(order[used:], key=lambda j: corpus.unit_hash(held_paths[j], "prompt"))
    rest = [j for j in rest if len(held_texts[j]) >= 1.5 * (pl + cl)]  # cheap pre-filter (chars)
    chosen, pos = [], 0
    while pos < len(rest) and len(chosen) < args.prompts:
        batch = rest[pos:pos + 64]
        pos += len(batch)
        for j, e in zip(batch, encode_docs(tok, [held_texts[j] for j in batch], bos, eos)):
            if len(e) >= pl + cl and len(chosen) < args.prompts:  # [bos] + >= pl+cl-1 doc tokens
                chosen.append((j, e))
    prompts = np.stack([e[:pl] for _, e in chosen]) if chosen else np.zeros((0, pl), np.int32)
    conts = np.stack([e[pl:pl + cl] for _, e in chosen]) if chosen else np.zeros((0, cl), np.int32)
    # calibration: train split in 'calib' hash order, packed
    corder = sorted(range(len(train_paths)), key=lambda j: corpus.unit_hash(train_paths[j], "calib"))
    cneed, cdocs, cn, pos = args.calib_seqs * args.calib_len, [], 0, 0
    while pos < len(corder) and cn < cneed:
        batch = corder[pos:pos + 64]
        pos += len(batch)
        for e in encode_docs(tok, [train_texts[j] for j in batch], bos, eos):
            cdocs.append(e)
            cn += len(e)
    calib_w = windows_from(cdocs, args.calib_len, args.calib_seqs)
    meta = {
        "eval_tokens": f"[{eval_w.shape[0]}, {args.eval_len}] held-out: docs <|bos|> text <|eos|> in "
                       "corpus.unit_hash(relpath, 'eval') order, packed, cut into windows",
        "calib_tokens": f"[{calib_w.shape[0]}, {args.calib_len}] train split, 'calib' hash order, packed",
        "prompt_tokens": f"[{len(chosen)}, {pl}] held-out docs not used by eval, 'prompt' hash order, with "
                         f">= {pl + cl - 1} tokens: <|bos|> + the first {pl - 1} tokens",
        "prompt_continuations": f"[{len(chosen)}, {cl}] the true next {cl} tokens of each prompt",
        "prompt_files": [held_paths[j] for j, _ in chosen],
        "special": TT.special_ids(cfg),
    }
    data = {
        "eval_tokens": torch.from_numpy(eval_w.astype(np.int32)),
        "calib_tokens": torch.from_numpy(calib_w.astype(np.int32)),
        "prompt_tokens": torch.from_numpy(prompts.astype(np.int32)),
        "prompt_continuations": torch.from_numpy(conts.astype(np.int32)),
    }
    stats = {"eval_docs": len(docs), "eval_bytes_per_token": bpt, "eval_windows": list(eval_w.shape),
             "calib_windows": list(calib_w.shape), "prompts": len(chosen)}
    return data, meta, stats


# ======================================================================================
# Eval / parity
# ======================================================================================


@torch.no_grad()
def evaluate(model: TrainModel, windows: torch.Tensor, amp: bool, bs: int, device) -> dict:
    """Held-out metrics on windows [N, L]: target CE on L-2 positions, MTP CE (predicting
    t+2 from h_t and the true token t+1), top-1 accuracies, MTP agreement with the
    target's greedy next-next token (argmax MTP_t == argmax target logits_{t+1})."""
    tot = {"ce": 0.0, "mtp": 0.0, "acc": 0.0, "mtp_acc": 0.0, "agree": 0.0}
    n_pos = n_agree = 0
    for i in range(0, windows.shape[0], bs):
        w = windows[i:i + bs].to(device).long()
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp):
            o = model.losses(w, amp, keep_logits=True)
        T = w.shape[1] - 2
        npos = w.shape[0] * T
        lg, ml = o["logits"].float(), o["mtp_logits"].float()
        tot["ce"] += float(o["ce"]) * npos
        tot["mtp"] += float(o["mtp"]) * npos
        am, amm = lg.argmax(-1), ml.argmax(-1)
        tot["acc"] += float((am == w[:, 1:T + 1]).float().sum())
        tot["mtp_acc"] += float((amm == w[:, 2:T + 2]).float().sum())
        tot["agree"] += float((amm[:, :-1] == am[:, 1:]).float().sum())
        n_pos += npos
        n_agree += w.shape[0] * (T - 1)
    r = {
        "windows": int(windows.shape[0]), "window_len": int(windows.shape[1]), "positions": n_pos,
        "ce": tot["ce"] / n_pos, "mtp_ce": tot["mtp"] / n_pos,
        "top1": tot["acc"] / n_pos, "mtp_top1": tot["mtp_acc"] / n_pos,
        "mtp_agree_greedy": tot["agree"] / n_agree,
    }
    r["ppl"], r["mtp_ppl"] = math.exp(r["ce"]), math.exp(r["mtp_ce"])
    return r


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@torch.no_grad()
def parity(model: TrainModel, cfg: dict, tensors: dict, prompts: list[list[int]], n_greedy: int,
           device, log_fn=log) -> dict:
    """This file's fp32 forward vs recipes/model.py's Model on the same tensors."""
    ref = M.Model(cfg, tensors, device=str(device))
    res = {"prompts": [], "max_rel_logits": 0.0, "max_rel_mtp": 0.0, "greedy_equal": True,
           "min_greedy_margin": float("inf")}
    greedy = []
    for p in prompts:
        t0 = time.time()
        toks = torch.tensor(p, dtype=torch.long, device=device)
        cache = ref.new_cache()
        ro = ref.forward(toks, cache)
        g = ref.generate_greedy(p, n_greedy)
        nxt = toks[1:]
        rm = ref.mtp_forward(ro["hidden"][:-1], nxt, ref.new_cache())["logits"]
        h = model.hidden(toks[None], amp=False)
        ml = model.logits(h)[0]
        mm = model.logits(model.mtp_hidden(h[:, :-1], nxt[None], amp=False))[0]
        # greedy with this file's forward (full re-forward per token)
        seq = list(p)
        mine = []
        for _ in range(n_greedy):
            lg = model.logits(model.hidden(torch.tensor(seq, device=device)[None], amp=False))[0, -1]
            mine.append(int(lg.argmax()))
            seq.append(mine[-1])
        margins = M.top2_margin(g["logits"]).tolist()
        e = {
            "len": len(p),
            "rel_logits": rel_diff(ml, ro["logits"]),
            "rel_mtp": rel_diff(mm, rm),
            "greedy_ref": g["tokens"], "greedy_mine": mine,
            "greedy_equal": g["tokens"] == mine,
            "min_greedy_margin": min(margins),
            "seconds": round(time.time() - t0, 2),
        }
        res["prompts"].append(e)
        greedy.append(g["tokens"])
        res["max_rel_logits"] = max(res["max_rel_logits"], e["rel_logits"])
        res["max_rel_mtp"] = max(res["max_rel_mtp"], e["rel_mtp"])
        res["greedy_equal"] &= e["greedy_equal"]
        res["min_greedy_margin"] = min(res["min_greedy_margin"], e["min_greedy_margin"])
        log_fn(f"parity prompt len {len(p)}: rel logits {e['rel_logits']:.2e} rel mtp {e['rel_mtp']:.2e} "
               f"greedy equal {e['greedy_equal']} min margin {e['min_greedy_margin']:.3f} ({e['seconds']}s)")
    res["greedy_tokens"] = greedy
    return res


# ======================================================================================
# Export / unpack
# ======================================================================================


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for blk in iter(lambda: f.read(1 << 22), b""):
            h.update(blk)
    return h.hexdigest()


def write_data(path: str, data: dict[str, torch.Tensor], meta: dict) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in data.items()}, path,
              metadata={"speclab": json.dumps(meta, sort_keys=True)})


CKPT_FILES = ("config.json", "model.safetensors", "tokenizer.json", "data.safetensors", "train_log.json")


def export(ckpt_dir: str, out_dir: str, train_log: dict, part_mib: float) -> dict:
    """ckpt_dir holds config.json, model.safetensors, tokenizer.json, data.safetensors.
    Writes ckpt_dir/train_log.json (with sha256 of the others), a tar of all five split
    into out_dir/ckpt.tar.partNN, and out_dir/train_log.json (+ the tar's hashes)."""
    files = {}
    for n in CKPT_FILES[:-1]:
        p = os.path.join(ckpt_dir, n)
        files[n] = {"bytes": os.path.getsize(p), "sha256": sha256_file(p)}
    train_log["files"] = files
    with open(os.path.join(ckpt_dir, "train_log.json"), "w") as f:
        json.dump(train_log, f, indent=1, sort_keys=True)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for n in CKPT_FILES:
            ti = tf.gettarinfo(os.path.join(ckpt_dir, n), arcname=n)
            ti.mtime, ti.uid, ti.gid, ti.uname, ti.gname, ti.mode = 0, 0, 0, "", "", 0o644
            with open(os.path.join(ckpt_dir, n), "rb") as fh:
                tf.addfile(ti, fh)
    data = buf.getvalue()
    part = int(part_mib * (1 << 20))
    os.makedirs(out_dir, exist_ok=True)
    for old in os.listdir(out_dir):
        if old.startswith("ckpt.tar.part"):
            os.remove(os.path.join(out_dir, old))
    parts = []
    for j, off in enumerate(range(0, len(data), part)):
        name = f"ckpt.tar.part{j:02d}"
        chunk = data[off:off + part]
        with open(os.path.join(out_dir, name), "wb") as f:
            f.write(chunk)
        parts.append({"name": name, "bytes": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
    outer = dict(train_log)
    outer["tar"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest(), "parts": parts,
                    "files": list(CKPT_FILES)}
    with open(os.path.join(out_dir, "train_log.json"), "w") as f:
        json.dump(outer, f, indent=1, sort_keys=True)
    return outer["tar"]


def write_partial_log(out_dir: str, train_log: dict) -> None:
    """train_log.json in out_dir while the run is in progress (overwritten at export)."""
    try:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "train_log.json"), "w") as f:
            json.dump(train_log, f, indent=1, sort_keys=True, default=str)
    except Exception:  # noqa: BLE001
        pass


def read_tar_bytes(src: str) -> tuple[bytes, dict | None]:
    """src: a directory with ckpt.tar.partNN (+ train_log.json), a .tar, or one part."""
    outer = None
    if os.path.isdir(src):
        lp = os.path.join(src, "train_log.json")
        if os.path.exists(lp):
            with open(lp) as f:
                outer = json.load(f)
        parts = sorted(n for n in os.listdir(src) if n.startswith("ckpt.tar.part"))
        if not parts:
            raise SystemExit(f"no ckpt.tar.partNN in {src}")
        data = b"".join(open(os.path.join(src, n), "rb").read() for n in parts)
    elif ".part" in os.path.basename(src):
        d = os.path.dirname(src) or "."
        return read_tar_bytes(d)
    else:
        data = open(src, "rb").read()
    if outer and "tar" in outer:
        got = hashlib.sha256(data).hexdigest()
        if got != outer["tar"]["sha256"]:
            raise SystemExit(f"tar sha256 mismatch: {got} != {outer['tar']['sha256']}")
    return data, outer


def unpack(src: str, dest: str) -> dict:
    data, outer = read_tar_bytes(src)
    os.makedirs(dest, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r") as tf:
        names = tf.getnames()
        for n in names:
            if n not in CKPT_FILES:
                raise SystemExit(f"unexpected member {n!r}")
        for m in tf.getmembers():
            fh = tf.extractfile(m)
            with open(os.path.join(dest, m.name), "wb") as f:
                f.write(fh.read())
    with open(os.path.join(dest, "train_log.json")) as f:
        inner = json.load(f)
    for n, meta in inner["files"].items():
        got = sha256_file(os.path.join(dest, n))
        if got != meta["sha256"]:
            raise SystemExit(f"{n}: sha256 {got} != {meta['sha256']}")
    cfg, tensors = M.load_checkpoint(dest)
    specs = {n: (tuple(s), d) for n, s, d in M.tensor_specs(cfg)}
    assert set(specs) == set(tensors), "checkpoint tensors differ from tensor_specs"
    for n, (s, d) in specs.items():
        assert tuple(tensors[n].shape) == s and tensors[n].dtype == d, (n, tensors[n].shape, tensors[n].dtype)
    tok = TT.load_tokenizer(os.path.join(dest, "tokenizer.json"), cfg)
    return {"dest": dest, "tar_verified": bool(outer and "tar" in outer), "files": inner["files"],
            "tensors": len(tensors), "vocab": tok.get_vocab_size(), "eval": inner.get("eval")}


def load_resume(src: str, work: str) -> str:
    """-> a directory with config.json, model.safetensors, tokenizer.json."""
    if os.path.isdir(src) and os.path.exists(os.path.join(src, "model.safetensors")):
        return src
    d = os.path.join(work, "resume")
    unpack(src, d)
    return d


# ======================================================================================
# Self-test (CPU): chunked KDA and the whole forward vs recipes/model.py
# ======================================================================================


def selftest(device, log_fn=log) -> dict:
    torch.manual_seed(0)
    res = {}
    # 1. kda_chunked vs the per-token recurrence, strong and weak decays, T not % chunk
    B, T, h, d = 2, 45, 3, 8
    q = l2norm(torch.randn(B, T, h, d, dtype=torch.float64, device=device)) * d ** -0.5
    k = l2norm(torch.randn(B, T, h, d, dtype=torch.float64, device=device))
    v = torch.randn(B, T, h, d, dtype=torch.float64, device=device)
    glog = -torch.exp(torch.randn(B, T, h, d, dtype=torch.float64, device=device) * 2.5)
    glog[:, 7] = -200.0  # total forget mid-chunk: exp(G) underflows, must stay finite
    beta = torch.sigmoid(torch.randn(B, T, h, dtype=torch.float64, device=device))
    S0 = torch.randn(B, h, d, d, dtype=torch.float64, device=device)
    S = S0.clone()
    ref = torch.empty_like(v)
    for t in range(T):
        S = S * torch.exp(glog[:, t]).unsqueeze(-1)
        u = v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t])
        S = S + beta[:, t, :, None, None] * (k[:, t].unsqueeze(-1) * u.unsqueeze(-2))
        ref[:, t] = torch.einsum("bhkv,bhk->bhv", S, q[:, t])
    for C in (4, 16):
        o, Sf = kda_chunked(q, k, v, glog, beta, C, S0)
        res[f"kda_chunk{C}_f64_rel"] = max(rel_diff(o, ref), rel_diff(Sf, S))
    o32, _ = kda_chunked(q.float(), k.float(), v.float(), glog.float(), beta.float(), 16, S0.float())
    res["kda_chunk16_f32_rel"] = rel_diff(o32, ref)
    # gradients are finite under total forgetting
    qq = q.float().clone().requires_grad_()
    gg = glog.float().clone().requires_grad_()
    o32, _ = kda_chunked(qq, k.float(), v.float(), gg, beta.float(), 16)
    o32.square().sum().backward()
    res["kda_grads_finite"] = bool(torch.isfinite(qq.grad).all() and torch.isfinite(gg.grad).all())
    # 2. whole model (micro, reference init) vs recipes/model.py Model
    cfg = M.make_config("micro")
    tensors = M.init_weights(cfg, 0)
    tm = TrainModel(cfg, {k_: v_ for k_, v_ in tensors.items()}).to(device)
    assert all(torch.equal(tm.export_tensors()[n], tensors[n]) for n in tensors), "export round trip"
    rng = np.random.RandomState(1)
    prompt = [cfg["bos_token_id"]] + [int(x) for x in rng.randint(0, 504, size=40)]
    pr = parity(tm, cfg, tensors, [prompt], 8, device, log_fn=log_fn)
    res["model_rel_logits"] = pr["max_rel_logits"]
    res["model_rel_mtp"] = pr["max_rel_mtp"]
    res["model_greedy_equal"] = pr["greedy_equal"]
    # 3. batched training forward == per-sequence forward (no cross-sequence leakage)
    win = torch.tensor(rng.randint(0, 512, size=(3, 30)), device=device)
    a = tm.losses(win, amp=False, keep_logits=True)
    b = tm.losses(win[1:2], amp=False, keep_logits=True)
    res["batch_vs_single_rel"] = max(rel_diff(a["logits"][1], b["logits"][0]),
                                     rel_diff(a["mtp_logits"][1], b["mtp_logits"][0]))
    ok = (res["kda_chunk4_f64_rel"] < 1e-10 and res["kda_chunk16_f64_rel"] < 1e-10
          and res["kda_chunk16_f32_rel"] < 1e-4 and res["kda_grads_finite"]
          and res["model_rel_logits"] < 1e-4 and res["model_rel_mtp"] < 1e-4
          and res["model_greedy_equal"] and res["batch_vs_single_rel"] < 1e-4)
    res["ok"] = bool(ok)
    log_fn("selftest " + json.dumps(res))
    return res


# ======================================================================================
# Main
# ======================================================================================


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny", choices=M.PRESET_NAMES)
    ap.add_argument("--root", default=None, help="site-packages to read (default: this Python's)")
    ap.add_argument("--out", default=None, help="output folder ($OUT)")
    ap.add_argument("--work", default=None, help="scratch folder (default: a temp dir; not --out)")
    ap.add_argument("--budget-s", type=float, default=540.0, help="whole-run wall-clock budget")
    ap.add_argument("--reserve-s", type=float, default=0.0,
                    help="seconds kept after training for eval+export (0: auto)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    # data
    ap.add_argument("--tok-sample-mb", type=float, default=48.0)
    ap.add_argument("--max-train-mb", type=float, default=0.0, help="0: the whole train split")
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--eval-seqs", type=int, default=256)
    ap.add_argument("--eval-len", type=int, default=512)
    ap.add_argument("--calib-seqs", type=int, default=128)
    ap.add_argument("--calib-len", type=int, default=512)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--cont-len", type=int, default=256)
    # optimisation
    ap.add_argument("--batch", type=int, default=0, help="sequences per step; 0: probe candidates")
    ap.add_argument("--batch-candidates", default="32,64,128")
    ap.add_argument("--max-mem-frac", type=float, default=0.6, help="probe: max peak memory fraction")
    ap.add_argument("--probe-cpu", action="store_true", help="run the batch probe on CPU too (tests)")
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup-steps", type=int, default=100)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--beta2", type=float, default=0.95)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--aux-alpha", type=float, default=1e-4, help="sequence-wise balance loss weight")
    ap.add_argument("--bias-gamma", type=float, default=1e-3, help="aux-loss-free bias update speed")
    ap.add_argument("--chunk", type=int, default=16, help="KDA chunk length")
    ap.add_argument("--no-amp", action="store_true", help="train in fp32 (CPU tests)")
    ap.add_argument("--amp-cpu", action="store_true", help="bf16 autocast on CPU too (tests the GPU path)")
    ap.add_argument("--compile", action="store_true", help="torch.compile the KDA core (guarded)")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--max-steps", type=int, default=0, help="0: until the deadline")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    # eval / export
    ap.add_argument("--parity-prompts", type=int, default=4)
    ap.add_argument("--parity-greedy", type=int, default=32)
    ap.add_argument("--part-mib", type=float, default=15.0)
    ap.add_argument("--max-out-files", type=int, default=8, help="incl. train_log.json and log.txt")
    # modes
    ap.add_argument("--resume-from", default=None, help="checkpoint dir, tar, or folder of parts")
    ap.add_argument("--unpack", default=None, help="folder of ckpt.tar.partNN (or a tar): verify + extract")
    ap.add_argument("--dest", default=None, help="--unpack destination")
    ap.add_argument("--selftest", action="store_true", help="check the training forward vs model.py; exit")
    return ap.parse_args(argv)


def pick_device(name: str):
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def lr_at(args, step: int, progress: float, scale: float) -> float:
    warm = min(1.0, (step + 1) / max(1, args.warmup_steps))
    p = min(max(progress, 0.0), 1.0)
    cos = args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * p))
    return args.lr * warm * cos * scale


def make_optimizer(model: TrainModel, args, device):
    decay, no_decay = [], []
    for k, p in model.params.items():
        if not p.requires_grad:
            continue
        (decay if p.ndim == 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": args.wd}, {"params": no_decay, "weight_decay": 0.0}]
    kw = dict(lr=args.lr, betas=(0.9, args.beta2), eps=1e-8)
    if device.type == "cuda":
        try:
            return torch.optim.AdamW(groups, fused=True, **kw)
        except Exception:  # noqa: BLE001
            pass
    return torch.optim.AdamW(groups, **kw)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.unpack:
        dest = args.dest or "ckpt_unpacked"
        r = unpack(args.unpack, dest)
        print(json.dumps(r, indent=1))
        return 0
    device = pick_device(args.device)
    if args.selftest:
        return 0 if selftest(device)["ok"] else 1
    if not args.out:
        raise SystemExit("--out is required")
    return run(args, device)


def run(args, device) -> int:
    clock = Clock(args.budget_s)
    cfg = M.make_config(args.preset)
    work = args.work or tempfile.mkdtemp(prefix="speclab_train_")
    out_dir = os.path.abspath(args.out)
    if os.path.abspath(work).startswith(out_dir + os.sep) or os.path.abspath(work) == out_dir:
        raise SystemExit("--work must not be inside --out (every file there is returned)")
    ckpt_dir = os.path.join(work, "ckpt")
    os.makedirs(ckpt_dir, exist_ok=True)
    amp = (not args.no_amp) and (device.type == "cuda" or args.amp_cpu)
    tl = {  # train_log.json
        "preset": args.preset, "args": vars(args), "torch": torch.__version__,
        "python": sys.version.split()[0], "device": str(device),
        "device_name": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
        "amp_bf16": amp, "phases": clock.phases, "status": "running", "cpus": N_CPUS,
        "rayon_threads": os.environ.get("RAYON_NUM_THREADS"),
        "config": cfg, "n_params": M.count_params(cfg),
    }
    try:
        import tokenizers

        tl["tokenizers"] = tokenizers.__version__
    except Exception:  # noqa: BLE001
        pass
    log(f"speclab train_target: preset {args.preset} ({tl['n_params']:,} params), device {device} "
        f"({tl['device_name']}), torch {torch.__version__}, amp bf16 {amp}, budget {args.budget_s:.0f}s, "
        f"work {work}, out {out_dir}")
    reserve = args.reserve_s or (50.0 if device.type == "cuda" else 25.0)

    # -- 0. self-test of the training forward vs the reference (micro, seconds) ------
    with clock.phase("selftest"):
        try:
            tl["selftest"] = selftest(device)
        except Exception:  # noqa: BLE001
            tl["selftest"] = {"ok": False, "error": traceback.format_exc()}
            log("selftest FAILED:\n" + tl["selftest"]["error"])
        if not tl["selftest"].get("ok"):
            log("WARNING: selftest not ok; training continues, see train_log.json selftest")

    # -- 1. corpus ---------------------------------------------------------------------
    with clock.phase("corpus"):
        corp = corpus.load_corpus(args.root, workers=min(32, N_CPUS * 2), log=log)
        tl["corpus"] = corp.manifest
        train_paths, train_texts = corp.train.paths, corp.train.texts
        held_paths, held_texts = corp.heldout.paths, corp.heldout.texts

    # -- 2. tokenizer ------------------------------------------------------------------
    resume_dir = None
    with clock.phase("tokenizer"):
        if args.resume_from:
            resume_dir = load_resume(args.resume_from, work)
            rcfg, _ = M.load_checkpoint(resume_dir)
            assert rcfg["preset"] == cfg["preset"], "resume checkpoint has another preset"
            tok = TT.load_tokenizer(os.path.join(resume_dir, "tokenizer.json"), cfg)
            tl["tokenizer"] = {"from": os.path.join(resume_dir, "tokenizer.json")}
            log(f"tokenizer from {resume_dir}")
        else:
            sample = TT.sample_texts(train_paths, train_texts, int(args.tok_sample_mb * 1e6))
            tok = TT.train_tokenizer(sample, cfg, log=log)
            tl["tokenizer"] = {"sample_files": len(sample), "sample_chars": sum(len(t) for t in sample),
                               "rule": "train files with corpus.unit_hash(relpath, 'tokenizer') < fraction"}
        tok.save(os.path.join(ckpt_dir, "tokenizer.json"))
    bos, eos = cfg["bos_token_id"], cfg["eos_token_id"]

    # -- 3. eval / calibration / prompts (synchronous, small) --------------------------
    with clock.phase("data"):
        data, data_meta, dstats = build_fixed_sets(tok, cfg, args, held_paths, held_texts, train_paths, train_texts)
        tl["data"] = dstats
        tl["tokenizer"]["heldout_bytes_per_token"] = dstats["eval_bytes_per_token"]
        log(f"eval {list(data['eval_tokens'].shape)} ({dstats['eval_bytes_per_token']:.2f} bytes/token), "
            f"calib {list(data['calib_tokens'].shape)}, prompts {list(data['prompt_tokens'].shape)} "
            f"(+{args.cont_len} continuation tokens)")
        stream = TrainStream(tok, train_paths, train_texts, args.seq_len + 2, bos, eos,
                             int(args.max_train_mb * 1e6))
        stream.start()
        del corp
    write_partial_log(out_dir, tl)

    # -- 4. model + batch probe --------------------------------------------------------
    with clock.phase("build"):
        if resume_dir:
            _, rt = M.load_checkpoint(resume_dir)
            model = TrainModel(cfg, rt, chunk=args.chunk).to(device)
            rlog = os.path.join(resume_dir, "train_log.json")
            tl["resumed_from"] = {"path": args.resume_from}
            if os.path.exists(rlog):
                with open(rlog) as f:
                    prev = json.load(f)
                tl["resumed_from"]["tokens_seen_before"] = prev.get("train", {}).get("tokens_seen")
        else:
            model = TrainModel(cfg, seed=args.seed, chunk=args.chunk).to(device)
        if args.compile:
            try:
                model.kda_fn = torch.compile(kda_chunked, dynamic=False)
                log("torch.compile(kda_chunked) for training (falls back to eager on failure)")
            except Exception:  # noqa: BLE001
                log("torch.compile unavailable: " + traceback.format_exc(limit=1))
        L = args.seq_len

        def step_once(win):
            with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp):
                model.stats = {}
                o = model.losses(win, amp)
                aux = model.stats.get("aux", torch.zeros((), device=device))
                loss = o["ce"] + args.mtp_weight * o["mtp"] + args.aux_alpha * aux
            loss.backward()
            return o, aux

        def step_fn(win):
            if model.kda_fn is kda_chunked:
                return step_once(win)
            try:
                return step_once(win)
            except torch.cuda.OutOfMemoryError:
                raise
            except Exception:  # noqa: BLE001
                log("compiled KDA failed, back to eager:\n" + traceback.format_exc(limit=3))
                tl["compile_error"] = traceback.format_exc()
                model.kda_fn = kda_chunked
                model.zero_grad(set_to_none=True)
                return step_once(win)

        cands_b = [args.batch] if args.batch else [int(x) for x in args.batch_candidates.split(",")]
        probe, best = [], None
        cuda = device.type == "cuda"
        if cuda or (args.probe_cpu and not args.batch):
            total_mem = torch.cuda.get_device_properties(0).total_memory if cuda else float("inf")
            for b in cands_b:
                if clock.left() < reserve + 90:
                    break
                win = None
                try:
                    if cuda:
                        torch.cuda.empty_cache()
                        torch.cuda.reset_peak_memory_stats()
                    win = torch.randint(0, cfg["vocab_size"] - 8, (b, L + 2), device=device)
                    ts = []
                    for _ in range(3):
                        t = time.time()
                        step_fn(win)
                        model.zero_grad(set_to_none=True)
                        sync(device)
                        ts.append(time.time() - t)
                    peak = torch.cuda.max_memory_allocated() if cuda else 0
                    dt = min(ts[1:])
                    rec = {"batch": b, "step_s": round(dt, 4), "first_s": round(ts[0], 2),
                           "tokens_per_s": round(b * L / dt), "peak_gib": round(peak / 2**30, 2)}
                    probe.append(rec)
                    log(f"probe batch {b}x{L}: {dt * 1e3:.0f} ms/step, {b * L / dt:,.0f} tok/s, "
                        f"peak {peak / 2**30:.1f} GiB (first step {ts[0]:.1f}s)")
                    # a larger batch must be clearly faster per token to be worth fewer steps
                    if best is None or rec["tokens_per_s"] >= 1.15 * best["tokens_per_s"]:
                        best = rec
                    if peak > args.max_mem_frac * total_mem:
                        log(f"batch {b}: peak memory above {args.max_mem_frac:.0%} of the GPU, not trying larger")
                        break
                except torch.cuda.OutOfMemoryError:
                    log(f"probe batch {b}: out of memory")
                    probe.append({"batch": b, "oom": True})
                    break
                except Exception:  # noqa: BLE001  (training will hit it too, and log it)
                    tl["probe_error"] = traceback.format_exc()
                    log(f"probe batch {b} failed:\n" + tl["probe_error"])
                    break
                finally:
                    model.zero_grad(set_to_none=True)
                    win = None
            if cuda:
                torch.cuda.empty_cache()
        best_b = best["batch"] if best else cands_b[0]
        if best is None and probe and probe[0].get("oom"):
            best_b = max(8, cands_b[0] // 2)  # even the smallest candidate failed
        B = best_b
        tl["probe"] = probe
        log(f"batch {B} x {L} = {B * L:,} tokens/step")

    # -- 5. train ----------------------------------------------------------------------
    hist = []
    tr = {"batch": B, "seq_len": L, "tokens_per_step": B * L, "history": hist, "nan_restarts": 0}
    tl["train"] = tr
    opt = make_optimizer(model, args, device)
    moe_layers = model.moe_layers
    train_deadline = clock.deadline - reserve
    step = 0
    lr_scale = 1.0
    with clock.phase("train"):
        pool = WindowPool(stream, device, args.seed)
        pool.wait_for(B * 4, timeout=max(5.0, clock.left() - reserve - 30))
        log(f"train windows ready: {pool.size():,} (stream: {stream.files_done}/{stream.n_files} files)")
        t_train0 = time.time()
        span = max(1.0, train_deadline - t_train0)
        acc = {"ce": torch.zeros((), device=device), "mtp": torch.zeros((), device=device),
               "aux": torch.zeros((), device=device), "gn": torch.zeros((), device=device)}
        load_acc = {i: torch.zeros(model.E, device=device) for i in moe_layers}
        n_acc = 0
        t_log, tok_log = time.time(), 0
        good = {k: v.detach().clone() for k, v in model.params.items()}
        stop_reason = "deadline"
        safety_done = False
        try:
            while True:
                now = time.time()
                if now >= train_deadline:
                    break
                if args.max_steps and step >= args.max_steps:
                    stop_reason = "max_steps"
                    break
                lr = lr_at(args, step, (now - t_train0) / span, lr_scale)
                for gr in opt.param_groups:
                    gr["lr"] = lr
                win = pool.next(B)
                o, aux = step_fn(win)
                gn = torch.nn.utils.clip_grad_norm_([p for p in model.params.values() if p.requires_grad], args.clip)
                opt.step()
                opt.zero_grad(set_to_none=True)
                with torch.no_grad():
                    for i in moe_layers:
                        load = model.stats["load"][i]
                        bias = model.P(f"model.layers.{i}.mlp.gate.e_score_correction_bias")
                        bias.add_(args.bias_gamma * torch.sign(load.mean() - load))
                        load_acc[i] += load
                    acc["ce"] += o["ce"].detach()
                    acc["mtp"] += o["mtp"].detach()
                    acc["aux"] += aux.detach()
                    acc["gn"] += gn.detach()
                n_acc += 1
                step += 1
                tok_log += B * L
                if step % args.log_every == 0 or step == 1:
                    ce = float(acc["ce"]) / n_acc  # syncs
                    e = {
                        "step": step, "t": round(time.time() - T_START, 1),
                        "tokens": step * B * L, "lr": lr,
                        "ce": ce, "mtp_ce": float(acc["mtp"]) / n_acc,
                        "aux": float(acc["aux"]) / n_acc, "grad_norm": float(acc["gn"]) / n_acc,
                        "tok_s": round(tok_log / (time.time() - t_log)),
                        "load_max_over_mean": [round(float(load_acc[i].max() / load_acc[i].mean().clamp_min(1e-9)), 3)
                                               for i in moe_layers],
                        "pool_windows": pool.size(), "epoch": pool.epoch,
                    }
                    e["eta_tokens"] = round(e["tokens"] + e["tok_s"] * max(0.0, train_deadline - time.time()))
                    hist.append(e)
                    log(f"step {step} tok {e['tokens'] / 1e6:.1f}M ce {ce:.4f} mtp {e['mtp_ce']:.4f} "
                        f"aux {e['aux']:.3f} gn {e['grad_norm']:.2f} lr {lr:.2e} {e['tok_s']:,} tok/s "
                        f"load max/mean {e['load_max_over_mean']} pool {e['pool_windows']} ep {pool.epoch} "
                        f"eta {e['eta_tokens'] / 1e6:.0f}M tokens")
                    if not math.isfinite(ce) or not math.isfinite(e["mtp_ce"]):
                        tr["nan_restarts"] += 1
                        log(f"non-finite loss at step {step}: restoring the last good weights, lr x0.5")
                        with torch.no_grad():
                            for k, v in model.params.items():
                                v.copy_(good[k])
                        opt = make_optimizer(model, args, device)
                        lr_scale *= 0.5
                        if tr["nan_restarts"] >= 3:
                            stop_reason = "non-finite loss (3 restarts)"
                            break
                    else:
                        with torch.no_grad():
                            for k, v in model.params.items():
                                good[k].copy_(v)
                    for k in acc:
                        acc[k].zero_()
                    for i in moe_layers:
                        load_acc[i].zero_()
                    n_acc, t_log, tok_log = 0, time.time(), 0
                    pool.poll()
                    if step % (args.log_every * 8) == 0:
                        tr.update(steps=step, tokens_seen=step * B * L)
                        write_partial_log(out_dir, tl)
                    if not safety_done and time.time() - t_train0 > 0.6 * span and clock.left() > reserve + 30:
                        # a usable checkpoint in --out in case the call is cut short
                        t = time.time()
                        tr.update(steps=step, tokens_seen=step * B * L)
                        tl["status"] = f"partial: safety export at step {step}, training continues"
                        M.save_checkpoint(ckpt_dir, cfg, model.export_tensors())
                        write_data(os.path.join(ckpt_dir, "data.safetensors"), data, data_meta)
                        export(ckpt_dir, out_dir, tl, args.part_mib)
                        safety_done = True
                        tr["safety_export"] = {"step": step, "seconds": round(time.time() - t, 2)}
                        log(f"safety export at step {step} in {time.time() - t:.1f}s")
                        t_log = time.time()
        except Exception:  # noqa: BLE001
            stop_reason = "exception: " + traceback.format_exc()
            log("training stopped by an exception:\n" + stop_reason)
            with torch.no_grad():
                for k, v in model.params.items():
                    v.copy_(good[k])
        sync(device)
        dt = time.time() - t_train0
        tr.update(steps=step, tokens_seen=step * B * L, seconds=round(dt, 1),
                  tokens_per_s=round(step * B * L / max(dt, 1e-9)), stop_reason=stop_reason,
                  epochs_completed=pool.epoch, pool_windows=pool.size(),
                  stream={"files": stream.n_files, "files_done": stream.files_done,
                          "tokens": stream.tokens, "seconds": stream.t_done, "error": stream.error},
                  final_bias={str(i): model.P(f"model.layers.{i}.mlp.gate.e_score_correction_bias").tolist()
                              for i in moe_layers})
        if resume_dir and tl.get("resumed_from", {}).get("tokens_seen_before"):
            tr["tokens_seen_total"] = tr["tokens_seen"] + tl["resumed_from"]["tokens_seen_before"]
        log(f"trained {step} steps, {step * B * L / 1e6:.1f}M tokens in {dt:.0f}s "
            f"({tr['tokens_per_s']:,} tok/s), stop: {stop_reason.splitlines()[0]}; "
            f"stream {stream.tokens / 1e6:.1f}M tokens tokenized in {stream.t_done}s")

    # -- 6. save + first export (safety) -----------------------------------------------
    with clock.phase("save"):
        tensors = model.export_tensors()
        M.save_checkpoint(ckpt_dir, cfg, tensors)
        write_data(os.path.join(ckpt_dir, "data.safetensors"), data, data_meta)
        tl["status"] = "trained, eval pending"
        export(ckpt_dir, out_dir, tl, args.part_mib)
    del opt
    model.zero_grad(set_to_none=True)
    model.stats = None
    model.kda_fn = kda_chunked
    if device.type == "cuda":
        torch.cuda.empty_cache()

    # -- 7. eval -----------------------------------------------------------------------
    with clock.phase("eval"):
        try:
            ev = {}
            em = TrainModel(cfg, tensors, chunk=args.chunk).to(device)  # bf16-rounded weights
            em.eval()
            ew = data["eval_tokens"]
            bs = 32 if device.type == "cuda" else 4
            ev["bf16_weights_fp32_compute"] = evaluate(em, ew, amp=False, bs=bs, device=device)
            log("eval (bf16 checkpoint, fp32 compute): " + json.dumps(ev["bf16_weights_fp32_compute"]))
            if amp and clock.left() > 30:
                ev["master_weights_amp"] = evaluate(model, ew, amp=True, bs=bs, device=device)
                log("eval (fp32 masters, bf16 autocast): " + json.dumps(ev["master_weights_amp"]))
            tl["eval"] = ev
        except Exception:  # noqa: BLE001
            tl["eval_error"] = traceback.format_exc()
            log("eval failed:\n" + tl["eval_error"])
    with clock.phase("parity"):
        try:
            n_par = min(args.parity_prompts, data["prompt_tokens"].shape[0])
            plist = [data["prompt_tokens"][j].tolist() for j in range(n_par)]
            if clock.left() < 20:
                plist = plist[:1]
            pr = parity(em, cfg, tensors, plist, args.parity_greedy, device)
            tl["parity"] = {k: v for k, v in pr.items() if k != "greedy_tokens"}
            if pr["greedy_tokens"]:
                data["parity_greedy_tokens"] = torch.tensor(pr["greedy_tokens"], dtype=torch.int32)
                data_meta["parity_greedy_tokens"] = (
                    f"[{len(plist)}, {args.parity_greedy}] recipes/model.py Model greedy continuation "
                    f"of prompt_tokens[:{len(plist)}] on {device} in fp32 (bf16 checkpoint)")
            samples = []
            for j, p in enumerate(plist[:2]):
                samples.append({"prompt_tail": tok.decode(p[-48:], skip_special_tokens=False),
                                "greedy": tok.decode(pr["greedy_tokens"][j], skip_special_tokens=False)})
                log(f"sample {j}: ...{samples[-1]['prompt_tail']!r} => {samples[-1]['greedy']!r}")
            tl["samples"] = samples
        except Exception:  # noqa: BLE001
            tl["parity_error"] = traceback.format_exc()
            log("parity failed:\n" + tl["parity_error"])

    # -- 8. final export ---------------------------------------------------------------
    with clock.phase("export"):
        write_data(os.path.join(ckpt_dir, "data.safetensors"), data, data_meta)
        tl["status"] = "done"
        tl["elapsed_s"] = round(clock.elapsed(), 1)
        tl["log"] = LOG_LINES
        tar = export(ckpt_dir, out_dir, tl, args.part_mib)
        outs = sorted(os.listdir(out_dir))
        log(f"exported {len(tar['parts'])} parts ({tar['bytes'] / 2**20:.1f} MiB tar, sha256 {tar['sha256'][:16]}...) "
            f"to {out_dir}: {outs}")
        big = [n for n in outs if os.path.getsize(os.path.join(out_dir, n)) > 16 * 2**20]
        if len(outs) + 1 > args.max_out_files or big:  # + log.txt from tee
            log(f"WARNING: {len(outs)} files in --out (+ log.txt), over 16 MiB: {big}")
    log(f"phases: {json.dumps(clock.phases)}; total {clock.elapsed():.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
