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

import random
import struct

import pytest

from lowercache import api
from lowercache.bench import models
from lowercache.config import Settings
from lowercache.lowering.targets import ETHOSU_TARGETS, vela_sections

FAMILIES = {"ethos-u55": "Ethos_U55", "ethos-u65": "Ethos_U65", "ethos-u85": "Ethos_U85"}


def _names(tosa: bytes) -> list[str]:
    """Every tensor name of every block, as the flatbuffer holds them."""
    from tosa.TosaGraph import TosaGraph

    graph = TosaGraph.GetRootAs(tosa, 0)
    names = []
    for r in range(graph.RegionsLength()):
        region = graph.Regions(r)
        for b in range(region.BlocksLength()):
            block = region.Blocks(b)
            names += [block.Tensors(t).Name().decode() for t in range(block.TensorsLength())]
    return names


def renamed(tosa: bytes, seed: int) -> bytes:
    """Each tensor renamed at random, consistently (same length, in place: every occurrence of the string)."""
    rng = random.Random(seed)
    out = bytearray(tosa)
    taken = set(_names(tosa))
    for name in sorted(set(_names(tosa))):
        new = name
        while new in taken:
            new = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789_") for _ in name)
        taken.add(new)
        old_bytes = struct.pack("<I", len(name)) + name.encode() + b"\0"
        new_bytes = struct.pack("<I", len(new)) + new.encode() + b"\0"
        at = out.find(old_bytes)
        while at >= 0:
            out[at:at + len(old_bytes)] = new_bytes
            at = out.find(old_bytes, at + len(new_bytes))
    assert _names(bytes(out)) != _names(tosa)
    return bytes(out)


def _permuted(tosa: bytes, seed: int, field: int, chosen) -> bytes:
    """Each block's vector at table ``field`` with the entries ``chosen(block, j)`` picks permuted among themselves
    (their offsets, in place)."""
    from tosa.TosaGraph import TosaGraph

    rng = random.Random(seed)
    out = bytearray(tosa)
    graph = TosaGraph.GetRootAs(tosa, 0)
    for r in range(graph.RegionsLength()):
        region = graph.Regions(r)
        for b in range(region.BlocksLength()):
            block = region.Blocks(b)
            table = block._tab
            vector = table.Vector(table.Offset(field))
            slots = [vector + 4 * j for j in range(table.VectorLen(table.Offset(field))) if chosen(block, j)]
            targets = [slot + struct.unpack_from("<I", tosa, slot)[0] for slot in slots]
            rng.shuffle(targets)
            for slot, target in zip(slots, targets):
                struct.pack_into("<I", out, slot, target - slot)
    return bytes(out)


def shuffled(tosa: bytes, seed: int) -> bytes:
    """Each block's tensor list in another order (the vector's offsets permuted in place)."""
    out = _permuted(tosa, seed, 8, lambda block, j: True)
    assert sorted(_names(out)) == sorted(_names(tosa)) and _names(out) != _names(tosa)
    return out


def constants_reordered(tosa: bytes, seed: int) -> bytes:
    """Each block's CONST operators in another order among themselves (the operator vector's offsets permuted in place):
    a region splice lists constants in another order than stock (``lowering/regionsplice.py``)."""
    from tosa.Op import Op

    out = _permuted(tosa, seed, 6, lambda block, j: block.Operators(j).Op() == Op.CONST)
    assert out != tosa
    return out


def one_weight_changed(tosa: bytes) -> bytes:
    """The largest constant with one byte flipped: a change Vela must see (so the comparisons above can fail)."""
    from tosa.TosaGraph import TosaGraph

    block = TosaGraph.GetRootAs(tosa, 0).Regions(0).Blocks(0)
    tensors = [block.Tensors(t) for t in range(block.TensorsLength())]
    largest = max(tensors, key=lambda t: t.DataLength())
    at = largest._tab.Vector(largest._tab.Offset(10))
    out = bytearray(tosa)
    out[at] ^= 0x01
    return bytes(out)


def vela(tosa: bytes, target: str, system_config: str, memory_mode: str) -> object:
    """Vela's stream (and external blocks) for the TOSA bytes under the compile spec's own flags; None when Vela refuses
    the combination."""
    from executorch.backends.arm.arm_vela import vela_compile
    from executorch.backends.arm.ethosu import EthosUCompileSpec

    flags = EthosUCompileSpec(target, system_config=system_config, memory_mode=memory_mode).compiler_flags
    try:
        result = vela_compile(tosa, list(flags))
    except (SystemExit, Exception):  # noqa: BLE001  (Vela says no to a memory mode the accelerator lacks)
        return None
    if isinstance(result, bytes):  # ExecuTorch 1.4 returns the stream itself
        return result
    return result.processed_bytes, result.external_blocks


MODELS = ("tiny_cnn", "transformer_block")  # convolutions; attention, layer norm and matmuls


@pytest.fixture(scope="module")
def partitions(tmp_path_factory) -> dict[tuple[str, str], bytes]:
    """Each model's first partition TOSA for one target of each family (the TOSA does not depend on the MAC count)."""
    cache = tmp_path_factory.mktemp("cache")
    found = {}
    for name in MODELS:
        for family in FAMILIES:
            target = next(t for t in ETHOSU_TARGETS if t.startswith(family))
            module, example = getattr(models, name)()
            artifacts = api.lower(module, example, target=target, settings=Settings(cache_dir=cache))
            found[name, family] = artifacts.files["partition_0.tosa"]
    return found


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
