#!/usr/bin/env python3
"""Train the ``dflash2-tiny`` drafter on the W4A16 target's own greedy outputs, in one
wall-clock budget (one GPU call), evaluate it with real greedy speculative decoding,
and export it.

    PYTHONUNBUFFERED=1 python3 recipes/train_dflash2.py --target models/tiny --budget-s 540 --out $OUT

Phases (each timed, printed, recorded in ``dflash2_log.json``):

1. selftest  (micro, random weights, seconds) the batched cached decoder below vs
             ``recipes/model.py``'s ``Model`` (features, logits, greedy tokens), the batched
             MTP chain vs ``Model.mtp_forward`` run step by step, and the acceptance
             bookkeeping on oracle drafters (perfect / first k right / never right).
2. load      the target checkpoint (W4A16 ``weight_packed`` experts dequantized exactly to
             f32, bf16 tensors upcast; a single ``model.safetensors`` or shards), into
             ``train_target.TrainModel`` (the fast GPU forward: chunked KDA, dense MoE),
             frozen, f32 compute, TF32 off.
3. evalset   the first ``--eval-prompts`` held-out prompts of ``data.safetensors``
             (``prompt_tokens``): the target's greedy continuation (``--eval-gen`` + 8
             tokens), target features (docs/dflash2.md §3) and final hiddens. Parity: the
             same greedy tokens and features from ``model.py``'s ``Model`` on one prompt.
4. prompts   train-split prompts: the corpus of ``recipes/corpus.py`` (the target's own
             split rule; files in a fixed hash order), tokenized with the checkpoint's
             tokenizer; half start at a file start (``<|bos|>`` + its first P-1 tokens,
             the eval prompt format; ``--head-files`` file heads, each used once per
             prompt length), half are windows of a packed stream of whole train files
             (``--prompt-text-mb``). ``--prompt-source calib`` (or a corpus failure) uses
             windows of ``calib_tokens`` instead.
5. generate  batched greedy decoding with the target (prefill with the chunked KDA, then
             one token per step with the KDA recurrence, the short-conv tails and a
             preallocated KV cache for the full-attention layers), rows of
             ``--row-len`` tokens: prompt (length cycling through ``--prompt-lens``) +
             greedy continuation; the features of every position are captured on the way
             (the residual stream after ``target_layer_ids``), so no second pass is
             needed. Stops at ``--gen-s`` seconds or when the row store is full.
6. train     ``recipes/dflash2.py``'s ``Drafter.train_forward`` (docs §8: decay-weighted
             block CE + selector CE), mode v2, ``init_weights(scheme="train")`` (convs
             start as the identity), anchors drawn uniformly in the generated
             continuation (the prompt tokens are never labels), AdamW with warmup +
             cosine on wall-clock progress; the conv parameters get a lower LR that starts
             late and ramps up (``--conv-*``). A safety checkpoint is written to --out at
             ``--safety-frac`` of the training time. Stops at the deadline.
7. eval      the bf16 checkpoint re-read from --out: real speculative decoding (greedy)
             on the eval prompts with ``Drafter.draft_block`` (v2, and v1 = conv +
             selector off) against the target's greedy tokens: per-position acceptance,
             draft acceptance rate, tau = 1 + accepted / draft steps. With greedy
             verification the accepted tokens are always the target's greedy sequence, so
             verification compares with the precomputed greedy continuation; the full
             loop (``model.py`` target verifies each block, the verify rows' features are
             appended at commit, docs §7) is also run on ``--verify-prompts`` prompts and
             must give the same acceptance. MTP (the target's MTP layer reused
             autoregressively, vLLM style: step j >= 2 is fed the previous MTP step's
             pre-``shared_head.norm`` hidden and its draft token) at N = 1..7 with the same
             bookkeeping. Teacher-forced held-out metrics (docs §8.6) too.
8. export    --out: ``config.json`` + ``model.safetensors`` (bf16, docs §9/§10; loads with
             ``recipes/dflash2.py``) + ``dflash2_log.json``.
"""

from __future__ import annotations

import time

T0 = time.time()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import hashlib  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import corpus  # noqa: E402
import dflash2 as D  # noqa: E402
import model as M  # noqa: E402
import train_target as TTg  # noqa: E402  (TrainModel, kda_chunked, rmsnorm, encode_docs)
import train_tokenizer as TTok  # noqa: E402

LOG_LINES: list[str] = []
TL: dict = {}  # dflash2_log.json


def log(*a):
    s = " ".join(str(x) for x in a)
    LOG_LINES.append(f"{time.time() - T0:7.1f} {s}")
    print(f"[{time.time() - T0:6.1f}s] {s}", flush=True)


class Clock:
    def __init__(self, budget_s: float):
        self.budget = budget_s
        self.deadline = T0 + budget_s
        self.phases: dict[str, float] = {}

    def elapsed(self) -> float:
        return time.time() - T0

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


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for blk in iter(lambda: f.read(1 << 22), b""):
            h.update(blk)
    return h.hexdigest()


# ======================================================================================
# Target checkpoint
# ======================================================================================


def load_target_tensors(directory: str) -> tuple[dict, dict[str, torch.Tensor], list[str]]:
    """config + raw tensors (as stored: W4A16 packed experts stay packed), from
    ``model.safetensors`` or shards (``model.safetensors.index.json`` or ``model-*.safetensors``)."""
    from safetensors.torch import load_file

    with open(os.path.join(directory, "config.json")) as f:
        cfg = json.load(f)
    single = os.path.join(directory, "model.safetensors")
    if os.path.exists(single):
        files = [single]
    else:
        idx = os.path.join(directory, "model.safetensors.index.json")
        if os.path.exists(idx):
            with open(idx) as f:
                files = sorted({os.path.join(directory, v) for v in json.load(f)["weight_map"].values()})
        else:
            files = sorted(os.path.join(directory, n) for n in os.listdir(directory)
                           if n.endswith(".safetensors") and n.startswith("model"))
    if not files:
        raise SystemExit(f"no model safetensors in {directory}")
    tensors = {}
    for p in files:
        part = load_file(p)
        dup = set(part) & set(tensors)
        assert not dup, f"tensor in two shards: {sorted(dup)[:3]}"
        tensors.update(part)
    return cfg, tensors, [os.path.basename(p) for p in files]


def canonical_f32(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """W4A16 ``{mod}.weight_packed/_scale/_shape`` -> ``{mod}.weight`` f32 (exact
    dequantization, model.py's), everything else upcast to f32."""
    out = {}
    for name, t in tensors.items():
        if name.endswith(".weight_packed"):
            mod = name[: -len(".weight_packed")]
            out[f"{mod}.weight"] = M.dequantize(t, tensors[f"{mod}.weight_scale"], tensors[f"{mod}.weight_shape"].tolist())
        elif name.endswith(".weight_scale") or name.endswith(".weight_shape"):
            continue
        else:
            out[name] = t.to(torch.float32)
    return out


# ======================================================================================
# Batched cached greedy decoding with train_target.TrainModel's parameters
# ======================================================================================


class TargetRunner:
    """Incremental batched forward of docs/model.md's target using a frozen
    ``train_target.TrainModel`` (its parameters, its MoE / SwiGLU / chunked KDA): prefill
    any length from an empty state, then one token per step. f32 throughout. State per
    layer: full attention K/V in a preallocated [B, nkv, Tmax, d] buffer; KDA the
    short-conv tails [B, kc-1, C] and the recurrent state S [B, nl, dk, dv]."""

    def __init__(self, tm: "TTg.TrainModel", layer_ids, device, max_pos: int):
        self.tm, self.cfg = tm, tm.cfg
        c = self.cfg
        self.ids = list(layer_ids)
        self.L = c["num_hidden_layers"]
        self.eps = tm.eps
        self.nh, self.nkv, self.d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        self.nl, self.dl, self.kc = c["linear_num_heads"], c["linear_head_dim"], c["linear_conv_kernel_dim"]
        self.device = device
        self.cos, self.sin = M.rope_tables(torch.arange(max_pos, device=device), self.d, float(c["rope_theta"]))
        self.max_pos = max_pos

    def P(self, name):
        return self.tm.P(name)

    def new_state(self, B: int, Tmax: int) -> list[dict]:
        assert Tmax <= self.max_pos
        st = []
        C = self.nl * self.dl
        dev = self.device
        for i in range(self.L):
            if M.layer_kind(self.cfg, i) == "full_attention":
                z = torch.zeros(B, self.nkv, Tmax, self.d, device=dev)
                st.append({"k": z, "v": z.clone()})
            else:
                z = lambda: torch.zeros(B, self.kc - 1, C, device=dev)  # noqa: E731
                st.append({"cq": z(), "ck": z(), "cv": z(),
                           "S": torch.zeros(B, self.nl, self.dl, self.dl, device=dev)})
        return st

    @staticmethod
    def slice_state(st, b0, b1):
        return [{k: v[b0:b1] for k, v in s.items()} for s in st]

    @staticmethod
    def put_state(st, sub, b0, b1):
        for s, u in zip(st, sub):
            for k in s:
                if s[k][b0:b1].data_ptr() != u[k].data_ptr():
                    s[k][b0:b1] = u[k]

    def _attn(self, Pfx, a, st, pos0):
        B, T, _ = a.shape
        nh, nkv, d = self.nh, self.nkv, self.d
        q = F.linear(a, self.P(f"{Pfx}.self_attn.q_proj.weight")).view(B, T, nh, d)
        k = F.linear(a, self.P(f"{Pfx}.self_attn.k_proj.weight")).view(B, T, nkv, d)
        v = F.linear(a, self.P(f"{Pfx}.self_attn.v_proj.weight")).view(B, T, nkv, d)
        cos = self.cos[pos0:pos0 + T].view(1, T, 1, d)
        sin = self.sin[pos0:pos0 + T].view(1, T, 1, d)
        q = q * cos + M.rotate_half(q) * sin
        k = k * cos + M.rotate_half(k) * sin
        st["k"][:, :, pos0:pos0 + T] = k.transpose(1, 2)
        st["v"][:, :, pos0:pos0 + T] = v.transpose(1, 2)
        Lk = pos0 + T
        K, V = st["k"][:, :, :Lk], st["v"][:, :, :Lk]
        G = nh // nkv
        scale = d ** -0.5
        if T == 1:  # head h = g*G + j uses kv head g (HF repeat_kv)
            qg = q.view(B, nkv, G, d)
            s = (qg @ K.transpose(-1, -2)) * scale  # [B, nkv, G, Lk]
            o = torch.softmax(s, dim=-1) @ V  # [B, nkv, G, d]
            o = o.reshape(B, 1, nh * d)
        else:
            assert pos0 == 0, "multi-token steps only from an empty state (prefill)"
            o = F.scaled_dot_product_attention(q.transpose(1, 2), K.repeat_interleave(G, dim=1),
                                               V.repeat_interleave(G, dim=1), is_causal=True, scale=scale)
            o = o.transpose(1, 2).reshape(B, T, nh * d)
        return F.linear(o, self.P(f"{Pfx}.self_attn.o_proj.weight"))

    def _conv(self, x, w, state):
        kc = w.shape[-1]
        T = x.shape[1]
        xp = torch.cat([state, x], dim=1)
        y = w[:, 0, 0] * xp[:, 0:T]
        for j in range(1, kc):
            y = y + w[:, 0, j] * xp[:, j:j + T]
        return F.silu(y), xp[:, xp.shape[1] - (kc - 1):]

    def _kda(self, Pfx, a, st):
        A = f"{Pfx}.linear_attn"
        B, T, _ = a.shape
        nl, dl = self.nl, self.dl
        lin = lambda x, n: F.linear(x, self.P(f"{A}.{n}.weight"))  # noqa: E731
        q, st["cq"] = self._conv(lin(a, "q_proj"), self.P(f"{A}.q_conv1d.weight"), st["cq"])
        k, st["ck"] = self._conv(lin(a, "k_proj"), self.P(f"{A}.k_conv1d.weight"), st["ck"])
        v, st["cv"] = self._conv(lin(a, "v_proj"), self.P(f"{A}.v_conv1d.weight"), st["cv"])
        q = TTg.l2norm(q.view(B, T, nl, dl)) * (dl ** -0.5)
        k = TTg.l2norm(k.view(B, T, nl, dl))
        v = v.view(B, T, nl, dl)
        f = lin(lin(a, "f_a_proj"), "f_b_proj")
        glog = -torch.exp(self.P(f"{A}.A_log")).view(1, 1, nl, 1) * F.softplus(
            (f + self.P(f"{A}.dt_bias")).view(B, T, nl, dl))
        beta = torch.sigmoid(lin(a, "b_proj"))  # [B, T, nl]
        if T == 1:
            S = st["S"] * torch.exp(glog[:, 0]).unsqueeze(-1)  # decay over the key axis
            u = v[:, 0] - torch.einsum("bhkv,bhk->bhv", S, k[:, 0])
            S = S + beta[:, 0, :, None, None] * (k[:, 0].unsqueeze(-1) * u.unsqueeze(-2))
            o = torch.einsum("bhkv,bhk->bhv", S, q[:, 0]).unsqueeze(1)
        else:
            o, S = TTg.kda_chunked(q, k, v, glog, beta, self.tm.chunk, S0=st["S"])
        st["S"] = S
        gout = lin(lin(a, "g_a_proj"), "g_b_proj").view(B, T, nl, dl)
        o = TTg.rmsnorm(o, self.P(f"{A}.o_norm.weight"), self.eps) * torch.sigmoid(gout)
        return F.linear(o.reshape(B, T, nl * dl), self.P(f"{A}.o_proj.weight"))

    @torch.no_grad()
    def forward(self, tokens: torch.Tensor, st, pos0: int, all_logits: bool = False):
        """tokens [B, T] at positions pos0.. -> features [B, T, m*H], final (post-norm)
        hidden [B, T, H], logits [B, V] of the last row (or [B, T, V])."""
        tm = self.tm
        x = self.P("model.embed_tokens.weight")[tokens]
        feats = {}
        for i in range(self.L):
            Pfx = f"model.layers.{i}"
            a = TTg.rmsnorm(x, self.P(f"{Pfx}.input_layernorm.weight"), self.eps)
            if M.layer_kind(self.cfg, i) == "full_attention":
                x = x + self._attn(Pfx, a, st[i], pos0)
            else:
                x = x + self._kda(Pfx, a, st[i])
            f = TTg.rmsnorm(x, self.P(f"{Pfx}.post_attention_layernorm.weight"), self.eps)
            x = x + (tm._moe(i, f) if M.is_moe_layer(self.cfg, i) else tm._swiglu(f, f"{Pfx}.mlp"))
            if i in self.ids:
                feats[i] = x
        feats = torch.cat([feats[i] for i in self.ids], dim=-1)  # docs/dflash2.md §3 order
        h = TTg.rmsnorm(x, self.P("model.norm.weight"), self.eps)
        lg = F.linear(h if all_logits else h[:, -1], self.P("lm_head.weight"))
        return feats, h, lg

    @torch.no_grad()
    def generate(self, prompts: torch.Tensor, n_new: int, feat_dtype=torch.float32, want_hidden=False,
                 prefill_tokens: int = 65536, want_margin=False):
        """Greedy: prompts [B, P] -> tokens [B, P + n_new]; features [B, P + n_new - 1, F]
        (every position fed to the target); optionally final hiddens (same rows) and the
        top-1 minus top-2 logit margin of each greedy choice [B, n_new]."""
        B, Pl = prompts.shape
        dev = self.device
        Tmax = Pl + n_new - 1
        st = self.new_state(B, Tmax)
        Fd = len(self.ids) * self.cfg["hidden_size"]
        toks = torch.empty(B, Pl + n_new, dtype=torch.long, device=dev)
        toks[:, :Pl] = prompts
        feats = torch.empty(B, Tmax, Fd, dtype=feat_dtype, device=dev)
        hid = torch.empty(B, Tmax, self.cfg["hidden_size"], device=dev) if want_hidden else None
        margin = torch.empty(B, n_new, device=dev) if want_margin else None
        sb = max(1, prefill_tokens // max(1, Pl))
        lg_all = []
        for b0 in range(0, B, sb):
            b1 = min(B, b0 + sb)
            sub = self.slice_state(st, b0, b1)
            f, h, lg = self.forward(prompts[b0:b1], sub, 0)
            self.put_state(st, sub, b0, b1)
            feats[b0:b1, :Pl] = f.to(feat_dtype)
            if want_hidden:
                hid[b0:b1, :Pl] = h
            lg_all.append(lg)
        lg = torch.cat(lg_all)
        for t in range(n_new):
            if want_margin:
                top2 = torch.topk(lg, 2, dim=-1).values
                margin[:, t] = top2[:, 0] - top2[:, 1]
            nxt = lg.argmax(-1)
            toks[:, Pl + t] = nxt
            if t == n_new - 1:
                break
            f, h, lg = self.forward(nxt[:, None], st, Pl + t)
            feats[:, Pl + t] = f[:, 0].to(feat_dtype)
            if want_hidden:
                hid[:, Pl + t] = h[:, 0]
        return {"tokens": toks, "features": feats, "hidden": hid, "margin": margin}


# ======================================================================================
# MTP reused autoregressively (vLLM style), batched over every draft state
# ======================================================================================


class MTPChain:
    """docs/model.md §6 with the MTP layer's own KV cache. Base stream: row i (RoPE
    position i) is fed (target post-norm hidden h_i, token x_{i+1}) and predicts x_{i+2}.
    A draft step whose anchor (the bonus token) is x_n uses base row s = n - 1 as MTP
    step 1 (its K/V is a committed entry); step j >= 2 is fed (x_{j-1} = the previous
    step's pre-``shared_head.norm`` hidden, d_{j-1}) at position s + j - 1 and attends to
    base rows 0..s plus the chain's own earlier speculative rows."""

    def __init__(self, runner: TargetRunner):
        self.r = runner
        self.tm = runner.tm
        self.N = self.tm.mtp_idx
        assert self.N is not None, "target has no MTP layer"
        self.Pfx = f"model.layers.{self.N}"

    def P(self, n):
        return self.tm.P(n)

    def _pre(self, h, toks, pos):
        """h [B, S, H], toks [B, S], pos [S] -> x, q, k, v (q/k after RoPE)."""
        r, Pfx = self.r, self.Pfx
        eps = r.eps
        e = TTg.rmsnorm(self.P("model.embed_tokens.weight")[toks], self.P(f"{Pfx}.enorm.weight"), eps)
        hh = TTg.rmsnorm(h, self.P(f"{Pfx}.hnorm.weight"), eps)
        x = F.linear(torch.cat([e, hh], dim=-1), self.P(f"{Pfx}.eh_proj.weight"))
        a = TTg.rmsnorm(x, self.P(f"{Pfx}.input_layernorm.weight"), eps)
        B, S, _ = a.shape
        q = F.linear(a, self.P(f"{Pfx}.self_attn.q_proj.weight")).view(B, S, r.nh, r.d)
        k = F.linear(a, self.P(f"{Pfx}.self_attn.k_proj.weight")).view(B, S, r.nkv, r.d)
        v = F.linear(a, self.P(f"{Pfx}.self_attn.v_proj.weight")).view(B, S, r.nkv, r.d)
        cos, sin = r.cos[pos].view(1, S, 1, r.d), r.sin[pos].view(1, S, 1, r.d)
        q = q * cos + M.rotate_half(q) * sin
        k = k * cos + M.rotate_half(k) * sin
        return x, q, k, v

    def _post(self, x, o):
        Pfx = self.Pfx
        x = x + F.linear(o, self.P(f"{Pfx}.self_attn.o_proj.weight"))
        f = TTg.rmsnorm(x, self.P(f"{Pfx}.post_attention_layernorm.weight"), self.r.eps)
        return x + self.tm._moe(self.N, f)

    def logits(self, x):
        m = TTg.rmsnorm(x, self.P(f"{self.Pfx}.shared_head.norm.weight"), self.r.eps)
        return F.linear(m, self.P("lm_head.weight"))

    @torch.no_grad()
    def base(self, h, next_toks):
        """h [B, S, H] (target final hiddens of positions 0..S-1), next_toks [B, S]."""
        r = self.r
        B, S, _ = h.shape
        x, q, k, v = self._pre(h, next_toks, torch.arange(S, device=h.device))
        G = r.nh // r.nkv
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(G, 1),
                                           v.transpose(1, 2).repeat_interleave(G, 1), is_causal=True,
                                           scale=r.d ** -0.5)
        x = self._post(x, o.transpose(1, 2).reshape(B, S, r.nh * r.d))
        return x, k, v

    @torch.no_grad()
    def chain(self, h, next_toks, states: torch.Tensor, steps: int, forced=None):
        """Drafts of every state s in ``states`` (base row of MTP step 1): [B, len(states), steps]
        (and the logits of every step). ``forced`` [B, Ns, steps] feeds given tokens instead
        of the argmax drafts (tests)."""
        r = self.r
        xb, kb, vb = self.base(h, next_toks)
        B, S, _ = xb.shape
        Ns = states.numel()
        G, d = r.nh // r.nkv, r.d
        scale = d ** -0.5
        xprev = xb[:, states]
        lg = self.logits(xprev)
        logits = [lg]
        drafts = [lg.argmax(-1) if forced is None else forced[:, :, 0]]
        kc, vc = [], []
        vis = torch.arange(S, device=h.device).view(1, S) <= states.view(Ns, 1)  # [Ns, S]
        for j in range(2, steps + 1):
            pos = states + (j - 1)
            x, q, k, v = self._pre(xprev, drafts[-1], pos)
            kc.append(k)
            vc.append(v)
            qg = q.view(B, Ns, r.nkv, G, d)
            sb = torch.einsum("bsngd,btnd->bsngt", qg, kb) * scale
            sb = sb.masked_fill(~vis.view(1, Ns, 1, 1, S), float("-inf"))
            K = torch.stack(kc, dim=2)  # [B, Ns, j-1, nkv, d]
            V = torch.stack(vc, dim=2)
            sc = torch.einsum("bsngd,bscnd->bsngc", qg, K) * scale
            p = torch.softmax(torch.cat([sb, sc], dim=-1), dim=-1)
            o = torch.einsum("bsngt,btnd->bsngd", p[..., :S], vb) + torch.einsum("bsngc,bscnd->bsngd", p[..., S:], V)
            xprev = self._post(x, o.reshape(B, Ns, r.nh * d))
            lg = self.logits(xprev)
            logits.append(lg)
            drafts.append(lg.argmax(-1) if forced is None else forced[:, :, j - 1])
        return torch.stack(drafts, dim=-1), torch.stack(logits, dim=2)


# ======================================================================================
# Speculative decoding bookkeeping (greedy)
# ======================================================================================


def simulate(greedy: list[int], P: int, n_gen: int, N: int, propose) -> list[int]:
    """Greedy speculative decoding of one request. ``greedy``: prompt + the target's greedy
    continuation (>= P + n_gen + N tokens). After the prefill the target's first token
    greedy[P] is the anchor at position n = P. Each step: ``propose(n)`` -> N draft tokens
    for positions n+1..n+N (the drafter may use target features of positions < n only);
    greedy verification accepts the longest matching prefix A, commits the anchor + A
    drafts and the bonus token greedy[n+A+1] becomes the next anchor (n += A + 1). Stops
    once >= n_gen tokens were generated. Returns A of every step."""
    assert len(greedy) >= P + n_gen + N, (len(greedy), P, n_gen, N)
    n, acc = P, []
    while n - P + 1 < n_gen:
        d = [int(t) for t in propose(n)]
        assert len(d) == N
        A = 0
        while A < N and d[A] == greedy[n + 1 + A]:
            A += 1
        acc.append(A)
        n += A + 1
    return acc


def acceptance_stats(accs: list[list[int]], N: int) -> dict:
    """Pooled over requests (vLLM's counters): tau = 1 + accepted / draft steps."""
    flat = [a for r in accs for a in r]
    steps = len(flat)
    acc = sum(flat)
    if steps == 0:
        return {"N": N, "requests": len(accs), "draft_steps": 0, "accepted": 0, "drafted": 0,
                "acceptance_rate": None, "tau": None, "per_position": None, "per_position_conditional": None,
                "tau_per_request": []}
    reach = [sum(1 for a in flat if a >= j) for j in range(N + 1)]  # reach[0] = steps
    return {
        "N": N, "requests": len(accs), "draft_steps": steps, "accepted": acc, "drafted": steps * N,
        "acceptance_rate": acc / max(1, steps * N),
        "tau": 1.0 + acc / max(1, steps),
        "per_position": [reach[j] / max(1, steps) for j in range(1, N + 1)],  # P(A >= j)
        "per_position_conditional": [reach[j] / max(1, reach[j - 1]) for j in range(1, N + 1)],
        "tau_per_request": [1.0 + sum(r) / max(1, len(r)) for r in accs],
    }


def oracle_selftest() -> dict:
    """The bookkeeping on drafters whose acceptance is known by construction."""
    rng = np.random.RandomState(0)
    V, P, n_gen, N = 50, 10, 40, 7
    g = [int(x) for x in rng.randint(0, V, size=P + n_gen + N)]
    res = {}
    for k in (N, 3, 0):
        def prop(n, k=k):
            d = g[n + 1:n + 1 + N]
            return d[:k] + [(t + 1) % V for t in d[k:]]
        acc = simulate(g, P, n_gen, N, prop)
        st = acceptance_stats([acc], N)
        want_steps = math.ceil((n_gen - 1) / (k + 1))
        ok = (all(a == k for a in acc) and st["draft_steps"] == want_steps and abs(st["tau"] - (k + 1)) < 1e-12
              and st["per_position"] == [1.0] * k + [0.0] * (N - k)
              and abs(st["acceptance_rate"] - k / N) < 1e-12)
        res[f"first_{k}_right"] = {"tau": st["tau"], "steps": st["draft_steps"], "ok": ok}
    # a drafter right at every other step: tau = 1 + N/2 on average
    flip = {"i": 0}

    def alt(n):
        flip["i"] += 1
        d = g[n + 1:n + 1 + N]
        return d if flip["i"] % 2 else [(t + 1) % V for t in d]
    acc = simulate(g, P, n_gen, N, alt)
    st = acceptance_stats([acc], N)
    res["alternating"] = {"accs": acc, "tau": st["tau"],
                          "ok": acc[::2] == [N] * len(acc[::2]) and acc[1::2] == [0] * len(acc[1::2])}
    res["ok"] = all(v["ok"] for v in res.values() if isinstance(v, dict))
    return res


def dflash_propose_fn(drafter: "D.Drafter", feats: torch.Tensor, greedy: list[int], mode: str, N: int):
    """propose(n) for simulate(): the reference Drafter with its own DraftCache; the
    context (features of positions < n: the anchor and accepted drafts of the previous
    step, docs §7 commit) is appended lazily before each draft."""
    cache = drafter.new_cache()

    def propose(n):
        if n > cache.length:
            drafter.append_context(cache, feats[cache.length:n])
        assert cache.length == n
        return drafter.draft_block(cache, greedy[n], mode=mode, num_speculative_tokens=N)["tokens"].tolist()
    return propose


@torch.no_grad()
def real_verify_run(ref: "M.Model", drafter: "D.Drafter", prompt: list[int], n_gen: int, mode: str, ids) -> dict:
    """The whole loop with model.py's target (docs §7): prefill, draft, verify the block
    [anchor, d_1..d_N] on a copy of the target cache, accept greedily, append the verify
    rows' features of the anchor + accepted drafts, commit the target state, bonus token."""
    N = drafter.B - 1
    cache = ref.new_cache()
    o = ref.forward(prompt, cache, collect=True)
    dc = drafter.new_cache()
    drafter.append_context(dc, D.target_features(o["hidden_states"], ids))
    anchor = int(torch.argmax(o["logits"][-1]))
    out, accs = [anchor], []
    while len(out) < n_gen:
        d = drafter.draft_block(dc, anchor, mode=mode)["tokens"].tolist()
        c2 = cache.clone()
        v = ref.forward([anchor] + d, c2, collect=True)
        g = torch.argmax(v["logits"], dim=-1).tolist()
        A = 0
        while A < N and d[A] == g[A]:
            A += 1
        drafter.append_context(dc, D.target_features(v["hidden_states"], ids)[:A + 1])
        if A == N:
            cache = c2
        else:
            ref.forward([anchor] + d[:A], cache)
        out += d[:A] + [g[A]]
        anchor = g[A]
        accs.append(A)
    return {"accs": accs, "tokens": out}


# ======================================================================================
# Self-test (micro, random weights): runner and MTP chain vs recipes/model.py
# ======================================================================================


def selftest(device, log_fn=log) -> dict:
    torch.manual_seed(0)
    res = {"oracle": oracle_selftest()}
    cfg = M.make_config("micro")
    tensors = M.init_weights(cfg, 0)
    tm = TTg.TrainModel(cfg, tensors).to(device)
    for p in tm.parameters():
        p.requires_grad_(False)
    ids = [0, 2]
    runner = TargetRunner(tm, ids, device, max_pos=cfg["max_position_embeddings"])
    ref = M.Model(cfg, tensors, device=str(device))
    rng = np.random.RandomState(1)
    B, Pl, n_new = 3, 37, 9
    prompts = torch.tensor(rng.randint(0, 504, size=(B, Pl)), device=device)
    prompts[:, 0] = cfg["bos_token_id"]
    g = runner.generate(prompts, n_new, want_hidden=True, prefill_tokens=40)  # 1-row prefill chunks
    worst_f = worst_h = 0.0
    greedy_equal = True
    for b in range(B):
        seq = g["tokens"][b].tolist()
        o = ref.forward(seq[:-1], ref.new_cache(), collect=True)  # teacher-forced on the runner's tokens
        worst_f = max(worst_f, rel_diff(g["features"][b], D.target_features(o["hidden_states"], ids)))
        worst_h = max(worst_h, rel_diff(g["hidden"][b], o["hidden"]))
        greedy_equal &= torch.argmax(o["logits"][Pl - 1:], dim=-1).tolist() == seq[Pl:]
    res["runner_rel_features"], res["runner_rel_hidden"], res["runner_greedy_equal"] = worst_f, worst_h, greedy_equal
    # MTP chain vs model.py's mtp_forward run one step at a time (fed the chain's drafts)
    b = 1
    seq = g["tokens"][b]
    T = seq.numel() - 1
    h = g["hidden"][b:b + 1, :T - 1]
    nxt = seq[1:T].view(1, -1)
    states = torch.tensor([Pl - 1, Pl + 2], device=device)
    steps = 4
    drafts, lgs = MTPChain(runner).chain(h, nxt, states, steps)
    worst_m = 0.0
    for si, s in enumerate(states.tolist()):
        mc = ref.new_cache()
        o = ref.mtp_forward(g["hidden"][b, :s + 1], seq[1:s + 2], mc)
        worst_m = max(worst_m, rel_diff(lgs[0, si, 0], o["logits"][-1]))
        x = o["hidden"][-1:]
        for j in range(1, steps):
            o = ref.mtp_forward(x, drafts[0, si, j - 1:j], mc)
            worst_m = max(worst_m, rel_diff(lgs[0, si, j], o["logits"][-1]))
            x = o["hidden"][-1:]
    res["mtp_chain_rel_logits"] = worst_m
    res["ok"] = bool(res["oracle"]["ok"] and worst_f < 1e-4 and worst_h < 1e-4 and greedy_equal and worst_m < 1e-4)
    log_fn("selftest " + json.dumps({k: v for k, v in res.items() if k != "oracle"}) +
           f" oracle ok {res['oracle']['ok']}")
    return res


# ======================================================================================
# Prompts
# ======================================================================================


class PromptSource:
    """Train-split prompts. ``heads``: the first tokens of documents (``[bos] + ids``); a
    doc-start prompt of length P is ``head[:P]`` (``<|bos|>`` + the document's first P-1
    tokens, the eval prompt format), each head used at most once per P. ``stream``: packed
    ``<|bos|> doc <|eos|>`` tokens; a window prompt is P tokens of it at a random start."""

    def __init__(self, heads: list[np.ndarray], stream: np.ndarray, seed: int, doc_start_frac: float):
        self.heads = heads
        self.stream = stream
        self.rng = np.random.RandomState(seed)
        self.cursor: dict[int, int] = {}
        self.frac = doc_start_frac
        self.doc_starts_used = 0
        self.windows_used = 0

    def batch(self, n: int, P: int) -> np.ndarray:
        want = int(round(n * self.frac))
        out = []
        c = self.cursor.get(P, 0)
        while len(out) < want and c < len(self.heads):
            d = self.heads[c]
            c += 1
            if len(d) >= P:
                out.append(d[:P])
        self.cursor[P] = c
        self.doc_starts_used += len(out)
        assert len(self.stream) > P, "prompt stream shorter than a prompt"
        while len(out) < n:
            s = int(self.rng.randint(0, len(self.stream) - P))
            out.append(self.stream[s:s + P])
            self.windows_used += 1
        return np.stack(out).astype(np.int64)


def corpus_prompts(args, tcfg, tok, log_fn=log) -> tuple[list[np.ndarray], np.ndarray, dict]:
    """Heads of every train file (first --head-chars characters; an eos only where the
    file really ends) in 'dflash2-prompts' hash order, and a packed stream of whole train
    files (--prompt-text-mb) for window prompts."""
    corp = corpus.load_corpus(args.root, workers=min(32, TTg.N_CPUS * 2), log=log_fn)
    paths, texts = corp.train.paths, corp.train.texts
    bos, eos = tcfg["bos_token_id"], tcfg["eos_token_id"]
    order = sorted(range(len(paths)), key=lambda j: corpus.unit_hash(paths[j], "dflash2-prompts"))
    t = time.time()
    hc = args.head_chars
    horder = order[:args.head_files] if args.head_files else order
    heads = TTg.encode_docs(tok, [texts[j][:hc] for j in horder], bos, eos)
    heads = [h if len(texts[j]) <= hc else h[:-1] for j, h in zip(horder, heads)]
    sel, tot = [], 0
    cap = int(args.prompt_text_mb * 1e6)
    for j in order:
        if tot >= cap:
            break
        sel.append(j)
        tot += len(texts[j])
    docs = TTg.encode_docs(tok, [texts[j] for j in sel], bos, eos)
    stream = np.concatenate(docs) if docs else np.zeros(0, np.int32)
    info = {"manifest": corp.manifest, "head_files": len(heads), "head_chars": hc,
            "heads_ge": {str(P): sum(1 for h in heads if len(h) >= P) for P in (64, 128, 256, 320)},
            "stream_files": len(sel), "stream_chars": tot, "stream_tokens": int(len(stream)),
            "encode_s": round(time.time() - t, 2),
            "rule": "train split (corpus.py); files in corpus.unit_hash(relpath, 'dflash2-prompts') order"}
    return heads, stream, info


# ======================================================================================
# Training
# ======================================================================================


class RowStore:
    """Generated rows on the device: tokens [N, T], features [N, T, F], prompt length [N]."""

    def __init__(self, cap: int, T: int, Fd: int, feat_dtype, device):
        self.tokens = torch.zeros(cap, T, dtype=torch.long, device=device)
        self.feats = torch.zeros(cap, T, Fd, dtype=feat_dtype, device=device)
        self.plen = torch.zeros(cap, dtype=torch.long, device=device)
        self.n, self.cap, self.T = 0, cap, T

    def add(self, tokens, feats, P):
        k = min(tokens.shape[0], self.cap - self.n)
        if k <= 0:
            return 0
        self.tokens[self.n:self.n + k] = tokens[:k, :self.T]
        self.feats[self.n:self.n + k] = feats[:k, :self.T].to(self.feats.dtype)
        self.plen[self.n:self.n + k] = P
        self.n += k
        return k


def make_batch(tokens, feats, plen):
    T = tokens.shape[1]
    lm = (torch.arange(T, device=tokens.device).view(1, T) >= plen.view(-1, 1)).to(torch.float32)
    return {"tokens": tokens, "features": feats, "loss_mask": lm}


def sample_anchors(plen, T, n, gen):
    """docs §8.1 for these rows (one document each, labels = the generated continuation):
    eligible anchors are P-1 .. T-2; n drawn uniformly without replacement, sorted."""
    R = plen.shape[0]
    dev = plen.device
    a = torch.arange(T, device=dev).view(1, T)
    elig = (a >= (plen.view(-1, 1) - 1).clamp_min(1)) & (a <= T - 2)
    score = torch.rand(R, T, device=dev, generator=gen).masked_fill(~elig, -1.0)
    idx = torch.topk(score, n, dim=1).indices
    anchors = torch.sort(idx, dim=1).values
    return anchors, torch.gather(elig, 1, anchors)


def param_groups(dr: "D.Drafter", args):
    groups = {"body": [], "norm": [], "conv": [], "selector": []}
    for name, _ in D.tensor_specs(dr.cfg, dr.has_v2):
        w = dr.W[name]
        if "_conv." in name:
            groups["conv"].append(w)
        elif name.startswith("candidate_selector."):
            groups["selector"].append(w)
        elif w.ndim == 1:
            groups["norm"].append(w)
        else:
            groups["body"].append(w)
    return [{"params": v, "name": k, "weight_decay": args.wd if k == "body" else 0.0} for k, v in groups.items() if v]


def lr_for(args, group: str, step: int, progress: float, scale: float) -> float:
    warm = min(1.0, (step + 1) / max(1, args.warmup_steps))
    p = min(max(progress, 0.0), 1.0)
    cos = args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * p))
    lr = args.lr * warm * cos * scale
    if group == "conv":
        ramp = min(1.0, max(0.0, (p - args.conv_start) / max(1e-9, args.conv_warm)))
        lr *= args.conv_lr_mult * ramp
    elif group == "selector":
        lr *= args.sel_lr_mult
    return lr


@torch.no_grad()
def teacher_forced(dr: "D.Drafter", ev: dict, mode: str, amp: bool, device, rows_per_chunk: int = 8) -> dict:
    """docs §8.6 metrics on the eval rows at every anchor of the generated range."""
    toks, feats, P, n_gen = ev["tokens"], ev["features"], ev["P"], ev["n_gen"]
    Tn = feats.shape[1]
    anchors_1 = torch.arange(P - 1, P + n_gen, device=device)
    tot = {"n": 0.0, "loss": 0.0, "block_ce": 0.0, "selector_ce": 0.0, "tau": 0.0}
    acc = torch.zeros(dr.B - 1, device=device)
    for r0 in range(0, toks.shape[0], rows_per_chunk):
        tk = toks[r0:r0 + rows_per_chunk, :Tn]
        R = tk.shape[0]
        batch = make_batch(tk, feats[r0:r0 + rows_per_chunk], torch.full((R,), P, device=device))
        an = anchors_1.view(1, -1).expand(R, -1).contiguous()
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp):
            o = dr.train_forward(batch, an, torch.ones_like(an, dtype=torch.bool), mode)
        tot["n"] += R
        for k in ("loss", "block_ce", "tau"):
            tot[k] += float(o[k]) * R
        if "selector_ce" in o:
            tot["selector_ce"] += float(o["selector_ce"]) * R
        acc += o["acc"].float() * R
    n = tot.pop("n")
    out = {k: v / n for k, v in tot.items()}
    out["acc"] = (acc / n).tolist()
    if mode == "v1":
        out.pop("selector_ce")
    return out


# ======================================================================================
# Main
# ======================================================================================


def build_evalset(args, data, runner, tm, tcfg, raw, tok, ids, N, device):
    """Held-out prompts -> the target's greedy continuation (+ N + 1 tokens of lookahead),
    features and final hiddens; self-consistency against one full forward; parity of the
    first prompt against recipes/model.py's Model (which is also returned: it verifies in
    the full-loop check)."""
    ptoks = data["prompt_tokens"][:args.eval_prompts].long()
    if args.eval_prompt_len:
        ptoks = ptoks[:, :args.eval_prompt_len]
    Pe = ptoks.shape[1]
    n_ev = args.eval_gen + N + 1
    t = time.time()
    g = runner.generate(ptoks.to(device), n_ev, feat_dtype=torch.float32, want_hidden=True, want_margin=True)
    sync(device)
    ev = {"tokens": g["tokens"], "features": g["features"], "hidden": g["hidden"], "P": Pe, "n_gen": args.eval_gen}
    info = {"prompts": int(ptoks.shape[0]), "prompt_len": Pe, "generated": n_ev, "seconds": round(time.time() - t, 2),
            "min_greedy_margin": float(g["margin"].min()),
            "greedy_margins_below_1e-3": int((g["margin"] < 1e-3).sum())}
    with torch.no_grad():  # one full forward over prompt + continuation (TrainModel.hidden)
        h_full = tm.hidden(g["tokens"][:, :-1], amp=False)
        am = tm.logits(h_full).argmax(-1)[:, Pe - 1:]
    info["full_forward_greedy_agree"] = float((am == g["tokens"][:, Pe:]).float().mean())
    info["full_forward_rel_hidden"] = rel_diff(g["hidden"], h_full)
    del h_full, am
    ref = None
    try:  # parity with recipes/model.py (the contract) on the first prompt
        ref = M.Model(tcfg, raw, device=str(device))
        t = time.time()
        p0 = ptoks[0].tolist()
        o = ref.forward(p0, ref.new_cache(), collect=True)
        rg = ref.generate_greedy(p0, args.parity_tokens)["tokens"]
        info["parity"] = {
            "rel_features_prompt": rel_diff(g["features"][0, :Pe], D.target_features(o["hidden_states"], ids)),
            "rel_hidden_prompt": rel_diff(g["hidden"][0, :Pe], o["hidden"]),
            "greedy_equal": rg == g["tokens"][0, Pe:Pe + args.parity_tokens].tolist(),
            "tokens": args.parity_tokens, "seconds": round(time.time() - t, 2)}
    except Exception:  # noqa: BLE001
        ref = None
        info["parity_error"] = traceback.format_exc()
        log("parity failed:\n" + info["parity_error"])
    log("evalset " + json.dumps(info))
    try:
        info["sample"] = tok.decode(g["tokens"][0, Pe:Pe + 64].tolist(), skip_special_tokens=False)
    except Exception:  # noqa: BLE001
        pass
    return ev, ref, info


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default="models/tiny", help="target checkpoint dir (config.json, safetensors, tokenizer.json)")
    ap.add_argument("--data", default=None, help="data.safetensors (default: <target>/data.safetensors)")
    ap.add_argument("--preset", default="dflash2-tiny", choices=D.PRESET_NAMES)
    ap.add_argument("--out", default=None, help="output folder ($OUT)")
    ap.add_argument("--budget-s", type=float, default=540.0, help="whole-run wall-clock budget")
    ap.add_argument("--reserve-s", type=float, default=0.0, help="kept after training for eval + export (0: auto)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0)
    # prompts / generation
    ap.add_argument("--prompt-source", choices=("corpus", "calib"), default="corpus")
    ap.add_argument("--root", default=None, help="site-packages for the corpus (default: corpus.py's)")
    ap.add_argument("--prompt-text-mb", type=float, default=12.0, help="train-split text packed for window prompts")
    ap.add_argument("--head-files", type=int, default=8000, help="train files whose head gives doc-start prompts (0: all)")
    ap.add_argument("--head-chars", type=int, default=1400, help="characters of each file head (~400 tokens)")
    ap.add_argument("--doc-start-frac", type=float, default=0.5)
    ap.add_argument("--row-len", type=int, default=512, help="training row = prompt + greedy continuation")
    ap.add_argument("--prompt-lens", default="64,128,192,256,320")
    ap.add_argument("--gen-s", type=float, default=100.0, help="max seconds of training-data generation")
    ap.add_argument("--gen-batch", type=int, default=2048)
    ap.add_argument("--max-rows", type=int, default=0, help="row store capacity (0: from free GPU memory)")
    ap.add_argument("--prefill-tokens", type=int, default=65536, help="prefill sub-batch size in tokens")
    ap.add_argument("--feat-dtype", choices=("auto", "f32", "bf16"), default="auto",
                    help="stored training features (auto: bf16 with amp, else f32)")
    # training
    ap.add_argument("--rows", type=int, default=0, help="rows per step (0: probe --row-candidates)")
    ap.add_argument("--row-candidates", default="32,64,128")
    ap.add_argument("--anchors", type=int, default=128, help="anchors per row")
    ap.add_argument("--probe-cpu", action="store_true", help="run the batch probe on CPU too (tests)")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup-steps", type=int, default=100)
    ap.add_argument("--conv-lr-mult", type=float, default=0.3, help="conv params' LR / body LR")
    ap.add_argument("--conv-start", type=float, default=0.05, help="progress where the conv LR starts rising")
    ap.add_argument("--conv-warm", type=float, default=0.15, help="progress span of the conv LR ramp")
    ap.add_argument("--sel-lr-mult", type=float, default=1.0)
    ap.add_argument("--wd", type=float, default=0.0)
    ap.add_argument("--beta2", type=float, default=0.95)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--gamma", type=float, default=None, help="loss decay gamma (default: config's 4.0)")
    ap.add_argument("--selector-loss-weight", type=float, default=None, help="default: config's 1.0")
    ap.add_argument("--v1-frac", type=float, default=0.0, help="fraction of steps trained in v1 mode")
    ap.add_argument("--no-amp", action="store_true", help="train in f32")
    ap.add_argument("--amp-cpu", action="store_true", help="bf16 autocast on CPU too (tests the GPU path)")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--val-every", type=int, default=200)
    ap.add_argument("--max-steps", type=int, default=0)
    ap.add_argument("--safety-frac", type=float, default=0.6)
    # eval
    ap.add_argument("--eval-prompts", type=int, default=32)
    ap.add_argument("--eval-prompt-len", type=int, default=0, help="truncate eval prompts (0: as stored, 256)")
    ap.add_argument("--eval-gen", type=int, default=128)
    ap.add_argument("--verify-prompts", type=int, default=2, help="prompts run through the full model.py verify loop")
    ap.add_argument("--mtp-max-n", type=int, default=7)
    ap.add_argument("--parity-tokens", type=int, default=16, help="greedy tokens checked against model.py")
    ap.add_argument("--skip-selftest", action="store_true")
    ap.add_argument("--selftest", action="store_true", help="run the self-test only")
    return ap.parse_args(argv)


def pick_device(name: str):
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def write_log(out_dir: str, tl: dict) -> None:
    try:
        tl["log"] = LOG_LINES
        with open(os.path.join(out_dir, "dflash2_log.json"), "w") as f:
            json.dump(tl, f, indent=1, sort_keys=True, default=str)
    except Exception:  # noqa: BLE001
        print("could not write dflash2_log.json: " + traceback.format_exc(), flush=True)


def save_drafter(out_dir: str, cfg: dict, dr: "D.Drafter") -> dict:
    D.save_checkpoint(out_dir, cfg, dr.tensors_bf16())
    return {n: {"bytes": os.path.getsize(os.path.join(out_dir, n)), "sha256": sha256_file(os.path.join(out_dir, n))}
            for n in ("config.json", "model.safetensors")}


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = pick_device(args.device)
    torch.backends.cuda.matmul.allow_tf32 = False  # the target and the eval are f32 (docs §1)
    torch.backends.cudnn.allow_tf32 = False
    if args.selftest:
        return 0 if selftest(device)["ok"] else 1
    if not args.out:
        raise SystemExit("--out is required")
    try:
        return run(args, device)
    except BaseException:
        TL["status"] = "crashed"
        TL["crash"] = traceback.format_exc()
        log("CRASHED:\n" + TL["crash"])
        write_log(os.path.abspath(args.out), TL)
        raise


def run(args, device) -> int:
    clock = Clock(args.budget_s)
    out_dir = os.path.abspath(args.out)
    os.makedirs(out_dir, exist_ok=True)
    cuda = device.type == "cuda"
    amp = (not args.no_amp) and (cuda or args.amp_cpu)
    feat_dtype = {"f32": torch.float32, "bf16": torch.bfloat16}.get(args.feat_dtype,
                                                                      torch.bfloat16 if amp else torch.float32)
    reserve = args.reserve_s or (55.0 if cuda else 25.0)
    tl = TL
    tl.update({"args": vars(args), "torch": torch.__version__, "python": sys.version.split()[0], "device": str(device),
          "device_name": torch.cuda.get_device_name(0) if cuda else "cpu", "amp_bf16": amp,
          "feat_dtype": str(feat_dtype), "phases": clock.phases, "status": "running", "cpus": TTg.N_CPUS})
    log(f"speclab train_dflash2: {args.preset} on {args.target}, device {device} ({tl['device_name']}), "
        f"torch {torch.__version__}, amp bf16 {amp}, budget {args.budget_s:.0f}s, out {out_dir}")

    # -- 1. self-test -----------------------------------------------------------------
    if not args.skip_selftest:
        with clock.phase("selftest"):
            try:
                tl["selftest"] = selftest(device)
            except Exception:  # noqa: BLE001
                tl["selftest"] = {"ok": False, "error": traceback.format_exc()}
                log("selftest FAILED:\n" + tl["selftest"]["error"])
            if not tl["selftest"].get("ok"):
                log("WARNING: selftest not ok; continuing, see dflash2_log.json selftest")

    # -- 2. target --------------------------------------------------------------------
    with clock.phase("load"):
        tcfg, raw, files = load_target_tensors(args.target)
        canon = canonical_f32(raw)
        tm = TTg.TrainModel(tcfg, canon).to(device)
        tm.eval()
        for p in tm.parameters():
            p.requires_grad_(False)
        del canon
        dcfg = D.make_config(args.preset)
        assert dcfg["hidden_size"] == tcfg["hidden_size"] and dcfg["vocab_size"] == tcfg["vocab_size"], "preset/target mismatch"
        assert dcfg["num_target_layers"] == tcfg["num_hidden_layers"]
        ids = D.dcfg(dcfg, "target_layer_ids")
        B = dcfg["block_size"]
        N = B - 1
        runner = TargetRunner(tm, ids, device, max_pos=max(args.row_len, 1024) + 16)
        tok = TTok.load_tokenizer(os.path.join(args.target, "tokenizer.json"), tcfg)
        from safetensors.torch import load_file

        data = load_file(args.data or os.path.join(args.target, "data.safetensors"))
        tl["target"] = {"dir": os.path.abspath(args.target), "files": files,
                        "quantized": "quantization_config" in tcfg,
                        "sha256": {f: sha256_file(os.path.join(args.target, f)) for f in files},
                        "packed_modules": sum(1 for n in raw if n.endswith(".weight_packed"))}
        tl["drafter_config"] = dcfg
        log(f"target: {files}, quantized {tl['target']['quantized']} ({tl['target']['packed_modules']} packed modules); "
            f"drafter {args.preset}: {D.count_params(dcfg):,} params, target layers {ids}, block {B}")

    # -- 3. eval set ------------------------------------------------------------------
    ev, ref = None, None
    with clock.phase("evalset"):
        try:
            ev, ref, tl["evalset"] = build_evalset(args, data, runner, tm, tcfg, raw, tok, ids, N, device)
        except Exception:  # noqa: BLE001  (training still runs; no validation / eval then)
            tl["evalset_error"] = traceback.format_exc()
            log("eval set failed:\n" + tl["evalset_error"])
    write_log(out_dir, tl)

    # -- 4. prompts -------------------------------------------------------------------
    with clock.phase("prompts"):
        src_info = {"source": args.prompt_source}
        heads = stream = None
        if args.prompt_source == "corpus":
            try:
                heads, stream, info = corpus_prompts(args, tcfg, tok)
                src_info.update(info)
                src_info.pop("manifest", None)
                src_info["corpus_root"] = info["manifest"]["root"]
                src_info["corpus_train_fingerprint"] = info["manifest"]["train"]["fingerprint"]
            except Exception:  # noqa: BLE001
                src_info["error"] = traceback.format_exc()
                log("corpus prompts failed, falling back to calib_tokens:\n" + src_info["error"])
                heads = stream = None
        if stream is None:  # calib windows (train split, packed): window prompts only
            src_info["source"] = "calib"
            heads, stream = [], data["calib_tokens"].reshape(-1).numpy().astype(np.int32)
        prompts = PromptSource(heads, stream, args.seed + 11, args.doc_start_frac if heads else 0.0)
        tl["prompts"] = src_info
        log(f"prompts: {json.dumps(src_info)[:400]}")

    # -- 5. generate ------------------------------------------------------------------
    T = args.row_len
    plens = [int(x) for x in args.prompt_lens.split(",") if int(x) < T - 2]
    Fd = len(ids) * tcfg["hidden_size"]
    with clock.phase("generate"):
        cap = args.max_rows
        if not cap:
            if cuda:
                free = torch.cuda.mem_get_info()[0]
                per_row = T * (Fd * (2 if feat_dtype == torch.bfloat16 else 4) + 8)
                cap = int(0.35 * free / per_row)
            else:
                cap = 256
        store = RowStore(cap, T, Fd, feat_dtype, device)
        gen_deadline = min(time.time() + args.gen_s, clock.deadline - reserve - 60)
        gstats = {"batches": [], "capacity": cap}
        tl["generate"] = gstats
        bi = 0
        t_gen0 = time.time()
        gen_batch, fails = args.gen_batch, 0
        while (bi == 0 or time.time() < gen_deadline) and store.n < store.cap:
            P = plens[bi % len(plens)]
            nb = min(gen_batch, store.cap - store.n)
            t = time.time()
            try:
                pr = torch.from_numpy(prompts.batch(nb, P)).to(device)
                g = runner.generate(pr, T - P + 1, feat_dtype=feat_dtype, prefill_tokens=args.prefill_tokens)
                k = store.add(g["tokens"], g["features"], P)
                sync(device)
                del g
            except Exception as ex:  # noqa: BLE001  (OOM: halve the batch; 3 failures stop generation)
                g = None
                fails += 1
                gstats.setdefault("errors", []).append(traceback.format_exc())
                log(f"gen batch {bi} failed ({type(ex).__name__}); batch {gen_batch} -> {max(1, gen_batch // 2)}:\n"
                    + traceback.format_exc(limit=2))
                gen_batch = max(1, gen_batch // 2)
                if cuda:
                    torch.cuda.empty_cache()
                if fails >= 3 or time.time() >= gen_deadline:
                    break
                continue
            dt = time.time() - t
            gstats["batches"].append({"P": P, "rows": k, "s": round(dt, 2), "gen_tok_s": round(k * (T - P) / dt)})
            log(f"gen batch {bi}: {k} rows P {P} + {T - P} greedy in {dt:.1f}s ({k * (T - P) / dt:,.0f} generated tok/s); "
                f"store {store.n}/{store.cap}")
            bi += 1
        gt = time.time() - t_gen0
        gen_tokens = int(sum(b["rows"] * (T - b["P"]) for b in gstats["batches"]))
        gstats.update(rows=store.n, generated_tokens=gen_tokens, seconds=round(gt, 1),
                      gen_tok_s=round(gen_tokens / max(gt, 1e-9)), doc_start_prompts=prompts.doc_starts_used,
                      window_prompts=prompts.windows_used)
        if store.n:
            # how repetitive is the target's greedy text (share of continuation tokens equal to the token 1..8 back)
            tk = store.tokens[:min(store.n, 256)]
            rep = (tk[:, 9:] == tk[:, 1:-8]).float().mean()
            gstats["repeat_at_8"] = float(rep)
        log(f"generated {store.n} rows, {gen_tokens / 1e6:.2f}M greedy tokens in {gt:.0f}s")
        if cuda:
            torch.cuda.empty_cache()
    del heads, stream, prompts
    if store.n == 0:
        tl["status"] = "no training data generated"
        write_log(out_dir, tl)
        return 1
    write_log(out_dir, tl)

    # -- 6. train ---------------------------------------------------------------------
    embed, head = raw["model.embed_tokens.weight"], raw["lm_head.weight"]
    dr = D.Drafter(dcfg, D.init_weights(dcfg, args.seed, scheme="train"), embed, head, device=str(device), trainable=True)
    gamma = args.gamma
    lam = args.selector_loss_weight
    gen = torch.Generator(device=device).manual_seed(args.seed + 5)
    perm_gen = torch.Generator(device=device).manual_seed(args.seed + 6)
    ac = lambda: torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=amp)  # noqa: E731
    n_anc = min(args.anchors, T - 1 - max(plens))

    class Sampler:
        def __init__(self):
            self.queue = torch.zeros(0, dtype=torch.long, device=device)
            self.epoch = 0

        def next(self, R):
            if self.queue.numel() < R:
                self.queue = torch.cat([self.queue, torch.randperm(store.n, device=device, generator=perm_gen)])
                self.epoch += 1
            idx, self.queue = self.queue[:R], self.queue[R:]
            return idx

    sampler = Sampler()

    def step_fn(R, mode):
        idx = sampler.next(R)
        batch = make_batch(store.tokens[idx], store.feats[idx], store.plen[idx])
        an, av = sample_anchors(store.plen[idx], T, n_anc, gen)
        with ac():
            o = dr.train_forward(batch, an, av, mode, gamma=gamma, selector_loss_weight=lam)
        o["loss"].backward()
        return o

    with clock.phase("probe"):
        cands = [args.rows] if args.rows else [int(x) for x in args.row_candidates.split(",")]
        probe, best = [], None
        if (cuda or args.probe_cpu) and not args.rows:
            for R in cands:
                if clock.left() < reserve + 60:
                    break
                try:
                    if cuda:
                        torch.cuda.empty_cache()
                        torch.cuda.reset_peak_memory_stats()
                    ts = []
                    for _ in range(3):
                        t = time.time()
                        step_fn(R, "v2")
                        for w in dr.parameters():
                            w.grad = None
                        sync(device)
                        ts.append(time.time() - t)
                    dt = min(ts[1:])
                    peak = torch.cuda.max_memory_allocated() if cuda else 0
                    rec = {"rows": R, "step_s": round(dt, 4), "anchors_per_s": round(R * n_anc / dt),
                           "peak_gib": round(peak / 2**30, 2), "first_s": round(ts[0], 2)}
                    probe.append(rec)
                    log(f"probe {R} rows x {n_anc} anchors: {dt * 1e3:.0f} ms/step, {R * n_anc / dt:,.0f} anchors/s, "
                        f"peak {peak / 2**30:.1f} GiB")
                    if best is None or rec["anchors_per_s"] >= 1.15 * best["anchors_per_s"]:
                        best = rec
                    if cuda and peak > 0.7 * torch.cuda.get_device_properties(0).total_memory:
                        log(f"{R} rows: peak memory (incl. the row store) above 70% of the GPU, not trying larger")
                        break
                except torch.cuda.OutOfMemoryError:
                    probe.append({"rows": R, "oom": True})
                    log(f"probe {R} rows: out of memory")
                    break
                except Exception:  # noqa: BLE001
                    tl["probe_error"] = traceback.format_exc()
                    log("probe failed:\n" + tl["probe_error"])
                    break
                finally:
                    for w in dr.parameters():
                        w.grad = None
            if cuda:
                torch.cuda.empty_cache()
        R = best["rows"] if best else (max(4, cands[0] // 2) if probe and probe[0].get("oom") else cands[0])
        R = min(R, store.n)
        tl["probe"] = probe
        log(f"training batch: {R} rows x {n_anc} anchors x {B} block rows; row len {T}")

    opt = torch.optim.AdamW(param_groups(dr, args), lr=args.lr, betas=(0.9, args.beta2), eps=1e-8)
    hist, vals = [], []
    tr = {"rows_per_step": R, "anchors_per_row": n_anc, "history": hist, "val": vals, "nan_restarts": 0}
    tl["train"] = tr
    train_deadline = clock.deadline - reserve
    step = 0
    lr_scale = 1.0
    labels_seen = anchors_total = 0
    stop_reason = "deadline"
    safety_done = False
    with clock.phase("train"):
        t_tr0 = time.time()
        span = max(1.0, train_deadline - t_tr0)
        good = {k: v.detach().clone() for k, v in dr.W.items()}
        acc = {k: torch.zeros((), device=device) for k in ("loss", "block_ce", "selector_ce", "tau", "gn", "labels")}
        acc_pos = torch.zeros(N, device=device)
        n_acc, t_log = 0, time.time()
        v1_every = int(round(1.0 / args.v1_frac)) if args.v1_frac > 0 else 0
        try:
            while True:
                now = time.time()
                if now >= train_deadline:
                    break
                if args.max_steps and step >= args.max_steps:
                    stop_reason = "max_steps"
                    break
                prog = (now - t_tr0) / span
                for gr in opt.param_groups:
                    gr["lr"] = lr_for(args, gr["name"], step, prog, lr_scale)
                mode = "v1" if (v1_every and step % v1_every == v1_every - 1) else "v2"
                try:
                    o = step_fn(R, mode)
                except torch.cuda.OutOfMemoryError:
                    for w in dr.parameters():
                        w.grad = None
                    o = None
                    torch.cuda.empty_cache()
                    tr.setdefault("oom", []).append({"step": step, "rows": R})
                    if R <= 4 or len(tr["oom"]) > 3:
                        raise
                    R = max(4, R // 2)
                    tr["rows_per_step"] = R
                    log(f"out of memory at step {step}: {R} rows per step from now on")
                    continue
                gn = torch.nn.utils.clip_grad_norm_(dr.parameters(), args.clip)
                opt.step()
                opt.zero_grad(set_to_none=True)
                with torch.no_grad():
                    acc["loss"] += o["loss"].detach()
                    acc["block_ce"] += o["block_ce"].detach()
                    if "selector_ce" in o:
                        acc["selector_ce"] += o["selector_ce"].detach()
                    acc["tau"] += o["tau"]
                    acc["gn"] += gn
                    acc["labels"] += o["n_labels"]
                    acc_pos += o["acc"].float()
                n_acc += 1
                step += 1
                anchors_total += R * n_anc
                if step % args.log_every == 0 or step == 1:
                    vals_ = {k: float(v) / n_acc for k, v in acc.items()}  # syncs
                    labels_seen += int(float(acc["labels"]))
                    dt = time.time() - t_log
                    e = {"step": step, "t": round(time.time() - T0, 1), "lr": opt.param_groups[0]["lr"],
                         "lr_conv": next((g_["lr"] for g_ in opt.param_groups if g_["name"] == "conv"), None),
                         "loss": vals_["loss"], "block_ce": vals_["block_ce"], "selector_ce": vals_["selector_ce"],
                         "tau_tf": vals_["tau"], "grad_norm": vals_["gn"],
                         "acc": [round(float(x) / n_acc, 4) for x in acc_pos],
                         "anchors_per_s": round(n_acc * R * n_anc / dt), "epoch": sampler.epoch,
                         "labels_seen": labels_seen}
                    hist.append(e)
                    log(f"step {step} loss {e['loss']:.4f} (block {e['block_ce']:.4f} sel {e['selector_ce']:.4f}) "
                        f"acc@1 {e['acc'][0]:.3f} acc@7 {e['acc'][-1]:.3f} tau_tf {e['tau_tf']:.3f} gn {e['grad_norm']:.2f} "
                        f"lr {e['lr']:.2e}/{e['lr_conv'] or 0:.2e} {e['anchors_per_s']:,} anchors/s ep {sampler.epoch}")
                    if not (math.isfinite(e["loss"]) and math.isfinite(e["grad_norm"])):
                        tr["nan_restarts"] += 1
                        log(f"non-finite loss/grad at step {step}: restoring the last good weights, lr x0.5")
                        with torch.no_grad():
                            for k, v in dr.W.items():
                                v.copy_(good[k])
                        opt = torch.optim.AdamW(param_groups(dr, args), lr=args.lr, betas=(0.9, args.beta2), eps=1e-8)
                        lr_scale *= 0.5
                        if tr["nan_restarts"] >= 3:
                            stop_reason = "non-finite loss (3 restarts)"
                            break
                    else:
                        with torch.no_grad():
                            for k, v in dr.W.items():
                                good[k].copy_(v)
                    for k in acc:
                        acc[k].zero_()
                    acc_pos.zero_()
                    n_acc, t_log = 0, time.time()
                    if ev is not None and (step % args.val_every == 0 or step == args.log_every):
                        tv = time.time()
                        vv = teacher_forced(dr, ev, "v2", amp, device)
                        vv.update(step=step, s=round(time.time() - tv, 2))
                        vals.append(vv)
                        log(f"val step {step}: loss {vv['loss']:.4f} block {vv['block_ce']:.4f} acc@1 {vv['acc'][0]:.3f} "
                            f"tau_tf {vv['tau']:.3f} ({vv['s']}s)")
                        tr.update(steps=step, labels_seen=labels_seen)
                        write_log(out_dir, tl)
                        t_log = time.time()
                    if not safety_done and time.time() - t_tr0 > args.safety_frac * span and clock.left() > reserve + 20:
                        ts = time.time()
                        tr.update(steps=step, labels_seen=labels_seen)
                        tl["status"] = f"partial: safety checkpoint at step {step}, training continues"
                        tl["files"] = save_drafter(out_dir, dcfg, dr)
                        write_log(out_dir, tl)
                        tr["safety_export"] = {"step": step, "seconds": round(time.time() - ts, 2)}
                        safety_done = True
                        log(f"safety checkpoint at step {step} in {time.time() - ts:.1f}s")
                        t_log = time.time()
        except Exception:  # noqa: BLE001
            stop_reason = "exception: " + traceback.format_exc()
            log("training stopped by an exception:\n" + stop_reason)
            with torch.no_grad():
                for k, v in dr.W.items():
                    v.copy_(good[k])
        sync(device)
        dt = time.time() - t_tr0
        labels_seen += int(float(acc["labels"]))
        tr.update(steps=step, seconds=round(dt, 1), stop_reason=stop_reason, epochs=sampler.epoch,
                  anchors_seen=anchors_total, labels_seen=labels_seen,
                  context_tokens_seen=anchors_total // n_anc * T, anchors_per_s=round(anchors_total / max(dt, 1e-9)),
                  rows_available=store.n)
        log(f"trained {step} steps ({anchors_total / 1e6:.2f}M anchors, {labels_seen / 1e6:.2f}M labels, "
            f"{sampler.epoch} epochs of {store.n} rows) in {dt:.0f}s; stop: {stop_reason.splitlines()[0]}")

    # -- 7. save + eval ---------------------------------------------------------------
    with clock.phase("save"):
        tl["status"] = "trained, eval pending"
        tl["files"] = save_drafter(out_dir, dcfg, dr)
        write_log(out_dir, tl)
        opt = store = None  # frees the rows (closures above refer to them)
        for w in dr.parameters():
            w.grad = None
        if cuda:
            torch.cuda.empty_cache()
    evr = {}
    tl["eval"] = evr
    with clock.phase("eval"):
        try:
            rcfg, rt = D.load_checkpoint(out_dir)
            edr = D.Drafter(rcfg, rt, embed, head, device=str(device))
            # reloaded == trained (bf16 rounding only)
            evr["reload_check"] = {"tensors": len(rt), "max_abs_vs_bf16": max(
                float((rt[k].float().to(device) - dr.W[k].detach().to(torch.bfloat16).float()).abs().max()) for k in rt)}
            dr = None
            if ev is None:
                raise RuntimeError("no eval set (see evalset_error)")
            toks_cpu = ev["tokens"].tolist()
            feats = ev["features"]
            Pe, ng = ev["P"], ev["n_gen"]
            evr["teacher_forced"] = {m: teacher_forced(edr, ev, m, False, device) for m in ("v2", "v1")}
            log("teacher-forced (held-out, f32): " + json.dumps(evr["teacher_forced"]))
            n_prompts = len(toks_cpu)

            def run_dflash(mode):
                t = time.time()
                accs = []
                for b in range(n_prompts):
                    if clock.left() < 8:
                        evr[f"{mode}_truncated_at"] = b
                        break
                    accs.append(simulate(toks_cpu[b], Pe, ng, N, dflash_propose_fn(edr, feats[b], toks_cpu[b], mode, N)))
                st = acceptance_stats(accs, N)
                st["seconds"] = round(time.time() - t, 2)
                st["accepted_per_step"] = accs
                evr[f"dflash_{mode}"] = st
                log(f"DFlash {mode}: tau {st['tau']}, acceptance rate {st['acceptance_rate']}, "
                    f"per position {[round(x, 3) for x in st['per_position'] or []]}, {st['draft_steps']} steps over "
                    f"{st['requests']} prompts ({st['seconds']}s)")

            run_dflash("v2")
            # MTP, N = 1..mtp_max_n, the same bookkeeping
            try:
                t = time.time()
                mc = MTPChain(runner)
                Tn = ev["tokens"].shape[1] - 1
                states = torch.arange(Pe - 1, Pe + ng, device=device)
                steps = args.mtp_max_n
                drafts, _ = mc.chain(ev["hidden"][:, :Tn - 1], ev["tokens"][:, 1:Tn], states, steps)
                dl = drafts.tolist()
                mt = {}
                for n_spec in range(1, steps + 1):
                    accs = [simulate(toks_cpu[b], Pe, ng, n_spec,
                                     lambda n, b=b, k=n_spec: dl[b][n - 1 - (Pe - 1)][:k]) for b in range(len(dl))]
                    st = acceptance_stats(accs, n_spec)
                    st.pop("tau_per_request")
                    mt[str(n_spec)] = st
                mt["seconds"] = round(time.time() - t, 2)
                evr["mtp"] = mt
                log("MTP tau by N: " + json.dumps({k: v["tau"] for k, v in mt.items() if k != "seconds"}))
            except Exception:  # noqa: BLE001
                evr["mtp_error"] = traceback.format_exc()
                log("MTP eval failed:\n" + evr["mtp_error"])
            run_dflash("v1")
            # the full loop with model.py's target verifying (must match the bookkeeping above)
            if ref is not None and args.verify_prompts:
                rv = []
                for b in range(min(args.verify_prompts, n_prompts)):
                    if clock.left() < 10:
                        break
                    t = time.time()
                    r = real_verify_run(ref, edr, toks_cpu[b][:Pe], ng, "v2", ids)
                    sim = evr["dflash_v2"]["accepted_per_step"][b] if b < len(evr["dflash_v2"]["accepted_per_step"]) else None
                    rv.append({"prompt": b, "accs": r["accs"], "same_accs_as_sim": r["accs"] == sim,
                               "same_tokens_as_greedy": r["tokens"] == toks_cpu[b][Pe:Pe + len(r["tokens"])],
                               "seconds": round(time.time() - t, 2)})
                    log(f"real verify prompt {b}: same acceptance as the bookkeeping {rv[-1]['same_accs_as_sim']}, "
                        f"tokens = greedy {rv[-1]['same_tokens_as_greedy']} ({rv[-1]['seconds']}s)")
                evr["real_verify_v2"] = rv
        except Exception:  # noqa: BLE001
            tl["eval_error"] = traceback.format_exc()
            log("eval failed:\n" + tl["eval_error"])

    # -- 8. export ----------------------------------------------------------------------
    with clock.phase("export"):
        tl["status"] = "done"
        tl["summary"] = {
            "tau_v2": evr.get("dflash_v2", {}).get("tau"), "tau_v1": evr.get("dflash_v1", {}).get("tau"),
            "tau_mtp": {k: v["tau"] for k, v in evr.get("mtp", {}).items() if k != "seconds"},
            "acceptance_rate_v2": evr.get("dflash_v2", {}).get("acceptance_rate"),
            "per_position_v2": evr.get("dflash_v2", {}).get("per_position"),
            "train_steps": tr.get("steps"), "labels_seen": tr.get("labels_seen"),
            "generated_tokens": tl["generate"].get("generated_tokens"),
        }
        tl["elapsed_s"] = round(clock.elapsed(), 1)
        write_log(out_dir, tl)
        outs = sorted(os.listdir(out_dir))
        big = [n for n in outs if os.path.getsize(os.path.join(out_dir, n)) > 16 * 2**20]
        log(f"--out: {outs}" + (f"; WARNING over 16 MiB: {big}" if big else ""))
    log("summary " + json.dumps(tl["summary"]))
    log(f"phases: {json.dumps(clock.phases)}; total {clock.elapsed():.1f}s")
    write_log(out_dir, tl)
    return 0


if __name__ == "__main__":
    sys.exit(main())
