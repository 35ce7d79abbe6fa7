"""LoRA adapters over the base model's projections, many adapters in one batch.

* :mod:`.adapter`: reads and validates a PEFT adapter folder into a :class:`~.adapter.LoRAAdapter`
  (fp32 A and B per (layer, module), the scaling folded into B). Anything that does not fit the
  base model is refused there, before a tensor is read.
* :mod:`.stack`: the device slots of one projection (q/k/v fused, o, gate/up fused, down): what
  :meth:`ModelRunner.set_lora <qworker.model.runner.ModelRunner.set_lora>` writes an adapter into.
* :mod:`.apply`: the per-step segments (which rows run under which slot) and the projection
  wrapper that adds each segment's ``x @ A.T @ B.T`` to the base output: grouped torch GEMMs on
  the CPU backend, the Triton shrink/expand kernels (:mod:`kernels.lora_sgmv`) on the Triton one.

Without :meth:`ModelRunner.enable_lora` nothing here is on the forward path.
"""
