"""Lower partitions in the order the partitioner found them, in every process.

Stock ExecuTorch 1.5.1 is not deterministic across processes for Arm models
with more than one partition. ``TOSAPartitioner._tag_module`` collects the
partition tags (``tag0``, ``tag1``, ...) in a ``set`` of strings, and
``partition()`` builds ``partition_tags`` by iterating it, so their order
follows Python's per-process string-hash seed (``PYTHONHASHSEED``).
``to_backend`` then lowers the partitions in that order, and the order
changes the node order and names inside later partitions: the TOSA tensor
names, the Vela command stream and the .pte differ (data and ops do not).
Measured with stock alone: DeiT-tiny on Ethos-U55-128 gives one .pte under
hash seeds 0-2 and another under seed 3. Upstream:
https://github.com/pytorch/executorch/issues/19045 (open; the proposed fix,
pull request 19060, keeps discovery order, as here).

A cache cannot serve "what stock would give in this process" without
keying on the hash seed, which would make half the hits misses. So while
lowercache's hooks are on, ``partition_tags`` is put in discovery order
(the order of the tag counter), which is what stock produces whenever the
set happens to iterate in that order (for ``{tag0, tag1}``: seeds 3, 4, 6
and 7 of 0-8). Single-partition models are unaffected.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from ..speedups.patching import AttributePatch

_TAG = re.compile(r"tag(\d+)")


def discovery_order(tags: dict[str, Any]) -> dict[str, Any]:
    """``tags`` reordered by the partitioner's tag counter; unchanged unless every key is ``tag<N>``."""
    numbers = {}
    for tag in tags:
        match = _TAG.fullmatch(tag) if isinstance(tag, str) else None
        if match is None:
            return tags
        numbers[tag] = int(match.group(1))
    return {tag: tags[tag] for tag in sorted(tags, key=numbers.__getitem__)}


def is_discovery_order(tags: list[str]) -> bool:
    """Whether a stock run lowered its partitions in discovery order (so its bytes are the canonical ones)."""
    return list(discovery_order(dict.fromkeys(tags))) == list(tags)


def record_order(partitioner: Any, orders: list[list[str]]) -> Any:
    """Make one partitioner instance append the tag order of each result to ``orders`` (nothing else changes)."""
    partition = partitioner.partition

    def recording(exported_program: Any) -> Any:
        result = partition(exported_program)
        orders.append(list(result.partition_tags))
        return result

    partitioner.partition = recording
    return partitioner


def _owners() -> list[Any]:
    from executorch.backends.arm.tosa.partitioner import TOSAPartitioner

    return [TOSAPartitioner]


def _partition(self: Any, exported_program: Any) -> Any:
    from executorch.backends.arm.tosa.partitioner import TOSAPartitioner

    result = _patch.originals[TOSAPartitioner](self, exported_program)
    return dataclasses.replace(result, partition_tags=discovery_order(result.partition_tags))


_patch = AttributePatch(_owners, "partition", _partition)
enable = _patch.enable
"""Lower Arm partitions in discovery order (reference counted, thread-safe)."""
disable = _patch.disable
