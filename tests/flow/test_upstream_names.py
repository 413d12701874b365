"""An Ethos-U .pte does not depend on node names upstream of the TOSA pass pipeline.

A region splice further upstream than today's (``lowering/replay/regionsplice.py``) would hand on a program equal to
stock's up to node names, which are minted from whole-graph counters. Two stages are checked, on tiny_cnn for
Ethos-U55-128 (``benchmarks/upstream_names.py`` measures more models and targets, ``docs/regions.md``):

1. the quantized ExportedProgram ``to_edge_transform_and_lower`` receives: every call_function node and placeholder
   renamed at random, the signature with it; and its lifted constants' placeholders in another order. None of the new
   names reaches stage 2: ``to_edge``'s first ``run_decompositions`` re-traces and names every node again;
2. the edge program each partition's ``TOSABackend._preprocess`` receives: renamed the same way. The new names reach
   the TOSA flatbuffer; Vela's stream ignores them (``test_vela_names.py``).

The .pte stays stock's. One weight changed does change it, so the comparisons can fail.
"""

from __future__ import annotations

import torch

from benchmarks.upstream_names import lower, rename, reorder

from tests.helpers.oracle import reference

MODEL, TARGET = "tiny_cnn", "ethos-u55-128"


def _one_weight_changed(module: torch.nn.Module) -> None:
    with torch.no_grad():
        next(module.parameters()).view(-1)[0] += 1.0


def test_pte_ignores_node_names_upstream_of_the_tosa_pipeline():
    stock = reference(MODEL, TARGET)

    renamed: dict[str, str] = {}
    stage1_tosa: list[bytes] = []
    seen: set[str] = set()
    assert lower(MODEL, TARGET, stage1=lambda p: renamed.update(rename(p, 1)),
                 stage2=lambda p, i: seen.update(n.name for n in p.graph.nodes), tosa=stage1_tosa) == stock
    assert len(renamed) > 20
    assert seen and not seen & set(renamed.values())  # to_edge's re-trace names every node again

    reordered: list[str] = []
    assert lower(MODEL, TARGET, stage1=lambda p: reordered.extend(reorder(p, 2))) == stock
    assert len(reordered) > 20

    counts: list[int] = []
    stage2_tosa: list[bytes] = []
    assert lower(MODEL, TARGET, stage2=lambda p, i: counts.append(len(rename(p, 3 + i))), tosa=stage2_tosa) == stock
    assert counts and min(counts) > 20
    assert len(stage2_tosa) == len(stage1_tosa) and stage2_tosa != stage1_tosa  # the new names reach the flatbuffer

    assert lower(MODEL, TARGET, edit=_one_weight_changed) != stock
