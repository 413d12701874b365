"""Every Arm pass as a recorded step: what ran, what was skipped, how long each took.

``ArmPass.__call__`` is the one choke point for both Arm pipelines (the
quantizer's transform-for-annotation passes and the ~146 TOSA backend passes).
Wrapping it records, per pass and pipeline position:

- ``skip``: ``should_run_pass`` found no target op, so the pass did nothing;
- ``noop``: the pass ran and reported no modification;
- ``ran``: the pass ran and modified the graph.

Each record also says how the pass's retrace treated the nodes
(``retrace.py`` / ``fastcopy.py`` counters over the call): ``retraced``
(re-dispatched through FakeTensor), ``copied`` (fake value reused) and
``copied_fast`` (node built without interpreting it).

These records are the base that pass-level caching builds on (no-op and
replay steps); today they tell where a lowering spends its time.
"""

from __future__ import annotations

import time
from typing import Any

from ..speedups import fastcopy, retrace
from ..speedups.patching import Patch
from ..cache.steps import current_session

_original: list[Any] = []


def _recording_call(self: Any, graph_module: Any) -> Any:
    session = current_session()
    if session is None:
        return _original[0](self, graph_module)
    start = time.perf_counter()
    before = _node_counts()
    applicable = self.should_run_pass(graph_module)
    result = _original[0](self, graph_module)
    modified = bool(getattr(result, "modified", True)) if result is not None else True
    outcome = "ran" if modified else ("noop" if applicable else "skip")
    after = _node_counts()
    nodes = {k: after[k] - before[k] for k in after if after[k] != before[k]}
    session.note("pass", type(self).__name__, outcome, time.perf_counter() - start, nodes)
    return result


def _node_counts() -> dict[str, int]:
    counts = retrace.stats()
    return {"retraced": counts["redispatched"], "copied": counts["reused"], "copied_fast": fastcopy.stats()["copied"]}


def _apply() -> None:
    from executorch.backends.arm._passes.arm_pass import ArmPass

    _original[:] = [ArmPass.__call__]
    ArmPass.__call__ = _recording_call


def _undo() -> None:
    from executorch.backends.arm._passes.arm_pass import ArmPass

    ArmPass.__call__ = _original.pop()


_patch = Patch(_apply, _undo)
enable = _patch.enable
disable = _patch.disable
