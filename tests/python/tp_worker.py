"""One rank of the tensor-parallel check: detlogp.torch.linear_logp with tp_group against TP=1.

Run by torchrun (`torchrun --nproc-per-node 2 tests/python/tp_worker.py --device cuda [--split engine]`) on GPUs,
or spawned by tests/python/test_torch.py with gloo on the CPU. Exit code 0 only when every check
passed; each check prints one line with the numbers it compared.
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist

import detlogp
import detlogp.torch as dt
from detlogp._torch import tensor_parallel


def shard_bounds(vocab: int, world: int, rank: int, split: str = "tile"):
    if split == "engine":  # V / world rows each, as inference engines shard: boundaries off the tile grid
        sizes = [vocab // world + (r < vocab % world) for r in range(world)]
        start = sum(sizes[:rank])
        return start, start + sizes[rank]
    per = -(-vocab // world)
    shard = max(64, -(-per // 64) * 64)  # multiple of VOCAB_TILE: no tile straddles two ranks
    start = min(vocab, rank * shard)
    return start, min(vocab, start + shard)


def problem(n, d, v, device, seed):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, d, generator=g).bfloat16()
    w = (torch.randn(v, d, generator=g) * 0.05).bfloat16()
    b = torch.randn(v, generator=g) * 0.1
    t = torch.randint(0, v - 40, (n,), generator=g)  # below real_vocab = v - 40
    t[1] = -100
    temp = torch.rand(n, generator=g) + 0.5
    return [x.to(device) for x in (h, w, b, t, temp)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--rows", type=int, default=257)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=5000)
    ap.add_argument("--split", choices=("tile", "engine"), default="tile",
                    help="shards of whole 64-lane tiles, or V / world rows each (straddling tiles)")
    ap.add_argument("--multi", action="store_true",
                    help="only the [N, K] targets and top-k checks (multi_id_checks)")
    args = ap.parse_args()
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast
    backend = "nccl" if args.device == "cuda" else "gloo"
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    failures = []

    def check(name, ok, detail=""):
        print(f"[rank {rank}] {'PASS' if ok else 'FAIL'} {name} {detail}", flush=True)
        if not ok:
            failures.append(name)

    real_vocab = args.vocab - 40  # a padded head: the last rows of the weight are padding
    h, w, b, t, temp = problem(args.rows, args.dim, args.vocab, dev, 1234)
    lo, hi = shard_bounds(args.vocab, world, rank, args.split)
    if args.multi:
        starts = [shard_bounds(args.vocab, world, r, args.split)[0] for r in range(world)]
        multi_id_checks(h, w, b, t, temp, lo, hi, real_vocab, starts, rank, world, check)
        finish(rank, failures)

    # TP = 1 on every rank (the whole weight), then the same rows through the group.
    h1 = h.clone().requires_grad_()
    w1 = w.clone().requires_grad_()
    b1 = b.clone().requires_grad_()
    lp1, lse1, z1 = dt.linear_logp(h1, w1, t, bias=b1, temperature=temp, return_logits=True, real_vocab=real_vocab)
    (lp1.sum() + 0.25 * lse1.sum()).backward()

    hs = h.clone().requires_grad_()
    ws = w[lo:hi].clone().requires_grad_()
    bs = b[lo:hi].clone().requires_grad_()
    lps, lses, zs = dt.linear_logp(
        hs, ws, t, bias=bs, temperature=temp, return_logits=True, vocab_start=lo, real_vocab=real_vocab,
        tp_group=dist.group.WORLD,
    )  # fmt: skip
    rep = dt.last_report()
    check("logp bits equal TP=1", torch.equal(lps.view(torch.int32), lp1.view(torch.int32)))
    check("lse bits equal TP=1", torch.equal(lses.view(torch.int32), lse1.view(torch.int32)))
    check("logits shard bits equal TP=1 slice", torch.equal(zs.view(torch.int32), z1[:, lo:hi].view(torch.int32)))
    check("report names a contract backend", rep["contract"], rep["backend_id"])
    (lps.sum() + 0.25 * lses.sum()).backward()
    for name, a, r in (("grad_hidden", hs.grad, h1.grad), ("grad_weight", ws.grad, w1.grad[lo:hi]),
                       ("grad_bias", bs.grad, b1.grad[lo:hi])):  # fmt: skip
        err = ((a.float() - r.float()).abs().max() / r.float().abs().max().clamp_min(1e-30)).item()
        check(f"{name} matches TP=1", err < 2e-2, f"max rel err {err:.2e}")
    # Every rank ends with the same hidden gradient bits (rank-ordered sum, no all-reduce).
    gathered = [torch.empty_like(hs.grad) for _ in range(world)]
    dist.all_gather(gathered, hs.grad)
    check("grad_hidden identical on every rank", all(torch.equal(g.view(torch.int16), gathered[0].view(torch.int16)) for g in gathered))

    # The entropy through the group (TensorParallelLinearLogp with return_entropy): the bits of the
    # same operator at TP = 1 (a group of this rank alone, the whole weight) on every rank, logp/lse
    # unchanged; a backend that cannot compute it refuses it alike on every rank.
    solo = [dist.new_group([r]) for r in range(world)][rank]

    def with_entropy(hidden, weight, bias, start, group):
        return tensor_parallel.TensorParallelLinearLogp.apply(
            hidden, weight, bias, temp, t, 1.0, -100, False, start, real_vocab, "", False, group, True
        )

    try:
        hs_e = h.clone().requires_grad_()
        lp_e, lse_e, ent, _ = with_entropy(hs_e, w[lo:hi], b[lo:hi], lo, dist.group.WORLD)
        message = None
    except detlogp.DetlogpError as e:
        message = str(e)
    messages = [None] * world
    dist.all_gather_object(messages, message)
    if all(m is None for m in messages):
        h1_e = h.clone().requires_grad_()
        lp1_e, lse1_e, ent1, _ = with_entropy(h1_e, w, b, 0, solo)
        check("entropy bits equal TP=1", torch.equal(ent.view(torch.int32), ent1.view(torch.int32)))
        check("logp/lse bits unchanged by the entropy", torch.equal(lp_e.view(torch.int32), lps.view(torch.int32))
              and torch.equal(lse_e.view(torch.int32), lses.view(torch.int32)))  # fmt: skip
        check("entropy finite on every row, the ignored one too", bool(torch.isfinite(ent).all()))
        gathered = [torch.empty_like(ent) for _ in range(world)]
        dist.all_gather(gathered, ent.detach())
        check("entropy identical on every rank", all(torch.equal(g.view(torch.int32), gathered[0].view(torch.int32)) for g in gathered))
        import inspect

        from detlogp._torch import backward as _backward

        if "g_entropy" in inspect.signature(_backward.chunked_grads).parameters:
            ent.sum().backward()
            ent1.sum().backward()
            err = ((hs_e.grad.float() - h1_e.grad.float()).abs().max() / h1_e.grad.float().abs().max().clamp_min(1e-30)).item()
            check("entropy grad_hidden matches TP=1", err < 2e-2, f"max rel err {err:.2e}")
    else:
        same = all(m == messages[0] for m in messages) and "entropy" in (messages[0] or "")
        check("a backend without the entropy refuses it alike on every rank", same, (message or "")[:200])

    # A refusal on one rank reaches every rank as the same exception, before any data moves, and
    # leaves the group in step for the next call.
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
        check(name, same and named, (message or "no exception").replace("\n", " | ")[:200])

    def shard_call(targets=t, bias=None, backend=None):
        return dt.linear_logp(h, w[lo:hi], targets, bias=bias, vocab_start=lo, real_vocab=real_vocab,
                              tp_group=dist.group.WORLD, backend=backend)  # fmt: skip

    last = world - 1
    bad = t.clone()
    if rank == last:
        bad[5] = real_vocab + 7
    refused_alike("a bad target on one rank raises on all", IndexError, lambda: shard_call(bad), f"rank {last}:",
                  f"targets[5]={real_vocab + 7}")  # fmt: skip
    wrong_bias = b[lo:hi].double() if rank == 0 else b[lo:hi]
    refused_alike("a local check failing on one rank raises on all", ValueError,
                  lambda: shard_call(bias=wrong_bias), "rank 0:", "bias has dtype float64, which detlogp does not take here")  # fmt: skip
    refused_alike("a rank whose backend serves no partials is refused on all", ValueError,
                  lambda: shard_call(backend="reference-materialized" if rank == last else None), f"rank {last}:",
                  "cannot produce tensor-parallel partials")  # fmt: skip

    # Ranks that would be served under another contract or arch: one rank's local check is made to
    # report a different provenance (one build and one kind of device cannot produce it for real).
    # The other value is derived from the real one, so it differs whichever backend serves here.
    ext = tensor_parallel._ext
    real_check = ext.tensor_parallel_local_check
    for field in ("arch", "contract_version", "contract_name", "backend_id"):

        def served_otherwise(*args, field=field):
            report = real_check(*args)
            value = report["provenance"][field]
            report["provenance"][field] = value + 1 if isinstance(value, int) else f"other-{value}"
            return report

        ext.tensor_parallel_local_check = served_otherwise if rank == last else real_check
        try:
            refused_alike(f"ranks disagreeing on {field} are refused on all", detlogp.BackendError, shard_call,
                          "rank 0:", f"rank {last}: ", f"{field}=", "different backends")  # fmt: skip
        finally:
            ext.tensor_parallel_local_check = real_check

    lp_again = shard_call(bias=b[lo:hi])[0]
    lp_whole = dt.linear_logp(h, w, t, bias=b, real_vocab=real_vocab)[0]
    in_step = torch.equal(lp_again.view(torch.int32), lp_whole.view(torch.int32))
    check("the group is in step after the refusals", in_step)
    finish(rank, failures)


def finish(rank, failures):
    dist.barrier()
    dist.destroy_process_group()
    print(f"[rank {rank}] {'TP_OK' if not failures else 'TP_FAILED ' + ','.join(failures)}", flush=True)
    # The verdict is printed and the group destroyed: leave without the interpreter's finalization,
    # where torch.distributed's background threads can abort a process that has passed (SIGABRT,
    # "terminate called without an active exception"), which would turn a pass into a failure.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if failures else 0)


def multi_id_checks(h, w, b, t, temp, lo, hi, real_vocab, starts, rank, world, check):
    """[N, K] targets (ignored entries, ids on every rank's shard) and topk= through the group: the
    TP = 1 logp [N, K], lse, top-k ids and bits on every rank, and the gradients of a loss over all
    of them as at TP = 1 (the top-k ids held constant)."""
    n = h.shape[0]
    g = torch.Generator().manual_seed(77)
    ids = torch.randint(0, real_vocab, (n, 5), generator=g).to(t.device)
    ids[:, 0] = t.clamp(min=0)
    ids[1, 2] = -100
    for r, start in enumerate(starts):  # every shard's first id, and the last real id
        ids[4 + r, 3] = start
    ids[2, 4] = real_vocab - 1
    a = torch.randn(n, 5, generator=g).to(h.device)
    c = torch.randn(n, 7, generator=g).to(h.device)

    def run(weight, bias, **kw):
        hh, ww, bb = h.clone().requires_grad_(), weight.clone().requires_grad_(), bias.clone().requires_grad_()
        logp, lse, top_ids, top_logp = dt.linear_logp(hh, ww, ids, bias=bb, temperature=temp, real_vocab=real_vocab,
                                                      topk=7, **kw)  # fmt: skip
        ((logp * a).sum() + 0.25 * lse.sum() + (top_logp * c).sum()).backward()
        return (logp, lse, top_ids, top_logp), (hh.grad, ww.grad, bb.grad)

    one, g1 = run(w, b)
    tp, gt = run(w[lo:hi], b[lo:hi], vocab_start=lo, tp_group=dist.group.WORLD)
    bits = lambda x: x.view(torch.int32)  # noqa: E731
    check("multi logp [N, K] bits equal TP=1", torch.equal(bits(tp[0]), bits(one[0])))
    check("multi lse bits equal TP=1", torch.equal(bits(tp[1]), bits(one[1])))
    check("multi topk ids equal TP=1", torch.equal(tp[2], one[2]))
    check("multi topk_logp bits equal TP=1", torch.equal(bits(tp[3]), bits(one[3])))
    for name, x, r in (("grad_hidden", gt[0], g1[0]), ("grad_weight", gt[1], g1[1][lo:hi]),
                       ("grad_bias", gt[2], g1[2][lo:hi])):  # fmt: skip
        err = ((x.float() - r.float()).abs().max() / r.float().abs().max().clamp_min(1e-30)).item()
        check(f"multi {name} matches TP=1", err < 2e-2, f"max rel err {err:.2e}")
    gathered = [torch.empty_like(tp[2]) for _ in range(world)]
    dist.all_gather(gathered, tp[2])
    check("multi topk ids identical on every rank", all(torch.equal(x, gathered[0]) for x in gathered))


if __name__ == "__main__":
    main()
