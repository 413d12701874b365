"""The benchmark: stock ExecuTorch against lowercache on seeded models (``harness``),
the models themselves (``models``) and the stock reference runner (``stockref``).
"""
