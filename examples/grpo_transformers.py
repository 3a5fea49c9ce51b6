#!/usr/bin/env python3
"""GRPO on a transformers Qwen3-architecture model through detlogp (docs/integrations.md).

A model built from a config with random initialisation (no download): a tiny one on the CPU, a
Qwen3Config with the real vocabulary (151936) on CUDA. Each step: a KV-cache rollout of groups of
samples per prompt (detlogp.integrations.transformers.rollout: detlogp's sampling program at
temperature 0.9 with top-k 50 and top-p 0.95, each token's processed logp, its raw contract logp
and the head's weight fingerprint), a toy verifiable reward (the fraction of generated tokens whose
id is in a target set, target_set), group-normalized advantages, the clipped objective with
ratio = exp(logp_train - logp_rollout) over the processed logp (the behaviour policy's; the
trainer replays the program) and the backward through the whole model with detlogp's backward. It
prints, for the first step, the parity table (what differs between the rollout's logp and the
trainer's, row by row, processed and raw) and the hidden-state drift of the model itself, then the
reward of every step, and writes the reward curve as a PNG.

    python examples/grpo_transformers.py                       # CPU, tiny config
    python examples/grpo_transformers.py --device cuda         # H200: vocab 151936, hidden 1024, 2 layers
    python examples/grpo_transformers.py --png reward.png --steps 40 --seed 0 --top-k 0 --top-p 1  # no filter

tests/python/test_transformers.py imports this file and asserts what it prints.
"""

from __future__ import annotations

import argparse
import math
import struct
import time
import zlib
from dataclasses import dataclass
from typing import List, Optional

import torch

import detlogp
import detlogp.torch as dt
import detlogp.integrations.transformers as dtx

# The rollout's sampling program: temperature, then top-k, then top-p (docs/contract.md §11).
DEFAULT_SAMPLING = dict(temperature=0.9, top_k=50, top_p=0.95)


def tiny_config():
    """A CPU-sized Qwen3 (random init): 2 layers, hidden 128, vocabulary 512."""
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                       tie_word_embeddings=False)  # fmt: skip


def gpu_config(hidden: int = 1024, layers: int = 2):
    """Qwen3's vocabulary (151936) with a small body: hidden 1024 to 2048, 2 to 8 layers."""
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=151936, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                       num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256), head_dim=64,
                       max_position_embeddings=4096, tie_word_embeddings=False)  # fmt: skip


def build_model(config, device: str = "cpu", seed: int = 0, attn_implementation: str = "sdpa"):
    from transformers import Qwen3ForCausalLM

    config._attn_implementation = attn_implementation
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config).to(device=device, dtype=torch.bfloat16)


def target_set(vocab: int, device) -> torch.Tensor:
    """The toy reward's target ids as a bool mask [V]: the lowest eighth of the vocabulary."""
    return torch.arange(vocab, device=device) < vocab // 8


def toy_reward(tokens, mask, target):
    """Per sequence: the fraction of its generated tokens whose id is in the target set."""
    hit = target[tokens] & mask
    return hit.sum(1).float() / mask.sum(1).clamp(min=1).float()


def group_advantages(rewards, group_size: int, eps: float = 1e-4):
    """GRPO's group-normalized advantage: (r - mean of the group) / (std of the group + eps)."""
    r = rewards.view(-1, group_size)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + eps)).view(-1)


def make_prompts(n: int, target, gen: torch.Generator) -> List[List[int]]:
    """n random prompts of 3 to 8 tokens with ids outside the target set."""
    others = (~target).nonzero()[:, 0].cpu()
    lengths = torch.randint(3, 9, (n,), generator=gen).tolist()
    return [others[torch.randint(0, len(others), (k,), generator=gen)].tolist() for k in lengths]


def logsoftmax_logp(logits, tokens, temperature: float):
    """The usual trainer path: log_softmax of the bf16 logits (upcast to fp32) at the token."""
    return torch.log_softmax(logits.float() / temperature, dim=-1).gather(-1, tokens[..., None])[..., 0]


def k3(logp_rollout, logp_train):
    """The K3 estimator of KL(rollout || train) per token: exp(d) - 1 - d with d = train - rollout."""
    d = logp_train - logp_rollout
    return torch.exp(d) - 1 - d


@dataclass
class Compare:
    """One row of the parity table: the rollout side's and the trainer side's logp of the same tokens.
    The differences are over the tokens both sides give a finite logp; outside counts the others (a
    token the trainer's processed distribution leaves out of its support: logp -inf, ratio 0)."""

    rollout_side: str
    trainer_side: str
    max_abs: float
    mean_abs: float
    max_ratio_dev: float
    max_k3: float
    bit_equal: float  # fraction of tokens whose logp bits are equal
    outside: int  # tokens without a finite logp on one side

    @staticmethod
    def of(rollout_side, trainer_side, a, b):
        a, b = a.float(), b.float()
        both = torch.isfinite(a) & torch.isfinite(b)
        fa, fb = a[both], b[both]
        d = (fa - fb).abs()

        def top(x, reduce):
            return reduce(x).item() if x.numel() else 0.0

        return Compare(rollout_side, trainer_side, top(d, torch.max), top(d, torch.mean),
                       top((torch.exp(fb - fa) - 1).abs(), torch.max), top(k3(fa, fb).abs(), torch.max),
                       (a.view(torch.int32) == b.view(torch.int32)).float().mean().item(),
                       int((~both).sum()))  # fmt: skip


def _logits_temperature(r):
    """The rollout's temperature for [B, L, V] logits: a float, or the per-prompt values as [B, 1, 1]."""
    t = r.temperature
    return t.view(-1, 1, 1) if isinstance(t, torch.Tensor) else t


def parity(model, r):
    """The parity table of one rollout (no gradient). Rows: 0 and 1, detlogp's replay fed the
    rollout's own hidden states (processed logp, then raw); 2 and 3, the replay on the trainer's
    prefill hidden states (processed, raw); 4, the bf16-logits baseline on both sides (raw at T);
    5, detlogp's raw logp against the bf16 logits of one and the same forward. Also the hidden-state
    drift of the model between decode and prefill, and whether rows 0 and 1 are bit-exact."""
    p, sel = r.prompt_len, r.mask
    temperature = _logits_temperature(r)
    with torch.no_grad():
        h_pre = dtx.hidden_states(model, r.input_ids, r.attention_mask, r.position_ids)
        gen = slice(p - 1, p - 1 + r.tokens.shape[1])  # hidden position s predicts token s + 1
        h_fed = h_pre.clone()
        h_fed[:, gen][sel] = r.hidden[sel]
        fed = dtx.head_logprobs(model, h_fed, r.input_ids, r.attention_mask, r.position_ids, sampling=r.sampling)
        own = dtx.head_logprobs(model, h_pre, r.input_ids, r.attention_mask, r.position_ids, sampling=r.sampling)
        logits = model(input_ids=r.input_ids, attention_mask=r.attention_mask, position_ids=r.position_ids).logits
        base_train = logsoftmax_logp(logits[:, gen], r.tokens, temperature)
        base_roll = logsoftmax_logp(model.lm_head(r.hidden), r.tokens, temperature)
    lp, lr = r.logp[sel], r.logp_raw[sel]
    fed_lp, fed_raw = fed.logp[:, p:][sel], fed.logp_raw[:, p:][sel]
    own_lp, own_raw = own.logp[:, p:][sel], own.logp_raw[:, p:][sel]
    fed_side = "detlogp replay, the same hidden fed to the trainer"
    own_side = "detlogp replay, trainer's prefill hidden"
    rows = [
        Compare.of("detlogp processed, decode hidden", fed_side, lp, fed_lp),
        Compare.of("detlogp raw, decode hidden", fed_side, lr, fed_raw),
        Compare.of("detlogp processed, decode hidden", own_side, lp, own_lp),
        Compare.of("detlogp raw, decode hidden", own_side, lr, own_raw),
        Compare.of("bf16 logits + log_softmax, decode", "bf16 logits + log_softmax, prefill", base_roll[sel],
                   base_train[sel]),
        Compare.of("detlogp raw, trainer's prefill hidden", "model(...).logits bf16 + log_softmax, same forward",
                   own_raw, base_train[sel]),
    ]  # fmt: skip
    hd, hp = r.hidden[sel].float(), h_pre[:, gen][sel].float()
    drift = {
        "tokens": int(sel.sum()),
        "max_abs": (hd - hp).abs().max().item(),
        "rel_l2": ((hd - hp).norm() / hp.norm()).item(),
        "rows_bit_equal": (r.hidden[sel] == h_pre[:, gen][sel]).all(-1).float().mean().item(),
    }
    fed_exact = (
        torch.equal(fed_lp.view(torch.int32), lp.view(torch.int32))
        and torch.equal(fed_raw.view(torch.int32), lr.view(torch.int32))
        and bool((fed.mask[:, p:] == sel).all())
    )
    return rows, drift, fed_exact


def format_parity(rows) -> str:
    out = ["| rollout side | trainer side | max |dlogp| | mean |dlogp| | max |ratio-1| | max K3 | tokens bit-equal "
           "| outside support |", "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for c in rows:
        out.append(f"| {c.rollout_side} | {c.trainer_side} | {c.max_abs:.3g} | {c.mean_abs:.3g} | "
                   f"{c.max_ratio_dev:.3g} | {c.max_k3:.3g} | {100 * c.bit_equal:.1f} % | {c.outside} |")  # fmt: skip
    return "\n".join(out)


def format_drift(d) -> str:
    return ("| tokens | max |h_decode - h_prefill| | relative L2 | rows bit-equal |\n|---|---|---|---|\n"
            f"| {d['tokens']} | {d['max_abs']:.3g} | {d['rel_l2']:.3g} | "
            f"{100 * d['rows_bit_equal']:.1f} % |")  # fmt: skip


def grpo_step(model, opt, r, rewards, group_size: int, clip_eps: float = 0.2):
    """One GRPO update: the clipped objective averaged over the generated tokens, ratio =
    exp(logp_train - logp_rollout) of the processed logp (the behaviour policy the rollout sampled
    from; logp_train from detlogp's replay of the rollout's program on the trainer's forward,
    differentiable with the support held fixed), the backward through the whole model. A token
    outside the trainer's support has ratio 0. Returns the ratio's largest deviation from 1."""
    adv = group_advantages(rewards, group_size)[:, None]
    p, sel = r.prompt_len, r.mask
    train = dtx.token_logprobs(model, r.input_ids, r.attention_mask, position_ids=r.position_ids,
                               sampling=r.sampling)  # fmt: skip
    ratio = torch.exp(train.logp[:, p:] - r.logp)
    obj = torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    loss = -(obj * sel).sum() / sel.sum()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return (ratio.detach() - 1)[sel].abs().max().item()


def train(model, steps: int, seed: int = 0, prompts: int = 8, group_size: int = 4, max_new_tokens: int = 12,
          sampling: Optional[detlogp.SamplingParams] = None, lr: float = 3e-3, log=print):  # fmt: skip
    """GRPO for `steps` steps at a fixed seed over one fixed set of `prompts` prompts (a small
    dataset seen every step: a random-init model learns a reward from contexts that recur; new
    random prompts each step leave a 151936-row head nothing to generalize from in 30 steps).
    sampling: the rollout's program (default DEFAULT_SAMPLING); each rollout draws its seed from
    one generator seeded with seed + 1. Returns (mean reward per step, the first step's parity rows,
    its hidden drift, whether every step's fed-hidden parity, processed and raw, was exact)."""
    device = model.lm_head.weight.device
    sampling = sampling if sampling is not None else detlogp.SamplingParams(**DEFAULT_SAMPLING)
    target = target_set(model.config.vocab_size, device)
    gen = torch.Generator().manual_seed(seed)
    sample_gen = torch.Generator(device=device).manual_seed(seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    curve, first_rows, first_drift, all_exact = [], None, None, True
    base = make_prompts(prompts, target, gen)
    batch = [q for q in base for _ in range(group_size)]
    for step in range(steps):
        t0 = time.perf_counter()
        budgets = [max_new_tokens - (i % 4) for i in range(len(batch))]  # rows end at different lengths
        model.eval()
        r = dtx.rollout(model, batch, budgets, sampling=sampling, generator=sample_gen, keep_hidden=True)
        rewards = toy_reward(r.tokens, r.mask, target)
        rows, drift, exact = parity(model, r)
        all_exact &= exact
        if step == 0:
            first_rows, first_drift = rows, drift
        model.train()
        dev = grpo_step(model, opt, r, rewards, group_size)
        curve.append(rewards.mean().item())
        log(f"step {step:3d}  reward {curve[-1]:.4f}  fed-hidden parity {'exact' if exact else 'BROKEN'}  "
            f"max |ratio-1| {dev:.3g}  step set {r.steps[0]}->{r.steps[-1]} rows  "
            f"{time.perf_counter() - t0:.2f} s")  # fmt: skip
    return curve, first_rows, first_drift, all_exact


def write_png(path: str, values: List[float], width: int = 480, height: int = 240) -> None:
    """The reward curve as a PNG (matplotlib when installed; else a plain line plot, no text)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 3))
        ax.plot(range(len(values)), values, marker=".")
        ax.set_xlabel("GRPO step")
        ax.set_ylabel("mean reward")
        fig.tight_layout()
        fig.savefig(path)
        return
    except ImportError:
        pass
    img = [[255] * width for _ in range(height)]
    lo, hi = min(values), max(values)
    span = (hi - lo) or 1.0
    pts = [(int(i * (width - 1) / max(1, len(values) - 1)), int((height - 1) * (1 - (v - lo) / span)))
           for i, v in enumerate(values)]  # fmt: skip
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        n = max(abs(x1 - x0), abs(y1 - y0), 1)
        for k in range(n + 1):
            img[y0 + (y1 - y0) * k // n][x0 + (x1 - x0) * k // n] = 0
    raw = b"".join(b"\x00" + bytes(row) for row in img)

    def chunk(tag, data):
        return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))

    with open(path, "wb") as f:
        f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))  # fmt: skip


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=None, help="AdamW learning rate (default: 3e-3 CPU, 1e-2 CUDA)")
    ap.add_argument("--hidden", type=int, default=1024, help="CUDA config: hidden size (1024 to 2048)")
    ap.add_argument("--layers", type=int, default=2, help="CUDA config: decoder layers (2 to 8)")
    ap.add_argument("--png", default="grpo_reward.png", help="where the reward curve goes")
    ap.add_argument("--temperature", type=float, default=DEFAULT_SAMPLING["temperature"])
    ap.add_argument("--top-k", type=int, default=DEFAULT_SAMPLING["top_k"], help="0: off")
    ap.add_argument("--top-p", type=float, default=DEFAULT_SAMPLING["top_p"], help="1: off")
    ap.add_argument("--min-p", type=float, default=0.0, help="0: off")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device")
    config = tiny_config() if args.device == "cpu" else gpu_config(args.hidden, args.layers)
    # A sampled token's logit moves by about lr * |h|_1 per Adam step: at vocabulary 151936 the
    # reward moves within 30 steps from lr = 1e-2 (1e-3 left it flat, measured at hidden 1024).
    lr = args.lr if args.lr is not None else (3e-3 if args.device == "cpu" else 1e-2)
    model = build_model(config, args.device, args.seed)
    print(f"model: Qwen3ForCausalLM from a config, random init: vocab {config.vocab_size}, hidden "
          f"{config.hidden_size}, {config.num_hidden_layers} layers, bf16 on {args.device}")  # fmt: skip
    t0 = time.perf_counter()
    sampling = detlogp.SamplingParams(args.temperature, args.top_k, args.top_p, args.min_p)
    print(f"rollout sampling program: {sampling}")
    curve, rows, drift, exact = train(model, args.steps, seed=args.seed, sampling=sampling, lr=lr)
    print(f"\n{args.steps} steps in {time.perf_counter() - t0:.1f} s; backend {dt.last_report()['backend_id']}")
    print("\nparity, first step (rollout's logp vs the trainer's, the same tokens):\n" + format_parity(rows))
    print("\nhidden-state drift of the model itself, decode vs prefill (outside detlogp's contract):\n"
          + format_drift(drift))  # fmt: skip
    print(f"\nfed-hidden parity exact on every step (processed and raw): {exact}")
    k = max(1, len(curve) // 5)
    print(f"mean reward, first {k} steps {sum(curve[:k]) / k:.4f} -> last {k} steps {sum(curve[-k:]) / k:.4f}")
    write_png(args.png, curve)
    print(f"reward curve: {args.png}")
    return 0 if exact and not math.isnan(curve[-1]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
