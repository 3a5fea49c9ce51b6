#!/usr/bin/env python3
"""A vLLM-style logprobs response through detlogp (docs/python.md, docs/integrations.md).

For each generated position an engine returns the sampled token's logprob plus the top-k
alternatives, each with its rank (vLLM's ``Logprob(logprob, rank, decoded_token)`` in a dict keyed
by token id; ``SamplingParams(logprobs=k)``). Here, on the CPU with a tiny random head:

1. one ``detlogp.torch.sample(..., topk=k)`` call draws each row's token inside the contract
   (temperature, top-k, top-p) and gives, from the same pass over the vocabulary (no [N, V]), the
   token's raw logprob (``logp_raw``) and the top-k ids and logprobs at the sampling temperature:
   the ids and bits ``detlogp.torch.linear_logp(h, W, token, temperature=T, topk=k)`` gives;
2. ranks are 1-based positions in the contract's descending order of the scaled logits (equal
   logits by the lower id): the j-th top-k entry has rank j + 1; the sampled token's rank is its
   top-k position when it is there, else 1 + the number of ids that come before it, counted from
   the serving logits the sampler already holds (``return_logits=True``).

The logprobs are those of the distribution at the sampling temperature before the top-k / top-p
filters (vLLM's ``logprobs_mode="raw_logprobs"`` at T = 1 is ``temperature=1.0`` here); the
sampled token's value is bit for bit ``SampleResult.logp_raw``, and the trainer recomputes every
one of them bit for bit from the same hidden states and weight.

    python examples/vllm_logprobs.py              # prints the response and checks it
    python examples/vllm_logprobs.py --topk 8 --rows 4

tests/python/test_multi_id_topk.py runs this file and checks what it returns.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Dict, List

import torch

import detlogp
import detlogp.torch as dt


@dataclass(frozen=True)
class Logprob:
    """One entry of a position's logprobs, as vLLM returns it (vllm.sequence.Logprob)."""

    logprob: float
    rank: int
    decoded_token: str


def contract_rank(logits: torch.Tensor, temperature: float, token: torch.Tensor, real_vocab: int) -> torch.Tensor:
    """1 + the number of real ids that come before `token` in the contract's top-k order
    (docs/contract.md §12): a larger scaled logit y = fl(z * fl(1 / T)), or an equal one at a lower id."""
    inv_t = torch.ones((), dtype=torch.float32) / torch.tensor(temperature, dtype=torch.float32)
    y = (logits * inv_t)[:, :real_vocab]
    y_t = y.gather(1, token[:, None])
    lower = torch.arange(real_vocab)[None, :] < token[:, None]
    return 1 + ((y > y_t) | ((y == y_t) & lower)).sum(1)


def logprobs_response(hidden, weight, params: detlogp.SamplingParams, seed: int, key, topk: int,
                      vocab: List[str]) -> List[Dict[int, Logprob]]:  # fmt: skip
    """Per row: {token_id: Logprob} for the sampled token and the top-k (k or k + 1 entries), the
    sampled token first, as vLLM lists a position's logprobs."""
    real_vocab = weight.shape[0]
    with torch.no_grad():
        drawn = dt.sample(hidden, weight, params, seed=seed, key=key, return_logits=True, topk=topk)
        token, logp, top_ids, top_logp = drawn.token, drawn.logp_raw, drawn.topk_ids, drawn.topk_logp
        # The same ids and bits as the trainer-side call at the sampling temperature.
        scored, _lse, ids, lps = dt.linear_logp(hidden, weight, token, temperature=params.temperature, topk=topk)
    assert torch.equal(scored.view(torch.int32), logp.view(torch.int32))
    assert torch.equal(ids, top_ids) and torch.equal(lps.view(torch.int32), top_logp.view(torch.int32))
    ranks = contract_rank(drawn.logits, params.temperature, token, real_vocab)
    out = []
    for n in range(len(token)):
        t = int(token[n])
        row = {t: Logprob(float(logp[n]), int(ranks[n]), vocab[t])}
        for j in range(topk):
            i = int(top_ids[n, j])
            if i == t:
                assert int(ranks[n]) == j + 1  # the counted rank and the top-k position agree
                assert float(top_logp[n, j]) == float(logp[n])  # the token's entry is its logp_raw
            row.setdefault(i, Logprob(float(top_logp[n, j]), j + 1, vocab[i]))
        out.append(row)
    return out


def tiny_head(rows: int, dim: int, vocab_size: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, dim, generator=g).bfloat16()
    weight = (torch.randn(vocab_size, dim, generator=g) * 0.4).bfloat16()
    return hidden, weight


def main(argv=None) -> List[Dict[int, Logprob]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=500)
    ap.add_argument("--topk", type=int, default=5)
    ap.add_argument("--temperature", type=float, default=1.3)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args(argv)
    hidden, weight = tiny_head(args.rows, args.dim, args.vocab, args.seed)
    vocab = [f"<tok{i}>" for i in range(args.vocab)]
    params = detlogp.SamplingParams(temperature=args.temperature, top_k=50, top_p=0.95)
    key = torch.arange(args.rows, dtype=torch.int64)  # a request id / position per row
    response = logprobs_response(hidden, weight, params, args.seed, key, args.topk, vocab)
    for n, row in enumerate(response):
        print(f"position {n}:")
        for token_id, lp in row.items():
            print(f"  {token_id:>5} {lp.decoded_token:>9}  logprob={lp.logprob:+.6f}  rank={lp.rank}")
    print(f"backend: {dt.last_report()['backend_id']}")
    return response


if __name__ == "__main__":
    main()
