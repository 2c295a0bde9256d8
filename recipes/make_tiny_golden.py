#!/usr/bin/env python3
"""Golden outputs of the trained reference checkpoint (models/tiny, W4A16) from the
PyTorch reference (recipes/model.py, f32 compute, docs/model.md §1).

Issue 5 asks the golden-parity fixture of the target issue to be regenerated for the
trained checkpoint and the CPU engine to match it. This writes
models/tiny/golden.safetensors: for 3 held-out prompts (rows 40..43 of
`prompt_tokens`, first 24 tokens), the final logits at the last 4 positions, the MTP
logits at the same positions, and a 16-token greedy continuation with the top-1 /
top-2 margin of every chosen token. tests/it/model_tiny_parity.rs checks the Rust engine.

    /work/venv-vllm/bin/python recipes/make_tiny_golden.py --model models/tiny
"""
import argparse
import os
import sys

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import model as M  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="models/tiny")
    ap.add_argument("--rows", default="40,41,42")
    ap.add_argument("--prompt-len", type=int, default=24)
    ap.add_argument("--tail", type=int, default=4)
    ap.add_argument("--greedy", type=int, default=16)
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    cfg, tensors = M.load_checkpoint(a.model)
    m = M.Model(cfg, tensors)
    data = load_file(os.path.join(a.model, "data.safetensors"))
    G = {}
    for k, row in enumerate(int(r) for r in a.rows.split(",")):
        prompt = data["prompt_tokens"][row, : a.prompt_len].tolist()
        cache = m.new_cache()
        out = m.forward(prompt, cache)
        mtp = m.mtp_forward(out["hidden"][:-1], torch.tensor(prompt[1:]), cache)
        G[f"p{k}.prompt"] = torch.tensor(prompt, dtype=torch.int32)
        G[f"p{k}.logits_tail"] = out["logits"][-a.tail:].float().contiguous()
        G[f"p{k}.mtp_logits_tail"] = mtp["logits"][-a.tail:].float().contiguous()
        g = m.generate_greedy(prompt, a.greedy)
        logits = torch.stack(list(g["logits"])) if isinstance(g["logits"], (list, tuple)) else g["logits"]
        top2 = torch.topk(logits, 2, dim=-1).values
        G[f"p{k}.greedy"] = torch.as_tensor(g["tokens"], dtype=torch.int32)
        G[f"p{k}.greedy_margin"] = (top2[:, 0] - top2[:, 1]).float().contiguous()
        print(f"prompt {k} (row {row}): greedy {G[f'p{k}.greedy'].tolist()} min margin {G[f'p{k}.greedy_margin'].min():.4f}")
    save_file(G, os.path.join(a.model, "golden.safetensors"))


if __name__ == "__main__":
    main()
