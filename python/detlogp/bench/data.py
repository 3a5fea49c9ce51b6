"""The benchmark's inputs and its float64 reference.

Inputs look like a language model's last layer: hidden states RMS-normalized (every row's RMS is
1, as after the final norm), an N(0, 0.02) bf16 head, and a third of the rows peaked on their
target (the hidden state pulled towards the target's weight row: the target's logit is 9-45 at
D = 4096, where the other logits have a standard deviation of 0.02 * sqrt(D) = 1.28, as for
tokens predicted with some to full confidence). Random logits alone give flat
rows where every path's softmax is easy; peaked rows exercise the large-logit end of the range.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

# name: (D, V). The 8B heads are Qwen3-8B's and Llama-3-8B's lm_head, the small one Qwen3-0.6B's;
# cpu-small is the shape of a new user's first CPU try (N = 64 there).
HEADS = {
    "qwen3-8b": (4096, 151936),
    "llama3-8b": (4096, 128256),
    "qwen3-0.6b": (1024, 151936),
    "cpu-small": (1024, 32000),
}
HEAD_LABELS = {
    "qwen3-8b": "Qwen3-8B",
    "llama3-8b": "Llama-3-8B",
    "qwen3-0.6b": "Qwen3-0.6B",
    "cpu-small": "CPU small",
}
PEAKED_FRACTION = 3  # every third row is peaked on its target
FP64_CHUNK = 8192  # vocabulary rows of the weight converted to float64 at a time


@dataclass
class Inputs:
    hidden: torch.Tensor  # [N_max, D] bf16
    weight: torch.Tensor  # [V, D] bf16
    targets: torch.Tensor  # [N_max] int64
    grad: torch.Tensor  # [N_max] fp32: the per-token weights of the forward + backward loss


def rms_normalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + 1e-6)


def make_inputs(n_max: int, d: int, v: int, device, seed: int = 0) -> Inputs:
    """Inputs of n_max rows (every N of a run takes the first N rows, so a row's value is the same
    in every batch). Generated on the device, from a fixed seed."""
    device = torch.device(device)
    gen = torch.Generator(device=device).manual_seed(seed)
    weight = (torch.randn(v, d, device=device, generator=gen) * 0.02).to(torch.bfloat16)
    targets = torch.randint(0, v, (n_max,), device=device, generator=gen)
    h = torch.randn(n_max, d, device=device, generator=gen)
    peaked = torch.arange(n_max, device=device) % PEAKED_FRACTION == 0
    # h + k * sqrt(D) * (the target's unit weight row), k = beta / (1 - beta), beta in [0.1, 0.4]:
    # after the renormalization the target's logit is ~0.02 * D * k / sqrt(1 + k^2).
    wt = weight[targets].float()
    wt = wt / wt.norm(dim=-1, keepdim=True).clamp_min(1e-12) * d**0.5
    beta = 0.1 + 0.3 * torch.rand(n_max, 1, device=device, generator=gen)
    h = torch.where(peaked[:, None], h + beta / (1 - beta) * wt, h)
    hidden = rms_normalize(h).to(torch.bfloat16)
    grad = torch.rand(n_max, device=device, generator=gen) + 0.25
    return Inputs(hidden, weight, targets, grad)


def fp64_reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor):
    """(logp, entropy) in float64 of the given rows (a few): the exact value of the bf16 inputs'
    log-softmax, the weight converted FP64_CHUNK rows at a time."""
    h = hidden.double()
    logits = torch.cat([h @ weight[i : i + FP64_CHUNK].double().T for i in range(0, weight.shape[0], FP64_CHUNK)], 1)
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(1, targets[:, None])[:, 0]
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logp, entropy
