"""Sparse-MLA attention: KV cache formats (`kv_cache`), plain-torch reference ops (`ops/`), and the
attention layer that the model calls (`layer`). Parallel plumbing (PCP gathers, DCP shards) reaches
the layer through the communicator in its metadata; the model file never sees ranks."""
