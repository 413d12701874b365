"""An identity picture of a graph module: what the skip speed-ups (``retraceskip``, ``checkskip``) compare to tell
that a graph is as it was, without running any ``__eq__``."""

from __future__ import annotations

from typing import Any


def snapshot(graph_module: Any) -> tuple:
    """The graph and its name space (a name a body made and erased again still counts), each node (name, op,
    target, argument tuples, users in order, metadata keys and the objects they hold), the module's metadata and its
    tensors and submodules, by identity. Every object whose id is taken is kept alive in the last slot, so that no id
    is reused while the picture lives. Generated code is not read: ``recompile`` may renew it."""
    import torch

    graph = graph_module.graph
    space = graph._graph_namespace
    keep: list = [graph, graph._codegen, space, graph_module.meta]
    rows = []
    for n in graph.nodes:
        values = tuple(n.meta.values())
        keep += (n, n.args, n.kwargs, n.target, *values)
        rows.append((id(n), n.op, n.name, id(n.target), id(n.args), id(n.kwargs), tuple(map(id, n.users)),
                     tuple(n.meta), tuple(map(id, values))))
    meta = tuple(graph_module.meta.items())
    held = [(name, v) for name, v in vars(graph_module).items() if isinstance(v, (torch.Tensor, torch.nn.Module))]
    held += [(f"{table}.{name}", v) for table in ("_modules", "_parameters", "_buffers")
             for name, v in vars(graph_module)[table].items()]
    keep += [v for _, v in meta] + [v for _, v in held]
    return (id(graph), id(graph._codegen), id(space), len(space._used_names), len(space._obj_to_name),
            tuple(space._base_count.items()), tuple((k, id(v)) for k, v in meta), tuple(rows),
            tuple((name, id(v)) for name, v in held), keep)


def same(a: tuple, b: tuple) -> bool:
    """Equal pictures (the objects kept alive, the last slot, are compared through their ids)."""
    return a[:-1] == b[:-1]
