"""detlogp for Hugging Face ``transformers`` causal LMs (docs/integrations.md).

Trainer side: ``token_logprobs(model, input_ids, attention_mask, labels)`` runs the model's decoder
(``model.base_model``) and hands its final hidden states and ``model.lm_head`` (tied embeddings
too) to ``detlogp.torch.linear_logp``: per-token logp (and entropy) without an ``[N, V]`` logits
buffer, differentiable through the whole model. ``head_logprobs`` does the same from hidden states
the caller already has (the rollout's, for one). ``token_loss`` / ``head_loss`` take the per-token
loss into the op instead (``detlogp.torch.linear_logp_loss``: its gradients in the same pass, one
GEMM fewer than logp + backward), the loss's per-token data given as rows by ``hidden_aligned``.

Rollout side: ``rollout(model, prompts, ...)`` decodes a batch of prompts with the model's KV
cache; each step draws the active rows' tokens with detlogp's sampling program
(``detlogp.torch.sample``: temperature, top-k, top-p, min-p; docs/contract.md §11) and records the
token, its processed logp (``logp``, the behaviour policy's), its contract logp at the sampling
temperature (``logp_raw``), the support size and the weight-version fingerprint of the head. The
trainer replays the program (``token_logprobs(..., sampling=r.sampling)``): given the same hidden
states and the same head both logps are the rollout's bit for bit, so what remains between a
rollout and its trainer recomputation is the model's own drift upstream of the head.

Alignment: outputs are token-aligned, ``[B, S]`` like ``input_ids``: ``logp[b, s]`` is the logp of
``labels[b, s]`` given the tokens before ``s`` (transformers' label shift: hidden position ``s - 1``
predicts label ``s``); ``mask[b, s]`` says which positions carry one, and the others hold 0.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable, List, NamedTuple, Optional, Sequence, Union

import numpy as np
import torch
import torch.nn as nn
from torch import Tensor

from .. import _sampling, _what
from .. import torch as dt
from .._errors import InputError
from .._sampling import SamplingParams

__all__ = [
    "KEY_STRIDE",
    "Rollout",
    "TokenLogprobs",
    "TokenLoss",
    "check_servable",
    "head_logprobs",
    "head_loss",
    "hidden_aligned",
    "hidden_states",
    "multinomial_sampler",
    "rollout",
    "shift_labels",
    "token_logprobs",
    "token_loss",
    "trl_get_per_token_logps_and_entropies",
    "verl_fused_forward",
]

# Config attributes that put something between lm_head(h) and the logits the model samples from
# (each transformers architecture that has one applies it in its *ForCausalLM.forward); detlogp's
# head is y = (h . W^T + b) / T and nothing else. name -> (what it does, the value that is a no-op).
_LOGIT_TRANSFORMS = {
    "final_logit_softcapping": ("final-logit soft-capping, c * tanh(z / c)", None),
    "logit_softcapping": ("final-logit soft-capping, c * tanh(z / c)", None),
    "logit_scale": ("logit scaling, z * logit_scale", 1.0),
    "logits_scaling": ("logit scaling, z / logits_scaling", 1.0),
    "lm_head_multiplier": ("logit scaling, z * lm_head_multiplier", 1.0),
}


def _configs(model) -> list:
    config = getattr(model, "config", None)
    out = [] if config is None else [config]
    text = getattr(config, "text_config", None) if config is not None else None
    return out + ([text] if text is not None and text is not config else [])


def check_servable(model):
    """(weight, bias) of the model's output head, or InputError naming why detlogp cannot serve it:
    a logit transform in the config (soft-capping, scaling), an output head that is not a plain
    torch.nn.Linear (a subclass with its own forward, a wrapper, a quantized layer), forward hooks
    on the head (the adapter does not call it, so they would not run), a bias of a dtype that does
    not convert to float32 exactly. A tied head (tie_word_embeddings) is the embedding matrix."""
    for config in _configs(model):
        for name, (what, no_op) in _LOGIT_TRANSFORMS.items():
            value = getattr(config, name, None)
            if value is not None and value != no_op:
                raise InputError(
                    f"detlogp cannot serve {type(model).__name__}: config.{name}={value!r} applies {what} to "
                    "the logits, which detlogp's head (y = (h.W^T + b) / T) does not implement"
                )
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else getattr(model, "lm_head", None)
    if head is None:
        raise InputError(f"detlogp cannot serve {type(model).__name__}: it has no output head (lm_head)")
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward:
        raise InputError(
            f"detlogp cannot serve {type(model).__name__}: its lm_head is a {type(head).__module__}."
            f"{type(head).__name__}, not a plain torch.nn.Linear (detlogp computes h.W^T + b from the weight "
            "and bias alone; merge an adapter into the weight first)"
        )
    if head._forward_hooks or head._forward_pre_hooks:
        raise InputError(
            f"detlogp cannot serve {type(model).__name__}: its lm_head has forward hooks, which the adapter "
            "would bypass (it reads lm_head.weight and never calls the module)"
        )
    bias = head.bias
    if bias is not None and bias.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise InputError(
            f"detlogp cannot serve {type(model).__name__}: its lm_head bias is {bias.dtype}; detlogp takes a "
            "float32 bias, and only bf16, fp16 and fp32 convert to it exactly"
        )
    return head.weight, None if bias is None else bias.to(torch.float32)


def _bf16_operands(hidden: Tensor, weight: Tensor):
    """hidden and weight as the contract takes them (bf16). Under a bf16 autocast region the cast is
    the one autocast gives lm_head's F.linear; otherwise another dtype is refused (no silent cast)."""
    if hidden.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16:
        return hidden, weight
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev) and torch.get_autocast_dtype(dev) == torch.bfloat16:
        return hidden.to(torch.bfloat16), weight.to(torch.bfloat16)
    raise InputError(
        f"detlogp's contract takes bf16 hidden states and lm_head weight; got hidden {hidden.dtype} and weight "
        f"{weight.dtype} (run the model in bf16, model.to(torch.bfloat16), or inside "
        "torch.autocast(dtype=torch.bfloat16))"
    )


def _decoder(model):
    base = getattr(model, "base_model", None)
    if base is None or base is model:
        raise InputError(
            f"detlogp cannot serve {type(model).__name__}: it has no decoder (base_model) under its output head"
        )
    return base


def hidden_states(model, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                  position_ids: Optional[Tensor] = None, **model_kwargs) -> Tensor:  # fmt: skip
    """The final hidden states [B, S, D] that the model's lm_head would read: its decoder's
    last_hidden_state (after the final norm), computed with use_cache=False."""
    out = _decoder(model)(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False, **model_kwargs
    )
    return out.last_hidden_state


def shift_labels(labels: Tensor, attention_mask: Optional[Tensor] = None, position_ids: Optional[Tensor] = None,
                 ignore_index: int = -100) -> Tensor:  # fmt: skip
    """Targets [B, S] for hidden positions [B, S], transformers' shift: position s predicts
    labels[:, s + 1], the last position nothing. ignore_index wherever the label is ignore_index,
    where either position is padding (attention_mask 0), and, in a packed batch, at each sequence's
    first token (position_ids 0), whose predecessor belongs to the previous sequence."""
    if labels.dim() != 2:
        raise InputError(f"labels must be [B, S], got shape {list(labels.shape)}")
    ignored = torch.zeros_like(labels, dtype=torch.bool)
    for name, t in (("attention_mask", attention_mask), ("position_ids", position_ids)):
        if t is not None and t.shape != labels.shape:
            raise InputError(f"{name} has shape {list(t.shape)}, expected {list(labels.shape)} (labels)")
    if attention_mask is not None:
        pad = attention_mask == 0
        ignored = ignored | pad
        ignored[:, 1:] |= pad[:, :-1]  # a label whose predictor is padding
    if position_ids is not None:
        ignored = ignored | (position_ids == 0)
    labels = labels.masked_fill(ignored, ignore_index)
    return _to_hidden(labels, labels.new_full((labels.shape[0], 1), ignore_index))


class TokenLogprobs(NamedTuple):
    logp: Tensor  # [B, S] float32, token-aligned; 0 where mask is False (with sampling=: the processed logp)
    mask: Tensor  # [B, S] bool: the positions that carry a logp
    entropy: Optional[Tensor] = None  # [B, S] float32: entropy of the distribution that predicted position s
    logp_raw: Optional[Tensor] = None  # [B, S] float32 with sampling=: the contract logp at the program's T


_FIELDS = (("temperature", False), ("top_k", True), ("top_p", False), ("min_p", False))


def _checked_field(params: SamplingParams, name: str, integer: bool, shapes, device):
    """One SamplingParams field as a Python number or a torch tensor of one of `shapes` on device.
    The dtype rule is the library's (float32, int32/int64 for top_k: no silent cast); a numpy array is
    taken as it is (torch.from_numpy, another array through DLPack), a tensor on another device is
    moved (its values unchanged)."""
    value = getattr(params, name)
    dims = getattr(value, "shape", None)
    shape = next((s for s in shapes if dims is not None and len(s) == len(dims)), shapes[0])
    scalar, rows = _sampling._field(value, f"sampling.{name}", shape, integer)
    if rows is None:
        return scalar
    if not isinstance(rows, Tensor):
        rows = torch.from_numpy(rows) if isinstance(rows, np.ndarray) else torch.from_dlpack(rows)
    return rows.to(device)


def _sampling_of(sampling, shapes, device) -> SamplingParams:
    if not isinstance(sampling, SamplingParams):
        raise InputError(f"sampling must be a detlogp.SamplingParams, got {type(sampling).__name__}")
    return SamplingParams(*(_checked_field(sampling, n, i, shapes, device) for n, i in _FIELDS))


def _hidden_aligned(params: SamplingParams, b: int, s: int) -> SamplingParams:
    """Per-sequence fields [B] repeated over the S hidden positions; token-aligned fields [B, S]
    (the value of the token at s) moved to the hidden position that predicts it, s - 1 (the last
    position predicts nothing: it keeps the row's last value, which the library checks and ignores)."""

    def one(v):
        if not isinstance(v, Tensor):
            return v
        if v.dim() == 1:
            return v[:, None].expand(b, s).contiguous()
        return _to_hidden(v, v[:, -1:])

    return SamplingParams(*(one(getattr(params, n)) for n, _ in _FIELDS))


def _head_operands(model, hidden: Tensor, labels: Tensor, attention_mask, position_ids, ignore_index: int):
    """(hidden, weight, bias, targets) as the contract takes them: the head checked, hidden [B, S, D]
    against labels [B, S], the labels shifted to hidden positions, the operands bf16."""
    weight, bias = check_servable(model)
    if hidden.dim() != 3 or tuple(hidden.shape[:2]) != tuple(labels.shape):
        raise InputError(
            f"hidden must be [B, S, D] with [B, S] = {list(labels.shape)} (labels), got {list(hidden.shape)}"
        )
    targets = shift_labels(labels, attention_mask, position_ids, ignore_index)
    hidden, weight = _bf16_operands(hidden, weight)
    return hidden, weight, bias, targets


def head_logprobs(model, hidden: Tensor, labels: Tensor, attention_mask: Optional[Tensor] = None,
                  position_ids: Optional[Tensor] = None, temperature: Union[float, Tensor] = 1.0,
                  ignore_index: int = -100, return_entropy: bool = False, real_vocab: Optional[int] = None,
                  tp_group=None, vocab_start: int = 0, backend: Optional[str] = None,
                  strict: Optional[bool] = None,
                  sampling: Optional[SamplingParams] = None) -> TokenLogprobs:  # fmt: skip
    """token_logprobs from final hidden states [B, S, D] the caller already has (for one, the
    hidden states a rollout recorded). temperature: a float, or a 0-d tensor; real_vocab: ids at
    or past it are padding rows of the head (default: every row is a token); tp_group and
    vocab_start: the model's lm_head is this rank's vocabulary shard (docs/tensor-parallel.md).
    sampling: replay a rollout's sampling program (a detlogp.SamplingParams, e.g. Rollout.sampling;
    each field a scalar, one value per sequence [B], or one per token [B, S] token-aligned like
    labels): logp is then each label's processed logp (-inf outside the support), logp_raw its
    contract logp at the program's temperature, both the rollout's bits given the same hidden
    states; temperature stays 1.0, and neither return_entropy nor tp_group is served with it."""
    hidden, weight, bias, targets = _head_operands(model, hidden, labels, attention_mask, position_ids, ignore_index)
    if tp_group is None and real_vocab is None:
        real_vocab = weight.shape[0]
    carried = targets != ignore_index
    if sampling is not None:
        b, s = labels.shape
        program = _hidden_aligned(_sampling_of(sampling, [(b,), (b, s)], hidden.device), b, s)
        logp, _, raw = dt.linear_logp(
            hidden, weight, targets, bias=bias, temperature=temperature, ignore_index=ignore_index,
            real_vocab=real_vocab, tp_group=tp_group, vocab_start=vocab_start, backend=backend, strict=strict,
            return_entropy=return_entropy, sampling=program, return_raw=True,
        )  # fmt: skip
        return TokenLogprobs(_to_tokens(logp), _to_tokens(carried), None, _to_tokens(raw))
    out = dt.linear_logp(
        hidden, weight, targets, bias=bias, temperature=temperature, ignore_index=ignore_index, real_vocab=real_vocab,
        tp_group=tp_group, vocab_start=vocab_start, backend=backend, strict=strict, return_entropy=return_entropy,
    )  # fmt: skip
    # Hidden position s predicts token s + 1: one column to the right, none predicted at s = 0.
    logp = _to_tokens(out[0])
    entropy = _to_tokens(out[2]) if return_entropy else None
    return TokenLogprobs(logp, _to_tokens(carried), entropy)


def _to_tokens(x: Tensor) -> Tensor:
    return torch.cat([x.new_zeros((x.shape[0], 1)), x[:, :-1]], dim=1)


def _to_hidden(x: Tensor, last: Tensor) -> Tensor:
    """Token-aligned [B, S] values moved to the hidden position that predicts each (s - 1), with
    `last` [B, 1] at each row's last position (which predicts nothing): _to_tokens' inverse."""
    return torch.cat([x[:, 1:], last], dim=1)


def token_logprobs(model, input_ids: Tensor, attention_mask: Optional[Tensor] = None,
                   labels: Optional[Tensor] = None, position_ids: Optional[Tensor] = None,
                   temperature: Union[float, Tensor] = 1.0, ignore_index: int = -100, return_entropy: bool = False,
                   real_vocab: Optional[int] = None, tp_group=None, vocab_start: int = 0,
                   backend: Optional[str] = None, strict: Optional[bool] = None,
                   sampling: Optional[SamplingParams] = None, **model_kwargs) -> TokenLogprobs:  # fmt: skip
    """Per-token logp [B, S] of labels (default input_ids) under the model at temperature, through
    detlogp (no logits are materialized), token-aligned (module docstring). attention_mask marks
    padding (left or right), position_ids restart at 0 for each sequence of a packed row (the
    model's own attention decides how packed sequences are kept apart: pass what it needs, e.g.
    flash-attention's position_ids, in model_kwargs or here). Differentiable in every parameter
    of the model (the head's gradient through detlogp's backward); works with gradient
    checkpointing and inside torch.compile (compile the function that calls it). sampling: the
    rollout's sampling program, replayed (head_logprobs): logp is the processed logp, differentiable
    with the support held fixed, and logp_raw the contract logp at the program's temperature."""
    h = hidden_states(model, input_ids, attention_mask, position_ids, **model_kwargs)
    return head_logprobs(
        model, h, input_ids if labels is None else labels, attention_mask, position_ids, temperature, ignore_index,
        return_entropy, real_vocab, tp_group, vocab_start, backend, strict, sampling,
    )  # fmt: skip


class TokenLoss(NamedTuple):
    loss: Tensor  # 0-d float32: the sum of loss_fn over the chunks, differentiable through the whole model
    logp: Tensor  # [B, S] float32, token-aligned, detached; 0 where mask is False
    mask: Tensor  # [B, S] bool: the positions that carry a logp
    entropy: Optional[Tensor] = None  # [B, S] float32, detached: entropy of the distribution that predicted s


def hidden_aligned(x: Tensor, fill: Union[int, float, bool] = 0) -> Tensor:
    """Token-aligned per-token values [B, S] (advantages, the rollout's logps, a loss mask) as the
    rows loss_fn indexes in token_loss / head_loss: [B * S], row b * S + s holding x[b, s + 1], the
    value of the token hidden position s predicts, and `fill` at each row's last position (which
    predicts nothing; its logp is 0 there and takes no gradient)."""
    if not isinstance(x, Tensor) or x.dim() != 2:
        raise InputError(f"hidden_aligned takes a token-aligned [B, S] tensor, got {_what(x)}")
    return _to_hidden(x, x.new_full((x.shape[0], 1), fill)).reshape(-1)


def head_loss(model, hidden: Tensor, labels: Tensor, loss_fn: Callable[..., Tensor],
              attention_mask: Optional[Tensor] = None, position_ids: Optional[Tensor] = None,
              temperature: Union[float, Tensor] = 1.0, ignore_index: int = -100, return_entropy: bool = False,
              real_vocab: Optional[int] = None, chunk_rows: Optional[int] = None) -> TokenLoss:  # fmt: skip
    """A per-token loss of the labels' logp under the model's head, computed inside
    detlogp.torch.linear_logp_loss from final hidden states [B, S, D]: its gradients come in the
    same pass over row chunks (docs/python.md), so loss.backward() runs the decoder's backward
    without the head's recompute. loss_fn(logp, lse, rows) -- with return_entropy
    loss_fn(logp, lse, entropy, rows) -- gets one chunk's [rows] tensors, rows a slice of the B * S
    hidden positions (row b * S + s predicts labels[b, s + 1]): index per-token data made rows by
    hidden_aligned. It returns the chunk's 0-d contribution, a sum over its rows (a token mean
    divides by a count fixed before the call). Labels are shifted as in head_logprobs; logp,
    entropy and mask come back token-aligned. temperature: a float or a 0-d tensor."""
    hidden, weight, bias, targets = _head_operands(model, hidden, labels, attention_mask, position_ids, ignore_index)
    out = dt.linear_logp_loss(
        hidden, weight, targets, loss_fn, bias=bias, temperature=temperature, ignore_index=ignore_index,
        real_vocab=real_vocab, return_entropy=return_entropy, chunk_rows=chunk_rows,
    )  # fmt: skip
    entropy = _to_tokens(out.entropy) if return_entropy else None
    return TokenLoss(out.loss, _to_tokens(out.logp), _to_tokens(targets != ignore_index), entropy)


def token_loss(model, input_ids: Tensor, loss_fn: Callable[..., Tensor], attention_mask: Optional[Tensor] = None,
               labels: Optional[Tensor] = None, position_ids: Optional[Tensor] = None,
               temperature: Union[float, Tensor] = 1.0, ignore_index: int = -100, return_entropy: bool = False,
               real_vocab: Optional[int] = None, chunk_rows: Optional[int] = None,
               **model_kwargs) -> TokenLoss:  # fmt: skip
    """head_loss on the model's own final hidden states (hidden_states): a policy-gradient,
    PPO-clip, KL or entropy-bonus loss over labels (default input_ids), with the head's logits
    never materialized and one GEMM fewer than token_logprobs + loss.backward()."""
    h = hidden_states(model, input_ids, attention_mask, position_ids, **model_kwargs)
    return head_loss(
        model, h, input_ids if labels is None else labels, loss_fn, attention_mask, position_ids, temperature,
        ignore_index, return_entropy, real_vocab, chunk_rows,
    )  # fmt: skip


# --- rollout ---------------------------------------------------------------------------------------

# sampler(logits [A, V_real] float32 (unscaled z = h.W^T + b), temperature, generator) -> tokens [A] int64.
Sampler = Callable[[Tensor, float, Optional[torch.Generator]], Tensor]

# The sampling program's key of generated token j of prompt i: i * KEY_STRIDE + j. A draw then
# depends on the seed, the prompt's index in the call, the position, the hidden state and the
# parameters, not on which other rows share the decoder's batch.
KEY_STRIDE = 1 << 20


def multinomial_sampler(logits: Tensor, temperature: float, generator: Optional[torch.Generator]) -> Tensor:
    """Plain sampling at temperature T from softmax(z / T), no filter (no top-k, no top-p): a custom
    sampler for rollout(..., sampler=), drawing from the distribution whose contract logp is logp_raw."""
    probs = torch.softmax(logits / temperature, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


@dataclass
class Rollout:
    """A batch of prompts decoded with the KV cache. Layout: P left-padded prompt columns, then L
    generated columns (right-padded once a sequence finishes); input_ids/attention_mask/position_ids
    [B, P + L] are what the trainer feeds back to the model. Per generated token j of row b:
    tokens[b, j]; logp[b, j], its log-probability under the processed distribution it was drawn from
    (temperature, top-k, top-p, min-p: the behaviour policy's logp; finite, the token being in the
    support); logp_raw[b, j], detlogp's contract logp of that token at the sampling temperature
    (T = 0, greedy: at 1); support_size[b, j], the ids the filters kept; version[b, j], the index
    into fingerprints of the weight version that sampled it (one rollout call samples at one
    version). All from the hidden state that produced the token, by one detlogp.torch.sample call.
    sampling is the program with its per-prompt fields as [B] tensors (or scalars) and seed its
    seed: token_logprobs(..., sampling=r.sampling) replays logp and logp_raw bit for bit given the
    same hidden states. With a custom sampler (rollout(..., sampler=)), which takes only an
    unfiltered program, logp is logp_raw's bits, support_size the real vocabulary and seed None."""

    input_ids: Tensor  # [B, P + L] int64
    attention_mask: Tensor  # [B, P + L] int64: 1 on real prompt tokens and generated tokens
    position_ids: Tensor  # [B, P + L] int64
    prompt_len: int  # P
    tokens: Tensor  # [B, L] int64 (pad_token_id past a row's end)
    mask: Tensor  # [B, L] bool: generated tokens
    logp: Tensor  # [B, L] float32: processed logp (0 past a row's end)
    logp_raw: Tensor  # [B, L] float32: contract logp at the sampling temperature (0 past a row's end)
    support_size: Tensor  # [B, L] int64 (0 past a row's end)
    version: Tensor  # [B, L] int64, index into fingerprints (-1 past a row's end)
    fingerprints: List[str]  # weight-version fingerprints (detlogp.torch.weight_fingerprint of the head)
    sampling: SamplingParams  # each field a scalar or a [B] tensor on the model's device
    seed: Optional[int]  # the sampling program's seed; None with a custom sampler
    hidden: Optional[Tensor] = None  # [B, L, D] bf16: the decode-time hidden state that sampled each token
    steps: List[int] = field(default_factory=list)  # rows decoded at each step (the continuous-batching set)

    @property
    def lengths(self) -> Tensor:
        return self.mask.sum(1)

    @property
    def temperature(self) -> Union[float, Tensor]:
        return self.sampling.temperature


def _cache_kwarg(decoder) -> str:
    """The decoder forward's name for the KV cache: `cache` in newer transformers releases,
    `past_key_values` before."""
    params = inspect.signature(decoder.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _cache_of(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def _rollout_program(sampling, temperature, b: int, device) -> SamplingParams:
    if sampling is not None and temperature is not None:
        raise InputError(
            f"rollout got temperature={temperature!r} and sampling={sampling!r}: give the temperature in "
            "sampling (SamplingParams.temperature), not both"
        )
    if sampling is None:
        sampling = SamplingParams(temperature=1.0 if temperature is None else temperature)
    return _sampling_of(sampling, [(b,)], device)


def _custom_sampler_temperature(params: SamplingParams) -> float:
    """The one temperature a custom sampler takes: the program must be a scalar temperature > 0 and
    no filter, the distribution (softmax(z / T)) whose processed logp is logp_raw."""
    for name, _ in _FIELDS:
        if isinstance(getattr(params, name), Tensor):
            raise InputError(
                f"rollout with sampler= takes one scalar temperature; got a per-prompt sampling.{name} (drop sampler= "
                "to sample with detlogp's program, which takes per-prompt values)"
            )
    on = [f"{n}={getattr(params, n)!r}" for n, off in (("top_k", 0), ("top_p", 1.0), ("min_p", 0.0))
          if getattr(params, n) != off]  # fmt: skip
    if on:
        raise InputError(
            f"rollout with sampler= cannot record the processed logp of its filter ({', '.join(on)}): a custom "
            "sampler draws from softmax(z / T) as far as the record goes; drop sampler= to sample with detlogp's "
            "program, or turn the filters off"
        )
    t = params.temperature
    if not t > 0 or t == float("inf"):
        raise InputError(f"temperature={t!r} must be > 0 and finite to sample with sampler= (greedy: drop sampler=)")
    return t


def _rollout_seed(seed, generator: Optional[torch.Generator]) -> int:
    if seed is None:  # one draw from the generator: successive calls get independent noise
        dev = generator.device if generator is not None else "cpu"
        return int(torch.randint(0, (1 << 63) - 1, (1,), generator=generator, device=dev).item())
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < (1 << 64):
        raise InputError(f"seed must be an integer in [0, 2^64 - 1] (or None: drawn from generator), got {seed!r}")
    return seed


@torch.no_grad()
def rollout(model, prompts: Sequence[Sequence[int]], max_new_tokens: Union[int, Sequence[int]],
            temperature: Optional[float] = None, sampler: Optional[Sampler] = None,
            generator: Optional[torch.Generator] = None, eos_token_id: Optional[int] = None,
            pad_token_id: int = 0, real_vocab: Optional[int] = None, keep_hidden: bool = False,
            backend: Optional[str] = None, strict: Optional[bool] = None, *,
            sampling: Optional[SamplingParams] = None, seed: Optional[int] = None) -> Rollout:  # fmt: skip
    """Decode prompts (lists of token ids) with the model's KV cache. Each step runs the decoder on
    the rows still active (finished rows leave the cache: the step set shrinks as sequences end at
    different lengths) and draws their tokens with one detlogp.torch.sample call on their last
    hidden states: the sampling program `sampling` (a detlogp.SamplingParams; each field a scalar or
    one value per prompt, a [B] float32 / int32-int64 tensor or numpy array; temperature=T alone is
    SamplingParams(temperature=T), the default T = 1; T = 0 is greedy), the seed `seed` (an integer
    in [0, 2^64 - 1]; default: one draw from `generator`, or from torch's default generator, so each
    call gets fresh noise) and the key prompt index * KEY_STRIDE + generated position (2^20: a draw
    does not depend on which other rows share the step; max_new_tokens stays below it). The same
    call records each token's processed logp, logp_raw and support size (Rollout). A row ends at
    eos_token_id (recorded) or after its max_new_tokens (an int, or one per prompt). A bad parameter
    is refused by the first step, which holds every prompt (row i = prompt i).

    sampler: opt in to a custom sampler instead, sampler(z[:, :real_vocab], T, generator) on
    detlogp's serving logits z; the program must then be a scalar T > 0 without filters, and
    logp_raw (a second detlogp call with the drawn tokens) is also the processed logp.
    keep_hidden: also keep each token's decode-time hidden state (for parity checks)."""
    weight, bias = check_servable(model)
    decoder = _decoder(model)
    device = weight.device
    b = len(prompts)
    budgets = [int(max_new_tokens)] * b if isinstance(max_new_tokens, int) else [int(x) for x in max_new_tokens]
    if len(budgets) != b:
        raise InputError(f"max_new_tokens has {len(budgets)} entries for {b} prompts")
    if b == 0 or min(len(p) for p in prompts) == 0 or min(budgets) < 1:
        raise InputError("rollout needs at least one prompt, every prompt non-empty and every max_new_tokens >= 1")
    params = _rollout_program(sampling, temperature, b, device)
    if sampler is not None:
        if seed is not None:
            raise InputError("seed is the sampling program's; a custom sampler (sampler=) draws with generator")
        sampler_t = _custom_sampler_temperature(params)
    else:
        seed = _rollout_seed(seed, generator)
        if max(budgets) >= KEY_STRIDE:
            raise InputError(
                f"max_new_tokens={max(budgets)} must be below {KEY_STRIDE} (the sampling key's position field)"
            )
    rv = weight.shape[0] if real_vocab is None else int(real_vocab)
    p_len, n_new = max(len(p) for p in prompts), max(budgets)
    width = p_len + n_new
    input_ids = torch.full((b, width), pad_token_id, dtype=torch.long, device=device)
    attention = torch.zeros((b, width), dtype=torch.long, device=device)
    for i, p in enumerate(prompts):  # left padding: every prompt ends at column P - 1
        input_ids[i, p_len - len(p) : p_len] = torch.as_tensor(list(p), dtype=torch.long, device=device)
        attention[i, p_len - len(p) : p_len] = 1
    position = (attention.cumsum(1) - 1).clamp(min=0)
    tokens = torch.full((b, n_new), pad_token_id, dtype=torch.long, device=device)
    logp, logp_raw = (torch.zeros((b, n_new), dtype=torch.float32, device=device) for _ in range(2))
    support = torch.zeros((b, n_new), dtype=torch.long, device=device)
    version = torch.full((b, n_new), -1, dtype=torch.long, device=device)
    hidden = torch.zeros((b, n_new, weight.shape[1]), dtype=torch.bfloat16, device=device) if keep_hidden else None
    fingerprint = dt.weight_fingerprint(weight.detach().to(torch.bfloat16))
    cache_name = _cache_kwarg(decoder)

    active = torch.arange(b, device=device)  # original row of each row of the decoder's batch
    out = decoder(input_ids=input_ids[:, :p_len], attention_mask=attention[:, :p_len], position_ids=position[:, :p_len],
                  use_cache=True)  # fmt: skip
    cache, h = _cache_of(out), out.last_hidden_state[:, -1]
    steps = []
    for j in range(n_new):
        steps.append(int(active.numel()))
        hb, wb = _bf16_operands(h, weight)
        if sampler is None:
            rows = SamplingParams(*(v[active] if isinstance(v, Tensor) else v for v in
                                    (getattr(params, n) for n, _ in _FIELDS)))  # fmt: skip
            drawn = dt.sample(hb, wb, rows, seed, active * KEY_STRIDE + j, bias=bias, real_vocab=rv, backend=backend,
                              strict=strict)  # fmt: skip
            tok, lp, raw, kept = drawn.token, drawn.logp, drawn.logp_raw, drawn.support_size
            if bool((tok < 0).any()):
                bad = int(active[(tok < 0).nonzero()[0, 0]])
                raise InputError(
                    f"rollout: prompt {bad} at generated position {j} has no processed distribution (its logits "
                    "are NaN or all -inf: the model's hidden state is not finite)"
                )
        else:
            zeros = torch.zeros(hb.shape[0], dtype=torch.long, device=device)
            z = dt.linear_logp(hb, wb, zeros, bias=bias, real_vocab=rv, return_logits=True, backend=backend,
                               strict=strict)[-1]  # fmt: skip
            tok = sampler(z[:, :rv], sampler_t, generator).to(torch.long)
            raw = dt.linear_logp(hb, wb, tok, bias=bias, temperature=sampler_t, real_vocab=rv, backend=backend,
                                 strict=strict)[0]  # fmt: skip
            lp, kept = raw, torch.full_like(tok, rv)  # no filter: the support is every real id
        col = p_len + j
        tokens[active, j], logp[active, j], logp_raw[active, j], support[active, j] = tok, lp, raw, kept
        version[active, j] = 0
        input_ids[active, col], attention[active, col] = tok, 1
        if keep_hidden:
            hidden[active, j] = hb
        budget = torch.as_tensor(budgets, device=device)[active]
        done = budget <= j + 1
        if eos_token_id is not None:
            done |= tok == eos_token_id
        if bool(done.all()):
            break
        keep = (~done).nonzero()[:, 0]
        if keep.numel() < active.numel():
            cache.batch_select_indices(keep)
            active, tok = active[keep], tok[keep]
        pos = position[active, col - 1] + 1
        position[active, col] = pos
        out = decoder(input_ids=tok[:, None], attention_mask=attention[active, : col + 1], position_ids=pos[:, None],
                      use_cache=True, **{cache_name: cache})  # fmt: skip
        cache, h = _cache_of(out), out.last_hidden_state[:, -1]
    position = (attention.cumsum(1) - 1).clamp(min=0)
    return Rollout(
        input_ids=input_ids, attention_mask=attention, position_ids=position, prompt_len=p_len, tokens=tokens,
        mask=version >= 0, logp=logp, logp_raw=logp_raw, support_size=support, version=version,
        fingerprints=[fingerprint], sampling=params, seed=None if sampler is not None else seed, hidden=hidden,
        steps=steps,
    )  # fmt: skip


# --- drop-ins for RL frameworks' own entry points (docs/integrations.md) ------------------------------


def trl_get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                          compute_entropy=False, compute_aux_loss=False, **multimodal):  # fmt: skip
    """TRL's GRPOTrainer._get_per_token_logps_and_entropies (trl/trainer/grpo_trainer.py) through
    detlogp, for text-only batches: (logps [B, logits_to_keep], entropies or None, None), the
    completion tokens' logp at self.temperature and the entropy of the distribution predicting
    each, as TRL computes them from model(...).logits, without the logits. Use it as the method:
    ``class Trainer(GRPOTrainer): _get_per_token_logps_and_entropies = trl_get_per_token_logps_and_entropies``.
    Multimodal inputs and the MoE auxiliary loss (router logits) are refused."""
    given = sorted(k for k, v in multimodal.items() if v is not None)
    if given or compute_aux_loss:
        what = ", ".join(given) if given else "compute_aux_loss=True"
        raise InputError(f"detlogp's TRL entry serves text-only batches without the MoE auxiliary loss; got {what}")
    unwrap = getattr(getattr(self, "accelerator", None), "unwrap_model", None)
    causal_lm = unwrap(model) if unwrap is not None else model
    batch_size = batch_size or input_ids.size(0)
    logps, entropies = [], []
    for start in range(0, input_ids.size(0), batch_size):
        ids, mask = input_ids[start : start + batch_size], attention_mask[start : start + batch_size]
        out = token_logprobs(causal_lm, ids, mask, temperature=self.temperature, return_entropy=compute_entropy)
        logps.append(out.logp[:, -logits_to_keep:])
        if compute_entropy:
            entropies.append(out.entropy[:, -logits_to_keep:])
    return torch.cat(logps, 0), torch.cat(entropies, 0) if compute_entropy else None, None


class VerlOutput(NamedTuple):
    """What verl's actor reads from its fused-kernel forward: log_probs and entropy [B, S] fp32,
    hidden-aligned (position s: the logp of the label rolled in from s + 1)."""

    log_probs: Tensor
    entropy: Tensor


def verl_fused_forward(self, input_ids: Optional[Tensor] = None, attention_mask: Optional[Tensor] = None,
                       position_ids: Optional[Tensor] = None, labels: Optional[Tensor] = None,
                       temperature: float = 1.0, **kwargs) -> VerlOutput:  # fmt: skip
    """verl's fused-kernel forward (verl/models/transformers/dense_common.py,
    forward_with_torch_backend / forward_with_triton_backend) through detlogp: the decoder's
    hidden states, targets torch.roll(labels or input_ids, -1) as verl rolls them (packed
    `remove padding` rows included), and (log_probs, entropy) at temperature from one detlogp call.
    Install it as the model class's forward where verl installs its own
    (``model.__class__.forward = verl_fused_forward``, actor_rollout_ref.model.use_fused_kernels)."""
    for name in ("past_key_values", "cache", "inputs_embeds"):
        if kwargs.get(name) is not None:
            raise InputError(f"detlogp's verl entry takes input_ids only, got {name}")
    ids = labels if labels is not None else input_ids
    if ids is None:
        raise InputError("detlogp's verl entry needs labels or input_ids")
    weight, bias = check_servable(self)
    h = hidden_states(self, input_ids, attention_mask, position_ids)
    hb, wb = _bf16_operands(h, weight)
    logp, _, entropy = dt.linear_logp(hb, wb, torch.roll(ids, shifts=-1, dims=-1), bias=bias, temperature=temperature,
                                      return_entropy=True)  # fmt: skip
    return VerlOutput(logp, entropy)
