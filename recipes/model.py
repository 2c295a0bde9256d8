#!/usr/bin/env python3
"""Reference implementation of speclab's GLM-5.3-Flash twin (``speclab_glm5_next_tiny``).

The contract is ``docs/model.md``; this file implements it literally (fp32 compute,
bf16/fp32 weights upcast exactly, no bf16 rounding of activations) so that the Rust
engine can be checked against goldens produced here. Section numbers in comments refer
to ``docs/model.md``.

Only torch (>= 2.4), numpy and safetensors are required. ``compressed_tensors`` is used,
when installed, only to cross-check the W4A16 packing and ``quantization_config``.
"""

from __future__ import annotations

import copy
import json
import math
import os
import re
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

MODEL_TYPE = "speclab_glm5_next_tiny"
ARCHITECTURE = "SpeclabGlm5NextForCausalLM"
GROUP_SIZE = 128
NUM_SPECIAL = 8  # bos, eos, pad, mask, 4 reserved: the last NUM_SPECIAL ids of the vocab

# --------------------------------------------------------------------------------------
# Config / presets (§9, §10)
# --------------------------------------------------------------------------------------


def default_layer_types(n_layers: int, period: int = 4) -> list[str]:
    """``period - 1`` linear-attention layers then one full-attention layer, repeated."""
    return [
        "full_attention" if (i + 1) % period == 0 else "linear_attention"
        for i in range(n_layers)
    ]


_PRESETS = {
    # Committed test fixture. hidden 128 (not 64) because every routed-expert GEMM
    # must have in_features % 128 == 0 for INT4 group-128 (gate/up have K = hidden).
    "micro": dict(
        vocab_size=512,
        hidden_size=128,
        num_hidden_layers=4,
        layer_types=default_layer_types(4),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        linear_num_heads=2,
        linear_head_dim=32,
        linear_conv_kernel_dim=4,
        intermediate_size=128,
        first_k_dense_replace=1,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=128,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        num_nextn_predict_layers=1,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=256,
    ),
    # CPU-test sized target (not committed).
    "tiny": dict(
        vocab_size=8192 + NUM_SPECIAL,
        hidden_size=256,
        num_hidden_layers=8,
        layer_types=default_layer_types(8),
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        linear_num_heads=4,
        linear_head_dim=64,
        linear_conv_kernel_dim=4,
        intermediate_size=768,
        first_k_dense_replace=1,
        n_routed_experts=16,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=128,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        num_nextn_predict_layers=1,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=4096,
    ),
    # The card's shapes (config only: memory planning / dummy-weight benchmarks).
    # Card: hidden 4096, 45 layers + MTP layer 45, 288 experts top-8 + 1 shared,
    # moe-intermediate 2048, vocab 154,880, dense layers 0-2 (42 MoE layers x 288 x 3 =
    # 36,288 quantized tensors). Not on the card (assumptions, documented):
    # 36 KDA + 9 full-attention layers (every 5th; the split used by
    # experiments/df2w-block-size.ron), KDA 32 heads x 128, full attention as GQA
    # 32 x 128 with 8 KV heads (the real model uses MLA + DSA), dense intermediate 12288.
    "glm53-flash": dict(
        vocab_size=154880,
        hidden_size=4096,
        num_hidden_layers=45,
        layer_types=default_layer_types(45, period=5),
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        linear_num_heads=32,
        linear_head_dim=128,
        linear_conv_kernel_dim=4,
        intermediate_size=12288,
        first_k_dense_replace=3,
        n_routed_experts=288,
        num_experts_per_tok=8,
        n_shared_experts=1,
        moe_intermediate_size=2048,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        num_nextn_predict_layers=1,
        rope_theta=1000000.0,
        rms_norm_eps=1e-5,
        max_position_embeddings=262144,
    ),
}

PRESET_NAMES = tuple(_PRESETS)


def make_config(preset: str, **overrides) -> dict:
    if preset not in _PRESETS:
        raise ValueError(f"unknown preset {preset!r}; known: {', '.join(_PRESETS)}")
    p = copy.deepcopy(_PRESETS[preset])
    p.update(overrides)
    V = p["vocab_size"]
    cfg = {
        "model_type": MODEL_TYPE,
        "architectures": [ARCHITECTURE],
        "preset": preset,
        **p,
        "hidden_act": "silu",
        "attention_bias": False,
        "scoring_func": "sigmoid",
        "topk_method": "noaux_tc",
        "n_group": 1,
        "topk_group": 1,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": V - NUM_SPECIAL,
        "eos_token_id": V - NUM_SPECIAL + 1,
        "pad_token_id": V - NUM_SPECIAL + 2,
        "mask_token_id": V - NUM_SPECIAL + 3,
    }
    validate_config(cfg)
    return cfg


def validate_config(cfg: dict) -> None:
    L = cfg["num_hidden_layers"]
    assert len(cfg["layer_types"]) == L, "layer_types must have num_hidden_layers entries"
    assert set(cfg["layer_types"]) <= {"linear_attention", "full_attention"}
    assert cfg["num_attention_heads"] % cfg["num_key_value_heads"] == 0
    assert cfg["head_dim"] % 2 == 0
    assert cfg["num_nextn_predict_layers"] in (0, 1), "only 0 or 1 MTP layer is specified"
    assert cfg["n_group"] == 1 and cfg["topk_group"] == 1
    assert cfg["num_experts_per_tok"] <= cfg["n_routed_experts"]
    assert cfg["hidden_size"] % GROUP_SIZE == 0, "routed gate/up in_features must be % 128"
    assert cfg["moe_intermediate_size"] % GROUP_SIZE == 0, "routed down in_features must be % 128"


def is_moe_layer(cfg: dict, i: int) -> bool:
    """Layer i (0..L inclusive of the MTP layer) has an MoE FFN."""
    return i >= cfg["first_k_dense_replace"]


def mtp_layer_index(cfg: dict) -> int | None:
    return cfg["num_hidden_layers"] if cfg["num_nextn_predict_layers"] else None


def layer_kind(cfg: dict, i: int) -> str:
    if i == cfg["num_hidden_layers"]:
        return "full_attention"  # the MTP layer (§6)
    return cfg["layer_types"][i]


# --------------------------------------------------------------------------------------
# Tensor inventory (§7) and seeded init
# --------------------------------------------------------------------------------------


def tensor_specs(cfg: dict) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """Every tensor of the bf16 checkpoint: (name, shape, dtype), in a fixed order."""
    H, V = cfg["hidden_size"], cfg["vocab_size"]
    nh, nkv, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    nl, dl, kc = cfg["linear_num_heads"], cfg["linear_head_dim"], cfg["linear_conv_kernel_dim"]
    C = nl * dl
    E, Im, I = cfg["n_routed_experts"], cfg["moe_intermediate_size"], cfg["intermediate_size"]
    Is = Im * cfg["n_shared_experts"]
    bf, f32 = torch.bfloat16, torch.float32
    specs = [("model.embed_tokens.weight", (V, H), bf)]
    n_total = cfg["num_hidden_layers"] + cfg["num_nextn_predict_layers"]
    for i in range(n_total):
        P = f"model.layers.{i}"
        if i == cfg["num_hidden_layers"]:
            specs += [
                (f"{P}.enorm.weight", (H,), bf),
                (f"{P}.hnorm.weight", (H,), bf),
                (f"{P}.eh_proj.weight", (H, 2 * H), bf),
            ]
        specs.append((f"{P}.input_layernorm.weight", (H,), bf))
        if layer_kind(cfg, i) == "full_attention":
            specs += [
                (f"{P}.self_attn.q_proj.weight", (nh * d, H), bf),
                (f"{P}.self_attn.k_proj.weight", (nkv * d, H), bf),
                (f"{P}.self_attn.v_proj.weight", (nkv * d, H), bf),
                (f"{P}.self_attn.o_proj.weight", (H, nh * d), bf),
            ]
        else:
            A = f"{P}.linear_attn"
            specs += [
                (f"{A}.q_proj.weight", (C, H), bf),
                (f"{A}.k_proj.weight", (C, H), bf),
                (f"{A}.v_proj.weight", (C, H), bf),
                (f"{A}.q_conv1d.weight", (C, 1, kc), bf),
                (f"{A}.k_conv1d.weight", (C, 1, kc), bf),
                (f"{A}.v_conv1d.weight", (C, 1, kc), bf),
                (f"{A}.f_a_proj.weight", (dl, H), bf),
                (f"{A}.f_b_proj.weight", (C, dl), bf),
                (f"{A}.b_proj.weight", (nl, H), bf),
                (f"{A}.A_log", (nl,), f32),
                (f"{A}.dt_bias", (C,), f32),
                (f"{A}.g_a_proj.weight", (dl, H), bf),
                (f"{A}.g_b_proj.weight", (C, dl), bf),
                (f"{A}.o_norm.weight", (dl,), bf),
                (f"{A}.o_proj.weight", (H, C), bf),
            ]
        specs.append((f"{P}.post_attention_layernorm.weight", (H,), bf))
        M = f"{P}.mlp"
        if not is_moe_layer(cfg, i):
            specs += [
                (f"{M}.gate_proj.weight", (I, H), bf),
                (f"{M}.up_proj.weight", (I, H), bf),
                (f"{M}.down_proj.weight", (H, I), bf),
            ]
        else:
            specs += [
                (f"{M}.gate.weight", (E, H), bf),
                (f"{M}.gate.e_score_correction_bias", (E,), f32),
            ]
            for j in range(E):
                specs += [
                    (f"{M}.experts.{j}.gate_proj.weight", (Im, H), bf),
                    (f"{M}.experts.{j}.up_proj.weight", (Im, H), bf),
                    (f"{M}.experts.{j}.down_proj.weight", (H, Im), bf),
                ]
            specs += [
                (f"{M}.shared_experts.gate_proj.weight", (Is, H), bf),
                (f"{M}.shared_experts.up_proj.weight", (Is, H), bf),
                (f"{M}.shared_experts.down_proj.weight", (H, Is), bf),
            ]
        if i == cfg["num_hidden_layers"]:
            specs.append((f"{P}.shared_head.norm.weight", (H,), bf))
    specs += [("model.norm.weight", (H,), bf), ("lm_head.weight", (V, H), bf)]
    return specs


def count_params(cfg: dict) -> int:
    return sum(math.prod(s) for _, s, _ in tensor_specs(cfg))


def init_weights(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random init with scales chosen so every block contributes visibly.

    Uses numpy's legacy ``RandomState`` (a frozen stream) so the weights are the same
    for any numpy / torch version. Not part of the parity contract (the fixture is
    committed); documented in docs/model.md §10.
    """
    rng = np.random.RandomState(seed)
    H = cfg["hidden_size"]
    out = {}
    for name, shape, dtype in tensor_specs(cfg):
        n = math.prod(shape)
        base = name.rsplit(".", 1)[0]
        leaf = name.split(".")[-1]
        if leaf == "A_log":  # Kimi-Linear: A ~ U(1, 16)
            val = np.log(rng.uniform(1.0, 16.0, size=n))
        elif leaf == "dt_bias":  # Mamba/Kimi: inverse softplus of dt ~ logU(1e-3, 1e-1)
            dt = np.exp(rng.uniform(math.log(1e-3), math.log(1e-1), size=n))
            val = dt + np.log(-np.expm1(-dt))
        elif leaf == "e_score_correction_bias":
            val = rng.standard_normal(n) * 0.1
        elif name.endswith("norm.weight") or name.endswith("layernorm.weight"):
            val = 1.0 + 0.1 * rng.standard_normal(n)
        elif name == "model.embed_tokens.weight":
            val = rng.standard_normal(n)
        elif name == "lm_head.weight":
            val = rng.standard_normal(n) * (3.0 / math.sqrt(H))
        elif leaf == "weight" and base.endswith("conv1d"):
            val = rng.standard_normal(n) * 0.5
        else:  # Linear [out, in]: unit-gain init, std 1/sqrt(in)
            fan_in = shape[-1]
            val = rng.standard_normal(n) / math.sqrt(fan_in)
        t = torch.from_numpy(np.asarray(val, dtype=np.float32).reshape(shape))
        out[name] = t.to(dtype).contiguous()
    return out


# --------------------------------------------------------------------------------------
# Checkpoint I/O
# --------------------------------------------------------------------------------------


def save_checkpoint(directory: str, cfg: dict, tensors: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
        f.write("\n")
    save_file(
        {k: v.contiguous() for k, v in tensors.items()},
        os.path.join(directory, "model.safetensors"),
        metadata={"format": "pt"},
    )


def load_checkpoint(directory: str) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    with open(os.path.join(directory, "config.json")) as f:
        cfg = json.load(f)
    return cfg, load_file(os.path.join(directory, "model.safetensors"))


# --------------------------------------------------------------------------------------
# W4A16 pack-quantized (§8)
# --------------------------------------------------------------------------------------


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int q in [-8, 7], [N, K] -> int32 [N, K/8]; element k at bits 4*(k%8), as q + 8."""
    N, K = q.shape
    assert K % 8 == 0
    u = (q.to(torch.int64) + 8).reshape(N, K // 8, 8)
    assert int(u.min()) >= 0 and int(u.max()) <= 15
    shifts = torch.arange(8, dtype=torch.int64) * 4
    words = (u << shifts).sum(dim=-1)  # in [0, 2^32)
    words = torch.where(words >= 2**31, words - 2**32, words)  # reinterpret as int32
    return words.to(torch.int32)


def unpack_int4(packed: torch.Tensor, shape) -> torch.Tensor:
    """int32 [N, K/8] -> int8 q [N, K] in [-8, 7]."""
    N, K = int(shape[0]), int(shape[1])
    w = packed.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(8, dtype=torch.int64) * 4
    nib = (w.unsqueeze(-1) >> shifts) & 0xF  # [N, K/8, 8]
    return (nib.reshape(N, -1)[:, :K] - 8).to(torch.int8)


def quantize_rtn(w: torch.Tensor, group_size: int = GROUP_SIZE):
    """RTN symmetric INT4, per row per group of 128 along K (§8).

    Returns (weight_packed int32 [N, K/8], weight_scale bf16 [N, K/128], weight_shape
    int64 [2]).
    """
    N, K = w.shape
    assert K % group_size == 0
    wf = w.to(torch.float32).reshape(N, K // group_size, group_size)
    amax = wf.abs().amax(dim=-1)
    scale = (amax / 7.0).to(torch.bfloat16)
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    q = torch.round(wf / scale.to(torch.float32).unsqueeze(-1))  # round half to even
    q = q.clamp(-8, 7).to(torch.int8).reshape(N, K)
    return pack_int4(q), scale.contiguous(), torch.tensor([N, K], dtype=torch.int64)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, shape, group_size: int = GROUP_SIZE):
    """-> f32 [N, K]: q * scale, exact in f32 (not rounded to bf16)."""
    N, K = int(shape[0]), int(shape[1])
    q = unpack_int4(packed, (N, K)).to(torch.float32)
    s = scale.to(torch.float32).repeat_interleave(group_size, dim=1)[:, :K]
    return q * s


def quantization_config(cfg: dict) -> dict:
    """The ``quantization_config`` compressed-tensors 0.17 / llm-compressor would write."""
    L, k = cfg["num_hidden_layers"], cfg["first_k_dense_replace"]
    ignore = [
        "lm_head",
        "re:.*self_attn.*",
        "re:.*linear_attn.*",
        r"re:.*mlp\.gate$",
        "re:.*shared_experts.*",
    ]
    if k > 0:
        dense = "0" if k == 1 else "(" + "|".join(str(i) for i in range(k)) + ")"
        ignore.append(rf"re:model\.layers\.{dense}\.mlp\..*")
    if cfg["num_nextn_predict_layers"]:
        ignore.append(rf"re:model\.layers\.{L}\..*")
    return {
        "config_groups": {
            "group_0": {
                "format": None,
                "input_activations": None,
                "output_activations": None,
                "targets": ["Linear"],
                "weights": {
                    "actorder": None,
                    "block_structure": None,
                    "dynamic": False,
                    "group_size": GROUP_SIZE,
                    "num_bits": 4,
                    "observer": "memoryless_minmax",
                    "observer_kwargs": {},
                    "scale_dtype": None,
                    "strategy": "group",
                    "symmetric": True,
                    "type": "int",
                    "zp_dtype": None,
                },
            }
        },
        "format": "pack-quantized",
        "global_compression_ratio": None,
        "ignore": ignore,
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
        "sparsity_config": {},
        "transform_config": {},
        "version": "0.17.0",
    }


def linear_module_names(cfg: dict) -> list[str]:
    """Names of every Linear module (tensor name minus ``.weight``) of the bf16 model."""
    out = []
    for name, shape, _ in tensor_specs(cfg):
        if not name.endswith(".weight") or len(shape) != 2 or name == "model.embed_tokens.weight":
            continue
        out.append(name[: -len(".weight")])
    return out


def _match_name(name: str, target: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], name) is not None
    return target == name


def quantized_module_names(cfg: dict, qcfg: dict) -> list[str]:
    ignore = qcfg["ignore"]
    return [n for n in linear_module_names(cfg) if not any(_match_name(n, t) for t in ignore)]


def quantize_checkpoint(cfg: dict, tensors: dict[str, torch.Tensor]):
    """-> (config with quantization_config, tensors with routed experts packed)."""
    qcfg = quantization_config(cfg)
    qnames = quantized_module_names(cfg, qcfg)
    expect = [n for n in linear_module_names(cfg) if re.search(r"\.mlp\.experts\.\d+\.", n)]
    expect = [n for n in expect if int(n.split(".")[2]) < cfg["num_hidden_layers"]]
    assert qnames == expect, "ignore list must leave exactly the routed experts"
    out = {}
    qset = set(qnames)
    for name, t in tensors.items():
        mod = name[: -len(".weight")] if name.endswith(".weight") else None
        if mod in qset:
            packed, scale, shape = quantize_rtn(t)
            out[f"{mod}.weight_packed"] = packed
            out[f"{mod}.weight_scale"] = scale
            out[f"{mod}.weight_shape"] = shape
        else:
            out[name] = t
    qc = dict(cfg)
    qc["quantization_config"] = qcfg
    return qc, out


# --------------------------------------------------------------------------------------
# Forward (§2-§6)
# --------------------------------------------------------------------------------------


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps) * w


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def softplus(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x > 20.0, x, torch.log(1.0 + torch.exp(torch.clamp(x, max=20.0))))


def rope_tables(positions: torch.Tensor, d: int, theta: float):
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=positions.device) / d))
    ang = positions.to(torch.float64).unsqueeze(-1) * inv.unsqueeze(0)
    emb = torch.cat([ang, ang], dim=-1)
    return emb.cos().to(torch.float32), emb.sin().to(torch.float32)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x [T, heads, d]; cos/sin [T, d]
    return x * cos.unsqueeze(1) + rotate_half(x) * sin.unsqueeze(1)


def swiglu(x, wg, wu, wd):
    return (F.silu(x @ wg.T) * (x @ wu.T)) @ wd.T


@dataclass
class Cache:
    """Per-request state. ``layers[i]`` is a dict: full attention {k, v} [S, nkv, d];
    KDA {conv_q, conv_k, conv_v} [kc-1, C] and S [nl, dl, dl]. ``mtp`` is the MTP layer's
    {k, v}. ``length`` = tokens consumed by the target; ``mtp_length`` by the MTP layer."""

    layers: list = field(default_factory=list)
    mtp: dict | None = None
    length: int = 0
    mtp_length: int = 0

    def clone(self) -> "Cache":
        return Cache(
            layers=[{k: v.clone() for k, v in d.items()} for d in self.layers],
            mtp=None if self.mtp is None else {k: v.clone() for k, v in self.mtp.items()},
            length=self.length,
            mtp_length=self.mtp_length,
        )


class Model:
    def __init__(self, cfg: dict, tensors: dict[str, torch.Tensor], device: str = "cpu"):
        validate_config(cfg)
        self.cfg = cfg
        self.device = torch.device(device)
        W = {}
        for name, t in tensors.items():
            if name.endswith(".weight_packed"):
                mod = name[: -len(".weight_packed")]
                W[f"{mod}.weight"] = dequantize(
                    t, tensors[f"{mod}.weight_scale"], tensors[f"{mod}.weight_shape"].tolist()
                )
            elif name.endswith(".weight_scale") or name.endswith(".weight_shape"):
                continue
            else:
                W[name] = t.to(torch.float32)
        missing = {n for n, _, _ in tensor_specs(cfg)} - set(W)
        extra = set(W) - {n for n, _, _ in tensor_specs(cfg)}
        assert not missing and not extra, f"missing {sorted(missing)[:5]} extra {sorted(extra)[:5]}"
        self.W = {k: v.to(self.device) for k, v in W.items()}
        self.eps = float(cfg["rms_norm_eps"])

    # -- caches ------------------------------------------------------------------------
    def new_cache(self) -> Cache:
        c = self.cfg
        dev = self.device
        layers = []
        C = c["linear_num_heads"] * c["linear_head_dim"]
        kc = c["linear_conv_kernel_dim"]
        for i in range(c["num_hidden_layers"]):
            if layer_kind(c, i) == "full_attention":
                layers.append(self._empty_kv())
            else:
                z = lambda: torch.zeros(kc - 1, C, dtype=torch.float32, device=dev)  # noqa: E731
                layers.append(
                    {
                        "conv_q": z(),
                        "conv_k": z(),
                        "conv_v": z(),
                        "S": torch.zeros(
                            c["linear_num_heads"], c["linear_head_dim"], c["linear_head_dim"],
                            dtype=torch.float32, device=dev,
                        ),
                    }
                )
        mtp = self._empty_kv() if c["num_nextn_predict_layers"] else None
        return Cache(layers=layers, mtp=mtp)

    def _empty_kv(self):
        c = self.cfg
        z = torch.zeros(0, c["num_key_value_heads"], c["head_dim"], dtype=torch.float32, device=self.device)
        return {"k": z, "v": z.clone()}

    # -- blocks ------------------------------------------------------------------------
    def _full_attention(self, P: str, a: torch.Tensor, kv: dict, start: int) -> torch.Tensor:
        c, W = self.cfg, self.W
        T = a.shape[0]
        nh, nkv, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        q = (a @ W[f"{P}.self_attn.q_proj.weight"].T).view(T, nh, d)
        k = (a @ W[f"{P}.self_attn.k_proj.weight"].T).view(T, nkv, d)
        v = (a @ W[f"{P}.self_attn.v_proj.weight"].T).view(T, nkv, d)
        pos = torch.arange(start, start + T, device=self.device)
        cos, sin = rope_tables(pos, d, float(c["rope_theta"]))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        K = torch.cat([kv["k"], k], dim=0)
        Vv = torch.cat([kv["v"], v], dim=0)
        kv["k"], kv["v"] = K, Vv
        S = K.shape[0]
        G = nh // nkv
        kpos = torch.arange(S, device=self.device)
        mask = kpos.unsqueeze(0) > pos.unsqueeze(1)  # [T, S]
        scale = d ** -0.5
        o = torch.empty(T, nh, d, dtype=torch.float32, device=self.device)
        for h in range(nh):
            g = h // G
            s = (q[:, h, :] @ K[:, g, :].T) * scale
            s = s.masked_fill(mask, float("-inf"))
            p = torch.softmax(s, dim=-1)
            o[:, h, :] = p @ Vv[:, g, :]
        return o.reshape(T, nh * d) @ W[f"{P}.self_attn.o_proj.weight"].T

    @staticmethod
    def _short_conv(x: torch.Tensor, w: torch.Tensor, state: torch.Tensor):
        # x [T, C], w [C, 1, kc], state [kc-1, C] -> (silu(y) [T, C], new_state)
        kc = w.shape[-1]
        T = x.shape[0]
        xp = torch.cat([state, x], dim=0)  # [kc-1+T, C]
        y = torch.zeros_like(x)
        for j in range(kc):
            y = y + w[:, 0, j].unsqueeze(0) * xp[j : j + T]
        return F.silu(y), xp[xp.shape[0] - (kc - 1) :].clone()

    def _kda(self, P: str, a: torch.Tensor, st: dict) -> torch.Tensor:
        c, W = self.cfg, self.W
        A = f"{P}.linear_attn"
        T = a.shape[0]
        nl, dl = c["linear_num_heads"], c["linear_head_dim"]
        xq = a @ W[f"{A}.q_proj.weight"].T
        xk = a @ W[f"{A}.k_proj.weight"].T
        xv = a @ W[f"{A}.v_proj.weight"].T
        q, st["conv_q"] = self._short_conv(xq, W[f"{A}.q_conv1d.weight"], st["conv_q"])
        k, st["conv_k"] = self._short_conv(xk, W[f"{A}.k_conv1d.weight"], st["conv_k"])
        v, st["conv_v"] = self._short_conv(xv, W[f"{A}.v_conv1d.weight"], st["conv_v"])
        q = l2norm(q.view(T, nl, dl)) * (dl ** -0.5)
        k = l2norm(k.view(T, nl, dl))
        v = v.view(T, nl, dl)
        f = (a @ W[f"{A}.f_a_proj.weight"].T) @ W[f"{A}.f_b_proj.weight"].T
        glog = -torch.exp(W[f"{A}.A_log"]).view(1, nl, 1) * softplus(
            (f + W[f"{A}.dt_bias"]).view(T, nl, dl)
        )
        alpha = torch.exp(glog)  # [T, nl, dl]
        beta = torch.sigmoid(a @ W[f"{A}.b_proj.weight"].T)  # [T, nl]
        S = st["S"]  # [nl, dl(key), dl(value)]
        o = torch.empty(T, nl, dl, dtype=torch.float32, device=self.device)
        for t in range(T):
            S = S * alpha[t].unsqueeze(-1)
            u = v[t] - torch.einsum("hkv,hk->hv", S, k[t])
            S = S + beta[t].view(nl, 1, 1) * (k[t].unsqueeze(-1) * u.unsqueeze(1))
            o[t] = torch.einsum("hkv,hk->hv", S, q[t])
        st["S"] = S
        gout = ((a @ W[f"{A}.g_a_proj.weight"].T) @ W[f"{A}.g_b_proj.weight"].T).view(T, nl, dl)
        o = rmsnorm(o, W[f"{A}.o_norm.weight"], self.eps) * torch.sigmoid(gout)
        return o.reshape(T, nl * dl) @ W[f"{A}.o_proj.weight"].T

    def _moe(self, P: str, f: torch.Tensor, info: dict | None) -> torch.Tensor:
        c, W = self.cfg, self.W
        M = f"{P}.mlp"
        E, k = c["n_routed_experts"], c["num_experts_per_tok"]
        s = torch.sigmoid(f @ W[f"{M}.gate.weight"].T)  # [T, E]
        biased = s + W[f"{M}.gate.e_score_correction_bias"]
        # top-k, ties -> lower index: stable sort on descending score
        order = torch.sort(biased, dim=-1, descending=True, stable=True).indices
        sel = order[:, :k]
        w = torch.gather(s, 1, sel)
        if c["norm_topk_prob"]:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        w = w * float(c["routed_scaling_factor"])
        out = torch.zeros_like(f)
        for e in range(E):
            tok, slot = (sel == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            X = f[tok]
            y = swiglu(
                X,
                W[f"{M}.experts.{e}.gate_proj.weight"],
                W[f"{M}.experts.{e}.up_proj.weight"],
                W[f"{M}.experts.{e}.down_proj.weight"],
            )
            out.index_add_(0, tok, w[tok, slot].unsqueeze(-1) * y)
        out = out + swiglu(
            f,
            W[f"{M}.shared_experts.gate_proj.weight"],
            W[f"{M}.shared_experts.up_proj.weight"],
            W[f"{M}.shared_experts.down_proj.weight"],
        )
        if info is not None:
            sb = torch.sort(biased, dim=-1, descending=True).values
            info.setdefault("router_topk_ids", []).append(sel.clone())
            info.setdefault("router_topk_weights", []).append(w.clone())
            info.setdefault("router_gap", []).append((sb[:, k - 1] - sb[:, k]) if k < E else None)
            nob = torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :k]
            info.setdefault("bias_changed", []).append(
                (torch.sort(nob, -1).values != torch.sort(sel, -1).values).any(-1)
            )
        return out

    def _ffn(self, i: int, f: torch.Tensor, info: dict | None) -> torch.Tensor:
        P = f"model.layers.{i}"
        if is_moe_layer(self.cfg, i):
            return self._moe(P, f, info)
        W = self.W
        return swiglu(f, W[f"{P}.mlp.gate_proj.weight"], W[f"{P}.mlp.up_proj.weight"], W[f"{P}.mlp.down_proj.weight"])

    def _decoder_layer(self, i: int, x: torch.Tensor, state: dict, start: int, info) -> torch.Tensor:
        P = f"model.layers.{i}"
        W = self.W
        a = rmsnorm(x, W[f"{P}.input_layernorm.weight"], self.eps)
        if layer_kind(self.cfg, i) == "full_attention":
            x = x + self._full_attention(P, a, state, start)
        else:
            x = x + self._kda(P, a, state)
        f = rmsnorm(x, W[f"{P}.post_attention_layernorm.weight"], self.eps)
        return x + self._ffn(i, f, info)

    # -- public ------------------------------------------------------------------------
    def forward(self, tokens, cache: Cache, collect: bool = False) -> dict:
        """Run ``tokens`` (1-D ints) after what ``cache`` already holds; updates cache."""
        tokens = torch.as_tensor(tokens, dtype=torch.long, device=self.device).reshape(-1)
        W, c = self.W, self.cfg
        start = cache.length
        x = W["model.embed_tokens.weight"][tokens]
        hs = [x.clone()] if collect else None
        info = {} if collect else None
        for i in range(c["num_hidden_layers"]):
            x = self._decoder_layer(i, x, cache.layers[i], start, info)
            if collect:
                hs.append(x.clone())
        cache.length += tokens.numel()
        h = rmsnorm(x, W["model.norm.weight"], self.eps)
        out = {"logits": h @ W["lm_head.weight"].T, "hidden": h}
        if collect:
            out["hidden_states"] = torch.stack(hs)  # [L+1, T, H]: embeddings, after layer 0..L-1
            out["router"] = info
        return out

    def mtp_forward(self, hidden, next_tokens, cache: Cache, collect: bool = False) -> dict:
        """MTP (§6): hidden [T, H] = target final (post-norm) hidden at positions
        cache.mtp_length.., next_tokens [T] = the token following each of them."""
        c, W = self.cfg, self.W
        N = mtp_layer_index(c)
        assert N is not None
        P = f"model.layers.{N}"
        next_tokens = torch.as_tensor(next_tokens, dtype=torch.long, device=self.device).reshape(-1)
        e = rmsnorm(W["model.embed_tokens.weight"][next_tokens], W[f"{P}.enorm.weight"], self.eps)
        hh = rmsnorm(hidden, W[f"{P}.hnorm.weight"], self.eps)
        x = torch.cat([e, hh], dim=-1) @ W[f"{P}.eh_proj.weight"].T
        info = {} if collect else None
        x = self._decoder_layer(N, x, cache.mtp, cache.mtp_length, info)
        cache.mtp_length += next_tokens.numel()
        m = rmsnorm(x, W[f"{P}.shared_head.norm.weight"], self.eps)
        out = {"logits": m @ W["lm_head.weight"].T, "hidden": x}
        if collect:
            out["router"] = info
        return out

    def generate_greedy(self, prompt, n: int, cache: Cache | None = None) -> dict:
        """Prefill ``prompt`` then decode ``n`` tokens greedily one at a time.
        Returns tokens [n], the logits row that chose each one [n, V], the final hidden
        row of each step [n, H]."""
        cache = self.new_cache() if cache is None else cache
        out = self.forward(prompt, cache)
        rows, hid, toks = [out["logits"][-1]], [out["hidden"][-1]], []
        for j in range(n):
            t = int(torch.argmax(rows[-1]))
            toks.append(t)
            if j + 1 < n:
                o = self.forward([t], cache)
                rows.append(o["logits"][-1])
                hid.append(o["hidden"][-1])
        return {"tokens": toks, "logits": torch.stack(rows), "hidden": torch.stack(hid), "cache": cache}


def top2_margin(logits: torch.Tensor) -> torch.Tensor:
    v = torch.topk(logits, 2, dim=-1).values
    return v[..., 0] - v[..., 1]
