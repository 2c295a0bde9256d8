#!/usr/bin/env python3
"""Reference implementation of speclab's DFlash2 block-diffusion drafter.

The contract is ``docs/dflash2.md``; section numbers in comments refer to it. This file
implements it literally in f32 (bf16 weights upcast exactly, no bf16 rounding of
activations) so the Rust engine can be checked against goldens produced here, and it
also carries the batched training forward + loss used to train the drafter on a GPU.

DFlash v1 = the same drafter with the grouped convolutions and the candidate selector
off (``mode="v1"``); one checkpoint serves both modes.

The drafter shares the target's ``model.embed_tokens.weight`` and ``lm_head.weight``
(``recipes/model.py``); its checkpoint holds neither.

Only torch (>= 2.4), numpy and safetensors are required.

    python recipes/dflash2.py sanity-train        # a few CPU training steps (docs §13.1)
    python recipes/dflash2.py train-bench         # training-step time/memory at a preset's size
    python recipes/dflash2.py sizes               # parameter counts of the presets
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import model as M  # noqa: E402  (the target: presets, rmsnorm, RoPE tables)

ARCHITECTURE = "DFlash2DraftModel"

# --------------------------------------------------------------------------------------
# Config / presets (§10, §11)
# --------------------------------------------------------------------------------------

_PRESETS = {
    "dflash2-micro": dict(
        target_preset="micro",
        target_layer_ids=[0, 2],
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=256,
        block_size=8,
        sliding_window=16,
        conv_kernel_size=2,
        conv_group_size=16,
        selector_rank=16,
        selector_top_k=8,
        rope_theta=10000.0,
        max_position_embeddings=256,
    ),
    "dflash2-tiny": dict(
        target_preset="tiny",
        target_layer_ids=[1, 3, 5],
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=512,
        block_size=8,
        sliding_window=256,
        conv_kernel_size=2,
        conv_group_size=16,
        selector_rank=32,
        selector_top_k=8,
        rope_theta=10000.0,
        max_position_embeddings=4096,
    ),
    # The card's DFlash2 recipe (block 8, rank 256, top-k 16, layers [5,14,24,33,42], 5
    # sliding-window layers, window 2048); attention/MLP shapes assumed (docs §11).
    "dflash2-glm53-flash": dict(
        target_preset="glm53-flash",
        target_layer_ids=[5, 14, 24, 33, 42],
        num_hidden_layers=5,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=12288,
        block_size=8,
        sliding_window=2048,
        conv_kernel_size=2,
        conv_group_size=16,
        selector_rank=256,
        selector_top_k=16,
        rope_theta=1000000.0,
        max_position_embeddings=262144,
    ),
}

PRESET_NAMES = tuple(_PRESETS)
_DFLASH_KEYS = (
    "mask_token_id",
    "target_layer_ids",
    "conv_kernel_size",
    "conv_group_size",
    "selector_rank",
    "selector_top_k",
)


def make_config(preset: str, **overrides) -> dict:
    """Drafter config.json (docs §10) for a preset; overrides may name flat keys."""
    if preset not in _PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(_PRESETS)}")
    p = copy.deepcopy(_PRESETS[preset])
    p.update(overrides)
    tcfg = M.make_config(p.pop("target_preset"))
    L = p["num_hidden_layers"]
    dflash = {k: p.pop(k) for k in _DFLASH_KEYS if k in p}
    dflash.setdefault("mask_token_id", tcfg["mask_token_id"])
    training = {
        "loss_decay_gamma": p.pop("loss_decay_gamma", 4.0),
        "selector_loss_weight": p.pop("selector_loss_weight", 1.0),
        "num_anchors": p.pop("num_anchors", 512),
    }
    cfg = {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "speclab_preset": preset,
        "target_preset": tcfg["preset"],
        "hidden_size": tcfg["hidden_size"],
        "vocab_size": tcfg["vocab_size"],
        "num_target_layers": tcfg["num_hidden_layers"],
        "target_hidden_size": tcfg["hidden_size"],
        **p,
        "layer_types": ["sliding_attention"] * L,
        "use_sliding_window": True,
        "is_causal": False,
        "rms_norm_eps": tcfg["rms_norm_eps"],
        "hidden_act": "silu",
        "attention_bias": False,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "dflash_config": dflash,
        "training": training,
    }
    validate_config(cfg)
    return cfg


def dcfg(cfg: dict, key: str):
    return cfg["dflash_config"][key]


def validate_config(cfg: dict) -> None:
    H, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    assert cfg["hidden_size"] == cfg["target_hidden_size"], "shared embedding/head: H must equal the target's"
    assert cfg["layer_types"] == ["sliding_attention"] * L
    assert cfg["is_causal"] is False
    assert cfg["num_attention_heads"] % cfg["num_key_value_heads"] == 0
    assert cfg["head_dim"] % 2 == 0
    assert 2 <= cfg["block_size"] <= cfg["sliding_window"], "need 2 <= block_size <= sliding_window"
    assert H % dcfg(cfg, "conv_group_size") == 0, "conv_group_size must divide hidden_size"
    assert dcfg(cfg, "conv_kernel_size") >= 1
    assert 1 <= dcfg(cfg, "selector_top_k") <= cfg["vocab_size"]
    ids = dcfg(cfg, "target_layer_ids")
    assert all(0 <= i < cfg["num_target_layers"] for i in ids) and len(ids) >= 1
    assert 0 <= dcfg(cfg, "mask_token_id") < cfg["vocab_size"]


# --------------------------------------------------------------------------------------
# Tensor inventory (§9), sizes, init (§11.2), checkpoint I/O
# --------------------------------------------------------------------------------------


def tensor_specs(cfg: dict, include_v2: bool = True) -> list[tuple[str, tuple[int, ...]]]:
    """Every drafter tensor (all bf16): (name, shape), in a fixed order."""
    H, V, L = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    nh, nkv, d, I = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["intermediate_size"]
    Fdim = len(dcfg(cfg, "target_layer_ids")) * cfg["target_hidden_size"]
    K, G = dcfg(cfg, "conv_kernel_size"), H // dcfg(cfg, "conv_group_size")
    r = dcfg(cfg, "selector_rank")
    specs = [("fc.weight", (H, Fdim)), ("hidden_norm.weight", (H,))]
    for i in range(L):
        P = f"layers.{i}"
        specs += [
            (f"{P}.input_layernorm.weight", (H,)),
            (f"{P}.self_attn.q_proj.weight", (nh * d, H)),
            (f"{P}.self_attn.k_proj.weight", (nkv * d, H)),
            (f"{P}.self_attn.v_proj.weight", (nkv * d, H)),
            (f"{P}.self_attn.o_proj.weight", (H, nh * d)),
            (f"{P}.self_attn.q_norm.weight", (d,)),
            (f"{P}.self_attn.k_norm.weight", (d,)),
            (f"{P}.post_attention_layernorm.weight", (H,)),
            (f"{P}.mlp.gate_proj.weight", (I, H)),
            (f"{P}.mlp.up_proj.weight", (I, H)),
            (f"{P}.mlp.down_proj.weight", (H, I)),
        ]
        if include_v2:
            for conv in ("attention_conv", "mlp_conv"):
                specs += [
                    (f"{P}.{conv}.base_kernel", (2, K, H)),
                    (f"{P}.{conv}.kernel_projection.weight", (2 * K * G, H)),
                ]
    specs.append(("norm.weight", (H,)))
    if include_v2:
        specs += [
            ("candidate_selector.predecessor_codebook", (V, r)),
            ("candidate_selector.successor_codebook", (V, r)),
            ("candidate_selector.hidden_projection.weight", (r, H)),
        ]
    return specs


def count_params(cfg: dict, include_v2: bool = True) -> int:
    return sum(math.prod(s) for _, s in tensor_specs(cfg, include_v2))


def init_weights(cfg: dict, seed: int, scheme: str = "fixture") -> dict[str, torch.Tensor]:
    """Seeded init (docs §11.2); numpy legacy RandomState, so any numpy/torch version
    writes the same bytes. ``scheme``: "fixture" (every block visible) or "train"."""
    assert scheme in ("fixture", "train")
    rng = np.random.RandomState(seed)
    H = cfg["hidden_size"]
    r = dcfg(cfg, "selector_rank")
    out = {}
    for name, shape in tensor_specs(cfg):
        n = math.prod(shape)
        if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            val = 1.0 + 0.1 * rng.standard_normal(n) if scheme == "fixture" else np.ones(n)
        elif name.endswith("base_kernel"):
            two, K, _ = shape
            if scheme == "fixture":
                z = rng.standard_normal(n).reshape(shape)
                val = np.concatenate([1.0 + 0.1 * z[:, :1], 0.3 * z[:, 1:]], axis=1)
            else:
                val = np.zeros(shape)
                val[:, 0] = 1.0
        elif name.endswith("kernel_projection.weight"):
            val = rng.standard_normal(n) * (0.3 / math.sqrt(H)) if scheme == "fixture" else np.zeros(n)
        elif name.endswith("codebook"):
            std = r ** -0.25 if scheme == "fixture" else 0.1
            val = rng.standard_normal(n) * std
        else:  # Linear [out, in]
            val = rng.standard_normal(n) / math.sqrt(shape[-1])
        t = torch.from_numpy(np.asarray(val, dtype=np.float32).reshape(shape))
        out[name] = t.to(torch.bfloat16).contiguous()
    return out


def save_checkpoint(directory: str, cfg: dict, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    save_file(
        {k: v.to(torch.bfloat16).contiguous().cpu() for k, v in tensors.items()},
        os.path.join(directory, "model.safetensors"),
        metadata={"format": "pt"},
    )


def load_checkpoint(directory: str) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    with open(os.path.join(directory, "config.json")) as f:
        cfg = json.load(f)
    return cfg, load_file(os.path.join(directory, "model.safetensors"))


# --------------------------------------------------------------------------------------
# Target features (§3)
# --------------------------------------------------------------------------------------


def target_features(hidden_states: torch.Tensor, target_layer_ids) -> torch.Tensor:
    """``hidden_states`` [L+1, T, H] from ``model.Model.forward(collect=True)`` (index 0
    = embeddings, index i+1 = residual stream after layer i) -> [T, m*H]."""
    return torch.cat([hidden_states[i + 1] for i in target_layer_ids], dim=-1)


# --------------------------------------------------------------------------------------
# The drafter
# --------------------------------------------------------------------------------------


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """x [..., T, heads, d], positions [..., T] -> RoPE rotate-half (docs/model.md §3.1)."""
    cos, sin = M.rope_tables(positions, x.shape[-1], theta)
    return x * cos.unsqueeze(-2) + M.rotate_half(x) * sin.unsqueeze(-2)


@dataclass
class DraftCache:
    """Context K/V of one request (§7): per layer ``k[l]``, ``v[l]`` [S, nkv, d] f32
    (K after k_norm + RoPE), the rows' positions ``pos`` [S] (ascending) and ``length`` =
    positions appended so far = the position of the next anchor."""

    k: list = field(default_factory=list)
    v: list = field(default_factory=list)
    pos: torch.Tensor | None = None
    length: int = 0

    def clone(self) -> "DraftCache":
        return DraftCache([t.clone() for t in self.k], [t.clone() for t in self.v], self.pos.clone(), self.length)


class Drafter:
    def __init__(
        self,
        cfg: dict,
        tensors: dict[str, torch.Tensor],
        embed_tokens: torch.Tensor,
        lm_head: torch.Tensor,
        device: str = "cpu",
        trainable: bool = False,
    ):
        validate_config(cfg)
        self.cfg = cfg
        self.device = torch.device(device)
        names = {n for n, _ in tensor_specs(cfg)}
        v1_names = {n for n, _ in tensor_specs(cfg, include_v2=False)}
        have = set(tensors)
        assert v1_names <= have, f"missing {sorted(v1_names - have)[:5]}"
        assert have <= names, f"unknown tensors {sorted(have - names)[:5]}"
        self.has_v2 = names <= have
        assert self.has_v2 or have == v1_names, "v2 tensors must be all present or all absent"
        self.W = {}
        for k, t in tensors.items():
            w = t.to(torch.float32).to(self.device).contiguous()
            if trainable:
                w.requires_grad_(True)
            self.W[k] = w
        # shared with the target, frozen
        self.embed = embed_tokens.to(torch.float32).to(self.device)
        self.lm_head = lm_head.to(torch.float32).to(self.device)
        assert self.embed.shape == (cfg["vocab_size"], cfg["hidden_size"]) == self.lm_head.shape
        c = cfg
        self.H, self.L = c["hidden_size"], c["num_hidden_layers"]
        self.nh, self.nkv, self.d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        self.B, self.Wn = c["block_size"], c["sliding_window"]
        self.K, self.gs = dcfg(c, "conv_kernel_size"), dcfg(c, "conv_group_size")
        self.topk, self.mask_id = dcfg(c, "selector_top_k"), dcfg(c, "mask_token_id")
        self.eps, self.theta = float(c["rms_norm_eps"]), float(c["rope_theta"])

    def parameters(self) -> list[torch.Tensor]:
        return [self.W[n] for n, _ in tensor_specs(self.cfg, self.has_v2)]

    def tensors_bf16(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().to(torch.bfloat16).cpu().contiguous() for k, v in self.W.items()}

    # -- §4 context K/V --------------------------------------------------------------
    def context_kv(self, features: torch.Tensor, positions: torch.Tensor):
        """features [..., T, F], positions [..., T] -> per layer (K, V) [..., T, nkv, d]."""
        W = self.W
        c = M.rmsnorm(features @ W["fc.weight"].T, W["hidden_norm.weight"], self.eps)
        out = []
        for i in range(self.L):
            P = f"layers.{i}.self_attn"
            k = (c @ W[f"{P}.k_proj.weight"].T).unflatten(-1, (self.nkv, self.d))
            k = rope(M.rmsnorm(k, W[f"{P}.k_norm.weight"], self.eps), positions, self.theta)
            v = (c @ W[f"{P}.v_proj.weight"].T).unflatten(-1, (self.nkv, self.d))
            out.append((k, v))
        return out

    # -- §5.1 grouped dynamic conv ---------------------------------------------------
    def _conv(self, y: torch.Tensor, delta: torch.Tensor, base: torch.Tensor, block_len: int) -> torch.Tensor:
        """y [R, Q, H] (Q = whole blocks of block_len rows), delta [R, Q, K, G], base [K, H]."""
        R, Q, H = y.shape
        j = torch.arange(Q, device=y.device) % block_len
        coef = base.unsqueeze(0).unsqueeze(0) + delta.repeat_interleave(self.gs, dim=-1)  # [R,Q,K,H]
        out = coef[:, :, 0] * y
        for tau in range(1, self.K):
            shifted = F.pad(y[:, :-tau], (0, 0, tau, 0)) if tau < Q else torch.zeros_like(y)
            out = out + coef[:, :, tau] * shifted * (j >= tau).to(y.dtype).view(1, Q, 1)
        return out

    # -- §5.2 attention --------------------------------------------------------------
    def _attention(self, i: int, a: torch.Tensor, blk_pos: torch.Tensor, ctx_k, ctx_v, mask) -> torch.Tensor:
        """a [R, Q, H]; ctx_k/ctx_v [R, S, nkv, d]; mask [R, Q, S+Q] bool (True = visible)."""
        W, P = self.W, f"layers.{i}.self_attn"
        R, Q, _ = a.shape
        nh, nkv, d = self.nh, self.nkv, self.d
        q = (a @ W[f"{P}.q_proj.weight"].T).view(R, Q, nh, d)
        k = (a @ W[f"{P}.k_proj.weight"].T).view(R, Q, nkv, d)
        v = (a @ W[f"{P}.v_proj.weight"].T).view(R, Q, nkv, d)
        q = rope(M.rmsnorm(q, W[f"{P}.q_norm.weight"], self.eps), blk_pos, self.theta)
        k = rope(M.rmsnorm(k, W[f"{P}.k_norm.weight"], self.eps), blk_pos, self.theta)
        Kall = torch.cat([ctx_k, k], dim=1)  # [R, S+Q, nkv, d]
        Vall = torch.cat([ctx_v, v], dim=1)
        G = nh // nkv
        qg = q.view(R, Q, nkv, G, d).permute(0, 2, 3, 1, 4)  # [R, nkv, G, Q, d]; head h = g*G + j
        kg = Kall.permute(0, 2, 1, 3).unsqueeze(2)  # [R, nkv, 1, S+Q, d]
        vg = Vall.permute(0, 2, 1, 3).unsqueeze(2)
        s = (qg @ kg.transpose(-1, -2)) * (d ** -0.5)  # [R, nkv, G, Q, S+Q]
        s = s.masked_fill(~mask.view(R, 1, 1, Q, -1), float("-inf"))
        p = torch.softmax(s, dim=-1)
        o = (p @ vg).permute(0, 3, 1, 2, 4).reshape(R, Q, nh * d)
        return o @ W[f"{P}.o_proj.weight"].T

    # -- §5 the block stack ----------------------------------------------------------
    def block_forward(self, tokens, blk_pos, ctx, mask, block_len: int, mode: str, collect: bool = False):
        """tokens/blk_pos [R, Q] (whole blocks of block_len rows), ctx = per layer (K, V)
        [R, S, nkv, d], mask [R, Q, S+Q]. Returns block hidden h [R, Q, H] (post norm)."""
        assert mode in ("v1", "v2")
        if mode == "v2":
            assert self.has_v2, "checkpoint has no conv/selector tensors: v1 only"
        W = self.W
        R, Q = tokens.shape
        G = self.H // self.gs
        x = self.embed[tokens]
        layer_out = []
        for i in range(self.L):
            P = f"layers.{i}"
            a1 = M.rmsnorm(x, W[f"{P}.input_layernorm.weight"], self.eps)
            if mode == "v2":
                D = (a1 @ W[f"{P}.attention_conv.kernel_projection.weight"].T).view(R, Q, 2, self.K, G)
                base = W[f"{P}.attention_conv.base_kernel"]
                a2 = self._conv(a1, D[:, :, 0], base[0], block_len)
            else:
                a2 = a1
            o = self._attention(i, a2, blk_pos, ctx[i][0], ctx[i][1], mask)
            x = x + (self._conv(o, D[:, :, 1], base[1], block_len) if mode == "v2" else o)
            f1 = M.rmsnorm(x, W[f"{P}.post_attention_layernorm.weight"], self.eps)
            if mode == "v2":
                E = (f1 @ W[f"{P}.mlp_conv.kernel_projection.weight"].T).view(R, Q, 2, self.K, G)
                base = W[f"{P}.mlp_conv.base_kernel"]
                f2 = self._conv(f1, E[:, :, 0], base[0], block_len)
            else:
                f2 = f1
            m = M.swiglu(f2, W[f"{P}.mlp.gate_proj.weight"], W[f"{P}.mlp.up_proj.weight"], W[f"{P}.mlp.down_proj.weight"])
            x = x + (self._conv(m, E[:, :, 1], base[1], block_len) if mode == "v2" else m)
            if collect:
                layer_out.append(x)
        h = M.rmsnorm(x, W["norm.weight"], self.eps)
        return (h, torch.stack(layer_out, dim=1)) if collect else h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.lm_head.T

    # -- §6.2 selector ---------------------------------------------------------------
    def topk_candidates(self, logits: torch.Tensor):
        """top-k ids value-descending, ties -> lower id (stable sort). [.., V] -> ids, values."""
        order = torch.sort(logits, dim=-1, descending=True, stable=True).indices[..., : self.topk]
        return order, torch.gather(logits, -1, order)

    def edge_scores(self, cand: torch.Tensor, unary: torch.Tensor, h: torch.Tensor, pred: torch.Tensor):
        """cand/unary [.., k], h [.., H], pred [.., P] predecessor ids -> S [.., P, k]."""
        W = self.W
        g = h @ W["candidate_selector.hidden_projection.weight"].T  # [.., r]
        A = W["candidate_selector.predecessor_codebook"][pred] * g.unsqueeze(-2)  # [.., P, r]
        Bc = W["candidate_selector.successor_codebook"][cand]  # [.., k, r]
        return unary.unsqueeze(-2) + A @ Bc.transpose(-1, -2)

    # -- §7 inference ----------------------------------------------------------------
    def new_cache(self) -> DraftCache:
        z = torch.zeros(0, self.nkv, self.d, dtype=torch.float32, device=self.device)
        return DraftCache(
            [z.clone() for _ in range(self.L)],
            [z.clone() for _ in range(self.L)],
            torch.zeros(0, dtype=torch.long, device=self.device),
            0,
        )

    @torch.no_grad()
    def append_context(self, cache: DraftCache, features: torch.Tensor, evict: bool = True) -> None:
        """Append the target features [T, F] of positions cache.length .. +T-1 (§4, §7)."""
        features = features.to(torch.float32).to(self.device)
        T = features.shape[0]
        pos = torch.arange(cache.length, cache.length + T, device=self.device)
        kv = self.context_kv(features, pos)
        for i, (k, v) in enumerate(kv):
            cache.k[i] = torch.cat([cache.k[i], k], dim=0)
            cache.v[i] = torch.cat([cache.v[i], v], dim=0)
        cache.pos = torch.cat([cache.pos, pos])
        cache.length += T
        if evict:  # rows at positions <= n - W are never visible again (§7)
            keep = cache.pos > cache.length - self.Wn
            cache.k = [t[keep] for t in cache.k]
            cache.v = [t[keep] for t in cache.v]
            cache.pos = cache.pos[keep]

    @torch.no_grad()
    def draft_block(
        self,
        cache: DraftCache,
        anchor: int,
        mode: str = "v2",
        num_speculative_tokens: int | None = None,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
        collect: bool = False,
    ) -> dict:
        """One draft step (§5, §6): anchor token at position cache.length."""
        N = self.B - 1 if num_speculative_tokens is None else int(num_speculative_tokens)
        assert 1 <= N <= self.B - 1
        Q = N + 1
        P0 = cache.length
        tokens = torch.full((1, Q), self.mask_id, dtype=torch.long, device=self.device)
        tokens[0, 0] = int(anchor)
        blk_pos = torch.arange(P0, P0 + Q, device=self.device).unsqueeze(0)
        ctx_vis = (blk_pos[0].view(Q, 1) - cache.pos.view(1, -1)) <= self.Wn - 1  # [Q, S]
        mask = torch.cat([ctx_vis, torch.ones(Q, Q, dtype=torch.bool, device=self.device)], dim=1).unsqueeze(0)
        ctx = [(cache.k[i].unsqueeze(0), cache.v[i].unsqueeze(0)) for i in range(self.L)]
        res = self.block_forward(tokens, blk_pos, ctx, mask, Q, mode, collect=collect)
        h, layer_out = res if collect else (res, None)
        h = h[0]
        logits = self.logits(h)
        qT = temperature if temperature > 0 else 1.0
        out = {"hidden": h, "logits": logits, "anchor_pos": P0}
        if collect:
            out["layer_out"] = layer_out[0]
        V = logits.shape[-1]
        if mode == "v1":
            rows = logits[1:]
            q = torch.softmax(rows / qT, dim=-1)
            if temperature > 0:
                toks = torch.multinomial(q, 1, generator=generator).view(-1)
            else:
                toks = torch.argmax(rows, dim=-1)
            top2 = torch.topk(rows, 2, dim=-1).values
            out.update(tokens=toks, q=q, margin=top2[:, 0] - top2[:, 1])
            return out
        # v2: candidates, pair scores, walk
        cand, unary = self.topk_candidates(logits[1:])  # [N, k]
        pred = torch.cat([torch.full((1, self.topk), int(anchor), device=self.device, dtype=torch.long), cand[:-1]])
        S = self.edge_scores(cand, unary, h[1:], pred)  # [N, k, k]
        sorted_l = torch.sort(logits[1:], dim=-1, descending=True).values
        topk_gap = sorted_l[:, self.topk - 1] - sorted_l[:, self.topk] if self.topk < V else None
        prev = 0
        toks, choice, realized, q, margin = [], [], [], [], []
        for s in range(N):
            row = S[s, prev]
            p = torch.softmax(row / qT, dim=-1)
            if temperature > 0:
                c = int(torch.multinomial(p, 1, generator=generator))
            else:
                c = int(torch.argmax(row))
            t2 = torch.topk(row, 2).values if self.topk >= 2 else torch.stack([row[0], row[0] - float("inf")])
            margin.append(t2[0] - t2[1])
            qs = torch.zeros(V, dtype=torch.float32, device=self.device)
            qs[cand[s]] = p
            toks.append(int(cand[s, c]))
            choice.append(c)
            realized.append(row)
            q.append(qs)
            prev = c
        out.update(
            tokens=torch.tensor(toks, dtype=torch.long, device=self.device),
            q=torch.stack(q),
            cand_ids=cand,
            cand_unary=unary,
            edge_scores=S,
            choice=torch.tensor(choice, dtype=torch.long, device=self.device),
            realized=torch.stack(realized),
            margin=torch.stack(margin),
            topk_gap=topk_gap,
        )
        return out

    # -- §8 training -----------------------------------------------------------------
    def sample_anchors(self, batch: dict, num_anchors: int, generator: torch.Generator | None = None):
        """§8.1 -> anchors [R, n] long (sorted), valid [R, n] bool."""
        tokens = batch["tokens"]
        R, T = tokens.shape
        pos, doc, lm = self._batch_aux(batch)
        elig = torch.zeros(R, T, dtype=torch.bool, device=tokens.device)
        elig[:, : T - 1] = (pos[:, : T - 1] >= 1) & (doc[:, 1:] == doc[:, : T - 1]) & (lm[:, 1:] > 0)
        n = max(1, min(num_anchors, int(elig.sum(1).max())))
        anchors = torch.zeros(R, n, dtype=torch.long, device=tokens.device)
        valid = torch.zeros(R, n, dtype=torch.bool, device=tokens.device)
        for r in range(R):
            cand = elig[r].nonzero().view(-1)
            if cand.numel() == 0:
                continue
            perm = torch.randperm(cand.numel(), generator=generator).to(cand.device)
            pick = torch.sort(cand[perm[:n]]).values
            anchors[r, : pick.numel()] = pick
            valid[r, : pick.numel()] = True
        return anchors, valid

    @staticmethod
    def _batch_aux(batch):
        tokens = batch["tokens"]
        R, T = tokens.shape
        pos = batch.get("positions")
        if pos is None:
            pos = torch.arange(T, device=tokens.device).expand(R, T)
        doc = batch.get("doc_ids")
        if doc is None:
            doc = torch.zeros(R, T, dtype=torch.long, device=tokens.device)
        lm = batch.get("loss_mask")
        if lm is None:
            lm = torch.ones(R, T, device=tokens.device)
        return pos, doc, lm

    def train_block_hidden(self, batch: dict, anchors: torch.Tensor, mode: str):
        """The batched block forward of §8.2: -> h [R, n, B, H], label gather helpers."""
        tokens, features = batch["tokens"], batch["features"].to(torch.float32)
        pos, doc, _ = self._batch_aux(batch)
        R, T = tokens.shape
        n, B = anchors.shape[1], self.B
        dev = tokens.device
        off = torch.arange(B, device=dev)
        blk_tok = torch.full((R, n, B), self.mask_id, dtype=torch.long, device=dev)
        blk_tok[:, :, 0] = torch.gather(tokens, 1, anchors)
        a_pos = torch.gather(pos, 1, anchors)  # [R, n]
        a_doc = torch.gather(doc, 1, anchors)
        blk_pos = (a_pos.unsqueeze(-1) + off).view(R, n * B)
        # context part of the mask [R, n*B, T]
        t_idx = torch.arange(T, device=dev)
        ctx_ok = (t_idx.view(1, 1, T) < anchors.unsqueeze(-1)) & (doc.unsqueeze(1) == a_doc.unsqueeze(-1))  # [R, n, T]
        win = (blk_pos.view(R, n, B, 1) - pos.view(R, 1, 1, T)) <= self.Wn - 1  # [R, n, B, T]
        ctx_mask = (ctx_ok.unsqueeze(2) & win).view(R, n * B, T)
        bid = torch.arange(n * B, device=dev) // B
        blk_mask = (bid.view(-1, 1) == bid.view(1, -1)).expand(R, n * B, n * B)
        mask = torch.cat([ctx_mask, blk_mask], dim=-1)
        ctx = self.context_kv(features, pos)
        h = self.block_forward(blk_tok.view(R, n * B), blk_pos, ctx, mask, B, mode)
        return h.view(R, n, B, -1)

    def train_forward(
        self,
        batch: dict,
        anchors: torch.Tensor,
        anchor_valid: torch.Tensor,
        mode: str = "v2",
        gamma: float | None = None,
        selector_loss_weight: float | None = None,
    ) -> dict:
        """Loss of §8.3-§8.5 and metrics of §8.6 for one batch and its anchors."""
        tr = self.cfg.get("training", {})
        gamma = float(tr.get("loss_decay_gamma", 4.0) if gamma is None else gamma)
        lam = float(tr.get("selector_loss_weight", 1.0) if selector_loss_weight is None else selector_loss_weight)
        tokens = batch["tokens"]
        pos, doc, lm = self._batch_aux(batch)
        R, T = tokens.shape
        n, B = anchors.shape[1], self.B
        dev = tokens.device
        h = self.train_block_hidden(batch, anchors, mode)  # [R, n, B, H]
        hl = h[:, :, 1:]  # offsets 1..B-1
        logits = self.logits(hl)  # [R, n, B-1, V]
        # labels (§8.3); offset j label index a + j, predecessor index a + j - 1
        off = torch.arange(B, device=dev)
        idx = anchors.unsqueeze(-1) + off  # [R, n, B]
        inb = idx < T
        idxc = idx.clamp(max=T - 1)
        tok_at = torch.gather(tokens.unsqueeze(1).expand(R, n, T), 2, idxc)  # [R, n, B]
        doc_at = torch.gather(doc.unsqueeze(1).expand(R, n, T), 2, idxc)
        lm_at = torch.gather(lm.unsqueeze(1).expand(R, n, T).to(torch.float32), 2, idxc)
        a_doc = torch.gather(doc, 1, anchors).unsqueeze(-1)
        valid = (inb & (doc_at == a_doc) & (lm_at > 0) & anchor_valid.unsqueeze(-1))[:, :, 1:]  # [R, n, B-1]
        y = tok_at[:, :, 1:]
        prev = tok_at[:, :, :-1]
        w = torch.exp(-torch.arange(B - 1, device=dev, dtype=torch.float32) / gamma)  # j-1 = 0..B-2
        wv = w.view(1, 1, -1) * valid.to(torch.float32)
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="none").view_as(wv)
        block_ce = (ce * wv).sum() / wv.sum().clamp_min(1e-6)
        out = {"block_ce": block_ce}
        with torch.no_grad():
            correct = (logits.argmax(-1) == y) & valid
        loss = block_ce
        if mode == "v2":
            cand = torch.sort(logits.detach(), dim=-1, descending=True, stable=True).indices[..., : self.topk]
            unary = torch.gather(logits, -1, cand)  # with gradient
            S = self.edge_scores(cand, unary, hl, prev.unsqueeze(-1)).squeeze(-2)  # [R, n, B-1, k]
            hit = cand == y.unsqueeze(-1)
            inside = hit.any(-1)
            tgt = hit.to(torch.long).argmax(-1)
            ws = wv * inside.to(torch.float32)
            sce = F.cross_entropy(S.reshape(-1, self.topk), tgt.reshape(-1), reduction="none").view_as(ws)
            sel_ce = (sce * ws).sum() / ws.sum().clamp_min(1e-6)
            loss = loss + lam * sel_ce
            out["selector_ce"] = sel_ce
            out["selector_coverage"] = (inside & valid).sum() / valid.sum().clamp_min(1)
            with torch.no_grad():
                correct = inside & (S.argmax(-1) == tgt) & valid
        with torch.no_grad():
            vf = valid.to(torch.float32)
            acc = (correct.to(torch.float32) * vf).sum((0, 1)) / vf.sum((0, 1)).clamp_min(1)
            full = valid.all(-1)  # anchors with all B-1 labels valid
            run = torch.cumprod(correct.to(torch.float32), dim=-1).sum(-1)
            tau = 1.0 + (run * full).sum() / full.sum().clamp_min(1)
        out.update(loss=loss, acc=acc, tau=tau, n_labels=valid.sum())
        return out


# --------------------------------------------------------------------------------------
# Training sanity run and benchmark (docs §13.1)
# --------------------------------------------------------------------------------------


def _sample_from_target(model: "M.Model", prompt: list[int], n: int, gen: torch.Generator, temperature: float):
    """Continue prompt by n target tokens (greedy at temperature 0, else sampled); return
    the tokens and the hidden states of every position (one fresh target forward over the
    whole document, as training data is prepared: docs §8)."""
    cache = model.new_cache()
    out = model.forward(prompt, cache)
    toks = list(prompt)
    row = out["logits"][-1]
    for _ in range(n):
        if temperature > 0:
            t = int(torch.multinomial(torch.softmax(row / temperature, -1), 1, generator=gen))
        else:
            t = int(torch.argmax(row))
        toks.append(t)
        row = model.forward([t], cache)["logits"][-1]
    hs = model.forward(toks, model.new_cache(), collect=True)["hidden_states"]
    return toks, hs


def sanity_train(args) -> dict:
    torch.manual_seed(0)
    if args.threads:
        torch.set_num_threads(args.threads)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tcfg, tt = M.load_checkpoint(os.path.join(root, "tests/fixtures/model"))
    target = M.Model(tcfg, tt)
    cfg = make_config("dflash2-micro")
    ids = dcfg(cfg, "target_layer_ids")
    gen = torch.Generator().manual_seed(args.seed)
    rng = np.random.RandomState(args.seed + 3000)
    n_regular = tcfg["vocab_size"] - M.NUM_SPECIAL
    succ = rng.permutation(n_regular)  # the "markov" source's successor of each regular id
    # packed rows: two documents per row (a short random prompt, then the target's continuation)
    t0 = time.time()
    rows = []
    doc_len = args.doc_len
    for r in range(args.rows):
        toks, feats, pos, doc = [], [], [], []
        for dd in range(2):
            if args.data == "target":
                prompt = [tcfg["bos_token_id"]] + [int(x) for x in rng.randint(0, n_regular, size=3)]
                t, hs = _sample_from_target(target, prompt, doc_len - len(prompt), gen, args.temperature)
            else:  # "markov": t_{i+1} = succ[t_i] with probability 0.9, else uniform
                t = [tcfg["bos_token_id"], int(rng.randint(0, n_regular))]
                while len(t) < doc_len:
                    t.append(int(succ[t[-1]]) if rng.rand() < 0.9 else int(rng.randint(0, n_regular)))
                hs = target.forward(t, target.new_cache(), collect=True)["hidden_states"]
            toks += t
            feats.append(target_features(hs, ids))
            pos += list(range(len(t)))
            doc += [dd] * len(t)
        rows.append((toks, torch.cat(feats), pos, doc))
    batch_all = {
        "tokens": torch.tensor([r[0] for r in rows]),
        "features": torch.stack([r[1] for r in rows]),
        "positions": torch.tensor([r[2] for r in rows]),
        "doc_ids": torch.tensor([r[3] for r in rows]),
    }
    # the prompt tokens are not labels (only the continuation is)
    lmask = torch.ones_like(batch_all["tokens"], dtype=torch.float32)
    lmask[batch_all["positions"] < (4 if args.data == "target" else 2)] = 0
    batch_all["loss_mask"] = lmask
    data_s = time.time() - t0
    n_train = args.rows - args.eval_rows
    batch_all = {k: v.to(args.device) for k, v in batch_all.items()}
    split = lambda b, sl: {k: v[sl] for k, v in b.items()}  # noqa: E731
    train, held = split(batch_all, slice(0, n_train)), split(batch_all, slice(n_train, None))
    results = {}
    for mode in args.modes.split(","):
        dr = Drafter(cfg, init_weights(cfg, args.seed, scheme="train"), tt["model.embed_tokens.weight"], tt["lm_head.weight"],
                     device=args.device, trainable=True)
        opt = torch.optim.AdamW(dr.parameters(), lr=args.lr, weight_decay=0.0)
        g = torch.Generator().manual_seed(args.seed + 1)
        ga = torch.Generator().manual_seed(12345)
        ea, ev = dr.sample_anchors(held, 64, ga)
        hist = []
        t1 = time.time()
        for step in range(args.steps + 1):
            if step % args.eval_every == 0:
                with torch.no_grad():
                    e = dr.train_forward(held, ea, ev, mode, selector_loss_weight=args.selector_loss_weight)
                hist.append(
                    dict(
                        step=step,
                        loss=float(e["loss"]),
                        block_ce=float(e["block_ce"]),
                        selector_ce=float(e.get("selector_ce", float("nan"))),
                        acc1=float(e["acc"][0]),
                        tau=float(e["tau"]),
                    )
                )
                print(f"[{mode}] step {step:4d}  held-out loss {hist[-1]['loss']:.4f}  block_ce {hist[-1]['block_ce']:.4f}"
                      f"  sel_ce {hist[-1]['selector_ce']:.4f}  acc@1 {hist[-1]['acc1']:.3f}  tau {hist[-1]['tau']:.3f}", flush=True)
            if step == args.steps:
                break
            sel = torch.randperm(n_train, generator=g)[: args.batch_rows].to(args.device)
            b = split(train, sel)
            an, av = dr.sample_anchors(b, args.anchors, g)
            o = dr.train_forward(b, an, av, mode, selector_loss_weight=args.selector_loss_weight)
            opt.zero_grad()
            o["loss"].backward()
            opt.step()
        results[mode] = dict(history=hist, train_s=time.time() - t1)
    results["data_s"] = data_s
    return results


def train_bench(args) -> None:
    """Timing / memory smoke test of the batched training step at a preset's real size,
    on random tokens and random N(0, 1) features (no target forward): checks the training
    path runs on the device; reports the block CE per step (random labels: only fitting
    the batch can lower it)."""
    torch.manual_seed(args.seed)
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = args.tf32
    cfg = make_config(args.preset)
    tcfg = M.make_config(cfg["target_preset"])
    H, V = tcfg["hidden_size"], tcfg["vocab_size"]
    rng = np.random.RandomState(args.seed)
    embed = torch.from_numpy(rng.standard_normal((V, H)).astype(np.float32)).to(torch.bfloat16)
    head = torch.from_numpy((rng.standard_normal((V, H)) * (3.0 / math.sqrt(H))).astype(np.float32)).to(torch.bfloat16)
    dr = Drafter(cfg, init_weights(cfg, args.seed, scheme="train"), embed, head, device=args.device, trainable=True)
    R, T = args.rows, args.seq_len
    Fdim = len(dcfg(cfg, "target_layer_ids")) * H
    g = torch.Generator().manual_seed(args.seed)
    n_reg = V - M.NUM_SPECIAL
    batch = {
        "tokens": torch.randint(0, n_reg, (R, T), generator=g).to(args.device),
        "features": torch.randn(R, T, Fdim, generator=g).to(args.device),
    }
    an, av = dr.sample_anchors(batch, args.anchors, g)
    opt = torch.optim.AdamW(dr.parameters(), lr=args.lr, weight_decay=0.0)
    ac = torch.autocast(device_type=args.device.split(":")[0], dtype=torch.bfloat16) if args.bf16 else None
    times, losses = [], []
    for step in range(args.steps):
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.time()
        if ac is not None:
            with ac:
                o = dr.train_forward(batch, an, av, args.mode)
        else:
            o = dr.train_forward(batch, an, av, args.mode)
        opt.zero_grad()
        o["loss"].backward()
        opt.step()
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        times.append(time.time() - t0)
        losses.append(float(o["block_ce"].detach()))
    peak = torch.cuda.max_memory_allocated() / 2**30 if args.device.startswith("cuda") else float("nan")
    steady = times[1:] if len(times) > 1 else times
    print(json.dumps(dict(preset=args.preset, mode=args.mode, device=args.device, torch=torch.__version__,
                          rows=R, seq_len=T, anchors=int(an.shape[1]), bf16_autocast=args.bf16, tf32=args.tf32,
                          step_s=sum(steady) / len(steady), first_step_s=times[0], peak_gib=peak,
                          block_ce=losses), indent=1))
    assert all(math.isfinite(x) for x in losses)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    st = sub.add_parser("sanity-train", help="a few CPU training steps on the micro target's own samples")
    st.add_argument("--seed", type=int, default=0)
    st.add_argument("--rows", type=int, default=64)
    st.add_argument("--eval-rows", type=int, default=8)
    st.add_argument("--doc-len", type=int, default=48)
    st.add_argument("--data", choices=("markov", "target"), default="markov",
                    help="documents: a noisy deterministic bigram chain (learnable) or the target's own continuation")
    st.add_argument("--temperature", type=float, default=0.0, help="--data target: 0 = greedy continuation")
    st.add_argument("--steps", type=int, default=200)
    st.add_argument("--eval-every", type=int, default=25)
    st.add_argument("--batch-rows", type=int, default=8)
    st.add_argument("--anchors", type=int, default=16)
    st.add_argument("--lr", type=float, default=2e-3)
    st.add_argument("--modes", default="v1,v2")
    st.add_argument("--selector-loss-weight", type=float, default=None, help="default: the config's (1.0)")
    st.add_argument("--threads", type=int, default=1, help="torch CPU threads (0 = torch default)")
    st.add_argument("--json", default=None, help="write the loss history here")
    st.add_argument("--device", default="cpu")
    tb = sub.add_parser("train-bench", help="time the training step at a preset's size on random data")
    tb.add_argument("--preset", default="dflash2-tiny", choices=PRESET_NAMES)
    tb.add_argument("--mode", default="v2", choices=("v1", "v2"))
    tb.add_argument("--device", default="cuda")
    tb.add_argument("--rows", type=int, default=4)
    tb.add_argument("--seq-len", type=int, default=2048)
    tb.add_argument("--anchors", type=int, default=512)
    tb.add_argument("--steps", type=int, default=10)
    tb.add_argument("--lr", type=float, default=1e-4)
    tb.add_argument("--seed", type=int, default=0)
    tb.add_argument("--bf16", action="store_true", help="torch.autocast bf16 (training only; the contract is f32)")
    tb.add_argument("--tf32", action="store_true")
    sub.add_parser("sizes", help="parameter counts / bf16 bytes of the presets")
    args = ap.parse_args(argv)
    if args.cmd == "sizes":
        for p in PRESET_NAMES:
            cfg = make_config(p)
            n = count_params(cfg)
            print(f"{p:22s} params {n:>14,d}  bf16 {2 * n / 2**20:10.2f} MiB  (v1 only: {count_params(cfg, False):,d})")
        return
    if args.cmd == "train-bench":
        train_bench(args)
        return
    res = sanity_train(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
