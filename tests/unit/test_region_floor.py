"""The benchmark's edit floor (``benchmarks/region_edit.py``): what a replay of unchanged regions could reach at best.

docs/regions.md judges issue 42's aims by these floors, so their arithmetic is checked here on made-up pieces.
"""

from __future__ import annotations

import pytest

from benchmarks import region_edit

PIECES = {
    "export": 1.0, "prepare": 2.0, "of it annotation passes": 1.5, "calibrate": 0.0, "convert": 1.0, "re-export": 1.0,
    "to_edge outside TOSA and Vela": 2.0, "TOSA pipeline prefix": 2.0, "TOSA pipeline suffix (layout passes on)": 3.0,
    "TOSA visitors and serialization": 1.0, "Vela": 1.0, "to_executorch": 1.0,
    "rest (hash, cache, start-up of steps)": 5.0, "total": 25.0,
}


def test_the_floor_keeps_whole_model_pieces_and_shrinks_the_rest_to_the_changed_share():
    floor = region_edit.floor(PIECES, unchanged_share=0.6, block_share=0.1, cold=19.2)
    assert floor["whole-model pieces"] == 6.0  # export, suffix, Vela, to_executorch
    assert floor["region-able pieces"] == 9.0  # the "of it" line and the rest are not counted
    assert floor["edit floor"] == pytest.approx(6.0 + 0.4 * 9.0)
    assert floor["cold / edit floor"] == 2.0
    assert floor["edit floor, suffix region-able too"] == pytest.approx(9.6 - 0.6 * 3.0)
    assert floor["edit floor if only the edited block re-ran"] == pytest.approx(6.0 + 0.1 * 9.0)
    # served up to the pipeline: the prefix and visitors (3.0) run for every changed region, the rest for the block
    assert floor["edit floor if the blocks after it re-ran from the TOSA pipeline on"] == pytest.approx(6.0 + 0.1 * 6.0 + 0.4 * 3.0)


def test_reuse_counts_the_nodes_of_unchanged_regions_and_of_the_edited_block():
    base = {"stem": ("a", 10), "stages.0": ("b", 20), "stages.0.1": ("c", 30), "head": ("d", 40)}
    edited = {"stem": ("a", 10), "stages.0": ("B", 20), "stages.0.1": ("C", 30), "head": ("D", 40)}
    found = region_edit.reuse(base, edited, "stages.0")
    assert found["unchanged"] == 1 and found["changed"] == ["stages.0", "stages.0.1", "head"]
    assert found["node share unchanged"] == 0.1
    assert found["node share of the edited block"] == 0.5  # stages.0 and the regions inside it, not stem
