"""One rank of the tensor-parallel sampling check: detlogp.torch.sample and linear_logp(sampling=)
with tp_group against TP = 1 (the whole head on this rank alone).

Run by torchrun (`torchrun --nproc-per-node 2 tests/python/tp_sample_worker.py --device cuda`) on
GPUs, or spawned by tests/python/test_sampling.py with gloo on the CPU. Exit code 0 only when every
check passed; each check prints one line with what it compared.
"""

import argparse
import os

import torch
import torch.distributed as dist

import detlogp
import detlogp.torch as dt
from tp_worker import finish  # the same barrier, verdict line and exit (this directory)


def bits(x):
    return x.view(torch.int32) if x.dtype == torch.float32 else x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", type=int, default=97)
    ap.add_argument("--dim", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=3001)
    args = ap.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    group = dist.group.WORLD
    failures = []

    def check(name, ok, detail=""):
        print(f"[rank {rank}] {'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)
        if not ok:
            failures.append(name)

    n, d, v = args.rows, args.dim, args.vocab
    real_vocab = v - 29  # a padded head
    g = torch.Generator().manual_seed(77)
    h = torch.randn(n, d, generator=g).bfloat16().to(dev)
    w = (torch.randn(v, d, generator=g) * 0.4).bfloat16().to(dev)
    b = (torch.randn(v, generator=g) * 0.5).to(dev)
    key = torch.arange(n, dtype=torch.int64).to(dev) * 3 + 11
    i = torch.arange(n)
    params = detlogp.SamplingParams(
        temperature=torch.where(i % 7 == 3, 0.0, 0.6 + 0.2 * (i % 4).float()).to(dev),
        top_k=torch.where(i % 4 == 0, 0, 1 + (i * 13) % 90).to(dev),
        top_p=torch.where(i % 3 == 0, 1.0, 0.7 + 0.1 * (i % 3).float()).to(dev),
        min_p=torch.where(i % 5 == 0, 0.0, 0.02 * (i % 3).float()).to(dev),
    )
    # An engine's split: V / world rows each, boundaries off the 64-lane tile grid.
    sizes = [v // world + (r < v % world) for r in range(world)]
    lo = sum(sizes[:rank])
    hi = lo + sizes[rank]

    # The rollout: every rank's draw is the TP = 1 draw, bit for bit.
    one = dt.sample(h, w, params, 2024, key, bias=b, real_vocab=real_vocab, return_logits=True)
    tp = dt.sample(h, w[lo:hi], params, 2024, key, bias=b[lo:hi], vocab_start=lo, real_vocab=real_vocab,
                   return_logits=True, tp_group=group)  # fmt: skip
    for f in ("token", "logp", "logp_raw", "lse", "support_size"):
        check(f"sample {f} equals TP=1", torch.equal(bits(getattr(tp, f)), bits(getattr(one, f))))
    check("sample logits shard equals the TP=1 columns", torch.equal(bits(tp.logits), bits(one.logits[:, lo:hi])))
    rep = dt.last_report()
    ranks = rep.get("tensor_parallel")
    check("report names the ranks", ranks == {"ranks": world, "rank": rank}, str(ranks))
    check("report names the sampling program", rep["provenance"]["sample_id"] == one.report["provenance"]["sample_id"])
    # The top-k output beside the draw: linear_logp's top-k at each row's T (1 for a greedy row).
    tk = dt.sample(h, w[lo:hi], params, 2024, key, bias=b[lo:hi], vocab_start=lo, real_vocab=real_vocab,
                   tp_group=group, topk=9)  # fmt: skip
    temps = torch.where(params.temperature == 0, 1.0, params.temperature)
    _, _, ids1, tlp1 = dt.linear_logp(h, w, one.token.clamp(min=0), bias=b, temperature=temps, real_vocab=real_vocab,
                                      topk=9)  # fmt: skip
    check("sample topk_ids equal linear_logp's at TP=1", torch.equal(tk.topk_ids, ids1))
    check("sample topk_logp equal linear_logp's at TP=1", torch.equal(bits(tk.topk_logp), bits(tlp1)))
    check("sample with topk draws the same token", torch.equal(tk.token, one.token))

    # The replay of the drawn tokens (some ignored, some outside the support), forward and backward.
    t = one.token.clone()
    t[1] = -100
    t[2] = (int(t[2]) + 1) % real_vocab
    h1, w1, b1 = (x.clone().requires_grad_() for x in (h, w, b))
    lp1, lse1, raw1 = dt.linear_logp(h1, w1, t, bias=b1, real_vocab=real_vocab, sampling=params, return_raw=True)
    hs = h.clone().requires_grad_()
    ws = w[lo:hi].clone().requires_grad_()
    bs = b[lo:hi].clone().requires_grad_()
    lps, lses, raws = dt.linear_logp(hs, ws, t, bias=bs, vocab_start=lo, real_vocab=real_vocab, sampling=params,
                                     return_raw=True, tp_group=group)  # fmt: skip
    check("replay logp equals TP=1", torch.equal(bits(lps), bits(lp1)))
    check("replay lse equals TP=1", torch.equal(bits(lses), bits(lse1)))
    check("replay logp_raw equals TP=1", torch.equal(bits(raws), bits(raw1)))
    check("replay logp equals the rollout's", torch.equal(bits(lps[3:]), bits(one.logp[3:])))
    finite = torch.isfinite(lp1)
    (lp1[finite].sum() + 0.25 * lse1.sum() + 0.5 * raw1.sum()).backward()
    (lps[finite].sum() + 0.25 * lses.sum() + 0.5 * raws.sum()).backward()
    for name, a, r in (("grad_hidden", hs.grad, h1.grad), ("grad_weight", ws.grad, w1.grad[lo:hi]),
                       ("grad_bias", bs.grad, b1.grad[lo:hi])):  # fmt: skip
        err = ((a.float() - r.float()).abs().max() / r.float().abs().max().clamp_min(1e-30)).item()
        check(f"replay {name} matches TP=1", err < 2e-2, f"max rel err {err:.2e}")
    gathered = [torch.empty_like(hs.grad) for _ in range(world)]
    dist.all_gather(gathered, hs.grad)
    check("replay grad_hidden identical on every rank",
          all(torch.equal(x.view(torch.int16), gathered[0].view(torch.int16)) for x in gathered))  # fmt: skip

    # A refusal on one rank reaches every rank as the same exception, nothing hangs.
    def refused_alike(name, exc_type, call, *must_name):
        try:
            call()
            message = None
        except exc_type as e:
            message = str(e)
        messages = [None] * world
        dist.all_gather_object(messages, message)
        same = message is not None and all(m == message for m in messages)
        named = message is not None and all(s in message for s in must_name)
        check(name, same and named, (message or "no exception").replace("\n", " | ")[:240])

    last = world - 1
    bad_top_p = params.top_p.clone()
    if rank == last:
        bad_top_p[4] = 1.5
    bad = detlogp.SamplingParams(params.temperature, params.top_k, bad_top_p, params.min_p)

    def shard_sample(p=params, k=key, bias=b[lo:hi]):
        return dt.sample(h, w[lo:hi], p, 2024, k, bias=bias, vocab_start=lo, real_vocab=real_vocab, tp_group=group)

    refused_alike("a bad top_p row on one rank raises on all", detlogp.DetlogpError, lambda: shard_sample(bad),
                  "tensor-parallel sample refused on every rank", f"rank {last}:", "top_p_rows[4]=1.5")  # fmt: skip
    wrong_key = key.int() if rank == 0 else key
    refused_alike("a torch-side check failing on one rank raises on all", ValueError, lambda: shard_sample(k=wrong_key),
                  "rank 0:", "key")  # fmt: skip
    wrong_bias = b[lo:hi].double() if rank == 0 else b[lo:hi]
    refused_alike("an array check failing on one rank raises on all (sample)", ValueError,
                  lambda: shard_sample(bias=wrong_bias), "rank 0:", "bias")  # fmt: skip

    def shard_replay(targets=t, hidden=h):
        return dt.linear_logp(hidden, w[lo:hi], targets, bias=b[lo:hi], vocab_start=lo, real_vocab=real_vocab,
                              sampling=params, tp_group=group)  # fmt: skip

    bad_t = t.clone()
    if rank == last:
        bad_t[5] = real_vocab + 7
    refused_alike("a bad target on one rank raises on all (replay)", detlogp.DetlogpError, lambda: shard_replay(bad_t),
                  "tensor-parallel linear_logp refused on every rank", f"rank {last}:",
                  f"targets[5]={real_vocab + 7}")  # fmt: skip
    refused_alike("a hidden of the wrong shape on one rank raises on all (replay)", ValueError,
                  lambda: shard_replay(hidden=h[:-1] if rank == 0 else h), "rank 0:", "hidden must be")  # fmt: skip
    if world > 1:
        shifted = lo + 1 if rank == last else lo
        refused_alike("inconsistent shards are refused on all", detlogp.DetlogpError,
                      lambda: dt.sample(h, w[lo:hi], params, 2024, key, bias=b[lo:hi], vocab_start=shifted,
                                        real_vocab=real_vocab, tp_group=group),
                      "vocab_start")  # fmt: skip

    again = shard_sample()
    check("the group is in step after the refusals", torch.equal(again.token, one.token)
          and torch.equal(bits(again.logp), bits(one.logp)))  # fmt: skip
    finish(rank, failures)


if __name__ == "__main__":
    main()
