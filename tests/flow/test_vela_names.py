"""Vela's command stream does not depend on TOSA tensor names, the order of a block's tensor list, nor the order of its
constants (CONST operators).

Region replay for Ethos-U (issue 42, ``../shared/notes/regions-ethosu.md``)
rests on this: a spliced TOSA graph may differ from stock's in the names
passes mint from whole-graph counters and in constant order, and still give
stock's Vela stream, and so stock's ``.pte``. It was measured once by hand on
two configs; here it is checked on every Ethos-U accelerator with every
system config and memory mode Vela accepts for it. If one ever depends on
names, regions must not be used for it.
"""

from __future__ import annotations

import pytest

from lowercache.targets.arm_ethosu import TARGETS as ETHOSU_TARGETS, vela_sections

from tests.helpers.tosa import FAMILIES, MODELS, constants_reordered, one_weight_changed, renamed, shuffled, vela


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("target", ETHOSU_TARGETS)
def test_vela_stream_ignores_tensor_names_and_order(target, model, partitions):
    family = target.rsplit("-", 1)[0]
    tosa = partitions[model, family]
    variants = {"renamed": renamed(tosa, 1), "renamed again": renamed(tosa, 2), "shuffled": shuffled(tosa, 3),
                "constants reordered": constants_reordered(tosa, 4)}
    configs = [c for c in vela_sections("System_Config") if c.startswith(FAMILIES[family] + "_")]
    accepted = 0
    for system_config in configs:
        for memory_mode in vela_sections("Memory_Mode"):
            stock = vela(tosa, target, system_config, memory_mode)
            if stock is None:
                continue
            if not accepted:
                assert vela(one_weight_changed(tosa), target, system_config, memory_mode) != stock
            accepted += 1
            for name, variant in variants.items():
                assert vela(variant, target, system_config, memory_mode) == stock, (system_config, memory_mode, name)
    assert accepted >= len(configs)  # every system config with at least one memory mode
