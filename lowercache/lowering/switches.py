"""The patches a family's hooks turn on while its lowering runs: the exact speed-ups the registry has on for that
family, and the family's own patches of the flow, in one order.

Every family's hooks module (``arm.py``, ``xnnpack.py``) holds one :class:`Switches`; each patch is reference counted
(``speedups/patching.py``), so two families' hooks on at once (``api.cached``) share the patches they both use.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..speedups import registry

# The order patches go on (and, reversed, come off): some wrap what others wrap. Besides the registry's speed-ups
# (but gcfreeze, a context the flow enters), the Arm flow's own patches (qparams, passes, partitionorder).
ORDER = (
    "provenance", "paramsearch", "qparams", "histogram", "passes", "retrace", "fastcopy", "lazycode", "attrnames",
    "decompositions", "fakecache", "partitionorder", "signature", "treeiter", "dtypecheck", "callsite", "stacklines",
    "deadcode", "ciaops", "exportguards", "propagate", "retraceskip", "checkskip", "partitioner", "groupmerge", "legalize",
    "jsonhints", "debugtext", "qpatterns", "regions", "rebind",
)


class Switches:
    """What one hooks module turns on: ``patches`` always (the flow's own), the speed-ups the registry has on for
    ``families`` (a speed-up implemented beside the flow is found in ``speedups``, the others in ``lowercache.speedups``)."""

    def __init__(self, families: tuple[str, ...], patches: Mapping[str, Any], speedups: Mapping[str, Any]):
        self.families = families
        self.patches = dict(patches)
        self.speedups = dict(speedups)
        self._enabled: list[Any] = []  # what on() turned on, so off() turns off the same

    def on(self) -> None:
        """The flow's patches and the speed-ups on for these families (pins checked before any patch)."""
        speedups = set(registry.active(*self.families))
        chosen = [self.patches.get(name) or self.speedups.get(name) or registry.module(name)
                  for name in ORDER if name in self.patches or name in speedups]
        for patch in chosen:
            patch.enable()
            self._enabled.append(patch)

    def off(self) -> None:
        while self._enabled:
            self._enabled.pop().disable()

    def enabled(self) -> list[Any]:
        """The patches on now through these switches, in the order they went on."""
        return list(self._enabled)
