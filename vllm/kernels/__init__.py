"""Triton kernels for the sparse-MLA path on Hopper (SPEC §3, §10; issue 5).

One module per op, each with a public wrapper whose docstring is the spec, a private
``_..._kernel``, the plain-torch reference it must match and a ``..._cost(shape) -> (flops, bytes)``:

  * ``kv_write``           quantise + scatter new rows into the fp8_ds_mla / indexer caches
  * ``sparse_mla_fwd``     the one sparse-MLA attention kernel (MQA: a KV row serves every head)
  * ``sparse_mla_decode``  paged decode over the fp8_ds_mla or bf16 cache (split-K + merge)
  * ``sparse_mla_prefill`` MQA prefill over a flat bf16/fp32 context
  * ``merge_attn``         LSE merge of partial attentions (DCP combine, split-K combine)
  * ``indexer_logits``     lightning-indexer scores (prefill over flat keys, decode over pages)
  * ``topk``               exact top-k selection by radix select (score desc, position asc)
  * ``moe_grouped``        routed experts as two grouped GEMMs, no host sync (opt-in)

Nothing outside ``vllm/attention/ops/dispatch.py`` should import these modules: it decides when the
fast kernels run (CUDA tensors) and when the references do (CPU, VLLM_USE_REF_KERNELS=1). The one
exception is ``moe_grouped``, which ``vllm/model_executor/layers/moe.py`` imports when
VLLM_MOE_BACKEND=grouped. Importing this package does not import Triton; the op modules do.
"""
