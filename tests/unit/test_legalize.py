"""``legalize``: the graph made of the moved nodes is the graph torch's copy makes, call by call: the same order,
names, arguments (containers rebuilt as the copy rebuilds them), users in order, metadata (new dicts of the same
values), sort keys, name space and lookup table. On graphs built to need sorting, on its fallbacks, and on every call
of a real XNNPACK lowering with four partitions."""

from __future__ import annotations

import operator

import pytest
import torch
from torch.fx.passes import tools_common

from lowercache.speedups import legalize

from tests.helpers import attention


def described(value):
    """An argument as the graph holds it: nodes by name, every container with its exact type."""
    if isinstance(value, torch.fx.Node):
        return ("node", value.name)
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(described(v) for v in value))
    if isinstance(value, dict):
        return (type(value), tuple((k, described(v)) for k, v in value.items()))
    return (type(value), repr(value))


def picture(graph: torch.fx.Graph) -> tuple:
    """Everything a later reader of the graph can see, nodes by name (the copy's nodes are other objects)."""
    rows = []
    for n in graph.nodes:
        rows.append((n.name, n.op, str(n.target), described(n.args), described(n.kwargs), n.type,
                     tuple(u.name for u in n.users), tuple(i.name for i in n._input_nodes), tuple(n.meta),
                     tuple(map(id, n.meta.values())), n._sort_key, n._repr_fn, n._erased, dict(vars(n))))
    space, table = graph._graph_namespace, graph._find_nodes_lookup_table.table
    return (rows, sorted(space._used_names), dict(space._base_count), sorted(space._obj_to_name.values()),
            {key: [n.name for n in found] for key, found in table.items() if found}, len(graph.nodes), graph._len,
            graph._tracer_cls, graph._tracer_extras, graph._co_fields)


SHARED = object()  # a metadata value both builds hold: the copy's metadata holds the very object


def unsorted_graph(extra_attribute: bool = False, builtin_name: bool = False) -> torch.fx.GraphModule:
    """A graph whose nodes are out of topological order (as a partition's split leaves it): users made before
    their inputs, a torch.Size argument, keyword arguments, an ``operator.add`` the sort puts first, shared meta values."""
    g = torch.fx.Graph()
    x = g.placeholder("x")
    y = g.placeholder("y")
    relu = g.call_function(torch.ops.aten.relu.default, (x,))
    view = g.call_function(torch.ops.aten.view.default, (relu, torch.Size([2, 3])))
    add = g.call_function(torch.ops.aten.add.Tensor, (view, y), {"alpha": 2})
    total = g.call_function(operator.add, (view, 2))  # made ready with the aten add, sorted before it
    mul = g.call_function(torch.ops.aten.mul.Tensor, (add, total))
    # x's users in an order the sort does not make: the add, made first, waits for the sigmoid; the abs does not
    sig = g.call_function(torch.ops.aten.sigmoid.default, (y,))
    late = g.call_function(torch.ops.aten.add.Tensor, (x, sig))
    first = g.call_function(torch.ops.aten.abs.default, (x,))
    g.output((mul, add, late, first))
    for i, n in enumerate(g.nodes):
        n.meta.update(val=SHARED, index=i)
    with g.inserting_before(relu):  # a user made before its input: the graph needs sorting
        early = g.call_function(torch.ops.aten.neg.default, (mul,))
    g.output_node().args = ((mul, add, late, first, early),)
    relu._repr_fn = lambda node: f"<{node.name}>"  # a copy's is None
    if extra_attribute:
        relu.custom = "kept by a move, dropped by a copy"
    if builtin_name:
        object.__setattr__(relu, "name", "max")  # a copy renames it (a builtin's name)
    return torch.fx.GraphModule(torch.nn.Module(), g)


def both(build) -> tuple[tuple, tuple]:
    """The picture after stock's legalize and after the speed-up's, each on its own build of the same graph."""
    stock_gm, moved_gm = build(), build()
    codegens = stock_gm.graph._codegen, moved_gm.graph._codegen
    held = {n.name: (n.meta, n.args, n.kwargs) for n in moved_gm.graph.nodes}
    tools_common.legalize_graph(stock_gm)
    legalize.legalize_graph(moved_gm)
    assert (stock_gm.graph._codegen, moved_gm.graph._codegen) == codegens  # the very code generator, kept
    for n in moved_gm.graph.nodes:  # new metadata dicts and argument containers, as a copy's
        meta, args, kwargs = held.get(n.name, (None, None, None))
        assert n.meta is not meta and (not args or n.args is not args) and (not kwargs or n.kwargs is not kwargs)
    return picture(stock_gm.graph), picture(moved_gm.graph)


@pytest.fixture(autouse=True)
def _stock_behind(monkeypatch):
    """The speed-up falls back on torch's function (set when the patch is on)."""
    monkeypatch.setitem(legalize._originals, "legalize_graph", tools_common.legalize_graph)


@pytest.mark.quick
def test_the_speed_up_is_on_for_the_audited_source():
    assert legalize.sources_digest() == legalize._AUDITED_DIGEST


@pytest.mark.quick
@pytest.mark.parametrize("case", [{}, {"extra_attribute": True}, {"builtin_name": True}])
def test_a_graph_that_needs_sorting_is_the_copys(case):
    stock, moved = both(lambda: unsorted_graph(**case))
    targets = [row[2] for row in stock[0]]
    assert targets.index(str(operator.add)) < targets.index(str(torch.ops.aten.add.Tensor))
    assert targets.index(str(torch.ops.aten.neg.default)) > targets.index(str(torch.ops.aten.mul.Tensor))  # sorted
    x_users = next(row[6] for row in stock[0] if row[0] == "x")
    assert [targets[[r[0] for r in stock[0]].index(u)] for u in x_users][:2] == [str(torch.ops.aten.relu.default),
                                                                               str(torch.ops.aten.abs.default)]
    assert moved == stock


@pytest.mark.quick
def test_an_argument_from_another_graph_raises_stocks_error():
    def with_stranger() -> torch.fx.GraphModule:
        gm = unsorted_graph()
        relu = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.relu.default)
        relu.args = (torch.fx.Graph().placeholder("stranger"),)
        return gm

    with pytest.raises(KeyError):
        tools_common.legalize_graph(with_stranger())
    with pytest.raises(KeyError):
        legalize.legalize_graph(with_stranger())


@pytest.mark.quick
def test_a_cycle_raises_stocks_error():
    gm = unsorted_graph()
    relu = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.relu.default)
    neg = next(n for n in gm.graph.nodes if n.target is torch.ops.aten.neg.default)
    relu.args = (neg,)
    with pytest.raises(RuntimeError, match="Input graph has cycles"):
        legalize.legalize_graph(gm)


def test_every_split_of_a_real_lowering_is_the_copys(monkeypatch):
    """Stock's to_edge_transform_and_lower for XNNPACK (four partitions), each legalize call checked: torch's sort
    on the graph, then the speed-up on the same graph as it was (torch's leaves it untouched), compared."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import lowered_backend_module, to_edge_transform_and_lower

    compared = []

    def checked(gm: torch.fx.GraphModule) -> torch.fx.GraphModule:
        before = gm.graph
        tools_common.legalize_graph(gm)
        holder = torch.fx.GraphModule(gm, before)
        legalize.legalize_graph(holder)
        compared.append(picture(holder.graph) == picture(gm.graph) and holder.graph._codegen is gm.graph._codegen)
        return gm

    monkeypatch.setattr(lowered_backend_module, "legalize_graph", checked)
    model, example = attention.attention()
    to_edge_transform_and_lower(torch.export.export(model, example), partitioner=[XnnpackPartitioner()])
    assert len(compared) == 4 and all(compared)
