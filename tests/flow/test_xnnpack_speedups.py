"""Every speed-up proven on XNNPACK graphs: with it on and off, the same .pte (stock's) and the same partition payloads.

One process lowers an MLP, a small CNN (with a batch norm) and a self-attention block (its layer norm left on the
portable ops: four partitions) to ``xnnpack`` and ``xnnpack-int8`` with every speed-up on, under a profiler that shows
which speed-ups' code ran on which lowering: each one the registry turns on for XNNPACK must have done work on one of
them, and the .pte must be stock's. Then each is switched off (``LOWERCACHE_SPEEDUPS=all,-NAME``) on one of the
lowerings where it worked, taken in turn so that fp32 and int8 graphs of every model are covered (a minute of worker
time in all; the histograms re-bin only on a calibration of several samples, one more int8 lowering), and every byte
must stay as it was. The Arm-only ones are never switched on for XNNPACK, even when
named. Stock bytes come from the benchmark's stock script in a new process (``helpers/xnnstock.py``).
"""

from __future__ import annotations

import cProfile
import importlib.util
import pstats
import textwrap

import pytest

import lowercache
from lowercache.lowering import xnnpack
from lowercache.speedups import registry

from tests.helpers import attention
from tests.helpers.xnnstock import stock_bytes

MODELS = textwrap.dedent('''
    import torch
    from torch import nn


    def mlp():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4)).eval(), (torch.randn(1, 8),)


    def cnn():
        torch.manual_seed(1)
        net = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2),
                            nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5)).eval()
        return net, (torch.randn(1, 3, 16, 16),)
''') + attention.SOURCE

CASES = [(None, factory, target) for factory in ("mlp", "cnn", "attention") for target in ("xnnpack", "xnnpack-int8")]
# Calibrated on samples of growing range, so the observers re-bin their histograms (the stock script calibrates on the
# example only: this one is compared with itself, the speed-ups on and off).
CALIBRATED = ("calibrated", "mlp", "xnnpack-int8")
FAMILY = "xnnpack"
ON = [s.name for s in registry.SPEEDUPS if registry.applies(s.name, FAMILY)]
NOT_ON = [s.name for s in registry.SPEEDUPS if not registry.applies(s.name, FAMILY)]
# The module of a speed-up, when it is not lowercache/speedups/<name>.py; and functions that set up, not speed up.
MODULES = {"regions": "lowering/replay/regionsplice.py", "rebind": "lowering/rebind.py"}
SETUP = {"_apply", "_undo", "apply", "undo", "enable", "disable", "<module>", "sources_digest", "_audited_sources", "_setup",
         "_functions", "kernels_digest", "stats", "reset_stats", "enabled", "_enable", "_disable", "_modules", "_module"}


def _module_file(name: str) -> str:
    return "lowercache/" + MODULES.get(name, f"speedups/{name}.py")


def _ran(profile: cProfile.Profile) -> set[str]:
    """The speed-ups (of every family) whose own code ran, beyond switching on and off."""
    files = {_module_file(s.name): s.name for s in registry.SPEEDUPS}
    found = set()
    for (filename, _, function), row in pstats.Stats(profile).stats.items():  # type: ignore[attr-defined]
        name = next((n for f, n in files.items() if filename.endswith(f)), None)
        if name is not None and function not in SETUP and row[1]:
            found.add(name)
    return found


@pytest.fixture
def lower(tmp_path, monkeypatch):
    """Lowers a case under a ``LOWERCACHE_SPEEDUPS`` setting: its .pte, every partition's payload (``preprocess``'s
    result as the .pte holds it: delegate bytes, named data and debug handles), and the speed-ups switched on for it."""
    from executorch.backends.xnnpack.xnnpack_preprocess import XnnpackBackend

    path = tmp_path / "models.py"
    path.write_text(MODELS)
    spec = importlib.util.spec_from_file_location("xnnpack_speedup_models", path)
    models = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(models)
    seen: dict[str, list] = {"payloads": [], "on": []}
    stock_preprocess = XnnpackBackend.preprocess

    def preprocess(program, compile_specs):  # the hooks wrap this one as stock's: it sees each partition computed
        seen["on"].append({registry_name(p) for p in xnnpack._switches.enabled()})
        result = stock_preprocess(program, compile_specs)
        output = result.data_store_output
        seen["payloads"].append((result.processed_bytes, result.debug_handle_map, list(output.pte_data.items()), output.buffers))
        return result

    monkeypatch.setattr(XnnpackBackend, "preprocess", staticmethod(preprocess))

    def run(case, setting, profile=None):
        monkeypatch.setenv("LOWERCACHE_SPEEDUPS", setting)
        seen["payloads"], seen["on"] = [], []
        module, example = getattr(models, case[1])()
        calibration = [tuple(x * scale for x in example) for scale in (0.5, 2.0, 8.0)] if case[0] == "calibrated" else None
        if profile is not None:
            profile.enable()
        try:
            artifacts = lowercache.lower(module, example, target=case[2], calibration=calibration, use_cache=False)
        finally:
            if profile is not None:
                profile.disable()
        assert seen["on"] and all(on == seen["on"][0] for on in seen["on"])
        return artifacts, seen["payloads"], seen["on"][0]

    yield run
    registry.select("all")


def registry_name(patch) -> str:
    return patch.__name__.rpartition(".")[2]


def test_each_speedup_on_xnnpack_graphs_gives_stock_bytes_and_payloads(tmp_path, lower):
    (tmp_path / "stock").mkdir()
    stock = stock_bytes(MODELS, CASES, tmp_path / "stock")
    base, ran = {}, {}
    for case in [*CASES, CALIBRATED]:
        profile = cProfile.Profile()
        artifacts, payloads, on = lower(case, "all", profile)
        assert case not in stock or artifacts.pte == stock[case], case
        assert on == set(ON) - {"gcfreeze"}, case  # gcfreeze is the flow's context, not a patch the hooks switch
        assert {n: s for n, s in artifacts.manifest["speedups"].items() if n in NOT_ON} == {
            n: f"off: not for {FAMILY}" for n in NOT_ON}
        base[case], ran[case] = (artifacts.pte, payloads), _ran(profile)
        assert not ran[case] & set(NOT_ON), case
    idle = [name for name in ON if not any(name in r for r in ran.values())]
    assert not idle, f"switched on for XNNPACK but did no work on any XNNPACK lowering here: {idle}"
    for i, name in enumerate(ON):  # each off once, on a lowering where it worked, in turn (fp32 and int8 alike)
        worked = [case for case in ran if name in ran[case]]
        case = worked[i % len(worked)]
        artifacts, payloads, on = lower(case, f"all,-{name}")
        assert name not in on and artifacts.manifest["speedups"][name] == "off: disabled by setting"
        assert (artifacts.pte, payloads) == base[case], (name, case)


def test_the_arm_only_ones_stay_off_for_xnnpack_even_when_named(lower):
    artifacts, _, on = lower((None, "mlp", "xnnpack"), "all," + ",".join(NOT_ON))
    assert NOT_ON and not on & set(NOT_ON)
    assert all(artifacts.manifest["speedups"][name] == f"off: not for {FAMILY}" for name in NOT_ON)
