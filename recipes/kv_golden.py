#!/usr/bin/env python3
"""Golden KV-cache traces from vLLM 0.33.0's real ``KVCacheManager``.

Builds ``vllm.v1.core.kv_cache_manager.KVCacheManager`` (prefix caching off,
no EAGLE, no stats) for a layout, replays operation traces through it and
records what vLLM answers. The layout / operation / output formats are the
ones of ``docs/kv-replay-format.md``; ``speclab kv replay`` (the Rust port)
must reproduce every recorded output exactly.

Modes::

    # regenerate every golden (deterministic for a given --seed)
    python recipes/kv_golden.py --out tests/golden/kv --seed 0

    # replay a layout JSON + ops JSONL through vLLM, print output JSON lines
    python recipes/kv_golden.py --layout L.json --ops O.jsonl

    # re-replay existing goldens from scratch and compare with their results
    python recipes/kv_golden.py --check tests/golden/kv

vLLM code this mirrors / drives (0.33.0):

* ``vllm/v1/core/kv_cache_manager.py``  ``KVCacheManager.allocate_slots``/``free``
* ``vllm/v1/core/kv_cache_coordinator.py`` ``KVCacheCoordinatorNoPrefixCache``
* ``vllm/v1/core/single_type_kv_cache_manager.py`` ``FullAttentionManager``,
  ``SlidingWindowManager``, ``CircularBufferManager``, ``MambaManager``,
  ``get_manager_for_kv_cache_spec`` (admission cap), ``register_all_kvcache_specs``
* ``vllm/v1/core/block_pool.py`` ``BlockPool`` / ``FreeKVCacheBlockQueue``
* ``vllm/v1/kv_cache_interface.py`` ``KVCacheConfig``, ``KVCacheGroupSpec``,
  ``FullAttentionSpec``, ``SlidingWindowSpec``, ``CircularBufferSpec``, ``MambaSpec``
* ``vllm/v1/request.py`` ``RequestStatus``

The only non-vLLM behaviour is the ``window_plus_two`` sliding-window cap,
which has no vLLM implementation: see ``_window_plus_two_class`` below. Goldens
that use it say ``"reference": "vllm-0.33.0+window_plus_two-patch"``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
from typing import Any

# Quieten vLLM's logger before it is imported (lazily, in _vllm()).
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

VLLM_VERSION_EXPECTED = "0.33.0"

_V: dict[str, Any] = {}


def _vllm() -> dict[str, Any]:
    """Import the few vLLM pieces we use (lazily: the import takes seconds)."""
    if _V:
        return _V
    import torch
    import vllm
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.single_type_kv_cache_manager import SlidingWindowManager
    from vllm.v1.kv_cache_interface import (
        CircularBufferSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )
    from vllm.v1.request import RequestStatus

    if vllm.__version__ != VLLM_VERSION_EXPECTED:
        print(
            f"warning: vLLM {vllm.__version__} installed, goldens are for "
            f"{VLLM_VERSION_EXPECTED}",
            file=sys.stderr,
        )
    _V.update(
        torch=torch,
        version=vllm.__version__,
        KVCacheManager=KVCacheManager,
        SlidingWindowManager=SlidingWindowManager,
        CircularBufferSpec=CircularBufferSpec,
        FullAttentionSpec=FullAttentionSpec,
        KVCacheConfig=KVCacheConfig,
        KVCacheGroupSpec=KVCacheGroupSpec,
        MambaSpec=MambaSpec,
        SlidingWindowSpec=SlidingWindowSpec,
        RequestStatus=RequestStatus,
    )
    return _V


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------
# window_plus_two: the model card's sliding-window fix (NOT in vLLM)
# ---------------------------------------------------------------------------

_WP2: list[type] = []


def _window_plus_two_class() -> type:
    """``SlidingWindowManager`` patched to the ``window_plus_two`` cap policy.

    The group behaves as a per-request ring of at most
    ``C = cdiv(sliding_window, block_size) + 2`` physical blocks:

    * admission (``apply_admission_cap=True``) and execution alike need
      ``min(cdiv(num_tokens, block_size), C)`` blocks; the number to allocate is
      ``max(0, that - blocks currently held)`` (the ring never holds null
      blocks, so "held" is ``len(req_to_blocks[req])``);
    * ``remove_skipped_blocks`` does nothing (the ring reuses its own slots);
    * ``allocate_new_blocks`` appends the newly allocated blocks and returns them;
    * ``free`` is the base class's: all held blocks, in reverse order.

    Everything else (block pool, coordinator, KVCacheManager) is vLLM 0.33.0.
    """
    if _WP2:
        return _WP2[0]
    base = _vllm()["SlidingWindowManager"]

    class WindowPlusTwoSlidingWindowManager(base):  # type: ignore[misc, valid-type]
        ring_blocks: int

        def _ring_need(self, num_tokens: int) -> int:
            return min(cdiv(num_tokens, self.block_size), self.ring_blocks)

        def _held(self, request_id: str) -> int:
            return sum(
                not b.is_null for b in self.req_to_blocks.get(request_id, ())
            )

        def get_num_blocks_to_allocate(
            self,
            request_id,
            num_tokens,
            new_computed_blocks,
            total_computed_tokens,
            num_local_computed_tokens,
            num_tokens_main_model,
            apply_admission_cap=False,
            prefill_end=0,
        ):
            assert len(new_computed_blocks) == 0  # prefix caching is off
            return max(0, self._ring_need(num_tokens) - self._held(request_id))

        def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model):
            n = max(0, self._ring_need(num_tokens) - self._held(request_id))
            if n == 0:
                return []
            new_blocks = self.block_pool.get_new_blocks(n)
            self.req_to_blocks[request_id].extend(new_blocks)
            return new_blocks

        def remove_skipped_blocks(
            self, request_id, processed_computed_tokens, num_prompt_tokens=None
        ):
            return None

    _WP2.append(WindowPlusTwoSlidingWindowManager)
    return WindowPlusTwoSlidingWindowManager


# ---------------------------------------------------------------------------
# Layout -> vLLM KVCacheManager
# ---------------------------------------------------------------------------


def group_block_size(layout: dict, g: dict) -> int:
    if g["kind"] == "state":
        return int(g.get("block_size") or layout["max_model_len"])
    return int(g["block_size"])


def uses_patch(layout: dict) -> bool:
    return any(
        g["kind"] == "sliding_window" and g.get("cap", "upstream") == "window_plus_two"
        for g in layout["groups"]
    )


def reference_of(layout: dict) -> str:
    base = f"vllm-{VLLM_VERSION_EXPECTED}"
    return base + "+window_plus_two-patch" if uses_patch(layout) else base


def build_manager(layout: dict):
    """A vLLM ``KVCacheManager`` for ``layout`` (format: docs/kv-replay-format.md)."""
    V = _vllm()
    torch = V["torch"]
    mml = int(layout["max_model_len"])
    attn = dict(num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    groups = []
    block_sizes = []
    for g in layout["groups"]:
        kind = g["kind"]
        bs = group_block_size(layout, g)
        block_sizes.append(bs)
        if kind == "full":
            spec = V["FullAttentionSpec"](block_size=bs, **attn)
        elif kind == "sliding_window":
            spec = V["SlidingWindowSpec"](
                block_size=bs,
                sliding_window=int(g["sliding_window"]),
                extra_retained_tokens=int(g.get("extra_retained_tokens", 0)),
                **attn,
            )
        elif kind == "ring_buffer":
            spec = V["CircularBufferSpec"](block_size=bs, **attn)
        elif kind == "state":
            spec = V["MambaSpec"](
                block_size=bs,
                shapes=((1, 128),),
                dtypes=(torch.float32,),
                mamba_cache_mode="none",
                num_speculative_blocks=int(g.get("num_speculative_blocks", 0)),
            )
        else:
            raise ValueError(f"unknown group kind {kind!r}")
        groups.append(V["KVCacheGroupSpec"](layer_names=[g["name"]], kv_cache_spec=spec))
    cfg = V["KVCacheConfig"](
        num_blocks=int(layout["num_blocks"]), kv_cache_tensors=[], kv_cache_groups=groups
    )
    # Scheduling granularity: the LCM of all group block sizes (what vLLM's
    # engine core resolves); hash granularity is irrelevant with caching off,
    # it only has to divide it.
    lcm = math.lcm(*block_sizes)
    mift = layout.get("max_in_flight_tokens")
    mgr = V["KVCacheManager"](
        kv_cache_config=cfg,
        max_model_len=mml,
        scheduler_block_size=lcm,
        hash_block_size=lcm,
        max_in_flight_tokens=None if mift is None else int(mift),
        enable_caching=False,
        use_eagle=False,
        log_stats=False,
        watermark=float(layout.get("watermark", 0.0)),
    )
    wp2 = None
    for g, m in zip(layout["groups"], mgr.coordinator.single_type_managers):
        if g["kind"] != "sliding_window":
            continue
        cap = g.get("cap", "upstream")
        assert type(m) is V["SlidingWindowManager"], type(m)
        if cap == "upstream":
            pass  # as constructed by get_manager_for_kv_cache_spec
        elif cap == "none":
            # The uncapped build of vLLM issue #55800.
            m.max_admission_blocks_per_request = None
        elif cap == "window_plus_two":
            wp2 = wp2 or _window_plus_two_class()
            m.__class__ = wp2
            m.ring_blocks = cdiv(m.sliding_window, m.block_size) + 2
        else:
            raise ValueError(f"unknown cap {cap!r}")
    return mgr


class Req:
    """The attributes of ``vllm.v1.request.Request`` that ``KVCacheManager``
    reads with prefix caching off (allocate_slots / coordinator / managers)."""

    __slots__ = (
        "request_id",
        "num_prompt_tokens",
        "num_tokens",
        "num_computed_tokens",
        "status",
        "num_in_flight_tokens",
        "block_hashes",
        "shared_prefix_boundary",
        "skip_reading_prefix_cache",
        "num_preemptions",
    )

    def __init__(self, request_id: str, prompt_len: int, status) -> None:
        self.request_id = request_id
        self.num_prompt_tokens = prompt_len
        self.num_tokens = prompt_len
        self.num_computed_tokens = 0
        self.status = status
        self.num_in_flight_tokens = 0
        self.block_hashes: list = []
        self.shared_prefix_boundary = 0
        self.skip_reading_prefix_cache = False
        self.num_preemptions = 0


class Replayer:
    """Applies operations (docs/kv-replay-format.md) to a vLLM KVCacheManager."""

    def __init__(self, layout: dict) -> None:
        self.layout = layout
        self.mgr = build_manager(layout)
        self.reqs: dict[str, Req] = {}
        S = _vllm()["RequestStatus"]
        self.WAITING, self.RUNNING, self.PREEMPTED = S.WAITING, S.RUNNING, S.PREEMPTED

    def free_blocks(self) -> int:
        return self.mgr.block_pool.get_num_free_blocks()

    def apply(self, i: int, op: dict) -> dict:
        kind = op["op"]
        out: dict[str, Any] = {"i": i, "op": kind}
        if kind == "add":
            rid = op["req"]
            assert rid not in self.reqs, f"op {i}: duplicate request {rid}"
            self.reqs[rid] = Req(rid, int(op["prompt_len"]), self.WAITING)
        elif kind == "allocate":
            r = self.reqs[op["req"]]
            res = self.mgr.allocate_slots(
                r,
                int(op["num_new_tokens"]),
                num_lookahead_tokens=int(op.get("lookahead", 0)),
                full_sequence_must_fit=bool(op.get("must_fit", False)),
                has_scheduled_reqs=bool(op.get("has_scheduled_reqs", True)),
            )
            if res is None:
                out["blocks"] = None
            else:
                out["blocks"] = [list(ids) for ids in res.get_block_ids()]
                if r.status in (self.WAITING, self.PREEMPTED):
                    r.status = self.RUNNING
        elif kind == "computed":
            self.reqs[op["req"]].num_computed_tokens += int(op["n"])
        elif kind == "append":
            self.reqs[op["req"]].num_tokens += int(op["n"])
        elif kind == "preempt":
            r = self.reqs[op["req"]]
            self.mgr.free(r)
            r.num_computed_tokens = 0
            r.status = self.PREEMPTED
            r.num_preemptions += 1
        elif kind == "free":
            r = self.reqs.pop(op["req"])
            self.mgr.free(r)
        else:
            raise ValueError(f"op {i}: unknown op {kind!r}")
        out["free"] = self.free_blocks()
        return out


def replay(layout: dict, ops: list[dict]) -> list[dict]:
    rp = Replayer(layout)
    return [rp.apply(i, op) for i, op in enumerate(ops)]


# ---------------------------------------------------------------------------
# Trace generator: a plausible chunked-prefill + spec-decode scheduler
# ---------------------------------------------------------------------------


def _op(kind: str, req: str, **fields) -> dict:
    """An op object with default-valued fields left out (see the format doc)."""
    op: dict[str, Any] = {"op": kind, "req": req}
    defaults = {"lookahead": 0, "must_fit": False, "has_scheduled_reqs": True}
    for k, v in fields.items():
        if k in defaults and v == defaults[k]:
            continue
        op[k] = v
    return op


class SimReq:
    __slots__ = ("rid", "prompt_len", "num_tokens", "computed", "status",
                 "max_outputs", "outputs", "k_eff", "fails")

    def __init__(self, rid: str, prompt_len: int, max_outputs: int) -> None:
        self.rid = rid
        self.prompt_len = prompt_len
        self.num_tokens = prompt_len
        self.computed = 0
        self.status = "waiting"  # waiting | running | preempted
        self.max_outputs = max_outputs
        self.outputs = 0
        self.k_eff = 0
        self.fails = 0


class Sim:
    """Generates only ops vLLM accepts, executing each one as it is emitted.

    One scheduler step: running requests first (FCFS), each gets a prefill chunk
    (chunked prefill, <= the remaining token budget) or a decode step of
    ``1 + k`` tokens (``k`` draft tokens, ``lookahead`` in {0, k, k+1}); on a
    failed allocation a running request preempts the last running request
    (possibly itself), vLLM-style. Then waiting/preempted requests are admitted
    with ``must_fit`` (mostly true) until one fails or the budget is spent.
    After the step: ``computed -rejected`` and ``append accepted+1`` per decode,
    ``append 1`` after a final prefill chunk, ``free`` when finished. Requests
    arrive at random, are occasionally preempted or aborted (``free`` while
    waiting), and a request that cannot be admitted into an idle pool (the
    wedge) is aborted after a few tries.
    """

    def __init__(self, name: str, layout: dict, params: dict, seed: int) -> None:
        self.name = name
        self.layout = layout
        self.p = params
        self.rng = random.Random(f"{seed}/{name}")
        self.rp = Replayer(layout)
        self.ops: list[dict] = []
        self.results: list[dict] = []
        self.reqs: dict[str, SimReq] = {}
        self.running: list[SimReq] = []
        self.waiting: list[SimReq] = []
        self.next_id = 0
        self.stats = dict(allocs=0, fails=0, must_fit_fails=0, running_fails=0,
                          free_rose_on_fail=0, exceptions=0, preempts=0,
                          aborts=0, wedge_aborts=0)
        self.exception_msgs: list[str] = []

    # -- emission ---------------------------------------------------------
    def emit(self, op: dict) -> dict | None:
        """Run ``op`` through vLLM; keep it only if vLLM did not raise."""
        before = self.rp.free_blocks()
        try:
            res = self.rp.apply(len(self.ops), op)
        except Exception as e:  # noqa: BLE001 - record, rebuild, skip the op
            self.stats["exceptions"] += 1
            self.exception_msgs.append(f"{type(e).__name__}: {e} on {op}")
            # The failed call may have mutated vLLM state: rebuild it from the
            # ops kept so far so the golden stays replayable from scratch.
            self.rp = Replayer(self.layout)
            for i, o in enumerate(self.ops):
                self.rp.apply(i, o)
            return None
        self.ops.append(op)
        self.results.append(res)
        if op["op"] == "allocate":
            self.stats["allocs"] += 1
            if res["blocks"] is None:
                self.stats["fails"] += 1
                if op.get("must_fit"):
                    self.stats["must_fit_fails"] += 1
                elif self.rp.reqs[op["req"]].status == self.rp.RUNNING:
                    self.stats["running_fails"] += 1
                if res["free"] > before:
                    self.stats["free_rose_on_fail"] += 1
        return res

    # -- request lifecycle ------------------------------------------------
    def add(self, prompt_len: int | None = None, max_outputs: int | None = None) -> SimReq:
        p, rng = self.p, self.rng
        mml = self.layout["max_model_len"]
        if prompt_len is None:
            u = rng.random()
            lo, hi = p["prompt"]
            p_edge, p_long = p.get("p_edge", 0.03), p.get("p_long", 0.1)
            if u < p_edge:
                # Runs into max_model_len: exercises the min(..., max_model_len)
                # clamps of allocate_slots with lookahead past the end.
                prompt_len = mml - rng.randint(1, 3 * p["k"] + 4)
                max_outputs = mml
            elif u < p_edge + p_long:
                prompt_len = rng.randint(min(hi, mml - 1), mml - 1)
            elif u < p_edge + p_long + 0.05:
                prompt_len = rng.randint(1, 8)
            else:
                prompt_len = rng.randint(lo, hi)
            # vLLM's scheduler caps num_new_tokens at max_model_len - 1 -
            # num_computed_tokens: prompts stay below max_model_len and
            # num_tokens reaches it at most.
            prompt_len = max(1, min(prompt_len, mml - 1))
        if max_outputs is None:
            max_outputs = rng.randint(1, p.get("max_outputs", 40))
        rid = f"r{self.next_id}"
        self.next_id += 1
        r = SimReq(rid, prompt_len, max_outputs)
        self.emit(_op("add", rid, prompt_len=prompt_len))
        self.reqs[rid] = r
        self.waiting.append(r)
        return r

    def preempt(self, r: SimReq) -> None:
        self.emit(_op("preempt", r.rid))
        self.stats["preempts"] += 1
        r.computed = 0
        r.status = "preempted"
        self.running.remove(r)
        self.waiting.insert(0, r)  # vLLM prepends preempted requests

    def finish(self, r: SimReq) -> None:
        self.emit(_op("free", r.rid))
        del self.reqs[r.rid]
        if r in self.running:
            self.running.remove(r)
        if r in self.waiting:
            self.waiting.remove(r)

    def lookahead(self, decode: bool) -> int:
        k = self.p["k"]
        if decode:
            w = self.p.get("la_weights", (1, 1, 1))
        else:
            w = self.p.get("la_prefill_weights", (4, 1, 1))
        return self.rng.choices((0, k, k + 1), weights=w)[0]

    def plan(self, r: SimReq, budget: int) -> tuple[int, bool]:
        """(num_new_tokens, is_decode) for ``r`` under ``budget`` (0 = skip)."""
        mml = self.layout["max_model_len"]
        remaining = r.num_tokens - r.computed
        if remaining > 1 or r.outputs == 0:
            chunk = min(remaining, budget)
            if chunk > 1 and self.rng.random() < self.p.get("p_short_chunk", 0.15):
                chunk = self.rng.randint(1, chunk)
            return chunk, False
        assert remaining == 1, (r.rid, r.num_tokens, r.computed)
        k_eff = min(self.p["k"], max(0, mml - r.num_tokens - 1), budget - 1)
        if k_eff < 0:
            return 0, True
        r.k_eff = k_eff
        return 1 + k_eff, True

    def allocate(self, r: SimReq, n: int, decode: bool, must_fit: bool,
                 has_sched: bool) -> bool:
        if self.rng.random() < self.p.get("p_flip_sched", 0.05):
            has_sched = not has_sched
        res = self.emit(_op("allocate", r.rid, num_new_tokens=n,
                            lookahead=self.lookahead(decode),
                            must_fit=must_fit, has_scheduled_reqs=has_sched))
        return res is not None and res["blocks"] is not None

    def step(self) -> None:
        p, rng = self.p, self.rng
        budget = p["mnbt"]
        scheduled: list[tuple[SimReq, int, bool]] = []
        preempted_this_step = False
        # 1. running requests
        for r in list(self.running):
            if r not in self.running:
                continue  # preempted as a victim earlier in this step
            if budget <= 0:
                break
            n, decode = self.plan(r, budget)
            if n <= 0:
                continue
            while True:
                if self.allocate(r, n, decode, False, bool(scheduled)):
                    scheduled.append((r, n, decode))
                    budget -= n
                    self.emit(_op("computed", r.rid, n=n))
                    r.computed += n
                    break
                # Allocation failed: preempt the last running request.
                if rng.random() < p.get("p_wait_on_fail", 0.2):
                    break  # leave it for a later step
                victim = self.running[-1]
                if any(victim is s for s, _, _ in scheduled):
                    # vLLM never preempts an already-scheduled request here;
                    # preempt ourselves instead.
                    victim = r
                self.preempt(victim)
                preempted_this_step = True
                if victim is r:
                    break
        # 2. waiting / preempted requests
        if not preempted_this_step:
            for r in list(self.waiting):
                if budget <= 0 or len(self.running) >= p.get("max_running", 8):
                    break
                n, decode = self.plan(r, budget)
                if n <= 0:
                    break
                must_fit = rng.random() < p.get("p_must_fit", 0.85)
                if self.allocate(r, n, decode, must_fit, bool(scheduled)):
                    r.status = "running"
                    r.fails = 0
                    self.waiting.remove(r)
                    self.running.append(r)
                    scheduled.append((r, n, decode))
                    budget -= n
                    self.emit(_op("computed", r.rid, n=n))
                    r.computed += n
                else:
                    r.fails += 1
                    break
        # 3. step results
        mml = self.layout["max_model_len"]
        for r, n, decode in scheduled:
            if r.rid not in self.reqs or r.status != "running":
                continue
            if decode:
                k_eff = r.k_eff
                accepted = min(k_eff, int(rng.betavariate(2, 1.3) * (k_eff + 1)))
                rejected = k_eff - accepted
                if rejected:
                    self.emit(_op("computed", r.rid, n=-rejected))
                    r.computed -= rejected
                self.emit(_op("append", r.rid, n=accepted + 1))
                r.num_tokens += accepted + 1
                r.outputs += accepted + 1
            elif r.computed == r.num_tokens:
                self.emit(_op("append", r.rid, n=1))
                r.num_tokens += 1
                r.outputs += 1
            else:
                continue
            if r.outputs >= r.max_outputs or r.num_tokens >= mml:
                self.finish(r)
        # 4. wedge: nothing runs and the head request keeps failing admission
        if not self.running and self.waiting and not scheduled:
            head = self.waiting[0]
            if head.fails >= p.get("wedge_tries", 3):
                self.stats["wedge_aborts"] += 1
                self.finish(head)
        # 5. random events
        if self.running and rng.random() < p.get("p_preempt", 0.03):
            self.preempt(rng.choice(self.running))
        if self.waiting and rng.random() < p.get("p_abort", 0.01):
            self.stats["aborts"] += 1
            self.finish(rng.choice(self.waiting))
        if (len(self.reqs) < p.get("max_live", 6)
                and rng.random() < p.get("p_add", 0.6)):
            self.add()

    def drain(self) -> None:
        for r in list(self.reqs.values()):
            self.finish(r)

    def edge_first(self) -> None:
        """One request alone that decodes up to max_model_len (lookahead past
        the end is clamped by vLLM), or is aborted if the pool cannot admit it."""
        mml = self.layout["max_model_len"]
        r = self.add(prompt_len=mml - (self.p["k"] + 2 + self.rng.randint(0, 3)),
                     max_outputs=mml)
        p_add = self.p.get("p_add", 0.6)
        self.p["p_add"] = 0.0
        for _ in range(400):
            if r.rid not in self.reqs:
                break
            self.step()
        self.p["p_add"] = p_add

    def run(self, n_ops: int, script=None) -> None:
        if script is not None:
            script(self)
        elif self.layout["max_model_len"] <= 40 * self.p["mnbt"]:
            self.edge_first()
        for _ in range(self.p.get("initial", 2)):
            self.add()
        while len(self.ops) < n_ops:
            self.step()
        self.drain()


# ---------------------------------------------------------------------------
# Layouts
# ---------------------------------------------------------------------------


def F(name, bs):
    return {"name": name, "kind": "full", "block_size": bs}


def SW(name, bs, window, cap, extra=0):
    return {"name": name, "kind": "sliding_window", "block_size": bs,
            "sliding_window": window, "extra_retained_tokens": extra, "cap": cap}


def ST(name, k, bs=None):
    g = {"name": name, "kind": "state"}
    if bs is not None:
        g["block_size"] = bs
    g["num_speculative_blocks"] = k
    return g


def RB(name, bs):
    return {"name": name, "kind": "ring_buffer", "block_size": bs}


def L(num_blocks, mml, groups, mift=None, wm=0.0):
    return {"num_blocks": num_blocks, "max_model_len": mml,
            "max_in_flight_tokens": mift, "watermark": wm, "groups": groups}


GLM_MML = 262144


def glm_layout(cap: str) -> dict:
    """GLM-5.3-Flash + DFlash2 (the card's wedge configuration)."""
    return L(1012, GLM_MML, [
        F("target_full", 2304),
        RB("indexer_ring", 2304),
        ST("kda0", 7, GLM_MML),
        ST("kda1", 7, GLM_MML),
        ST("kda2", 7, GLM_MML),
        ST("kda3", 7, GLM_MML),
        SW("drafter_swa", 16, 2048, cap),
    ], mift=8192)


def glm_script(sim: Sim) -> None:
    """Admit each wedge prompt alone (must_fit 8192 chunk, lookahead 0, then
    the rest), decode a few DFlash2 steps, free; then two at once."""
    k = sim.p["k"]
    for prompt in (15523, 15536, 15537, 15556):
        r = sim.add(prompt_len=prompt, max_outputs=1)
        sim.waiting.remove(r)
        res = sim.emit(_op("allocate", r.rid, num_new_tokens=8192, lookahead=0,
                           must_fit=True, has_scheduled_reqs=False))
        if res["blocks"] is not None:
            sim.emit(_op("computed", r.rid, n=8192))
            rest = prompt - 8192
            res = sim.emit(_op("allocate", r.rid, num_new_tokens=rest, lookahead=0,
                               has_scheduled_reqs=False))
            if res["blocks"] is not None:
                sim.emit(_op("computed", r.rid, n=rest))
                sim.emit(_op("append", r.rid, n=1))
                for la, acc in ((0, 7), (k, 3), (k + 1, 0), (k, 5)):
                    res = sim.emit(_op("allocate", r.rid, num_new_tokens=1 + k,
                                       lookahead=la, has_scheduled_reqs=False))
                    if res["blocks"] is None:
                        break
                    sim.emit(_op("computed", r.rid, n=1 + k))
                    if k - acc:
                        sim.emit(_op("computed", r.rid, n=-(k - acc)))
                    sim.emit(_op("append", r.rid, n=acc + 1))
        sim.emit(_op("free", r.rid))
        del sim.reqs[r.rid]
    # Two wedge-sized prompts at once: the second is admitted while the first
    # is mid-prefill (has_scheduled_reqs true), then both try to continue.
    a = sim.add(prompt_len=15523, max_outputs=1)
    b = sim.add(prompt_len=15536, max_outputs=1)
    sim.waiting.remove(a)
    sim.waiting.remove(b)
    ra = sim.emit(_op("allocate", a.rid, num_new_tokens=8192, must_fit=True,
                      has_scheduled_reqs=False))
    if ra["blocks"] is not None:
        sim.emit(_op("computed", a.rid, n=8192))
    rb = sim.emit(_op("allocate", b.rid, num_new_tokens=8192, must_fit=True))
    if rb["blocks"] is not None:
        sim.emit(_op("computed", b.rid, n=8192))
    if ra["blocks"] is not None:
        sim.emit(_op("allocate", a.rid, num_new_tokens=15523 - 8192,
                     has_scheduled_reqs=False))
    if rb["blocks"] is not None:
        sim.emit(_op("allocate", b.rid, num_new_tokens=15536 - 8192))
    for r in (a, b):
        sim.emit(_op("free", r.rid))
        del sim.reqs[r.rid]


# name -> (layout, sim params, n_ops, script)
def golden_specs() -> list[tuple[str, dict, dict, int, Any]]:
    S = []

    def add(name, layout, n_ops=300, script=None, **params):
        params.setdefault("k", 3)
        S.append((name, layout, params, n_ops, script))

    # --- full attention only -------------------------------------------
    add("full_bs16", L(64, 2048, [F("attn", 16)]), mnbt=256, prompt=(16, 400))
    add("full_bs1_wm", L(100, 512, [F("attn", 1)], wm=0.01),
        mnbt=32, prompt=(1, 60), k=2, max_outputs=20, p_long=0.2, p_add=0.8)
    add("full_bs4_mift", L(150, 1024, [F("attn", 4)], mift=512),
        mnbt=128, prompt=(8, 200), k=4)
    add("full_bs256_wm5", L(30, 8192, [F("attn", 256)], wm=0.05),
        mnbt=1024, prompt=(100, 2500), k=5, max_outputs=60)
    # --- sliding window only, all three caps -----------------------------
    for cap in ("none", "upstream", "window_plus_two"):
        add(f"swa_bs16_w128_{cap}", L(48, 4096, [SW("swa", 16, 128, cap)], mift=512),
            mnbt=256, prompt=(64, 900), p_long=0.08)
    add("swa_bs4_w64_extra16_upstream",
        L(90, 2048, [SW("swa", 4, 64, "upstream", extra=16)]),
        mnbt=64, prompt=(4, 300), k=2)
    add("swa_bs64_w1000_extra3_w2",
        L(50, 16384, [SW("swa", 64, 1000, "window_plus_two", extra=3)], mift=1024),
        mnbt=512, prompt=(200, 4000), k=4, max_outputs=80)
    # --- full + sliding window ----------------------------------------------
    for cap in ("upstream", "none", "window_plus_two"):
        add(f"full16_swa16_w256_{cap}",
            L(120, 8192, [F("full", 16), SW("swa", 16, 256, cap)], mift=1024),
            mnbt=512, prompt=(32, 1500), k=3)
    add("full64_swa16_w512_extra8_w2",
        L(140, 8192, [F("full", 64), SW("swa", 16, 512, "window_plus_two", extra=8)],
          mift=2048, wm=0.01),
        mnbt=1024, prompt=(64, 3000), k=4)
    add("full16_swa16_w128_upstream_wm10",
        L(100, 4096, [F("full", 16), SW("swa", 16, 128, "upstream")], wm=0.1),
        mnbt=256, prompt=(16, 800), k=2)
    add("multi_swa_mixed_caps",
        L(200, 4096, [SW("swa_small", 16, 64, "upstream"),
                      SW("swa_big", 16, 512, "none", extra=5), F("full", 16)],
          mift=256),
        mnbt=256, prompt=(16, 900), k=3)
    add("swa_bs1_w16_w2_full4",
        L(150, 1024, [SW("swa", 1, 16, "window_plus_two"), F("full", 4)]),
        mnbt=32, prompt=(1, 120), k=2, max_outputs=16)
    add("swa64_w2048_upstream_mift256",
        L(80, 16384, [SW("swa", 64, 2048, "upstream")], mift=256),
        mnbt=256, prompt=(256, 6000), k=1, p_long=0.05)
    # --- state (Mamba, mamba_cache_mode none) ------------------------------
    add("state_only_k0", L(6, 8192, [ST("ssm", 0)]),
        mnbt=2048, prompt=(1, 4000), k=0, max_live=16, max_running=16, p_add=1.0,
        p_must_fit=0.6, max_outputs=6, initial=6)
    add("state_only_k7", L(40, 8192, [ST("ssm", 7, 8192)]),
        mnbt=2048, prompt=(1, 4000), k=7, max_live=8, p_add=0.9, p_must_fit=0.6)
    add("full64_state_k3", L(60, 4096, [F("full", 64), ST("ssm", 3)]),
        mnbt=512, prompt=(16, 2000), k=3)
    add("swa16_2state_k5_upstream",
        L(90, 4096, [SW("swa", 16, 256, "upstream"), ST("s0", 5), ST("s1", 5)],
          mift=512),
        mnbt=512, prompt=(16, 2000), k=5)
    add("full16_state_k1_k2_k6",
        L(110, 2048, [F("full", 16), ST("a", 1), ST("b", 2, 2048), ST("c", 6)],
          wm=0.02),
        mnbt=256, prompt=(16, 900), k=6)
    # --- ring buffer ---------------------------------------------------------
    add("full256_ring256", L(40, 8192, [F("full", 256), RB("ring", 256)]),
        mnbt=1024, prompt=(64, 3000), k=4)
    add("ring64_swa64_w1024_none_state_k2",
        L(80, 8192, [RB("ring", 64), SW("swa", 64, 1024, "none"), ST("ssm", 2)],
          mift=1024),
        mnbt=1024, prompt=(64, 5000), k=2)
    add("state_k4_ring16_full16",
        L(90, 2048, [ST("s0", 4), ST("s1", 4), RB("ring", 16), F("full", 16)]),
        mnbt=256, prompt=(16, 900), k=4)
    # --- big blocks ------------------------------------------------------
    add("full2304_swa16_w2048_upstream",
        L(300, 65536, [F("full", 2304), SW("swa", 16, 2048, "upstream")], mift=8192),
        mnbt=8192, prompt=(1000, 12000), k=7, p_long=0.03, max_outputs=30)
    # GLM-shaped, scaled down (more churn per op than the real one)
    add("glm_scaled_upstream",
        L(200, 32768, [F("target_full", 256), RB("indexer_ring", 256),
                       ST("kda0", 7), ST("kda1", 7), ST("kda2", 7), ST("kda3", 7),
                       SW("drafter_swa", 16, 256, "upstream")], mift=1024),
        mnbt=1024, prompt=(64, 3000), k=7, max_live=5)
    add("glm_scaled_w2",
        L(200, 32768, [F("target_full", 256), RB("indexer_ring", 256),
                       ST("kda0", 7), ST("kda1", 7), ST("kda2", 7), ST("kda3", 7),
                       SW("drafter_swa", 16, 256, "window_plus_two")], mift=1024),
        mnbt=1024, prompt=(64, 3000), k=7, max_live=5)
    # --- the GLM-5.3-Flash + DFlash2 wedge layout, three caps --------------
    for cap in ("none", "upstream", "window_plus_two"):
        add(f"glm53_dflash2_wedge_{cap}", glm_layout(cap), n_ops=320,
            script=glm_script, mnbt=8192, prompt=(200, 16000), k=7,
            p_long=0.06, max_outputs=24, max_live=12, p_short_chunk=0.05,
            p_must_fit=0.75, p_add=0.8)
    return S


def generate(out_dir: str, seed: int, only: list[str] | None = None) -> None:
    os.makedirs(out_dir, exist_ok=True)
    V = _vllm()
    total_ops = 0
    total_bytes = 0
    for name, layout, params, n_ops, script in golden_specs():
        if only and name not in only:
            continue
        sim = Sim(name, layout, params, seed)
        sim.run(n_ops, script)
        # Self-check: a fresh replay reproduces every recorded output.
        again = replay(layout, sim.ops)
        assert again == sim.results, f"{name}: replay mismatch"
        assert sim.results[-1]["free"] == layout["num_blocks"] - 1, name
        golden = {
            "name": name,
            "reference": reference_of(layout),
            "vllm_version": V["version"],
            "seed": seed,
            "layout": layout,
            "ops": sim.ops,
            "results": sim.results,
        }
        path = os.path.join(out_dir, f"{name}.json")
        text = _dump_golden(golden)
        with open(path, "w") as f:
            f.write(text)
        total_ops += len(sim.ops)
        total_bytes += len(text)
        st = sim.stats
        print(f"{name}: {len(sim.ops)} ops, {st['allocs']} allocs, "
              f"{st['fails']} failed ({st['must_fit_fails']} must_fit, "
              f"{st['running_fails']} running, "
              f"{st['free_rose_on_fail']} with free rising), "
              f"{st['preempts']} preempts, {st['wedge_aborts']} wedge aborts, "
              f"{st['exceptions']} vLLM exceptions, {len(text)} bytes",
              file=sys.stderr)
        for m in sim.exception_msgs:
            print(f"  exception (op dropped): {m}", file=sys.stderr)
    print(f"total: {total_ops} ops, {total_bytes} bytes", file=sys.stderr)


def _dump_golden(g: dict) -> str:
    """Readable header, one compact line per op / result."""
    c = dict(separators=(",", ":"))
    lines = ["{"]
    for key in ("name", "reference", "vllm_version", "seed"):
        lines.append(f' {json.dumps(key)}: {json.dumps(g[key])},')
    lines.append(f' "layout": {json.dumps(g["layout"], **c)},')
    for key in ("ops", "results"):
        items = g[key]
        lines.append(f' {json.dumps(key)}: [')
        for j, item in enumerate(items):
            sep = "," if j + 1 < len(items) else ""
            lines.append("  " + json.dumps(item, **c) + sep)
        lines.append(" ]," if key == "ops" else " ]")
    lines.append("}")
    return "\n".join(lines) + "\n"


def check(dir_: str) -> int:
    bad = 0
    n = 0
    for fn in sorted(os.listdir(dir_)):
        if not fn.endswith(".json"):
            continue
        with open(os.path.join(dir_, fn)) as f:
            g = json.load(f)
        got = replay(g["layout"], g["ops"])
        ok = got == g["results"]
        n += len(g["ops"])
        bad += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {fn} ({len(g['ops'])} ops)", file=sys.stderr)
    print(f"{n} ops checked, {bad} file(s) differ", file=sys.stderr)
    return 1 if bad else 0


def load_ops(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def load_layout(path: str) -> dict:
    with open(path) as f:
        doc = json.load(f)
    return doc["layout"] if "layout" in doc and "groups" not in doc else doc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", help="write goldens to this directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", nargs="*", help="generate only these golden names")
    ap.add_argument("--layout", help="layout JSON (or a golden JSON) to replay")
    ap.add_argument("--ops", help="ops JSONL to replay through vLLM")
    ap.add_argument("--check", metavar="DIR", help="re-replay goldens in DIR")
    ap.add_argument("--list", action="store_true", help="list golden names")
    a = ap.parse_args(argv)
    if a.list:
        for name, *_ in golden_specs():
            print(name)
        return 0
    if a.check:
        return check(a.check)
    if a.layout or a.ops:
        if not (a.layout and a.ops):
            ap.error("--layout and --ops go together")
        layout = load_layout(a.layout)
        rp = Replayer(layout)
        out = sys.stdout
        for i, op in enumerate(load_ops(a.ops)):
            out.write(json.dumps(rp.apply(i, op)) + "\n")
        return 0
    if a.out:
        generate(a.out, a.seed, a.only)
        return 0
    ap.error("one of --out, --layout/--ops, --check, --list is required")
    return 2


if __name__ == "__main__":
    sys.exit(main())
