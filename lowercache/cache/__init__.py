"""The cache engine: content hashing, the local store, steps with named key parts, remote tiers.

Nothing here knows about ExecuTorch: a step is a function of its declared
inputs, keyed by their digests, and its result is bytes. The lowering flow
(``lowercache.lowering``) builds on it; it imports nothing above it.
"""
