"""Inference on the network of ``model/``: the KV caches and their attention plan (``kv_cache``,
``paged_cache``, ``attention_plan``, ``slots``), ``prefill`` and the one ``decode_step`` entry
(``step``: eager, compiled-CPU and CUDA variants chosen inside it), the search step shared with the
serving engine (``search``, ``topk``), offline decoding (``generate``), the compiled CPU kernels
(``kernels``, ``csrc/``) and the int8 linear layers as a module-swap pass (``linear``).

Nothing is re-exported here: import from the modules, so that ``model.inference.prefill`` and
``model.inference.generate`` always name the modules."""
