"""Inference on the network of ``model/``: the KV caches and their attention plan (``kv_cache``,
``paged_cache``, ``attention_plan``, ``slots``), ``prefill`` and the one ``decode_step`` entry
(``step``, which alone chooses among its variants: ``dense_step`` and ``cuda_graphs`` for GPUs,
``fused_step`` on CPU, the eager reference), beam search (``beam``) and the search step shared with
the serving engine (``search``, ``topk``), offline decoding (``generate``), the compiled CPU kernels
(``kernels``, ``csrc/``), the int8 linear layers as a module-swap pass (``linear``) and the compute
switches with their environment defaults (``settings``).

Nothing is re-exported here: import from the modules, so that ``model.inference.prefill`` and
``model.inference.generate`` always name the modules."""
