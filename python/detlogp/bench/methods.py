"""The methods the benchmark times, and the hook to add one (register_method).

A method computes one thing per row of a batch, the way a user would call it:
- forward(h, w, t) -> a tuple of tensors whose first dimension is the row (logp, logits, ...),
  run under torch.no_grad() on inputs that do not require gradients;
- loss(h, w, t, g) -> a scalar whose backward gives the gradients of h and w, for the forward +
  backward suite (g: per-token weights; a method that takes only a scalar gradient ignores them
  and says so in its notes);
- logp_of / entropy_of pick the per-token log-probability / entropy out of forward's tuple (for
  the accuracy columns); None where the method computes no log-probabilities (the GEMM alone).
- available(ctx) -> None where the method can run here, else why not (not installed, no GPU, the
  wrong architecture, the import's own error text). Every skip is reported with that reason.

The peers (liger-kernel, cut-cross-entropy) are imported only when the benchmark runs, so the
module itself needs none of them.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F

DECODE, TRAINER, FWDBWD = "decode", "trainer", "fwdbwd"
ENTROPY_COEF = 0.01  # the entropy bonus of an RL loss: loss = (logp * g).sum() - ENTROPY_COEF * H.sum()
REFERENCE = "torch-linear"  # every ratio_vs_linear divides by this method of the same round-robin


@dataclass
class Context:
    """What the availability checks look at."""

    device: torch.device
    capability: Optional[Tuple[int, int]] = None  # CUDA compute capability, None on the CPU

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


@dataclass
class Method:
    key: str  # the CSV's method column
    label: str  # the legend
    modes: Tuple[str, ...]  # of DECODE, TRAINER, FWDBWD
    forward: Optional[Callable] = None
    loss: Optional[Callable] = None
    logp_of: Optional[Callable] = None
    entropy_of: Optional[Callable] = None
    available: Callable[[Context], Optional[str]] = field(default=lambda ctx: None)
    ratio_ref: Optional[str] = None  # the method its ratio_vs_ref divides by (same round-robin)
    graphable: bool = True  # may be captured in a CUDA graph (decode-graph mode)
    kind: str = "torch"  # "torch", "detlogp", "peer" or a caller's own
    notes: str = ""


_METHODS: Dict[str, Method] = {}


def register_method(method: Method, replace: bool = False) -> Method:
    """Adds a method to every later run of the benchmark (detlogp.bench.main / run). Its key must
    be new unless replace=True. Returns the method."""
    if not isinstance(method, Method):
        raise TypeError(f"register_method takes a detlogp.bench.Method, got {type(method).__name__}")
    if not method.key or "," in method.key:
        raise ValueError(f"method key must be a non-empty name without commas, got {method.key!r}")
    bad = [m for m in method.modes if m not in (DECODE, TRAINER, FWDBWD)]
    if bad:
        raise ValueError(f"method {method.key!r}: modes must be among {DECODE!r}, {TRAINER!r}, {FWDBWD!r}, got {bad}")
    if (DECODE in method.modes or TRAINER in method.modes) and method.forward is None:
        raise ValueError(f"method {method.key!r}: the {DECODE}/{TRAINER} modes need forward")
    if FWDBWD in method.modes and method.loss is None:
        raise ValueError(f"method {method.key!r}: the {FWDBWD} mode needs loss")
    if method.key in _METHODS and not replace:
        raise ValueError(f"method {method.key!r} is already registered (replace=True replaces it)")
    _METHODS[method.key] = method
    return method


def unregister_method(key: str) -> Method:
    """Removes a registered method (its key: KeyError when none has it); returns it."""
    if key not in _METHODS:
        raise KeyError(f"no registered method {key!r}; registered: {sorted(_METHODS)}")
    return _METHODS.pop(key)


def registered_methods() -> List[Method]:
    """Every registered method, in registration order."""
    return list(_METHODS.values())


def _first_sentence(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text.split('. ')[0][:200]}"


def _import(module: str, attr: Optional[str] = None):
    """(object, None) or (None, why not): not installed, or the import's own error."""
    try:
        mod = importlib.import_module(module)
        return (getattr(mod, attr) if attr else mod), None
    except ModuleNotFoundError as e:
        top = module.split(".")[0]
        if e.name == top:
            return None, "not installed"
        if e.name and e.name.startswith(top + "."):
            return None, f"the installed {top} has no module {e.name}"
        return None, f"import error: {_first_sentence(e)}"
    except Exception as e:  # noqa: BLE001 - a broken install reports its own words
        return None, f"import error: {_first_sentence(e)}"


def _sig_has(fn, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False


# ---- torch -------------------------------------------------------------------------------------


def _torch_logp(h, w, t):
    logits = F.linear(h, w)  # [N, V] bf16
    logp = torch.log_softmax(logits.float(), dim=-1)  # [N, V] fp32
    return logp.gather(1, t[:, None])[:, 0], logp


def _torch_materializing(h, w, t):
    return (_torch_logp(h, w, t)[0],)


def _torch_materializing_entropy(h, w, t):
    logp, all_logp = _torch_logp(h, w, t)
    return logp, -(all_logp.exp() * all_logp).sum(-1)


def _mm_fp32_available(ctx: Context) -> Optional[str]:
    op = getattr(torch.ops.aten.mm, "dtype", None)
    if op is None:
        return f"torch {torch.__version__} has no torch.ops.aten.mm.dtype"
    try:
        x = torch.zeros(2, 8, dtype=torch.bfloat16, device=ctx.device)
        op(x, x.T, torch.float32)
    except Exception as e:  # noqa: BLE001
        return f"torch.ops.aten.mm.dtype fails on {ctx.device.type}: {_first_sentence(e)}"
    return None


def _cpu_only(ctx: Context) -> Optional[str]:
    return None if not ctx.cuda else "the CPU reference (on a GPU, torch-mm-fp32out is torch's fp32-output path)"


# ---- detlogp -----------------------------------------------------------------------------------


def _dt():
    import detlogp.torch as dt

    return dt


def _detlogp_available(ctx: Context) -> Optional[str]:
    dt, why = _import("detlogp.torch")
    if dt is None:
        return f"detlogp.torch: {why}"
    if not ctx.cuda:
        return None
    import detlogp

    sm90 = [b for b in detlogp.backends() if b["id"].startswith("cuda-fused-linear-logp-sm90")]
    if not sm90:
        return "this detlogp build has no SM90 backend"
    if not sm90[0]["available"]:
        return f"detlogp's SM90 backend is unavailable here: {sm90[0]['detail']}"
    return None


def detlogp_entropy_unavailable(ctx: Context) -> Optional[str]:
    """Why detlogp's entropy output cannot run here (None when it can): the installed
    detlogp.torch lacks return_entropy, or a small forward + backward with it fails (its backend
    does not serve it), in the library's words."""
    why = _detlogp_available(ctx)
    if why:
        return why
    dt = _dt()
    if not _sig_has(dt.linear_logp, "return_entropy"):
        return "the installed detlogp.torch.linear_logp has no return_entropy argument"
    try:
        h = torch.full((2, 128), 0.5, dtype=torch.bfloat16, device=ctx.device, requires_grad=True)
        w = torch.full((1024, 128), 0.01, dtype=torch.bfloat16, device=ctx.device, requires_grad=True)
        logp, _lse, entropy = dt.linear_logp(h, w, torch.zeros(2, dtype=torch.long, device=ctx.device),
                                             return_entropy=True)  # fmt: skip
        (logp.sum() - ENTROPY_COEF * entropy.sum()).backward()
    except Exception as e:  # noqa: BLE001 - the backend's refusal, in its words
        return f"linear_logp(..., return_entropy=True) failed: {_first_sentence(e)}"
    return None


def _detlogp_trainer(h, w, t):
    return (_dt().linear_logp(h, w, t)[0],)


def _detlogp_serving(h, w, t):
    logp, _lse, logits = _dt().linear_logp(h, w, t, return_logits=True)
    return logp, logits


def _detlogp_entropy(h, w, t):
    logp, _lse, entropy = _dt().linear_logp(h, w, t, return_entropy=True)
    return logp, entropy


# The sampling program with every filter on (docs/contract.md §11): what an RL rollout runs.
SAMPLE_PROGRAM = {"temperature": 0.9, "top_k": 50, "top_p": 0.95, "min_p": 0.05}
# The trainer's replay of a top-k + top-p rollout.
REPLAY_PROGRAM = {"temperature": 1.0, "top_k": 50, "top_p": 0.95}
SAMPLE_SEED = 1234


def _detlogp_loss(h, w, t, g):
    return _dt().linear_logp_loss(h, w, t, lambda logp, lse, rows: (logp * g[rows]).sum()).loss


def _detlogp_loss_forward(h, w, t):
    return (_dt().linear_logp_loss(h, w, t, lambda logp, lse, rows: logp.sum()).logp,)


def _params(fields):
    import detlogp

    return detlogp.SamplingParams(**fields)


def detlogp_sampling_unavailable(ctx: Context) -> Optional[str]:
    """Why detlogp's sampling program cannot run here (None when it can), in the library's words."""
    why = _detlogp_available(ctx)
    if why:
        return why
    dt = _dt()
    if not hasattr(dt, "sample"):
        return "the installed detlogp.torch has no sample"
    try:
        h = torch.full((2, 128), 0.5, dtype=torch.bfloat16, device=ctx.device)
        w = torch.full((1024, 128), 0.01, dtype=torch.bfloat16, device=ctx.device)
        key = torch.zeros(2, dtype=torch.long, device=ctx.device)
        dt.sample(h, w, _params(SAMPLE_PROGRAM), SAMPLE_SEED, key)
        dt.linear_logp(h, w, key, sampling=_params(REPLAY_PROGRAM))
    except Exception as e:  # noqa: BLE001 - the backend's refusal, in its words
        return f"the sampling program failed: {_first_sentence(e)}"
    return None


def _detlogp_sample(h, w, t):
    # The row's key is its target id: a key carried by the row (a request id), so the batch
    # invariance check compares like with like.
    out = _dt().sample(h, w, _params(SAMPLE_PROGRAM), SAMPLE_SEED, t)
    return out.token, out.logp, out.logp_raw


def _detlogp_replay(h, w, t):
    return (_dt().linear_logp(h, w, t, sampling=_params(REPLAY_PROGRAM))[0],)


# ---- peers -------------------------------------------------------------------------------------


def _needs_cuda(ctx: Context, what: str) -> Optional[str]:
    return None if ctx.cuda else f"needs a CUDA device ({what}); this run is on the CPU"


def _liger_flce():
    fn, why = _import("liger_kernel.transformers.functional", "liger_fused_linear_cross_entropy")
    return fn, (f"liger-kernel: {why}" if why else None)


def _liger_flce_available(ctx: Context) -> Optional[str]:
    fn, why = _liger_flce()
    return why or _needs_cuda(ctx, "Triton kernels")


def _liger_flce_forward(h, w, t):
    return (-_liger_flce()[0](h, w, t, reduction="none"),)


def _liger_flce_loss(h, w, t, g):
    # Its gradients are computed inside the forward for a scalar upstream gradient (the backward
    # only rescales them), so the loss is the plain sum of the token losses: g is not applied.
    return _liger_flce()[0](h, w, t, reduction="sum")


def _liger_sm90():
    fn, why = _import("liger_kernel.ops.cutedsl.ops.fused_scaled_cross_entropy_sm90",
                      "LigerFusedScaledCrossEntropySM90Function")  # fmt: skip
    return fn, (f"liger-kernel's SM90 fused scaled cross entropy (CuTe DSL): {why}" if why else None)


def _liger_sm90_available(ctx: Context, entropy: bool = False) -> Optional[str]:
    fn, why = _liger_sm90()
    if why:
        return why
    if not ctx.cuda:
        return "needs an SM90 (Hopper) CUDA device; this run is on the CPU"
    if ctx.capability != (9, 0):
        major, minor = ctx.capability
        return f"needs an SM90 (Hopper, compute capability 9.0) GPU; this one is sm_{major}{minor}"
    if entropy and not _sig_has(fn.forward, "return_entropy"):
        return "the installed LigerFusedScaledCrossEntropySM90Function has no return_entropy"
    return None


def _liger_sm90_forward(h, w, t):
    return (-_liger_sm90()[0].apply(h, w, t, 1.0, -100, 1),)


def _liger_sm90_loss(h, w, t, g):
    return (-_liger_sm90()[0].apply(h, w, t, 1.0, -100, 1) * g).sum()


def _liger_sm90_entropy_forward(h, w, t):
    nll, entropy = _liger_sm90()[0].apply(h, w, t, 1.0, -100, 1, True)
    return -nll, entropy


def _liger_sm90_entropy_loss(h, w, t, g):
    nll, entropy = _liger_sm90()[0].apply(h, w, t, 1.0, -100, 1, True)
    return (-nll * g).sum() - ENTROPY_COEF * entropy.sum()


def _cce():
    fn, why = _import("cut_cross_entropy", "linear_cross_entropy")
    return fn, (f"cut-cross-entropy: {why}" if why else None)


def _cce_available(ctx: Context) -> Optional[str]:
    fn, why = _cce()
    return why or _needs_cuda(ctx, "Triton kernels")


def _cce_forward(h, w, t):
    return (-_cce()[0](h, w, t, reduction="none"),)


def _cce_loss(h, w, t, g):
    return (-_cce()[0](h, w, t, reduction="none") * g).sum()


MULTI_IDS = 8  # the multi-id method's K: the row's target and 7 more ids (a 1 + 7 logprobs request)
_multi_cache: Dict[str, tuple] = {}


def _multi_targets(t: torch.Tensor, v: int) -> torch.Tensor:
    """[N, MULTI_IDS] ids: the row's target first, then ids spread over the vocabulary. Built once
    per targets tensor (the same object, unmodified: the cache holds it, so no other tensor takes
    its storage), so the timing is linear_logp's."""
    hit = _multi_cache.get("last")
    if hit is not None and hit[0] is t and hit[1] == (t._version, v):
        return hit[2]
    step = torch.arange(MULTI_IDS, device=t.device, dtype=torch.long) * (v // MULTI_IDS + 1)
    ids = torch.where(t[:, None] < 0, t[:, None], (t.long()[:, None] + step) % v).to(t.dtype).contiguous()
    _multi_cache["last"] = (t, (t._version, v), ids)
    return ids


def _detlogp_multi(h, w, t):
    return (_dt().linear_logp(h, w, _multi_targets(t, w.shape[0]))[0],)  # logp [N, MULTI_IDS]


TOPK = 20  # the top-k method's K (an engine's logprobs=20)


def _detlogp_topk(h, w, t):
    logp, _, _, topk_logp = _dt().linear_logp(h, w, t, topk=TOPK)
    return logp, topk_logp


def _small_call_refusal(ctx: Context, what: str, target_shape: tuple, **kwargs) -> Optional[str]:
    """Why a detlogp feature cannot run here (None when it can): a small call using it (targets of
    `target_shape`, `kwargs`) fails, in the library's words, naming `what`."""
    why = _detlogp_available(ctx)
    if why:
        return why
    try:
        h = torch.full((2, 128), 0.5, dtype=torch.bfloat16, device=ctx.device)
        w = torch.full((1024, 128), 0.01, dtype=torch.bfloat16, device=ctx.device)
        _dt().linear_logp(h, w, torch.zeros(target_shape, dtype=torch.long, device=ctx.device), **kwargs)
    except Exception as e:  # noqa: BLE001 - the backend's refusal, in its words
        return f"linear_logp with {what} failed: {_first_sentence(e)}"
    return None


def detlogp_topk_unavailable(ctx: Context) -> Optional[str]:
    """Why the top-k output cannot run here (its backend does not compute it)."""
    return _small_call_refusal(ctx, f"topk={TOPK}", (2,), topk=TOPK)


def _multi_target_logp(out):
    return out[0][:, 0].contiguous()  # the row's own target's entry


def detlogp_multi_unavailable(ctx: Context) -> Optional[str]:
    """Why [N, K] targets cannot run here (their backend takes one target a row)."""
    return _small_call_refusal(ctx, f"[N, {MULTI_IDS}] targets", (2, MULTI_IDS))


def _first(out):
    return out[0]


def _second(out):
    return out[1]


def _register_builtins() -> None:
    lp = {"logp_of": _first}
    register_method(Method(
        REFERENCE, "torch F.linear (the bf16 GEMM alone)", (DECODE, TRAINER),
        forward=lambda h, w, t: (F.linear(h, w),),
        notes="bf16 logits; the forward + backward suite times its forward too, as the GEMM the others divide by",
    ))  # fmt: skip
    register_method(Method(
        "torch-mm-fp32out", "torch.ops.aten.mm.dtype (bf16 in, fp32 logits)", (DECODE, TRAINER),
        forward=lambda h, w, t: (torch.ops.aten.mm.dtype(h, w.T, torch.float32),), available=_mm_fp32_available,
        notes="fp32 logits: the GEMM the serving entry's logits compare with",
    ))  # fmt: skip
    register_method(Method(
        "torch-materializing", "torch F.linear -> float -> log_softmax -> gather", (DECODE, TRAINER, FWDBWD),
        forward=_torch_materializing, loss=lambda h, w, t, g: (_torch_materializing(h, w, t)[0] * g).sum(), **lp,
    ))  # fmt: skip
    register_method(Method(
        "torch-materializing-entropy", "torch materializing logp + entropy", (TRAINER, FWDBWD),
        forward=_torch_materializing_entropy, entropy_of=_second, ratio_ref="torch-materializing",
        loss=lambda h, w, t, g: _entropy_loss(_torch_materializing_entropy(h, w, t), g), **lp,
    ))  # fmt: skip
    register_method(Method(
        "torch-fp32-mm-lse", "torch fp32 matmul + logsumexp (CPU)", (DECODE, TRAINER),
        forward=lambda h, w, t: _fp32_lse(h, w, t), available=_cpu_only, **lp,
        notes="the CPU backend's reference: fp32 GEMM (the fp32 weight converted once, outside the timing), "
        "logsumexp, the target's logit",
    ))  # fmt: skip
    register_method(Method(
        "detlogp-trainer", "detlogp.torch.linear_logp (trainer entry)", (DECODE, TRAINER, FWDBWD),
        forward=_detlogp_trainer, loss=lambda h, w, t, g: (_detlogp_trainer(h, w, t)[0] * g).sum(),
        available=_detlogp_available, kind="detlogp", **lp,
    ))  # fmt: skip
    register_method(Method(
        "detlogp-serving", "detlogp.torch.linear_logp(return_logits=True) (serving entry)", (DECODE, TRAINER),
        forward=_detlogp_serving, available=_detlogp_available, ratio_ref="torch-mm-fp32out", kind="detlogp", **lp,
    ))  # fmt: skip
    register_method(Method(
        "detlogp-loss", "detlogp.torch.linear_logp_loss (the loss inside the op: three GEMMs)", (FWDBWD,),
        forward=_detlogp_loss_forward, loss=_detlogp_loss, available=_detlogp_available, kind="detlogp", **lp,
        notes="the same loss, sum(logp * g), computed per row chunk inside the op: the forward's logits kept a "
        "chunk at a time, no recompute in the backward",
    ))  # fmt: skip
    register_method(Method(
        "detlogp-entropy", "detlogp.torch.linear_logp(return_entropy=True)", (TRAINER, FWDBWD),
        forward=_detlogp_entropy, entropy_of=_second, ratio_ref="detlogp-trainer", kind="detlogp",
        loss=lambda h, w, t, g: _entropy_loss(_detlogp_entropy(h, w, t), g), available=detlogp_entropy_unavailable,
        **lp,
    ))  # fmt: skip
    register_method(Method(
        "detlogp-sample", "detlogp.torch.sample (T, top-k, top-p, min-p)", (DECODE,),
        forward=_detlogp_sample, available=detlogp_sampling_unavailable, ratio_ref="detlogp-trainer",
        kind="detlogp", graphable=False,
        notes=f"the rollout entry with every filter on ({SAMPLE_PROGRAM}); ratio_vs_ref against the trainer entry",
    ))  # fmt: skip
    register_method(Method(
        "detlogp-replay", "detlogp.torch.linear_logp(sampling=top-k 50, top-p 0.95)", (TRAINER,),
        forward=_detlogp_replay, available=detlogp_sampling_unavailable, ratio_ref="detlogp-trainer",
        kind="detlogp", notes=f"the trainer's replay of {REPLAY_PROGRAM}: the processed logp of the targets",
    ))  # fmt: skip
    register_method(Method(
        "liger-flce", "Liger fused linear cross entropy (Triton)", (TRAINER, FWDBWD),
        forward=_liger_flce_forward, loss=_liger_flce_loss, available=_liger_flce_available, kind="peer", **lp,
        notes="liger_fused_linear_cross_entropy, reduction='none' forward; forward + backward with reduction='sum' "
        "(its backward takes a scalar gradient, so the per-token weights are not applied)",
    ))  # fmt: skip
    register_method(Method(
        "liger-sm90", "Liger SM90 fused scaled CE (CuTe DSL)", (TRAINER, FWDBWD),
        forward=_liger_sm90_forward, loss=_liger_sm90_loss, available=_liger_sm90_available, kind="peer",
        graphable=False, **lp,
    ))  # fmt: skip
    register_method(Method(
        "liger-sm90-entropy", "Liger SM90 fused scaled CE + entropy (CuTe DSL)", (TRAINER, FWDBWD),
        forward=_liger_sm90_entropy_forward, loss=_liger_sm90_entropy_loss, entropy_of=_second,
        available=lambda ctx: _liger_sm90_available(ctx, entropy=True), ratio_ref="liger-sm90", kind="peer",
        graphable=False, **lp,
    ))  # fmt: skip
    register_method(Method(
        "cce", "Apple cut-cross-entropy (linear_cross_entropy)", (TRAINER, FWDBWD),
        forward=_cce_forward, loss=_cce_loss, available=_cce_available, kind="peer", **lp,
        notes="its defaults (impl='cce', filter_eps='auto': gradient blocks below the threshold skipped)",
    ))  # fmt: skip
    register_method(Method(
        "detlogp-multi8", f"detlogp.torch.linear_logp, [N, {MULTI_IDS}] targets (one pass)", (DECODE, TRAINER),
        forward=_detlogp_multi, logp_of=_multi_target_logp, available=detlogp_multi_unavailable,
        ratio_ref="detlogp-trainer", kind="detlogp", graphable=False,
        notes=f"{MULTI_IDS} logprobs a row (the target's first) from one pass over the vocabulary; the ratio divides "
        "by the single-target trainer entry",
    ))  # fmt: skip
    register_method(Method(
        f"detlogp-topk{TOPK}", f"detlogp.torch.linear_logp(..., topk={TOPK})", (DECODE, TRAINER),
        forward=_detlogp_topk, logp_of=lambda out: out[0], available=detlogp_topk_unavailable,
        ratio_ref="detlogp-trainer", kind="detlogp", graphable=False,
        notes=f"the target's logp plus the top-{TOPK} ids and logprobs a row (an engine's logprobs={TOPK}); the ratio "
        "divides by the trainer entry without them",
    ))  # fmt: skip


def _entropy_loss(out, g):
    logp, entropy = out
    return (logp * g).sum() - ENTROPY_COEF * entropy.sum()


_FP32_WEIGHT: Dict[tuple, torch.Tensor] = {}


def _fp32_weight(w: torch.Tensor) -> torch.Tensor:
    """The head in fp32, converted once per weight tensor (as a CPU user keeps an fp32 copy), so
    the reference's time is its matmul and logsumexp, not the conversion."""
    key = (w.data_ptr(), tuple(w.shape), w._version)
    if key not in _FP32_WEIGHT:
        _FP32_WEIGHT.clear()
        _FP32_WEIGHT[key] = w.float()
    return _FP32_WEIGHT[key]


def _fp32_lse(h, w, t):
    z = h.float() @ _fp32_weight(w).T
    return (z.gather(1, t[:, None])[:, 0] - torch.logsumexp(z, dim=-1),)


_register_builtins()
