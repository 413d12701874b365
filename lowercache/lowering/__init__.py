"""The lowering flow: ExecuTorch's Arm pipeline cut into cached steps.

Export, quantization, ``to_edge_transform_and_lower`` with the Arm
partitioners, per-partition TOSA and Vela, and ``to_executorch``, each a step
of ``lowercache.cache``. Exact speed-ups (``lowercache.speedups``) are switched
on around it; the flow's output bytes are stock ExecuTorch's.
"""
