"""The XNNPACK per-partition step (``lowering/xnnpack.py``): what its key covers, and its stored form round-trips."""

from __future__ import annotations

import json

import pytest
import torch

from lowercache.cache.store import Entry
from lowercache.lowering import xnnpack


def _partition() -> torch.export.ExportedProgram:
    torch.manual_seed(0)
    return torch.export.export(torch.nn.Sequential(torch.nn.Linear(4, 3)).eval(), (torch.randn(1, 4),))


def test_the_key_covers_source_functions_debug_handles_and_compile_specs():
    """The linear pass groups nodes by ``source_fn_stack``, which the common graph digest leaves out."""
    from executorch.exir.backend.compile_spec_schema import CompileSpec

    program = _partition()
    before = xnnpack.preprocess_parts(program, [])
    node = next(n for n in program.graph.nodes if n.op == "call_function")

    def changed(specs=()):
        after = xnnpack.preprocess_parts(program, list(specs))
        return sorted(k for k in before if before[k] != after[k])

    node.meta["source_fn_stack"] = [("renamed", torch.nn.Linear)]
    assert changed() == ["source_fns"]
    before = xnnpack.preprocess_parts(program, [])
    node.meta["debug_handle"] = 7
    assert changed() == ["program.graph"]
    before = xnnpack.preprocess_parts(program, [])
    assert changed([CompileSpec("dqlinear_partitioner", b"")]) == ["compile_specs"]


def _result():
    from executorch.exir._serialize._named_data_store import NamedDataStore
    from executorch.exir.backend.backend_details import PreprocessResult

    store = NamedDataStore()
    store.add_named_data("b", b"\x02" * 8, alignment=16)
    store.add_named_data("a", b"\x01" * 4, alignment=8)
    store.add_named_data("same as b", b"\x02" * 8, alignment=16)
    store.add_named_data("t", torch.arange(6, dtype=torch.float32).reshape(2, 3), external_tag="weights.ptd")
    return PreprocessResult(processed_bytes=b"delegate", debug_handle_map={3: (1, 2), "x": (4,)},
                            data_store_output=store.get_named_data_store_output())


def _kept(entry: Entry) -> Entry:
    """The entry as a store gives it back: its metadata through JSON."""
    return Entry(meta=json.loads(json.dumps(entry.meta)), blobs=dict(entry.blobs))


def test_a_result_round_trips_equal_in_every_field_and_order():
    stock = _result()
    served = xnnpack._served(_kept(xnnpack._stored(stock)))
    assert served == stock and served.data_store_output.external_data["weights.ptd"]["t"].tensor_layout is not None
    assert list(served.data_store_output.pte_data) == ["b", "a", "same as b"]
    assert served.debug_handle_map == {3: (1, 2), "x": (4,)}


def test_a_result_with_delegate_info_is_not_stored():
    stock = _result()
    stock._delegate_info_meta = {"anything": 1}
    with pytest.raises(xnnpack._Unstorable):
        xnnpack._stored(stock)


@pytest.mark.parametrize("damage", [
    lambda m: m["data_store"].update(buffers=1),
    lambda m: m["data_store"]["pte_data"][0].__setitem__(1, "0"),
    lambda m: m["data_store"]["external_data"][0][1][0][3].__setitem__(0, "NOT_A_TYPE"),
    lambda m: m.pop("debug_handle_map"),
])
def test_a_malformed_entry_raises_for_a_recompute(damage):
    entry = _kept(xnnpack._stored(_result()))
    damage(entry.meta)
    with pytest.raises((KeyError, TypeError, ValueError)):
        xnnpack._served(entry)
