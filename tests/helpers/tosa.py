"""TOSA flatbuffers rewritten in ways Vela must not see: tensors renamed, the tensor list shuffled, constants
reordered; and one weight changed, which it must see."""

from __future__ import annotations

import random
import struct

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
    a region splice lists constants in another order than stock (``lowering/replay/regionsplice.py``)."""
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
