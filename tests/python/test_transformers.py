"""detlogp.integrations.transformers on a real transformers Qwen3 model built from a config (random
init, no download): the adapter (label shift, masks, packing, tied heads, gradients, gradient
checkpointing, autocast, torch.compile, refusals), the KV-cache rollout loop, and the GRPO run of
examples/grpo_transformers.py: (a) exact parity given the same hidden states, (b) the model's own
decode/prefill drift reported, (c) the bf16-logits baseline drifting, (d) the reward rising. The
CPU tests use a tiny config; the `gpu` ones (skipped without CUDA) a Qwen3 vocabulary of 151936
and the Qwen3-8B head's memory."""

import importlib.util
import sys
import time

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed")
pytest.importorskip("transformers", reason="transformers is not installed (pip install transformers)")

import torch.nn as nn  # noqa: E402
from conftest import ROOT  # noqa: E402

import detlogp  # noqa: E402
import detlogp.integrations.transformers as dtx  # noqa: E402
import detlogp.torch as dt  # noqa: E402



def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # a dataclass looks its module up
    spec.loader.exec_module(module)
    return module


ex = _load("grpo_transformers", ROOT / "examples" / "grpo_transformers.py")

T = 0.9


def tiny(seed=0, **overrides):
    cfg = ex.tiny_config()
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return ex.build_model(cfg, "cpu", seed)


def f64_logp(h, w, targets, temperature=1.0, bias=None):
    """float64 log_softmax of the same bf16 operands at the targets (the accuracy reference)."""
    z = h.double() @ w.double().T
    if bias is not None:
        z = z + bias.double()
    return torch.log_softmax(z / temperature, -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]


def padded_batch(gen, vocab=512):
    """Three rows: left padding, right padding, none; one label set to -100."""
    ids = torch.randint(0, vocab, (3, 9), generator=gen)
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[0, :3] = 0
    mask[1, 6:] = 0
    labels = ids.clone()
    labels[2, 4] = -100
    return ids, mask, labels


# --- the adapter ------------------------------------------------------------------------------------


def test_token_logprobs_are_token_aligned_masked_and_accurate():
    m = tiny()
    ids, mask, labels = padded_batch(torch.Generator().manual_seed(0))
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        out = dtx.token_logprobs(m, ids, mask, labels, position_ids=pos, temperature=T)
        h = dtx.hidden_states(m, ids, mask, pos)
    assert out.logp.shape == ids.shape and out.logp.dtype == torch.float32
    expect = torch.zeros_like(out.mask)
    expect[0, 4:] = True  # left padding: the first real token (column 3) has no real predictor
    expect[1, 1:6] = True  # right padding from column 6
    expect[2, 1:] = True
    expect[2, 4] = False  # label -100
    assert torch.equal(out.mask, expect)
    assert torch.all(out.logp[~out.mask] == 0)
    # logp[:, s] is the label at s given the hidden state at s - 1, against float64.
    ref = f64_logp(h[:, :-1], m.lm_head.weight, labels[:, 1:], T)
    assert torch.allclose(out.logp[:, 1:][out.mask[:, 1:]].double(), ref[out.mask[:, 1:]], atol=2e-5, rtol=0)
    # The bits of detlogp.torch.linear_logp on those rows, one row at a time (batch invariance).
    for b, s in out.mask.nonzero().tolist()[:6]:
        lp, _ = dt.linear_logp(h[b, s - 1 : s], m.lm_head.weight, labels[b, s : s + 1], temperature=T)
        assert lp.view(torch.int32).item() == out.logp[b, s].view(torch.int32).item()


def test_shift_labels_follows_transformers_and_marks_packed_boundaries():
    labels = torch.tensor([[5, 6, 7, 8, 9, 10]])
    assert dtx.shift_labels(labels).tolist() == [[6, 7, 8, 9, 10, -100]]
    mask = torch.tensor([[0, 1, 1, 1, 1, 0]])
    assert dtx.shift_labels(labels, mask).tolist() == [[-100, 7, 8, 9, -100, -100]]
    pos = torch.tensor([[0, 1, 2, 0, 1, 2]])  # two packed sequences of 3
    assert dtx.shift_labels(labels, position_ids=pos, ignore_index=-1).tolist() == [[6, 7, -1, 9, 10, -1]]
    with pytest.raises(detlogp.InputError, match="attention_mask has shape \\[1, 5\\], expected \\[1, 6\\]"):
        dtx.shift_labels(labels, mask[:, :5])


def test_packed_rows_give_the_bits_of_each_sequence_alone():
    m = tiny()
    gen = torch.Generator().manual_seed(1)
    a, b = torch.randint(0, 512, (1, 7), generator=gen), torch.randint(0, 512, (1, 5), generator=gen)
    packed = torch.cat([a, b], 1)
    pos = torch.cat([torch.arange(7), torch.arange(5)])[None]
    with torch.no_grad():
        p = dtx.token_logprobs(m, packed, position_ids=pos)
        sa, sb = dtx.token_logprobs(m, a), dtx.token_logprobs(m, b)
        same_hidden = torch.equal(dtx.hidden_states(m, packed, None, pos)[:, 7:], dtx.hidden_states(m, b))
    assert not p.mask[0, 7] and int(p.mask.sum()) == 6 + 4  # the second sequence's first token: no predictor
    assert torch.equal(p.logp[:, :7].view(torch.int32), sa.logp.view(torch.int32))
    if not same_hidden:  # the model's attention, not detlogp: an older release mixing packed sequences
        pytest.skip("this transformers release does not keep packed sequences apart by position_ids under sdpa")
    assert torch.equal(p.logp[:, 7:].view(torch.int32), sb.logp.view(torch.int32))


def _grads(m, ids, mask):
    m.zero_grad(set_to_none=True)
    out = dtx.token_logprobs(m, ids, mask, temperature=T, return_entropy=True)
    loss = -(out.logp.sum() + 0.1 * (out.entropy * out.mask).sum())
    loss.backward()
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def _reference_grads(m, ids, mask):
    """The same loss with the head in float64 (log_softmax of h.W^T), the body as the model runs it."""
    m.zero_grad(set_to_none=True)
    h = dtx.hidden_states(m, ids, mask)
    targets = dtx.shift_labels(ids, mask)
    logq = torch.log_softmax((h.double() @ m.lm_head.weight.double().T) / T, -1)
    keep = targets != -100
    lp = logq.gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    ent = -(logq.exp() * logq).sum(-1)
    kept = torch.cat([keep.new_zeros((keep.shape[0], 1)), keep[:, :-1]], 1)
    ent_tok = torch.cat([ent.new_zeros((ent.shape[0], 1)), ent[:, :-1]], 1)
    loss = -((lp * keep).sum() + 0.1 * (ent_tok * kept).sum())
    loss.backward()
    return {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("tied", [False, True])
def test_gradients_through_the_whole_model_match_a_float64_head(tied):
    m = tiny(tie_word_embeddings=tied)
    if tied:
        m.tie_weights()
        assert m.lm_head.weight is m.model.embed_tokens.weight
    ids, mask, _ = padded_batch(torch.Generator().manual_seed(2))
    got, ref = _grads(m, ids, mask), _reference_grads(m, ids, mask)
    assert got.keys() == ref.keys() and "model.layers.0.self_attn.q_proj.weight" in got
    for name in got:
        g, r = got[name].double().flatten(), ref[name].double().flatten()
        cos = (g @ r / (g.norm() * r.norm())).item()
        assert cos > 0.999, f"{name}: cosine {cos}"
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"  # a tied head is the embedding
    assert torch.equal(_grads(m, ids, mask)[head], got[head])  # deterministic


def _head_loss(m, ids, mask, adv, loss_entry: bool):
    """A policy-gradient loss with an entropy bonus on the model's hidden states, through
    linear_logp + autograd or through linear_logp_loss (the loss inside the op): (logp, grads)."""
    m.zero_grad(set_to_none=True)
    h = dtx.hidden_states(m, ids, mask)
    t = dtx.shift_labels(ids, mask).reshape(-1)
    h2, a2 = h.reshape(-1, h.shape[-1]), adv.reshape(-1)

    def loss_fn(logp, lse, entropy, rows):
        return -(logp * a2[rows]).sum() - 0.1 * entropy.sum()

    if loss_entry:
        r = dt.linear_logp_loss(h2, m.lm_head.weight, t, loss_fn, temperature=T, return_entropy=True, chunk_rows=8)
        r.loss.backward()
        logp = r.logp
    else:
        logp, lse, entropy = dt.linear_logp(h2, m.lm_head.weight, t, temperature=T, return_entropy=True)
        loss_fn(logp, lse, entropy, slice(None)).backward()
        logp = logp.detach()
    return logp, {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def test_the_loss_entry_trains_the_whole_model_as_linear_logp_does():
    m = tiny()
    ids, mask, _ = padded_batch(torch.Generator().manual_seed(5))
    adv = torch.randn(ids.shape, generator=torch.Generator().manual_seed(6))
    want_logp, want = _head_loss(m, ids, mask, adv, loss_entry=False)
    got_logp, got = _head_loss(m, ids, mask, adv, loss_entry=True)
    assert torch.equal(got_logp.view(torch.int32), want_logp.view(torch.int32))
    assert got.keys() == want.keys() and "model.layers.0.self_attn.q_proj.weight" in got
    for name in got:
        g, r = got[name].double().flatten(), want[name].double().flatten()
        cos = (g @ r / (g.norm() * r.norm())).item()
        assert cos > 0.999, f"{name}: cosine {cos}"
    assert all(torch.equal(a, b) for a, b in zip(_head_loss(m, ids, mask, adv, True)[1].values(), got.values()))


def test_token_loss_is_the_token_aligned_loss_with_its_gradients_in_the_same_pass():
    m = tiny()
    ids, mask, _ = padded_batch(torch.Generator().manual_seed(7))
    adv = torch.randn(ids.shape, generator=torch.Generator().manual_seed(8))
    m.zero_grad(set_to_none=True)
    ref = dtx.token_logprobs(m, ids, mask, temperature=T, return_entropy=True)
    want_loss = -(ref.logp * adv).sum() - 0.1 * (ref.entropy * ref.mask).sum()
    want_loss.backward()
    want = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad(set_to_none=True)
    # The per-token data as rows: a hidden position's advantage and mask are those of the token it predicts.
    rows_adv, rows_mask = dtx.hidden_aligned(adv), dtx.hidden_aligned(ref.mask)

    def loss_fn(logp, lse, entropy, rows):
        return -(logp * rows_adv[rows]).sum() - 0.1 * (entropy * rows_mask[rows]).sum()

    got = dtx.token_loss(m, ids, loss_fn, mask, temperature=T, return_entropy=True, chunk_rows=8)
    # logp, entropy and mask are token_logprobs' bits, token-aligned
    assert torch.equal(got.logp.view(torch.int32), ref.logp.detach().view(torch.int32))
    assert torch.equal(got.mask, ref.mask)
    assert torch.equal(got.entropy.view(torch.int32), ref.entropy.detach().view(torch.int32))
    # the same loss (rows in another order: close, not bitwise), and its gradients through the model
    assert torch.allclose(got.loss, want_loss.detach(), rtol=1e-5, atol=1e-5)
    got.loss.backward()
    assert want.keys() == {n for n, p in m.named_parameters() if p.grad is not None}
    for name, r in want.items():
        g = dict(m.named_parameters())[name].grad.double().flatten()
        r = r.double().flatten()
        cos = (g @ r / (g.norm() * r.norm())).item()
        assert cos > 0.999, f"{name}: cosine {cos}"


def test_hidden_aligned_rows_and_refusals():
    x = torch.arange(6).reshape(2, 3)
    assert dtx.hidden_aligned(x).tolist() == [1, 2, 0, 4, 5, 0]
    assert dtx.hidden_aligned(x.bool(), fill=False).tolist() == [True, True, False, True, True, False]
    with pytest.raises(detlogp.InputError, match=r"token-aligned \[B, S\] tensor, got shape \[6\]"):
        dtx.hidden_aligned(x.reshape(-1))
    m = tiny()
    ids, mask, _ = padded_batch(torch.Generator().manual_seed(9))
    h = dtx.hidden_states(m, ids, mask)
    with pytest.raises(detlogp.InputError, match="hidden must be \\[B, S, D\\]"):
        dtx.head_loss(m, h[:, :-1], ids, lambda logp, lse, rows: logp.sum(), mask)


@pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated:FutureWarning")
def test_gradient_checkpointing_gives_the_same_gradients():
    m = tiny()
    m.train()
    ids, mask, _ = padded_batch(torch.Generator().manual_seed(3))
    plain = _grads(m, ids, mask)
    m.gradient_checkpointing_enable()
    assert m.model.gradient_checkpointing
    ckpt = _grads(m, ids, mask)
    for name in plain:
        assert torch.equal(plain[name], ckpt[name]), name


def test_autocast_casts_like_lm_head_and_other_dtypes_are_refused():
    m = ex.build_model(ex.tiny_config()).to(torch.float32)
    ids, mask, _ = padded_batch(torch.Generator().manual_seed(4))
    with pytest.raises(detlogp.InputError, match="bf16 hidden states .* got hidden torch.float32"):
        dtx.token_logprobs(m, ids, mask)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = dtx.token_logprobs(m, ids, mask)
        h = dtx.hidden_states(m, ids, mask)
    lp, _ = dt.linear_logp(h.to(torch.bfloat16), m.lm_head.weight.to(torch.bfloat16), dtx.shift_labels(ids, mask))
    assert torch.equal(out.logp[:, 1:].view(torch.int32), lp[:, :-1].view(torch.int32))


@pytest.mark.slow
def test_torch_compile_of_the_loss_gives_the_eager_head_bits():
    """torch.compile of a loss calling token_logprobs (the whole model traced by dynamo): the head's
    bits given the compiled body's hidden states are detlogp's, and the gradients match eager
    (the compiled body may round differently, so those compare closely, not bit for bit)."""
    m = tiny()
    ids, mask, _ = padded_batch(torch.Generator().manual_seed(5))

    def head_and_hidden(ids, mask):
        h = dtx.hidden_states(m, ids, mask)
        return dtx.head_logprobs(m, h, ids, mask, temperature=T).logp, h

    t0 = time.perf_counter()
    logp_c, h_c = torch.compile(head_and_hidden)(ids, mask)
    print(f"torch.compile of the tiny model's forward: {time.perf_counter() - t0:.1f} s")
    lp, _ = dt.linear_logp(h_c.detach(), m.lm_head.weight, dtx.shift_labels(ids, mask), temperature=T)
    assert torch.equal(logp_c[:, 1:].detach().view(torch.int32), lp[:, :-1].view(torch.int32))
    eager = _grads(m, ids, mask)

    def loss_fn(ids, mask):
        out = dtx.token_logprobs(m, ids, mask, temperature=T, return_entropy=True)
        return -(out.logp.sum() + 0.1 * (out.entropy * out.mask).sum())

    m.zero_grad(set_to_none=True)
    torch.compile(loss_fn)(ids, mask).backward()
    for name, p in m.named_parameters():
        g, r = p.grad.double().flatten(), eager[name].double().flatten()
        assert (g @ r / (g.norm() * r.norm())).item() > 0.999, name


def test_lm_head_bias_is_served_as_float32():
    m = tiny()
    head = nn.Linear(m.config.hidden_size, m.config.vocab_size, bias=True).to(torch.bfloat16)
    with torch.no_grad():
        head.weight.copy_(m.lm_head.weight)
        head.bias.copy_(torch.randn(m.config.vocab_size) * 0.5)
    m.lm_head = head
    ids, mask, _ = padded_batch(torch.Generator().manual_seed(6))
    out = dtx.token_logprobs(m, ids, mask)
    h = dtx.hidden_states(m, ids, mask)
    ref = f64_logp(h[:, :-1], head.weight, ids[:, 1:], bias=head.bias)
    assert torch.allclose(out.logp[:, 1:][out.mask[:, 1:]].double(), ref[out.mask[:, 1:]].detach(), atol=2e-5, rtol=0)
    out.logp.sum().backward()
    assert head.bias.grad is not None and torch.isfinite(head.bias.grad).all()


def _tiny_of(arch, **kw):
    import transformers

    cfg = getattr(transformers, f"{arch}Config")(vocab_size=128, hidden_size=32, intermediate_size=64,
                                                 num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                                 head_dim=16, **kw)  # fmt: skip
    return getattr(transformers, f"{arch}ForCausalLM")(cfg).to(torch.bfloat16)


@pytest.mark.parametrize(
    "arch, kw, reason",
    [
        ("Gemma2", {"final_logit_softcapping": 30.0},
         "config.final_logit_softcapping=30.0 applies final-logit soft-capping"),
        ("Cohere", {"logit_scale": 0.0625}, "config.logit_scale=0.0625 applies logit scaling"),
        ("Granite", {"logits_scaling": 8.0}, "config.logits_scaling=8.0 applies logit scaling"),
    ],
)  # fmt: skip
def test_logit_transforms_of_real_architectures_are_refused(arch, kw, reason):
    import transformers

    if not hasattr(transformers, f"{arch}ForCausalLM"):
        pytest.skip(f"this transformers release has no {arch}ForCausalLM")
    m = _tiny_of(arch, **kw)
    ids = torch.randint(0, 128, (1, 4))
    with pytest.raises(detlogp.InputError, match=f"cannot serve {arch}ForCausalLM: {reason}"):
        dtx.token_logprobs(m, ids)
    with pytest.raises(detlogp.InputError, match="cannot serve"):
        dtx.rollout(m, [[1, 2]], 2)


def test_heads_the_adapter_cannot_compute_are_refused():
    m = tiny()
    ids = torch.randint(0, 512, (1, 4))

    class Scaled(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    w = m.lm_head.weight
    for head, why in [
        (nn.Sequential(nn.Linear(128, 512)), "lm_head is a torch.nn.modules.container.Sequential, not a plain"),
        (Scaled(128, 512), "lm_head is a .*Scaled, not a plain torch.nn.Linear"),
        (nn.Linear(128, 512, bias=True).to(torch.float64), "lm_head bias is torch.float64"),
    ]:
        m.lm_head = head
        with pytest.raises(detlogp.InputError, match=why):
            dtx.token_logprobs(m, ids)
    m.lm_head = nn.Linear(128, 512, bias=False).to(torch.bfloat16)
    m.lm_head.weight = w
    handle = m.lm_head.register_forward_hook(lambda *a: None)
    with pytest.raises(detlogp.InputError, match="lm_head has forward hooks"):
        dtx.token_logprobs(m, ids)
    handle.remove()
    dtx.token_logprobs(m, ids)


# --- the frameworks' entry points (docs/integrations.md) ------------------------------------------------


def test_trl_entry_gives_what_trl_computes_from_the_logits():
    """TRL's _get_per_token_logps_and_entropies computes logits[:, :-1][:, -k:] / T, then
    log_softmax at input_ids[:, -k:] and the entropy of each row; the drop-in gives those values
    (against float64) without logits, in its (logps, entropies, aux_loss) form, chunked by batch_size."""
    from types import SimpleNamespace

    m = tiny()
    ids, mask, _ = padded_batch(torch.Generator().manual_seed(8))
    mask[1, 6:] = 1  # TRL pads prompts on the left; completions are masked by TRL afterwards
    k = 4
    trainer = SimpleNamespace(temperature=T)
    logps, ent, aux = dtx.trl_get_per_token_logps_and_entropies(trainer, m, ids, mask, k, batch_size=2,
                                                                compute_entropy=True)  # fmt: skip
    assert logps.shape == (3, k) and ent.shape == (3, k) and aux is None
    with torch.no_grad():
        h = dtx.hidden_states(m, ids, mask)
    logq = torch.log_softmax((h.double() @ m.lm_head.weight.double().T)[:, :-1][:, -k:] / T, -1)
    ref = logq.gather(-1, ids[:, -k:, None])[..., 0]
    assert torch.allclose(logps.double(), ref, atol=2e-5, rtol=0)
    assert torch.allclose(ent.double(), -(logq.exp() * logq).sum(-1), atol=2e-5, rtol=0)
    whole, none, _ = dtx.trl_get_per_token_logps_and_entropies(trainer, m, ids, mask, k)
    assert none is None and torch.equal(whole.view(torch.int32), logps.view(torch.int32))  # chunking: same bits
    with pytest.raises(detlogp.InputError, match="text-only .* got pixel_values"):
        dtx.trl_get_per_token_logps_and_entropies(trainer, m, ids, mask, k, pixel_values=torch.zeros(1))


def test_verl_entry_gives_verls_rolled_log_probs_and_entropy_on_packed_rows():
    """verl's fused forward rolls the labels by one (remove-padding rows: one packed row with
    position_ids) and returns hidden-aligned log_probs and entropy at temperature."""
    m = tiny()
    gen = torch.Generator().manual_seed(9)
    ids = torch.randint(0, 512, (1, 11), generator=gen)
    pos = torch.cat([torch.arange(6), torch.arange(5)])[None]
    m.__class__.forward, original = dtx.verl_fused_forward, m.__class__.forward
    try:
        out = m(input_ids=ids, attention_mask=None, position_ids=pos, use_cache=False, temperature=T)
    finally:
        m.__class__.forward = original
    assert out.log_probs.shape == ids.shape and out.entropy.shape == ids.shape
    with torch.no_grad():
        h = dtx.hidden_states(m, ids, None, pos)
    logq = torch.log_softmax((h.double() @ m.lm_head.weight.double().T) / T, -1)
    rolled = torch.roll(ids, -1, -1)
    assert torch.allclose(out.log_probs.double(), logq.gather(-1, rolled[..., None])[..., 0], atol=2e-5, rtol=0)
    assert torch.allclose(out.entropy.double(), -(logq.exp() * logq).sum(-1), atol=2e-5, rtol=0)
    out.log_probs.sum().backward()
    assert m.lm_head.weight.grad is not None


# --- the rollout loop -------------------------------------------------------------------------------


def test_rollout_records_contract_logp_of_every_token_with_a_shrinking_step_set():
    m = tiny()
    prompts = [[70, 71, 72], [80, 81, 82, 83, 84, 85], [90], [100, 101]]
    budgets = [2, 6, 4, 6]
    gen = torch.Generator().manual_seed(7)
    r = dtx.rollout(m, prompts, budgets, temperature=T, generator=gen, keep_hidden=True, eos_token_id=None)
    assert r.lengths.tolist() == budgets
    assert r.steps == [4, 4, 3, 3, 2, 2]  # rows leave the decoder's batch when they end
    assert r.fingerprints == [dt.weight_fingerprint(m.lm_head.weight)]
    assert torch.equal(r.version[r.mask], torch.zeros(int(r.mask.sum()), dtype=torch.long))
    assert torch.all(r.version[~r.mask] == -1) and torch.all(r.logp_raw[~r.mask] == 0)
    assert torch.all(r.logp[~r.mask] == 0) and torch.all(r.support_size[~r.mask] == 0)
    assert r.temperature == T and r.sampling.top_k == 0 and isinstance(r.seed, int)
    # Each token's logp_raw: the contract logp of that token from the hidden state that sampled it.
    lp, _ = dt.linear_logp(r.hidden[r.mask], m.lm_head.weight, r.tokens[r.mask], temperature=T)
    assert torch.equal(lp.view(torch.int32), r.logp_raw[r.mask].view(torch.int32))
    ref = f64_logp(r.hidden[r.mask], m.lm_head.weight, r.tokens[r.mask], T)
    assert torch.allclose(lp.double(), ref, atol=2e-5, rtol=0)
    # No filter: the processed distribution is the raw one, bit for bit, over every id.
    assert torch.equal(r.logp.view(torch.int32), r.logp_raw.view(torch.int32))
    assert torch.all(r.support_size[r.mask] == 512)
    # The layout the trainer feeds back: prompts left-padded to P, generated tokens after them.
    assert torch.equal(r.input_ids[:, r.prompt_len :][r.mask], r.tokens[r.mask])
    assert r.input_ids[1, : r.prompt_len].tolist() == prompts[1]
    assert r.attention_mask[0].tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 0, 0, 0, 0]
    # The same generator seed gives the same rollout (the program's seed is drawn from it), bit for bit.
    again = dtx.rollout(m, prompts, budgets, temperature=T, generator=torch.Generator().manual_seed(7))
    assert again.seed == r.seed and torch.equal(again.tokens, r.tokens)
    assert torch.equal(again.logp_raw.view(torch.int32), r.logp_raw.view(torch.int32))
    # An explicit seed is used as given: the same seed, the same draws.
    a, b = (dtx.rollout(m, prompts, budgets, temperature=T, seed=2**64 - 1) for _ in range(2))
    assert a.seed == 2**64 - 1 and torch.equal(a.tokens, b.tokens)


FIELDS = ("temperature", "top_k", "top_p", "min_p")


def _program_map(params, fn):
    """A SamplingParams with fn applied to each field."""
    return detlogp.SamplingParams(*(fn(getattr(params, f)) for f in FIELDS))


def _per_prompt_program():
    """Four prompts, each its own program: top-k and top-p, top-k alone, greedy, min-p."""
    return detlogp.SamplingParams(
        temperature=torch.tensor([0.9, 0.7, 0.0, 1.2]), top_k=torch.tensor([50, 5, 0, 0]),
        top_p=torch.tensor([0.95, 1.0, 1.0, 1.0]), min_p=torch.tensor([0.0, 0.0, 0.0, 0.05]),
    )  # fmt: skip


def test_rollout_samples_each_prompt_with_its_own_program_and_key():
    """Per-prompt fields follow their prompt as rows leave the step set: every recorded token is
    detlogp.torch.sample of its decode hidden state with its prompt's scalar parameters, the seed,
    and key = prompt index * KEY_STRIDE + position, bit for bit."""
    m = tiny()
    prompts = [[70, 71, 72], [80, 81, 82, 83, 84, 85], [90], [100, 101]]
    budgets = [3, 6, 2, 5]  # prompt 2 leaves first: the later steps' rows are prompts 0, 1, 3, then 1, 3
    params = _per_prompt_program()
    r = dtx.rollout(m, prompts, budgets, sampling=params, seed=11, keep_hidden=True)
    assert r.steps == [4, 4, 3, 2, 2, 1] and r.seed == 11
    assert torch.equal(r.temperature, params.temperature)
    for i in range(4):
        one = _program_map(params, lambda v: v[i].item())
        n = budgets[i]
        key = i * dtx.KEY_STRIDE + torch.arange(n)
        ref = dt.sample(r.hidden[i, :n], m.lm_head.weight, one, 11, key)
        assert torch.equal(ref.token, r.tokens[i, :n])
        for name in ("logp", "logp_raw"):
            assert torch.equal(getattr(ref, name).view(torch.int32), getattr(r, name)[i, :n].view(torch.int32)), name
        assert torch.equal(ref.support_size, r.support_size[i, :n])
    assert torch.all(r.support_size[0, :3] <= 50) and torch.all(r.support_size[1, :6] == 5)
    greedy = r.hidden[2, :2].float() @ m.lm_head.weight.float().T
    assert torch.equal(r.tokens[2, :2], greedy.argmax(-1)) and torch.all(r.logp[2, :2] == 0)
    assert torch.all(r.support_size[2, :2] == 1)
    # A filter makes the processed logp larger than the raw one (the support renormalizes).
    assert torch.all(r.logp[1, :6] > r.logp_raw[1, :6])
    # numpy arrays are taken as per-prompt values too.
    np_params = _program_map(params, lambda v: v.numpy())
    s = dtx.rollout(m, prompts, budgets, sampling=np_params, seed=11)
    assert torch.equal(s.tokens, r.tokens) and torch.equal(s.logp.view(torch.int32), r.logp.view(torch.int32))


def test_rollout_refuses_bad_sampling_arguments_naming_them():
    m = tiny()
    prompts = [[1, 2], [3], [4, 5, 6]]
    bad = [
        (dict(sampling=detlogp.SamplingParams(top_p=torch.tensor([0.9, 0.5, 1.5]))), r"top_p_rows\[2\]=1.5 is outside"),
        (dict(sampling=detlogp.SamplingParams(top_k=-1)), "top_k=-1 must be >= 0"),
        (dict(sampling=detlogp.SamplingParams(min_p=1.0)), r"min_p=1 is outside \[0, 1\)"),
        (dict(sampling=detlogp.SamplingParams(temperature=-0.5)), "temperature=-0.5 is outside"),
        (dict(sampling=detlogp.SamplingParams(top_k=torch.tensor([1, 2]))),
         r"sampling.top_k must be an integer or an int32/int64 array of shape \[3\]"),
        (dict(sampling=detlogp.SamplingParams(temperature=torch.tensor([0.9, 0.9, 0.9], dtype=torch.float64))),
         r"sampling.temperature of shape \[3\] must be float32, got float64 \(no silent cast\)"),
        (dict(sampling=detlogp.SamplingParams(top_p=[0.9, 0.9, 0.9])), "sampling.top_p must be a float or a float32"),
        (dict(sampling=(0.9, 50)), "sampling must be a detlogp.SamplingParams, got tuple"),
        (dict(temperature=0.9, sampling=detlogp.SamplingParams()), "give the temperature in sampling"),
        (dict(seed=-1), r"seed must be an integer in \[0, 2\^64 - 1\]"),
        (dict(seed=1.5), r"seed must be an integer in \[0, 2\^64 - 1\]"),
        (dict(sampler=dtx.multinomial_sampler, sampling=detlogp.SamplingParams(top_k=50, top_p=0.9)),
         r"sampler= cannot record the processed logp of its filter \(top_k=50, top_p=0.9\)"),
        (dict(sampler=dtx.multinomial_sampler, sampling=detlogp.SamplingParams(temperature=torch.ones(3))),
         "sampler= takes one scalar temperature; got a per-prompt sampling.temperature"),
        (dict(sampler=dtx.multinomial_sampler, seed=3), "a custom sampler .* draws with generator"),
        (dict(sampler=dtx.multinomial_sampler, temperature=0.0), "temperature=0.0 must be > 0 and finite"),
    ]  # fmt: skip
    for kwargs, message in bad:
        with pytest.raises(detlogp.InputError, match=message):
            dtx.rollout(m, prompts, 2, **kwargs)
    with pytest.raises(detlogp.InputError, match=f"max_new_tokens={dtx.KEY_STRIDE} must be below {dtx.KEY_STRIDE}"):
        dtx.rollout(m, [[1]], dtx.KEY_STRIDE)


def test_rollout_stops_at_eos_and_takes_any_sampler():
    m = tiny()
    calls = []

    def greedy(logits, temperature, generator):
        calls.append(logits.shape)
        return logits.argmax(-1)

    r = dtx.rollout(m, [[70, 71], [72]], 5, temperature=0.5, sampler=greedy, keep_hidden=True)
    assert calls[0] == (2, 512) and r.seed is None
    z = dt.linear_logp(r.hidden[r.mask], m.lm_head.weight, r.tokens[r.mask], return_logits=True)[-1]
    assert torch.equal(z.argmax(-1), r.tokens[r.mask])  # the sampler saw detlogp's serving logits
    lp, _ = dt.linear_logp(r.hidden[r.mask], m.lm_head.weight, r.tokens[r.mask], temperature=0.5)
    assert torch.equal(lp.view(torch.int32), r.logp_raw[r.mask].view(torch.int32))
    # A custom sampler takes no filter: its processed logp is logp_raw's bits, over every id.
    assert torch.equal(r.logp.view(torch.int32), r.logp_raw.view(torch.int32))
    assert torch.all(r.support_size[r.mask] == 512)
    # The program's greedy (T = 0) draws the same tokens, with processed logp +0 and raw logp at T = 1.
    g = dtx.rollout(m, [[70, 71], [72]], 5, temperature=0.0, keep_hidden=True)
    assert torch.equal(g.tokens, r.tokens) and torch.all(g.logp[g.mask].view(torch.int32) == 0)
    lp1, _ = dt.linear_logp(g.hidden[g.mask], m.lm_head.weight, g.tokens[g.mask])
    assert torch.equal(lp1.view(torch.int32), g.logp_raw[g.mask].view(torch.int32))
    eos = int(r.tokens[0, 1])
    s = dtx.rollout(m, [[70, 71], [72]], 5, temperature=0.5, sampler=greedy, eos_token_id=eos)
    assert s.lengths[0] == 2 and s.tokens[0, 1] == eos  # ends at eos, which is recorded
    with pytest.raises(detlogp.InputError, match="max_new_tokens has 1 entries for 2 prompts"):
        dtx.rollout(m, [[1], [2]], [3])


def test_trainer_replays_the_rollouts_program_raw_and_processed():
    """head_logprobs(..., sampling=r.sampling) on the rollout's hidden states gives both recorded
    logps bit for bit; per-token [B, S] fields (token-aligned like labels) give the bits of the
    per-sequence ones; every filter off gives processed == raw; a label outside the support has
    processed logp -inf (still carried), and the replay is differentiable where it is finite."""
    m = tiny()
    prompts = [[70, 71, 72], [80, 81, 82, 83, 84, 85], [90], [100, 101]]
    r = dtx.rollout(m, prompts, [3, 6, 2, 5], sampling=_per_prompt_program(), seed=5, keep_hidden=True)
    p, sel = r.prompt_len, r.mask
    with torch.no_grad():
        h = dtx.hidden_states(m, r.input_ids, r.attention_mask, r.position_ids)
        h[:, p - 1 : p - 1 + sel.shape[1]][sel] = r.hidden[sel]
        out = dtx.head_logprobs(m, h, r.input_ids, r.attention_mask, r.position_ids, sampling=r.sampling)
    assert out.entropy is None and torch.equal(out.mask[:, p:], sel)
    assert torch.equal(out.logp[:, p:][sel].view(torch.int32), r.logp[sel].view(torch.int32))
    assert torch.equal(out.logp_raw[:, p:][sel].view(torch.int32), r.logp_raw[sel].view(torch.int32))
    assert torch.all(out.logp[~out.mask] == 0) and torch.all(out.logp_raw[~out.mask] == 0)
    width = r.input_ids.shape[1]
    per_token = _program_map(r.sampling, lambda v: v[:, None].expand(4, width).contiguous())
    with torch.no_grad():
        tok = dtx.head_logprobs(m, h, r.input_ids, r.attention_mask, r.position_ids, sampling=per_token)
    assert torch.equal(tok.logp.view(torch.int32), out.logp.view(torch.int32))
    # Every filter off: processed == raw == the plain call at T, bit for bit.
    ids, mask, labels = padded_batch(torch.Generator().manual_seed(12))
    off = dtx.token_logprobs(m, ids, mask, labels, sampling=detlogp.SamplingParams(temperature=T))
    plain = dtx.token_logprobs(m, ids, mask, labels, temperature=T)
    assert torch.equal(off.logp.view(torch.int32), off.logp_raw.view(torch.int32))
    assert torch.equal(off.logp_raw.view(torch.int32), plain.logp.view(torch.int32))
    assert torch.equal(off.mask, plain.mask) and plain.logp_raw is None
    # Random labels under a top-5 program: most are outside the support.
    k5 = dtx.token_logprobs(m, ids, mask, labels, sampling=detlogp.SamplingParams(temperature=T, top_k=5))
    outside = k5.mask & torch.isinf(k5.logp)
    assert int(outside.sum()) > 0 and torch.all(k5.logp[outside] == float("-inf"))
    assert torch.equal(k5.logp_raw.view(torch.int32), plain.logp.view(torch.int32))
    assert dt.last_report()["sampling"]["outside_support"] == int(outside.sum())
    m.zero_grad(set_to_none=True)
    torch.where(torch.isfinite(k5.logp), k5.logp, 0).sum().backward()
    assert all(torch.isfinite(q.grad).all() for q in m.parameters() if q.grad is not None)
    assert m.lm_head.weight.grad is not None and m.lm_head.weight.grad.abs().sum() > 0
    with pytest.raises(detlogp.InputError, match=r"sampling.top_k must be .* shape \[3\]"):
        dtx.token_logprobs(m, ids, mask, labels, sampling=detlogp.SamplingParams(top_k=torch.tensor([1, 2])))
    with pytest.raises(detlogp.InputError, match=r"top_p_rows\[\d+\]=0 is outside"):
        dtx.token_logprobs(m, ids, mask, labels, sampling=detlogp.SamplingParams(top_p=torch.tensor([0.5, 0.0, 1.0])))
    with pytest.raises(detlogp.InputError, match="the temperature is the program's"):
        dtx.token_logprobs(m, ids, mask, labels, temperature=T, sampling=detlogp.SamplingParams(temperature=T))
    with pytest.raises(detlogp.InputError, match="return_entropy is not served with sampling="):
        dtx.token_logprobs(m, ids, mask, labels, return_entropy=True, sampling=detlogp.SamplingParams())


# --- GRPO: the (a) to (d) on the CPU tiny model --------------------------------------------------


@pytest.fixture(scope="module")
def grpo_run():
    m = tiny()
    t0 = time.perf_counter()
    curve, rows, drift, exact = ex.train(m, steps=30, seed=0, lr=3e-3, log=lambda s: None)
    print(f"\nGRPO, 30 steps on the tiny model: {time.perf_counter() - t0:.1f} s")
    print(ex.format_parity(rows))
    print(ex.format_drift(drift))
    print("reward:", " ".join(f"{x:.3f}" for x in curve))
    return curve, rows, drift, exact


def test_a_parity_is_exact_given_the_rollouts_hidden_states(grpo_run):
    _, rows, _, exact = grpo_run
    assert exact  # every step: the trainer fed the rollout's hidden states has logp's and logp_raw's bits
    for fed in rows[:2]:  # processed, raw
        assert fed.max_abs == 0 and fed.max_ratio_dev == 0 and fed.max_k3 == 0 and fed.bit_equal == 1
        assert fed.outside == 0


def test_a_the_rollout_samples_with_the_filters_on():
    m = tiny()
    r = dtx.rollout(m, [[70, 71, 72]] * 4, 12, sampling=detlogp.SamplingParams(**ex.DEFAULT_SAMPLING), seed=0)
    assert ex.DEFAULT_SAMPLING == {"temperature": 0.9, "top_k": 50, "top_p": 0.95}
    assert torch.all(r.support_size[r.mask] <= 50) and torch.all(r.logp[r.mask] > r.logp_raw[r.mask])


def test_b_the_models_own_decode_prefill_drift_is_measured(grpo_run):
    _, rows, drift, _ = grpo_run
    assert drift["tokens"] > 0 and all(v == v for v in drift.values())  # measured (printed above), finite
    # Whatever the model's drift is, detlogp adds nothing to it: identical hidden rows give identical logp.
    for own in rows[2:4]:  # processed, raw
        assert own.bit_equal >= drift["rows_bit_equal"]


def test_c_the_bf16_logits_baseline_drifts_against_the_trainers_recomputation(grpo_run):
    _, rows, _, _ = grpo_run
    base = rows[5]  # model(...).logits bf16 + log_softmax vs detlogp, one and the same forward
    assert base.max_abs > 0 and base.bit_equal < 1


def test_d_the_mean_reward_rises(grpo_run):
    curve = grpo_run[0]
    first, last = sum(curve[:5]) / 5, sum(curve[-5:]) / 5
    assert last > first + 0.15, curve


def test_the_example_runs_and_writes_the_reward_curve(tmp_path, capsys):
    png = tmp_path / "reward.png"
    assert ex.main(["--steps", "3", "--png", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = capsys.readouterr().out
    exact = "detlogp replay, the same hidden fed to the trainer | 0 | 0 | 0 | 0 | 100.0 % | 0 |"
    assert f"| detlogp processed, decode hidden | {exact}" in text
    assert f"| detlogp raw, decode hidden | {exact}" in text
    assert "SamplingParams(temperature=0.9, top_k=50, top_p=0.95, min_p=0.0)" in text
    assert "hidden-state drift of the model itself" in text


# --- GPU: Qwen3's vocabulary, and the Qwen3-8B head's memory ------------------------------------------------

_no_cuda = not torch.cuda.is_available()
_why = "needs torch with CUDA (an H100/H200 for the SM90 backend); this machine has none"
SM90 = "cuda-fused-linear-logp-sm90-contract-v1"


@pytest.mark.gpu
@pytest.mark.skipif(_no_cuda, reason=_why)
@pytest.mark.parametrize("hidden, layers", [(1024, 2), (2048, 8)])
def test_gpu_grpo_on_a_qwen3_vocabulary(hidden, layers):
    m = ex.build_model(ex.gpu_config(hidden, layers), "cuda", 0)
    curve, rows, drift, exact = ex.train(m, steps=30, seed=0, lr=1e-2)
    print(ex.format_parity(rows))
    print(ex.format_drift(drift))
    print("reward:", " ".join(f"{x:.3f}" for x in curve))
    rep = dt.last_report()  # the trainer's replay of the program (token_logprobs with sampling=)
    assert rep["backend_id"] == SM90 and rep["provenance"]["sample_id"] == "sample/v1"
    assert exact  # (a), processed and raw, every step
    for fed in rows[:2]:
        assert fed.max_k3 == 0 and fed.max_ratio_dev == 0 and fed.bit_equal == 1 and fed.outside == 0
    assert rows[5].max_abs > 0  # (c)
    assert sum(curve[-5:]) / 5 > sum(curve[:5]) / 5 + 0.15, curve  # (d)


@pytest.mark.gpu
@pytest.mark.skipif(_no_cuda, reason=_why)
def test_gpu_rollout_per_prompt_programs_are_the_cuda_sample_and_replay_bit_for_bit():
    """The CPU per-prompt tests on CUDA at Qwen3's vocabulary: each token is dt.sample of its decode
    hidden state with its prompt's parameters and key (SM90 backend), and the trainer's replay on
    those hidden states gives logp and logp_raw bit for bit."""
    m = ex.build_model(ex.gpu_config(1024, 2), "cuda", 0)
    prompts = [[70, 71, 72], [80, 81, 82, 83, 84, 85], [90], [100, 101]]
    budgets = [3, 6, 2, 5]
    params = _program_map(_per_prompt_program(), lambda v: v.cuda())
    r = dtx.rollout(m, prompts, budgets, sampling=params, seed=11, keep_hidden=True)
    assert dt.last_report()["backend_id"] == SM90
    for i in range(4):
        one = _program_map(params, lambda v: v[i].item())
        n = budgets[i]
        ref = dt.sample(r.hidden[i, :n], m.lm_head.weight, one, 11, i * dtx.KEY_STRIDE + torch.arange(n).cuda())
        assert torch.equal(ref.token, r.tokens[i, :n])
        assert torch.equal(ref.logp.view(torch.int32), r.logp[i, :n].view(torch.int32))
        assert torch.equal(ref.logp_raw.view(torch.int32), r.logp_raw[i, :n].view(torch.int32))
    p, sel = r.prompt_len, r.mask
    with torch.no_grad():
        h = dtx.hidden_states(m, r.input_ids, r.attention_mask, r.position_ids)
        h[:, p - 1 : p - 1 + sel.shape[1]][sel] = r.hidden[sel]
        out = dtx.head_logprobs(m, h, r.input_ids, r.attention_mask, r.position_ids, sampling=r.sampling)
    assert dt.last_report()["backend_id"] == SM90
    assert torch.equal(out.logp[:, p:][sel].view(torch.int32), r.logp[sel].view(torch.int32))
    assert torch.equal(out.logp_raw[:, p:][sel].view(torch.int32), r.logp_raw[sel].view(torch.int32))


@pytest.mark.gpu
@pytest.mark.skipif(_no_cuda, reason=_why)
def test_gpu_memory_at_the_qwen3_8b_head_has_no_n_by_v_buffer():
    """A trainer step (forward + backward through a one-layer body) at Qwen3-8B's head, D = 4096,
    V = 151936, with 16384 tokens: detlogp's peak above the same step with a head-free loss stays
    within the head gradient and the backward's chunk workspace, below a quarter of one [N, V] fp32
    buffer, while model(...).logits + log_softmax needs more than one [N, V] bf16 buffer."""
    from transformers import Qwen3Config

    cfg = Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=1,
                      num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                      tie_word_embeddings=False)  # fmt: skip
    m = ex.build_model(cfg, "cuda", 0)
    b, s = 4, 4096
    n, v, d = b * s, cfg.vocab_size, cfg.hidden_size
    ids = torch.randint(0, v, (b, s), device="cuda")

    def body_only():
        dtx.hidden_states(m, ids).float().mean().backward()

    def detlogp_step():
        dtx.token_logprobs(m, ids).logp.sum().backward()

    def logits_step():
        logits = m(input_ids=ids).logits
        torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None]).sum().backward()

    for p in m.parameters():  # gradients allocated once, before the measurement
        p.grad = torch.zeros_like(p)
    from detlogp.bench.harness import peak_extra_bytes
    peaks = {}
    for name, fn in (("body", body_only), ("detlogp", detlogp_step), ("logits", logits_step)):
        fn()  # warm-up (allocator, kernels)
        peaks[name] = peak_extra_bytes(fn)
    nv4 = n * v * 4
    head = peaks["detlogp"] - peaks["body"]
    print(f"N={n} D={d} V={v}: peak above start, GiB: body {peaks['body'] / 2**30:.2f}, detlogp "
          f"{peaks['detlogp'] / 2**30:.2f} (head {head / 2**30:.2f}), model(...).logits {peaks['logits'] / 2**30:.2f};"
          f" one [N, V] fp32 buffer {nv4 / 2**30:.2f}")  # fmt: skip
    # The head's own: its weight gradient (bf16, added into .grad), the fused backward's dz chunk, the
    # fp32 hidden-gradient accumulator and the forward's per-row outputs, with 256 MiB to spare.
    budget = v * d * 2 + dt.BACKWARD_FUSED_CHUNK_BYTES + n * d * 8 + 2**28
    assert head < budget, (head, budget)
    assert head < nv4 / 4
    assert peaks["logits"] - peaks["body"] > n * v * 2
