"""lowercache: incremental, caching lowering of PyTorch models to Arm targets."""
