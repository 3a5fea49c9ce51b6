"""Adapters of detlogp to the libraries RL code trains with, one module each (import the module:
this package imports none of them, so detlogp does not depend on them):

- ``detlogp.integrations.transformers``: a Hugging Face ``transformers`` causal LM's per-token logp
  (and entropy) through ``detlogp.torch.linear_logp``, and a KV-cache rollout loop sampling with
  detlogp's sampling program and recording each token's processed and raw logp, which the trainer
  replays (docs/integrations.md).
"""
