"""Transparent mode: stock ExecuTorch code, unchanged, served from the cache."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import lowercache
from lowercache.bench import models
from lowercache.cache.store import Store

from tests.helpers.oracle import reference, run_stock


SCRIPT = textwrap.dedent(
    """
    import sys
    import torch
    from executorch.backends.arm.ethosu import EthosUCompileSpec, EthosUPartitioner
    from executorch.backends.arm.quantizer import EthosUQuantizer, get_symmetric_quantization_config
    from executorch.exir import to_edge_transform_and_lower
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
    from lowercache.bench import models

    module, example = models.tiny_cnn()
    ep = torch.export.export(module, example)
    spec = EthosUCompileSpec("ethos-u55-128")
    quantizer = EthosUQuantizer(spec)
    quantizer.set_global(get_symmetric_quantization_config())
    prepared = prepare_pt2e(ep.module(check_guards=False), quantizer)
    prepared(*example)
    ep = torch.export.export(convert_pt2e(prepared), example)
    edge = to_edge_transform_and_lower(ep, partitioner=[EthosUPartitioner(spec)])
    with open(sys.argv[1], "wb") as f:
        f.write(edge.to_executorch().buffer)
    """
)


def test_cached_context_serves_the_arm_steps(cache_dir):
    module, example = models.tiny_cnn()
    expected = reference("tiny_cnn", "ethos-u55-128")
    with lowercache.cached(cache_dir=cache_dir) as first:
        assert run_stock(module, example, "ethos-u55-128") == expected
    assert [(r.kind, r.outcome) for r in first.records if r.kind in ("tosa", "vela")] == [("tosa", "miss"), ("vela", "miss")]
    with lowercache.cached(cache_dir=cache_dir) as second:
        assert run_stock(module, example, "ethos-u55-128") == expected
    assert [(r.kind, r.outcome) for r in second.records if r.kind in ("tosa", "vela")] == [("tosa", "hit"), ("vela", "hit")]
    assert {r.outcome for r in second.records if r.kind == "qparams"} == {"hit"}


def test_cached_context_leaves_no_hooks_behind(cache_dir):
    from executorch.backends.arm.ethosu import backend as ethosu_backend
    from executorch.backends.arm.tosa.backend import TOSABackend
    from executorch.backends.xnnpack.xnnpack_preprocess import XnnpackBackend

    before = (TOSABackend._preprocess, ethosu_backend.vela_compile, XnnpackBackend.preprocess)
    with lowercache.cached(cache_dir=cache_dir):
        assert TOSABackend._preprocess is not before[0] and XnnpackBackend.preprocess is not before[2]
    assert (TOSABackend._preprocess, ethosu_backend.vela_compile, XnnpackBackend.preprocess) == before


def test_run_wraps_an_unmodified_script(tmp_path, cache_dir):
    script = tmp_path / "export_script.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "LOWERCACHE_DIR": str(cache_dir)}
    for name in ("first.pte", "second.pte"):
        result = subprocess.run(
            [sys.executable, "-m", "lowercache.cli", "run", "--", sys.executable, str(script), str(tmp_path / name)],
            capture_output=True, text=True, env=env, timeout=600,
        )
        assert result.returncode == 0, result.stderr
        assert (tmp_path / name).read_bytes() == reference("tiny_cnn", "ethos-u55-128")
    counters = Store(cache_dir).counters()
    assert counters.get("count/tosa/miss") == 1 and counters.get("count/tosa/hit") == 1
    assert counters.get("count/vela/miss") == 1 and counters.get("count/vela/hit") == 1


def _stock_xnnpack(module, example):
    """The documented stock XNNPACK flow, as a user's script writes it."""
    import torch
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    program = torch.export.export(module, example)
    return to_edge_transform_and_lower(program, partitioner=[XnnpackPartitioner()]).to_executorch().buffer


def test_cached_context_serves_the_xnnpack_partitions(cache_dir):
    import torch

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()
    example = (torch.randn(1, 8),)
    expected = _stock_xnnpack(module, example)
    outcomes = []
    for _ in range(2):
        with lowercache.cached(cache_dir=cache_dir) as session:
            assert _stock_xnnpack(module, example) == expected
        outcomes.append([r.outcome for r in session.records if r.kind == "xnnpack"])
    assert outcomes == [["miss"], ["hit"]]
    counters = Store(cache_dir).counters()
    assert counters.get("count/xnnpack/miss") == 1 and counters.get("count/xnnpack/hit") == 1

    with torch.no_grad():
        module[0].weight[0, 0] += 0.25  # a weights edit: the partition's program changes, stock's bytes with it
    edited = _stock_xnnpack(module, example)
    assert edited != expected
    with lowercache.cached(cache_dir=cache_dir) as session:
        assert _stock_xnnpack(module, example) == edited
    assert [r.outcome for r in session.records if r.kind == "xnnpack"] == ["miss"]
