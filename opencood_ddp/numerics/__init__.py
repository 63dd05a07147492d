"""Numerical kernels below every layer: compiled helpers (``jit``) and accurate batch-norm statistics
(``batch_norm``). Nothing here knows perception or torch.distributed."""
