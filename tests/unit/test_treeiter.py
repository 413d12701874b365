"""The fast tree_iter yields torch's leaves in torch's order, as lazily, and is installed only while active."""

from __future__ import annotations

import collections
import dataclasses
import warnings

import pytest
import torch
import torch.utils._pytree as pytree
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.fx.immutable_collections import immutable_dict, immutable_list

from lowercache.lowering import arm
from lowercache.speedups import treeiter

STOCK = pytree.tree_iter
Point = collections.namedtuple("Point", "x y")


@dataclasses.dataclass
class Registered:
    a: object
    b: object


pytree.register_pytree_node(
    Registered,
    lambda r: ([r.b, r.a], None),  # children in a custom order
    lambda values, _: Registered(values[1], values[0]),
    serialized_type_name="tests.test_treeiter.Registered",
)


class PlainList(list):
    """A list subclass the registry does not know: a leaf."""


def trees():
    graph = torch.fx.Graph()
    node = graph.placeholder("x")
    symint = ShapeEnv().create_unbacked_symint()
    return [
        1,
        None,
        (),
        [],
        {},
        (node, 2, [3, (4.0, "s")], {"k": [5, {"j": None}]}),
        ((node, [1, 1], [0, 0], False, 1), {}),
        ((node, symint, 3), {"dim": symint}),
        immutable_list([1, immutable_dict({"a": (2, 3)})]),
        Point(1, [2, Point(3, 4)]),
        collections.OrderedDict([("b", 1), ("a", (2, 3))]),
        collections.defaultdict(list, {"z": [1, 2]}),
        collections.deque([1, (2, 3)]),
        torch.Size([2, 3]),
        (torch.zeros(2), [torch.ones(1)], Registered([1, 2], (3,))),
        [PlainList([1, 2]), {"d": PlainList([3])}],
        {"b": 1, "a": 2},  # insertion order, not sorted
        [slice(1, 2), torch.float32, torch.device("cpu"), Ellipsis],
    ]


def same(got, expected):
    return len(got) == len(expected) and all(a is b for a, b in zip(got, expected))


@pytest.mark.parametrize("index", range(len(trees())))
def test_same_leaves_in_the_same_order(index):
    tree = trees()[index]
    as_list = lambda x: isinstance(x, list)  # noqa: E731
    expected, expected_is_leaf = list(STOCK(tree)), list(STOCK(tree, is_leaf=as_list))
    with treeiter.active():
        assert pytree.tree_iter is treeiter.tree_iter
        got, got_is_leaf = list(pytree.tree_iter(tree)), list(pytree.tree_iter(tree, is_leaf=as_list))
        leaves = pytree.tree_leaves(tree)
    assert same(got, expected) and same(leaves, expected)
    assert same(got_is_leaf, expected_is_leaf)


def walk_and_mutate(iterate):
    """Appends to a list the walk has not reached yet, and to the one it is in:
    torch's walk sees both (a list is walked live, a tuple as a copy)."""
    current, later = [1, 2], [3]
    tree = (current, later, (4,))
    seen = []
    for leaf in iterate(tree):
        seen.append(leaf)
        if leaf == 1:
            later.append(98)
            current.append(99)
    return seen


def test_as_lazy_as_torch():
    expected = walk_and_mutate(STOCK)
    assert 98 in expected and 99 in expected
    with treeiter.active():
        assert walk_and_mutate(pytree.tree_iter) == expected


def test_create_node_still_warns_about_raw_symbolic_values():
    symint = ShapeEnv().create_unbacked_symint()
    with treeiter.active(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        graph = torch.fx.Graph()
        x = graph.placeholder("x")
        graph.create_node("call_function", torch.ops.aten.add.Tensor, (x, 1))
        assert not [w for w in caught if "Raw SymInt" in str(w.message)]
        graph.create_node("call_function", torch.ops.aten.add.Tensor, (x, [symint]))
    assert [w for w in caught if "Raw SymInt" in str(w.message)]


def test_installed_only_while_lowering_hooks_are_on():
    assert pytree.tree_iter is STOCK
    with arm.hooks():
        assert pytree.tree_iter is treeiter.tree_iter
    assert pytree.tree_iter is STOCK
