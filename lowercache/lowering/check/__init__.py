"""The numerics check (``lower --check``, docs/numerics.md): a lowering's outputs and, per layer, where the error enters,
against the eager float model; its key and its torch-free report."""
