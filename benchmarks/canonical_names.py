"""Evidence for the upstream patch in docs/upstream: with it, a splice's names and constant order do not matter.

    OMP_NUM_THREADS=1 python benchmarks/canonical_names.py --models tiny_cnn,residual_cnn,transformer_block,mobilenet_v2 \\
        --targets tosa-fp,ethos-u55-128

Region replay would splice regions lowered alone at the first layout pass
(``FuseViewCopyTransformPass``) and run the rest of the pipeline on the whole
graph. The spliced graph can match stock's node for node, but not in its
names. Operator names and the names of constants that passes minted come out
different, and so does the order of those constants. This script takes
stock's graph at that split and gives it such names and order: every minted
constant renamed, placed in reverse at the front, every operator renamed.
It then runs the rest of the pipeline on both the untouched and the scrambled
graph and compares the results. The comparison covers every node's form and
name, the constants' bytes and the placeholders' names and order. It is made
twice: once as stock ends, and once after the patch's
``CanonicalizeConstantPlaceholdersPass``, whose source is read from the patch
itself. Last, a stock lowering with the pass appended runs through to a
``.pte``. One JSON line per model and target.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

PATCH = Path(__file__).resolve().parent.parent / "docs" / "upstream" / "canonical-constant-names.patch"
NEW_FILE = "backends/arm/_passes/canonicalize_constant_placeholders_pass.py"


def proposed_pass() -> type:
    """``CanonicalizeConstantPlaceholdersPass`` as the patch adds it (the new file's lines)."""
    lines, inside = [], False
    for line in PATCH.read_text().splitlines():
        if line.startswith("diff --git"):
            inside = line.endswith(f"b/{NEW_FILE}")
        elif inside and line.startswith("+") and not line.startswith("+++"):
            lines.append(line[1:])
    source = Path(tempfile.mkdtemp(prefix="lowercache-upstream-")) / "canonicalize_constant_placeholders_pass.py"
    source.write_text("\n".join(lines) + "\n")
    spec = importlib.util.spec_from_file_location("canonicalize_constant_placeholders_pass", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.CanonicalizeConstantPlaceholdersPass


def scramble(program: Any, original: set[str]) -> int:
    """Rename minted constants and every operator, and put the minted constants first in reverse; their count."""
    from torch.export.graph_signature import InputSpec, TensorArgument

    graph = program.graph_module.graph
    specs = {s.arg.name: s for s in program.graph_signature.input_specs}
    minted = [n for n in graph.nodes if n.op == "placeholder" and n.name not in original]
    for i, node in enumerate(minted):
        old = specs.pop(node.name)
        node._rename(f"region_local_{len(minted) - i}")
        node.target = node.name
        specs[node.name] = InputSpec(kind=old.kind, arg=TensorArgument(name=node.name), target=old.target, persistent=old.persistent)
    for node in graph.nodes:
        if node.op == "call_function":
            node._rename(node.name + "_alone")
    first = next(n for n in graph.nodes if n.op == "placeholder")
    for node in minted:
        first.prepend(node)
        first = node
    order = [n.name for n in graph.nodes if n.op == "placeholder"]
    program._graph_signature = type(program.graph_signature)(
        input_specs=[specs[name] for name in order], output_specs=program.graph_signature.output_specs
    )
    program.graph_module.recompile()
    return len(minted)


def form(program: Any) -> dict[str, Any]:
    from lowercache.lowering.replay import regions

    whole = regions.whole_form(program)
    placeholders = [n.name for n in program.graph_module.graph.nodes if n.op == "placeholder" and n.users]
    return {"nodes": whole.nodes, "constants": whole.constants, "names": whole.names, "placeholders": placeholders}


def compare(model: str, target_name: str, canonical: type) -> dict[str, Any]:
    from executorch.backends.arm._passes.arm_pass_manager import ArmPassManager
    from executorch.backends.arm.tosa.specification import TosaLoweringContext
    from executorch.exir import to_edge_transform_and_lower

    from lowercache.bench import models
    import pass_census as census  # beside this script
    from lowercache.lowering import quantize
    from lowercache.lowering.flow import export
    from lowercache.targets import resolve

    target = resolve(target_name, True)
    module, example = models.MODELS[model]()
    samples = models.calibration_samples(example)
    edge, spec = census.pipeline_input(export(module, example), target, example, samples)
    original = {n.name for n in edge.graph_module.graph.nodes if n.op == "placeholder"}
    passes = census.pipeline_passes(spec, edge)
    split = [type(p).__name__ for p in passes].index("FuseViewCopyTransformPass")
    with TosaLoweringContext(spec.tosa_spec):
        state = edge
        for graph_pass in passes[:split]:
            state, _ = census.run_pass(graph_pass, state)
        results = []
        for scrambled in (False, True):
            program = copy.deepcopy(state)
            minted = scramble(program, original) if scrambled else 0
            for graph_pass in census.pipeline_passes(spec, program)[split:]:
                program, _ = census.run_pass(graph_pass, program)
            stock = form(program)
            program, _ = census.run_pass(canonical(program), program)
            results.append((minted, stock, form(program)))
    (_, stock_a, canon_a), (minted, stock_b, canon_b) = results

    original_transform = ArmPassManager._transform

    def with_pass(self: Any, exported_program: Any, graph_module: Any) -> Any:
        if exported_program is not None and graph_module is exported_program.graph_module:
            self.add_pass(canonical(exported_program))
        return original_transform(self, exported_program, graph_module)

    ArmPassManager._transform = with_pass
    try:
        program = export(*models.MODELS[model]())
        compile_spec = target.compile_spec()
        if target.quantized:
            program = quantize.run_stock(program, target, compile_spec, example, samples)
        pte = to_edge_transform_and_lower(program, partitioner=[target.partitioner(compile_spec)]).to_executorch().buffer
    finally:
        ArmPassManager._transform = original_transform
    return {
        "model": model,
        "target": target_name,
        "split": split,
        "minted constants renamed": minted,
        "same as stock ends": stock_a == stock_b,
        "same with the pass": canon_a == canon_b,
        "differs with the pass": [k for k in canon_a if canon_a[k] != canon_b[k]],
        "pte bytes with the pass": len(pte),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny_cnn,residual_cnn,transformer_block,mobilenet_v2")
    parser.add_argument("--targets", default="tosa-fp,ethos-u55-128")
    args = parser.parse_args(argv)
    canonical = proposed_pass()
    for model in args.models.split(","):
        for target in args.targets.split(","):
            print(json.dumps(compare(model, target, canonical)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
