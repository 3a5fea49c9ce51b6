"""The modules behind ``detlogp.torch``, one role each (import ``detlogp.torch``, not these):

- ``tensors``: argument checks and the tensor forms the C++ library takes;
- ``op``: the forward custom op ``detlogp::linear_logp`` (library lanes, the plain-torch lane, the
  fake implementation), its report readback and its autograd registration;
- ``grad_logits``: the custom op ``detlogp::grad_logits`` (one chunk's logit gradient);
- ``backward``: the chunked backward (the fused SM90 path and the torch chunk loop);
- ``tensor_parallel``: ``tp_group`` calls, the C++ tensor-parallel operator over torch.distributed.
"""
