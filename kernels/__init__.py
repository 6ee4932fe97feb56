"""Triton kernels of flashsdpa (installed as flashsdpa.kernels).

Imported lazily, only when an XPU/GPU tensor needs them: `import flashsdpa` never requires
Triton.
"""
