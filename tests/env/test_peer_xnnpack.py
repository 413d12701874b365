"""The peer tier, XNNPACK: a sample of ExecuTorch's own XNNPACK backend tests (shipped in the wheel), fp32 and int8,
under ``lowercache run -- python -m pytest``: the same outcome per test as without it and the same digest for every
delegate payload and each buffer of named data it hands the .pte, cold and warm, the warm run's partitions served from
the cache (``XnnpackBackend.preprocess`` is the ``xnnpack`` step, wrapped by ``run``'s hook as Arm's TOSA step is).

A served partition skips what stock's ``preprocess`` does to the program it is given (the XNNPACK passes rewrite it in
place); ExecuTorch hands it a copy, and these tests (each lowering checked, run and compared with eager by the wheel's
own tester) see the same outcomes and bytes.
"""

from __future__ import annotations

import pytest

from tests.helpers import optests
from tests.helpers.optests import XNNPACK


@pytest.mark.peer
def test_xnnpack_backend_tests_have_stock_outcomes_and_payloads_under_run(tmp_path, cache_dir):
    stock, cold, warm, moved = optests.against_stock(tmp_path, cache_dir, XNNPACK)
    assert sorted(stock.payloads) == sorted(XNNPACK.tests)  # every test lowered
    assert any(data for rows in stock.payloads.values() for _, _, data in rows)  # weights among the compared bytes
    for name, run in (("cold", cold), ("warm", warm)):
        assert run.payloads == stock.payloads, (name, optests.differing(stock, run))
        assert (run.status, run.outcomes) == (stock.status, stock.outcomes), name
    # the warm run: every partition served
    assert moved.get("count/xnnpack/hit") == stock.count("XnnpackBackend") and not moved.get("count/xnnpack/miss"), moved
