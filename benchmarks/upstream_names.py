"""Does an Ethos-U .pte depend on node names (or constant order) upstream of the TOSA pass pipeline?

    OMP_NUM_THREADS=1 nice -n 10 python benchmarks/upstream_names.py \\
        --models tiny_cnn,residual_cnn,transformer_block,mobilenet_v2 --targets ethos-u55-128,ethos-u85-256

Region replay splices inside the TOSA pass pipeline today (``lowering/replay/regionsplice.py``). A splice further upstream
(the quantization stage's re-export, ``to_edge``'s decompositions and partitioning) would hand on a program equal to
stock's up to node names, which are minted from whole-graph counters. This script lowers each model with the stock
flow (plain ExecuTorch calls, no lowercache cache: export, ``prepare_pt2e``, calibrate on the example inputs,
``convert_pt2e``, re-export, ``to_edge_transform_and_lower`` with the Ethos-U partitioner, ``to_executorch``) and
compares the final ``.pte`` bytes of these variants with a first stock run:

- ``control``: a second stock run in the same process, nothing changed;
- ``stage 1 renamed``: every node of the quantized ExportedProgram that ``to_edge_transform_and_lower`` receives
  renamed at random, consistently: call_function nodes, and placeholders (lifted constants and user inputs) with the
  signature's input/output specs and the module call graph's signature updated (seeds 1 and 2);
- ``stage 2 renamed``: the same, on the edge program each partition's ``TOSABackend._preprocess`` receives (the TOSA
  pass pipeline's input; seeds 1 and 2, per partition);
- ``stage 1 order``: the lifted constants' placeholders of the quantized program shuffled among themselves, with the
  input specs in the same order (seeds 1 and 2).

Node metadata that carries names (``from_node``, ``source_fn_stack``) is left as it is. For the renamed variants it
also counts how many of the new stage-1 names, and how many of the placeholders' new order, still reach stage 2. One
JSON line per model and target, then a table.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import random
import string
import sys
import time
from typing import Any, Callable

VARIANT_SEEDS = (1, 2)


def _fresh(rng: random.Random, taken: set[str]) -> str:
    """A random name of letters only (no ``_<digits>`` tail FX would renumber) not yet taken."""
    while True:
        name = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(6, 12)))
        if name not in taken:
            taken.add(name)
            return name


def rename(program: Any, seed: int) -> dict[str, str]:
    """Rename every call_function node and placeholder of ``program`` at random, consistently; old name -> new."""
    from torch.export.graph_signature import ExportGraphSignature, InputKind, OutputKind

    rng = random.Random(seed)
    graph = program.graph_module.graph
    signature = program.graph_signature
    taken = {n.name for n in graph.nodes}
    mapping: dict[str, str] = {}
    for node in graph.nodes:
        if node.op in ("call_function", "placeholder"):
            old = node.name
            node._rename(_fresh(rng, taken))
            if node.op == "placeholder":
                node.target = node.name
            mapping[old] = node.name

    def arg(a: Any) -> Any:
        name = getattr(a, "name", None)
        return dataclasses.replace(a, name=mapping[name]) if isinstance(name, str) and name in mapping else a

    inputs = [dataclasses.replace(s, arg=arg(s.arg)) for s in signature.input_specs]
    for s in inputs:
        assert s.kind != InputKind.USER_INPUT or s.arg.name in mapping.values()
    outputs = []
    for s in signature.output_specs:
        s = dataclasses.replace(s, arg=arg(s.arg))
        if s.kind == OutputKind.USER_INPUT_MUTATION and s.target in mapping:
            s = dataclasses.replace(s, target=mapping[s.target])
        outputs.append(s)
    program._graph_signature = ExportGraphSignature(input_specs=inputs, output_specs=outputs)
    for entry in program.module_call_graph:
        if entry.signature is not None:
            entry.signature.inputs = [arg(a) for a in entry.signature.inputs]
            entry.signature.outputs = [arg(a) for a in entry.signature.outputs]
    program.graph_module.recompile()
    placeholders = [n.name for n in graph.nodes if n.op == "placeholder"]
    assert placeholders == [s.arg.name for s in program.graph_signature.input_specs]
    return mapping


def reorder(program: Any, seed: int) -> list[str]:
    """Shuffle the lifted constants' placeholders (and their input specs) among themselves; the new order."""
    from torch.export.graph_signature import ExportGraphSignature, InputKind

    rng = random.Random(seed)
    graph = program.graph_module.graph
    signature = program.graph_signature
    lifted = [s for s in signature.input_specs if s.kind != InputKind.USER_INPUT]
    user = [s for s in signature.input_specs if s.kind == InputKind.USER_INPUT]
    assert signature.input_specs == lifted + user  # lifted constants first, as export leaves them
    shuffled = list(lifted)
    while len(shuffled) > 1 and shuffled == lifted:
        rng.shuffle(shuffled)
    nodes = {n.name: n for n in graph.nodes if n.op == "placeholder"}
    first = next(n for n in graph.nodes if n.op != "placeholder")
    for spec in shuffled + user:
        first.prepend(nodes[spec.arg.name])
    program._graph_signature = ExportGraphSignature(input_specs=shuffled + user, output_specs=signature.output_specs)
    program.graph_module.recompile()
    assert [n.name for n in graph.nodes if n.op == "placeholder"] == [s.arg.name for s in shuffled + user]
    return [s.arg.name for s in shuffled]


@contextlib.contextmanager
def at_pipeline_input(change: Callable[[Any, int], None], tosa: list[bytes] | None = None):
    """``change(edge_program, partition_index)`` on each partition's program before ``TOSABackend._preprocess`` runs
    (the program is already the backend's own copy: ``copy_exported_program_for_preprocess``); each partition's TOSA
    flatbuffer is appended to ``tosa``."""
    from executorch.backends.arm.tosa.backend import TOSABackend

    original = TOSABackend.__dict__["_preprocess"]
    count = 0

    def preprocess(edge_program: Any, compile_spec: Any) -> Any:
        nonlocal count
        change(edge_program, count)
        count += 1
        result = original.__func__(edge_program, compile_spec)
        if tosa is not None:
            tosa.append(result.processed_bytes)
        return result

    TOSABackend._preprocess = staticmethod(preprocess)
    try:
        yield
    finally:
        TOSABackend._preprocess = original


def lower(model: str, target_name: str, stage1: Callable[[Any], None] | None = None,
          stage2: Callable[[Any, int], None] | None = None, edit: Callable[[Any], None] | None = None,
          tosa: list[bytes] | None = None) -> bytes:
    """The stock flow's .pte for ``MODELS[model](seed=0)``, with ``stage1`` applied to the quantized program and
    ``stage2`` to each partition's pipeline input; ``edit(module)`` changes the float module first; ``tosa`` receives
    each partition's TOSA flatbuffer."""
    import torch
    from executorch.exir import to_edge_transform_and_lower

    from lowercache.bench.models import MODELS
    from lowercache.lowering import quantize
    from lowercache.targets import resolve

    module, example = MODELS[model](seed=0)
    if edit is not None:
        edit(module)
    target = resolve(target_name)
    spec = target.compile_spec()
    program = torch.export.export(module, tuple(example))
    quantized = quantize.run_stock(program, target, spec, example, [example])
    if stage1 is not None:
        stage1(quantized)
    with at_pipeline_input(stage2 or (lambda program, index: None), tosa), contextlib.redirect_stdout(io.StringIO()):
        edge = to_edge_transform_and_lower(quantized, partitioner=[target.partitioner(spec)])  # Vela's report muted
    return edge.to_executorch().buffer


def measure(model: str, target: str) -> dict[str, Any]:
    started = time.perf_counter()
    stock = lower(model, target)
    row: dict[str, Any] = {"model": model, "target": target, "pte_bytes": len(stock)}

    seen: dict[str, list[list[str]]] = {}  # node names at each partition's pipeline input, in graph order, per variant

    def watch(key: str) -> Callable[[Any, int], None]:
        def note(edge_program: Any, index: int) -> None:
            seen.setdefault(key, []).append([n.name for n in edge_program.graph.nodes])
        return note

    stock_tosa: list[bytes] = []
    row["control"] = lower(model, target, stage2=watch("stock"), tosa=stock_tosa) == stock  # the hook only reads
    stock_names = {name for names in seen["stock"] for name in names}
    row["partitions"] = len(seen["stock"])

    for seed in VARIANT_SEEDS:
        mapping: dict[str, str] = {}
        key = f"stage1 renamed {seed}"
        pte = lower(model, target, stage1=lambda p, s=seed: mapping.update(rename(p, s)), stage2=watch(key))
        row[key] = pte == stock
        reached = {name for names in seen[key] for name in names}
        row[f"{key}: renamed nodes"] = len(mapping)
        row[f"{key}: new names at stage 2"] = len(reached & set(mapping.values()))
        row[f"{key}: stage 2 names as stock"] = reached == stock_names

    for seed in VARIANT_SEEDS:
        counts: list[int] = []
        key = f"stage2 renamed {seed}"

        def at_stage2(edge_program: Any, index: int, s: int = seed) -> None:
            counts.append(len(rename(edge_program, 1000 * s + index)))

        tosa: list[bytes] = []
        row[key] = lower(model, target, stage2=at_stage2, tosa=tosa) == stock
        row[f"{key}: renamed nodes"] = sum(counts)
        row[f"{key}: TOSA differs"] = tosa != stock_tosa  # the new names reach the flatbuffer

    for seed in VARIANT_SEEDS:
        order: list[str] = []
        key = f"stage1 order {seed}"
        pte = lower(model, target, stage1=lambda p, s=seed: order.extend(reorder(p, s)), stage2=watch(key))
        row[key] = pte == stock
        row[f"{key}: lifted constants"] = len(order)
        stage2_order = [name for names in seen[key] for name in names]
        stock_order = [name for names in seen["stock"] for name in names]
        row[f"{key}: stage 2 as stock"] = stage2_order == stock_order
        row[f"{key}: stage 2 names as stock, other order"] = stage2_order != stock_order and sorted(
            stage2_order) == sorted(stock_order)
    row["seconds"] = round(time.perf_counter() - started, 1)
    return row


def _yes(value: bool) -> str:
    return "same" if value else "DIFFERENT"


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | target | partitions | .pte bytes | control | stage 1 renamed | stage 2 renamed "
        "| stage 1 constant order |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        s1 = ", ".join(_yes(r[f"stage1 renamed {s}"]) for s in VARIANT_SEEDS)
        s1 += f" ({r['stage1 renamed 1: renamed nodes']} renamed; {r['stage1 renamed 1: new names at stage 2']} reach stage 2)"
        s2 = ", ".join(_yes(r[f"stage2 renamed {s}"]) for s in VARIANT_SEEDS)
        s2 += f" ({r['stage2 renamed 1: renamed nodes']} renamed; TOSA "
        s2 += "differs)" if all(r[f"stage2 renamed {s}: TOSA differs"] for s in VARIANT_SEEDS) else "SAME)"
        order = ", ".join(_yes(r[f"stage1 order {s}"]) for s in VARIANT_SEEDS)
        order += f" ({r['stage1 order 1: lifted constants']} constants; "
        if all(r[f"stage1 order {s}: stage 2 as stock"] for s in VARIANT_SEEDS):
            order += "stage 2 input as stock)"
        elif all(r[f"stage1 order {s}: stage 2 names as stock, other order"] for s in VARIANT_SEEDS):
            order += "stage 2 input in another order)"
        else:
            order += "stage 2 input differs)"
        lines.append(f"| {r['model']} | {r['target']} | {r['partitions']} | {r['pte_bytes']} | {_yes(r['control'])} "
                     f"| {s1} | {s2} | {order} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny_cnn,residual_cnn,transformer_block,mobilenet_v2")
    parser.add_argument("--targets", default="ethos-u55-128,ethos-u85-256")
    args = parser.parse_args(argv)
    rows = []
    for model in args.models.split(","):
        for target in args.targets.split(","):
            row = measure(model, target)
            print(json.dumps(row), flush=True)
            rows.append(row)
    print(table(rows))
    verdicts = ["control"] + [f"{v} {s}" for v in ("stage1 renamed", "stage2 renamed", "stage1 order") for s in VARIANT_SEEDS]
    return 0 if all(r[k] for r in rows for k in verdicts) else 1  # 1: some .pte differs from stock's


if __name__ == "__main__":
    sys.exit(main())
