"""Cost models: hardware profiles (:mod:`.hardware`), compute (:mod:`.compute`),
communication (:mod:`.comm`) and memory (:mod:`.memory`). Seconds and bytes only.
Nothing here imports ``torch.distributed`` except :mod:`.profiling`, which measures a
machine and writes its profile. The formulas: docs/cost_models.md."""
