"""An exact, faster ``torch.utils._pytree.tree_iter``: plain containers and leaves are walked directly, as torch's own flatteners walk them.

Why it is exact, and figures: docs/speedups.md#treeiter.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

from .patching import AttributePatch

# Set when the patch is applied: torch's function, its registry, the entries
# this walk mirrors, and FX's immutable collection types.
_original: Callable[..., Iterator[Any]] | None = None
_nodes: dict[type, Any] = {}
_expected: tuple[tuple[type, Any], ...] = ()
_immutable_list: type = list
_immutable_dict: type = dict


def tree_iter(tree: Any, is_leaf: Callable[[Any], bool] | None = None) -> Iterator[Any]:
    """Same contract as torch's ``tree_iter``: the leaves of ``tree``, in order."""
    if is_leaf is not None or not all(_nodes.get(cls) is node_def for cls, node_def in _expected):
        yield from _original(tree, is_leaf=is_leaf)
    else:
        yield from _walk(tree)


def _walk(tree: Any) -> Iterator[Any]:
    kind = type(tree)
    if kind is tuple:
        children = list(tree)
    elif kind is list or kind is _immutable_list:
        children = tree
    elif kind is dict or kind is _immutable_dict:
        children = list(tree.values())
    elif kind not in _nodes and not issubclass(kind, tuple):
        yield tree
        return
    else:
        yield from _original(tree)  # namedtuples, torch.Size, registered classes
        return
    for child in children:
        kind = type(child)
        if kind in _nodes or issubclass(kind, (tuple, list, dict)):
            yield from _walk(child)
        else:
            yield child  # a leaf, yielded here rather than one generator deeper


def _pytree_module() -> list[Any]:
    """The module to patch, once its registrations for the fast cases are checked to be torch's."""
    global _original, _nodes, _expected, _immutable_list, _immutable_dict
    from torch.fx.immutable_collections import (
        _immutable_dict_flatten,
        _immutable_list_flatten,
        immutable_dict,
        immutable_list,
    )
    from torch.utils import _pytree as pytree

    flatten = {
        tuple: pytree._tuple_flatten,
        list: pytree._list_flatten,
        dict: pytree._dict_flatten,
        immutable_list: _immutable_list_flatten,
        immutable_dict: _immutable_dict_flatten,
    }
    nodes = pytree.SUPPORTED_NODES
    if any(cls not in nodes or nodes[cls].flatten_fn is not fn for cls, fn in flatten.items()):
        return []  # registrations differ from the ones this mirrors: leave torch's walk alone
    _expected = tuple((cls, nodes[cls]) for cls in flatten)
    _original, _nodes = pytree.tree_iter, nodes
    _immutable_list, _immutable_dict = immutable_list, immutable_dict
    return [pytree]


_patch = AttributePatch(_pytree_module, "tree_iter", tree_iter)
enable = _patch.enable  # while a lowering runs
disable = _patch.disable
active = _patch.active
