"""Target families: the registry the CLI reads, each family's protocol, and the stock script built from their parts."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys

import pytest

from lowercache.errors import LowercacheError
from lowercache.targets import FAMILIES, TARGETS, family_of, help_text, resolve
from lowercache.targets.family import Family

HOOKS_API = ("import_backend", "hooks", "install_permanently", "compile_spec_digest", "pass_insertions_digest", "spec_after_quantize",
             "import_quantizer", "backend_source_parts")


@pytest.mark.quick
def test_the_cli_lists_every_family_s_targets_in_the_registry_s_order():
    assert TARGETS == tuple(t for f in FAMILIES for t in f.targets)
    assert len(set(TARGETS)) == len(TARGETS), "a target name in two families"
    assert help_text() == "tosa-int, tosa-fp, ethos-u55-32/64/128/256, ethos-u65-256/512, ethos-u85-128/256/512/1024/2048, xnnpack, xnnpack-int8."
    assert [family_of(t).name for t in ("tosa-fp", "ethos-u85-256", "xnnpack-int8")] == ["arm-tosa", "arm-ethosu", "xnnpack"]


@pytest.mark.quick
def test_the_target_list_is_plain_data_without_torch():
    code = ("import sys; from lowercache.targets import help_text, resolve; help_text(); resolve('ethos-u55-128');"
            "sys.exit(any(m in sys.modules for m in ('torch', 'executorch')))")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.quick
@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_each_family_provides_the_protocol(family):
    for name in Family.__annotations__:
        assert hasattr(family, name), name
    for name in ("quantized", "quantization_config", "check_option", "compile_spec", "partitioner", "quantizer", "files"):
        assert callable(getattr(family, name)), name
    assert isinstance(family.steps, tuple) and set(family.options) <= {"system_config", "memory_mode"}  # Target's option fields
    hooks = importlib.util.find_spec(family.hooks)
    assert hooks is not None and hooks.origin is not None, family.hooks
    body = ast.parse(open(hooks.origin).read()).body  # read, not imported: the hooks import torch
    defined = {n.name for n in body if isinstance(n, ast.FunctionDef)}
    defined |= {t.id for n in body if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    defined |= {a.asname or a.name for n in body if isinstance(n, ast.ImportFrom) for a in n.names}
    assert set(HOOKS_API) <= defined, set(HOOKS_API) - defined


@pytest.mark.quick
def test_an_option_of_another_family_is_refused_naming_the_family_that_takes_it():
    with pytest.raises(LowercacheError, match="^--system-config applies to Ethos-U targets only, not tosa-int$"):
        resolve("tosa-int", system_config="Ethos_U55_High_End_Embedded")
    with pytest.raises(LowercacheError, match="^unknown target 'tosa'; known targets: tosa-int, tosa-fp, ethos-u55-32,"):
        resolve("tosa")
    assert resolve(" Ethos-U55-128 ").name == "ethos-u55-128"


@pytest.mark.quick
def test_quantization_is_each_family_s():
    assert [resolve(t).quantization_config for t in ("tosa-fp", "tosa-int", "ethos-u55-128")] == [
        "none", "get_symmetric_quantization_config(is_per_channel=True)", "get_symmetric_quantization_config(is_per_channel=True)"]
    assert resolve("ethos-u85-256", per_channel=False).quantization_config == "get_symmetric_quantization_config(is_per_channel=False)"
    # XNNPACK's quantizer is another class with a function of the same name: the key part names it
    assert [resolve(t, per_channel=c).quantization_config for t, c in (("xnnpack", True), ("xnnpack-int8", True), ("xnnpack-int8", False))] == [
        "none", "XNNPACKQuantizer get_symmetric_quantization_config(is_per_channel=True)",
        "XNNPACKQuantizer get_symmetric_quantization_config(is_per_channel=False)"]


@pytest.mark.quick
def test_each_family_names_its_partition_files():
    vela = {"command_stream": b"s", "summary.txt": b"t", "output/x_summary_Ethos.csv": b"c"}
    assert family_of("ethos-u55-128").files("vela", 1, vela) == {
        "partition_1.vela.bin": b"s", "partition_1.vela_summary.txt": b"t", "partition_1.vela_x_summary_Ethos.csv": b"c"}
    assert family_of("tosa-fp").files("tosa", 0, {"tosa": b"f"}) == family_of("ethos-u55-128").files("tosa", 0, {"tosa": b"f"}) == {
        "partition_0.tosa": b"f"}


@pytest.mark.quick
def test_the_stock_script_has_every_family_s_part():
    from lowercache.bench.stockscript import source

    namespace: dict = {}
    tree = ast.parse(source())
    exec(compile(ast.Module([n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.Assign))], []), "export.py", "exec"), namespace)
    assert set(namespace["FAMILY"]) == set(TARGETS)
    assert {namespace["FAMILY"][t].__name__ for t in TARGETS} == {f.name.replace("-", "_") for f in FAMILIES}


@pytest.mark.quick
def test_the_stock_script_makes_the_partitioner_after_quantization():
    """The quantizer can change the compile spec that the partitioner serializes when made (docs/design.md, The flow)."""
    from lowercache.bench.stockscript import source

    flow = next(n for n in ast.parse(source()).body if isinstance(n, ast.FunctionDef) and n.name == "lower")
    line = {n.func.id: n.lineno for n in ast.walk(flow) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    assert line["prepare_pt2e"] < line["convert_pt2e"] < line["partitioner"]
