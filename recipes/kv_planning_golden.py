#!/usr/bin/env python3
"""Golden KV pool plans for GLM-5.3-Flash (+ DFlash2) from vLLM 0.33.0's own planning code.

For each assumption set (tensor parallel size, KV dtype, requested --block-size, number of
speculative tokens, max_model_len, in-flight tokens, KV memory, and two research-overlay
switches) this script builds the per-layer KV cache specs GLM-5.3-Flash's vLLM model
classes build, then calls vLLM's functions on the CPU and records what they answer:

* ``vllm/platforms/interface.py`` ``Platform._align_hybrid_block_size`` (the attention
  block size vLLM picks for a model with recurrent state, and the padded Mamba page);
* ``vllm/v1/core/kv_cache_planning.py`` ``get_kv_cache_groups`` (hybrid grouping; this
  model resolves the block-outermost ``BLHNC`` layout because ``KpoolTailBackend`` only
  supports it, so ``_get_packed_kv_cache_groups`` runs), ``_pool_bytes_per_block``
  (bytes of one pool block), ``available_memory // bytes_per_block`` (num_blocks, as in
  ``get_kv_cache_configs``) and ``_max_memory_usage_bytes_from_groups`` (the startup
  check, against usable memory = available - one block for the null block);
* ``vllm/v1/core/kv_cache_utils.py`` ``get_kv_cache_capacity`` (the "GPU KV cache size: N
  tokens" and "Maximum concurrency for L tokens per request: Cx" boot-log line).

The specs (vLLM 0.33.0 sources):

* per DSA/MLA layer (``layer_types[i] == "indexed_attention"``; transformers'
  ``Glm5NextTextConfig`` default: every 4th layer, 11 of 45): the MLA latent cache
  (``MLAAttention.get_kv_cache_spec``: 1 head of ``kv_lora_rank + qk_rope_head_dim`` =
  512; ``fp8`` is canonicalised to ``fp8_ds_mla`` on FLASHMLA_SPARSE, 656 bytes a token,
  ``_canonicalize_sparse_mla_kv_cache_dtype``), the kpool indexer keys
  (``Glm5NextIndexerCache``: 128 fp8 + 4 scale bytes, one state per ``index_kpool`` = 16
  tokens) and the kpool tail ring (``Glm5NextTailCache``: ``CircularBufferSpec`` of
  ``16 * next_power_of_2(cdiv(16 + N, 16))`` slots, 2 x 128 bf16);
* per KDA layer (34 of 45): ``MambaSpec`` with ``Glm5NextForCausalLM``'s own
  ``get_mamba_state_shape_from_config`` / ``get_mamba_state_dtype_from_config`` (conv
  state ``(3 * 64 * 128 / TP, 3 + N)`` bf16, recurrent ``(64 / TP, 128, 128)`` fp32),
  ``num_speculative_blocks = N``, block size ``max_model_len`` (prefix caching off);
* the DFlash2 drafter: 5 sliding-window layers (window 2048; 8 KV heads x 128, an
  assumption: the drafter's config is not public), block size by
  ``Attention.get_kv_cache_spec`` (``_largest_kernel_block_within``: the attention block
  for FlashAttention's ``MultipleOf(16)``) or 16 with ``drafter_block_size: 16`` (the
  research overlay of the model card, whose drafter SlidingWindowManager has block 16).

Backends are the SM90 ones: FLASHMLA_SPARSE (kernel blocks ``MultipleOf(64)``),
``Glm5NextIndexerBackend`` (``16 * (32, 64)`` = 512 / 1024) and ``KpoolTailBackend``
(``MultipleOf(1)``). ``indexer_block_alignment: false`` drops the indexer backend from the
alignment (an overlay without the 512-token paged-MQA constraint).

Usage::

    python recipes/kv_planning_golden.py --out tests/golden/kv_plan/glm53_plan.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from contextlib import contextmanager
from types import SimpleNamespace as NS

os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

VLLM_VERSION_EXPECTED = "0.33.0"


def _imports():
    import torch
    import vllm
    import vllm.config.vllm as vllm_config_mod
    import vllm.v1.attention.backends.mla.indexer as indexer_mod
    from transformers import Glm5NextTextConfig
    from vllm.model_executor.models import ModelRegistry
    from vllm.models.glm5next.common.model import Glm5NextForCausalLM
    from vllm.platforms.interface import Platform
    from vllm.utils.math_utils import cdiv, round_up
    from vllm.v1.attention.backends.mla.flashmla_sparse import FlashMLASparseBackend
    from vllm.v1.attention.backends.mla.indexer import (
        Glm5NextIndexerBackend,
        KpoolTailBackend,
    )
    from vllm.v1.core import kv_cache_planning as planning
    from vllm.v1.core import kv_cache_utils as utils
    from vllm.v1.kv_cache_interface import (
        CircularBufferSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
        SparseCacheRole,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    if vllm.__version__ != VLLM_VERSION_EXPECTED:
        print(f"warning: vLLM {vllm.__version__}, goldens are for 0.33.0", file=sys.stderr)
    return NS(**locals())


def make_config(v, case):
    """A minimal stand-in for VllmConfig with exactly the fields vLLM's planning reads."""
    cache = NS(
        block_size=case["block_size"],
        user_specified_block_size=True,
        cache_dtype=case["kv_dtype"],
        mamba_cache_mode="none",
        mamba_cache_dtype="auto",
        mamba_ssm_cache_dtype="auto",
        mamba_page_size_padded=None,
        mamba_block_size=case["max_model_len"],
        num_gpu_blocks_override=None,
        kv_cache_dtype_skip_layers=None,
        get_resolved_kv_cache_layout=lambda: v.KVCacheLayout.BLHNC,
    )
    hf = v.Glm5NextTextConfig()
    model = NS(
        max_model_len=case["max_model_len"],
        original_max_model_len=case["max_model_len"],
        dtype=v.torch.bfloat16,
        use_mla=True,
        is_hybrid=True,
        architecture="Glm5NextForCausalLM",
        hf_text_config=hf,
        supports_kv_cache_grouping=False,
        get_num_kv_heads=lambda pc: 1,
        get_head_size=lambda: hf.kv_lora_rank + hf.qk_rope_head_dim,
    )
    return NS(
        cache_config=cache,
        model_config=model,
        scheduler_config=NS(
            disable_hybrid_kv_cache_manager=False,
            max_num_batched_tokens=case["max_in_flight_tokens"],
        ),
        attention_config=NS(hisparse_config=None),
        parallel_config=NS(
            tensor_parallel_size=case["tp"],
            decode_context_parallel_size=1,
            pipeline_parallel_size=1,
        ),
        speculative_config=NS(num_speculative_tokens=case["num_speculative_tokens"]),
        num_speculative_tokens=case["num_speculative_tokens"],
        max_in_flight_tokens=case["max_in_flight_tokens"],
        num_prefill_lookahead_tokens=0,
    )


@contextmanager
def _no_current_config():
    yield


def align_block_size(v, cfg, case) -> None:
    """Run vLLM's Platform._align_hybrid_block_size on the stand-in config."""
    backends = [v.FlashMLASparseBackend, v.Glm5NextIndexerBackend, v.KpoolTailBackend]
    if not case["indexer_block_alignment"]:
        backends = [v.FlashMLASparseBackend, v.KpoolTailBackend]
    v.Platform._find_non_ssm_backends = classmethod(lambda cls, vc: list(backends))
    v.ModelRegistry.resolve_model_cls = lambda *a, **k: (v.Glm5NextForCausalLM, "glm5next")
    v.vllm_config_mod.set_current_vllm_config = lambda vc: _no_current_config()
    v.indexer_mod.get_current_vllm_config = lambda: cfg
    v.Platform._align_hybrid_block_size.__func__(v.Platform, cfg, backends[0])


def build_specs(v, cfg, case) -> dict:
    hf = cfg.model_config.hf_text_config
    torch = v.torch
    bs = cfg.cache_config.block_size
    n = case["num_speculative_tokens"]
    kv = case["kv_dtype"]
    quant = kv != "auto"
    mla_dtype = torch.uint8 if quant else torch.bfloat16
    cache_str = "fp8_ds_mla" if quant else "auto"
    specs: dict = {}
    kpool = hf.index_kpool
    span = kpool + n
    ring = kpool * (1 << (v.cdiv(span, kpool) - 1).bit_length())
    shapes = v.Glm5NextForCausalLM.get_mamba_state_shape_from_config(cfg)
    dtypes = v.Glm5NextForCausalLM.get_mamba_state_dtype_from_config(cfg)
    for i, lt in enumerate(hf.layer_types):
        if lt == "indexed_attention":
            specs[f"model.layers.{i}.self_attn.indexer.k_cache"] = v.MLAAttentionSpec(
                block_size=bs, num_kv_heads=1, max_tp_shards=1,
                head_size=hf.index_head_dim + hf.index_head_dim // 128 * 4,
                dtype=torch.uint8, cache_role=v.SparseCacheRole.INDEXER,
                tokens_per_state=kpool,
            )
            specs[f"model.layers.{i}.self_attn.indexer.tail_cache"] = v.CircularBufferSpec(
                block_size=ring, num_kv_heads=2, head_size=hf.index_head_dim,
                head_size_v=0, dtype=torch.bfloat16, dcp_sharded=False,
            )
            specs[f"model.layers.{i}.self_attn.mla_attn"] = v.MLAAttentionSpec(
                block_size=bs, num_kv_heads=1, max_tp_shards=1,
                head_size=hf.kv_lora_rank + hf.qk_rope_head_dim, dtype=mla_dtype,
                cache_dtype_str=cache_str,
                state_content_bytes={"fp8_ds_mla": 656}.get(cache_str),
                topk_buffer_width=v.round_up(hf.index_topk + kpool - 1, 128),
                is_index_group_leader=True,
            )
        else:
            specs[f"model.layers.{i}.self_attn"] = v.MambaSpec(
                block_size=case["max_model_len"], shapes=shapes, dtypes=dtypes,
                page_size_padded=cfg.cache_config.mamba_page_size_padded,
                num_speculative_blocks=n,
            )
    heads = max(case["drafter_kv_heads"] // case["tp"], 1)
    sw_dtype = torch.uint8 if quant else torch.bfloat16
    sw_bs = case["drafter_block_size"] or bs // 16 * 16
    for j in range(case["drafter_layers"]):
        specs[f"drafter.layers.{j}.self_attn.attn"] = v.SlidingWindowSpec(
            block_size=sw_bs, num_kv_heads=heads, head_size=case["drafter_head_dim"],
            dtype=sw_dtype, sliding_window=case["drafter_window"],
        )
    return specs


def kind_of(v, spec) -> str:
    first = getattr(spec, "first_spec", spec)
    if isinstance(first, v.MambaSpec):
        return "state"
    if isinstance(first, v.CircularBufferSpec):
        return "ring_buffer"
    if isinstance(first, v.SlidingWindowSpec):
        return "sliding_window"
    return "full"


def plan(v, case) -> dict:
    cfg = make_config(v, case)
    align_block_size(v, cfg, case)
    specs = build_specs(v, cfg, case)
    groups = v.planning.get_kv_cache_groups(cfg, dict(specs))
    bpb = v.planning._pool_bytes_per_block(cfg, groups)
    num_blocks = case["kv_cache_memory_bytes"] // bpb
    out_groups = []
    for g in groups:
        spec = g.kv_cache_spec
        pages = [v.planning._get_per_layer_spec(g, n).page_size_bytes for n in g.layer_names]
        out_groups.append({
            "kind": kind_of(v, spec),
            "block_size": spec.block_size,
            "num_layers": len(g.layer_names),
            "bytes": sum(pages),
            "blocks_per_request": v.cdiv(spec.max_memory_usage_bytes(cfg), spec.page_size_bytes),
        })
    kvc = NS(kv_cache_groups=groups, num_blocks=num_blocks, hisparse_host_num_blocks=None)
    tokens, conc = v.utils.get_kv_cache_capacity(cfg, kvc)
    per_req = sum(g["blocks_per_request"] for g in out_groups)
    needed = bpb * per_req
    usable_memory = num_blocks * bpb - bpb
    return {
        "effective_block_size": cfg.cache_config.block_size,
        "mamba_page_size_padded": cfg.cache_config.mamba_page_size_padded,
        "groups": out_groups,
        "bytes_per_block": bpb,
        "num_blocks": num_blocks,
        "blocks_per_request": per_req,
        "max_concurrency": conc,
        "kv_cache_tokens": tokens,
        "starts": needed <= usable_memory,
    }


def cases() -> list[dict]:
    base = dict(
        num_speculative_tokens=7, drafter_layers=5, drafter_kv_heads=8,
        drafter_head_dim=128, drafter_window=2048,
    )
    out = []
    grid = itertools.product(
        [1, 2, 4, 8], ["auto", "fp8"], [1024, 1536, 2304], [None, 16], [True, False],
        [8192, 16384],
    )
    for tp, kv, bs, dbs, ialign, inflight in grid:
        out.append(dict(
            base, tp=tp, kv_dtype=kv, block_size=bs, drafter_block_size=dbs,
            indexer_block_alignment=ialign, max_in_flight_tokens=inflight,
            max_model_len=262_144, kv_cache_memory_bytes=24_174_526_464,
        ))
    # The card's 2x DGX Spark serve: TP 2, fp8, 1M context, KV_CACHE_MEM 9,663,676,416.
    for kv, dbs, ialign, inflight in itertools.product(
        ["auto", "fp8"], [None, 16], [True, False], [8192, 16384]
    ):
        out.append(dict(
            base, tp=2, kv_dtype=kv, block_size=2304, drafter_block_size=dbs,
            indexer_block_alignment=ialign, max_in_flight_tokens=inflight,
            max_model_len=1_048_576, kv_cache_memory_bytes=9_663_676_416,
        ))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    v = _imports()
    rows = []
    for case in cases():
        try:
            rows.append({"input": case, "vllm": plan(v, case)})
        except Exception as e:  # a refusal is a golden too
            rows.append({"input": case, "error": f"{type(e).__name__}: {e}"})
    doc = {
        "reference": f"vllm-{v.vllm.__version__}",
        "generator": "recipes/kv_planning_golden.py",
        "cases": rows,
    }
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    errs = sum("error" in r for r in rows)
    print(f"wrote {len(rows)} cases ({errs} refused) to {args.out}")


if __name__ == "__main__":
    main()
