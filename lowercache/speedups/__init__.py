"""Exact speed-ups: patches to torch and ExecuTorch that make a lowering cheaper
without changing a byte of its output.

Each one is pinned to a digest of the upstream source it was audited against
and stays off when the installed source differs. They are optional: with all
of them off, a lowering gives the same bytes, only slower.
"""
