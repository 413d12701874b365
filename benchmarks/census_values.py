"""The value census: which steps of the stock Arm flow read, compute or only carry weight-dependent values.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/census_values.py \\
        --models tiny_cnn,residual_cnn,transformer_block,mobilenet_v2,convnext \\
        --targets tosa-int,ethos-u55-128,ethos-u85-256 --edits retrained:1,retrained:2,block:1,head:1 \\
        --out benchmarks/results/census-values

Issue 54 asks whether a weights-only change (a retrained checkpoint: same
structure, every weight and so every quantization parameter different) can
be served from a record of the structure, recomputing only the values. That
holds only for the steps whose *structure* does not depend on values. For
each model, target and edit this runs the stock flow (no lowercache patch)
twice, on the base model and on the edited one, and observes the program
after every step:

- ``export``; quantization: ``_fuse_conv_bn_``, ``_fuse_linear_bn_``, each
  pass of the Arm annotation pipeline (``transform_for_annotation``),
  ``annotate``, ``prepare`` (observers), calibration, ``convert_pt2e``, the
  re-export;
- ``to_edge_transform_and_lower``: each ``run_decompositions`` call, the edge
  program, the partitioner's tags, each partition's input to the TOSA
  backend, each pass of the TOSA pipeline, and the serialized TOSA
  (canonical form, ``lowering/replay/tosacanon.py``); the lowered program.

Each observation is split into a *skeleton* (operators, targets, argument
structure, node names and references, shapes, dtypes, metadata kinds) and
*values* (float and integer literals, tensor bytes). A step is:

- ``carries``: same skeleton on both runs; the values that differ are ones
  that already differed before it (as pairs: base value, edited value);
- ``computes``: same skeleton; some value pairs are new: the step computed
  them from values (listed by where they sit: operator and argument);
- ``decides``: the skeletons differ: a value decided structure. The first
  step where the two runs part is reported, and the edit is not compared
  further (its later steps are no evidence);
- ``unchanged``: the step changed nothing in the base run.

An integer that differs is counted as a value, wherever it sits: a
difference in an argument that is normally structure (a shape, a slice
bound) shows up as a computed value at that position, and the report lists
every position. Research code, outside the package: evidence on these
models, not a proof for any pass. The JSON written per run lists every
observation; the summary table is printed as markdown.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import sys
import tempfile
import time
from typing import Any, Callable, Iterator

import torch

from lowercache.cache.digests import digest, digest_json
from lowercache.cache.hashing import IGNORED_META, Unhashable, canon, op_name, tensor_bytes

CARRIES, COMPUTES, DECIDES, UNCHANGED, INPUT = "carries", "computes", "decides", "unchanged", "input"
_META_LEFT_OUT = IGNORED_META | {"tensor_meta", "example_value", "eager_input_vals", "debug_handle", "stack_trace"}


# ---------------------------------------------------------------------------
# Forms: a program as a skeleton and a list of values


def _safe(value: Any) -> Any:
    try:
        return canon(value, real_tensors=True)
    except Unhashable:
        return ["opaque", type(value).__qualname__]


def _attribute(module: torch.nn.Module, target: str) -> Any:
    value: Any = module
    for part in target.split("."):
        value = getattr(value, part, None)
    return value


def tensor_value(t: torch.Tensor) -> Any:
    """A held tensor: fake ones (the partitioner's copy) by their metadata; real ones by their bytes, which is
    how the TOSA flatbuffer holds them too; small float vectors (per-channel scales) element by element, as
    the Arm passes read them into Python floats."""
    from torch._subclasses.fake_tensor import FakeTensor

    if isinstance(t, FakeTensor) or t.device.type == "meta":
        return _safe(t)
    if t.dtype in (torch.float32, torch.float64) and t.dim() == 1 and t.numel() <= 4096:
        return ["list", [["float", float(v).hex()] for v in t.tolist()]]
    return ["tensor_data", digest(tensor_bytes(t))]


def _module_form(module: Any) -> Any:
    """A submodule a node calls or fetches: its class and state (an observer's config and statistics)."""
    if isinstance(module, torch.Tensor):
        return tensor_value(module)
    if module is None:
        return None
    processed = getattr(module, "processed_bytes", None)  # a lowered backend module: its payload is a value
    if isinstance(processed, (bytes, bytearray)):
        return ["lowered", type(module).__qualname__, ["tensor_data", digest(bytes(processed))]]
    state = {k: v for k, v in vars(module).items() if not k.startswith("_") or k == "_buffers"}
    return [type(module).__qualname__, _safe(state)]


def _lifted(program: Any) -> dict[str, Any]:
    """Placeholder name -> the lifted tensor it stands for."""
    out = {}
    signature = program.graph_signature
    for spec in signature.input_specs:
        kind = spec.kind.name
        if kind in ("PARAMETER", "BUFFER") and spec.target in program.state_dict:
            out[spec.arg.name] = program.state_dict[spec.target]
        elif kind == "CONSTANT_TENSOR" and spec.target in program.constants:
            out[spec.arg.name] = program.constants[spec.target]
    return out


def graph_form(gm: torch.fx.GraphModule, lifted: dict[str, Any] | None = None) -> list[Any]:
    """Every node: kind, name, target, arguments and metadata (tensors with their bytes), and what it fetches or holds."""
    lifted = lifted or {}
    form = []
    for node in gm.graph.nodes:
        meta = {k: _safe(v) for k, v in node.meta.items() if k not in _META_LEFT_OUT}
        entry = [node.op, node.name, op_name(node.target), _safe(node.args), _safe(node.kwargs), meta]
        if node.op in ("get_attr", "call_module"):
            entry.append(_module_form(_attribute(gm, str(node.target))))
        elif node.op == "placeholder" and node.name in lifted:
            entry.append(_module_form(lifted[node.name]))
        form.append(entry)
    return form


def program_form(program: Any) -> list[Any]:
    if isinstance(program, torch.fx.GraphModule):
        return graph_form(program)
    return graph_form(program.graph_module, _lifted(program))


def tosa_form(tosa: bytes) -> list[Any]:
    """The serialized TOSA in canonical form, with operator codes, references and shapes as structure."""
    from lowercache.lowering.replay import tosacanon

    def tensor(t: Any) -> Any:
        if isinstance(t, list) and t and t[0] == "tensor" and len(t) == 7:
            return ["tosa_tensor", str(t[1]), f"type:{t[2]}", ["tensor_data", t[3]] if t[3] else None, *t[4:]]
        return t

    def block(b: list[Any]) -> list[Any]:
        name, inputs, outputs, operators, tensors, consts = b

        def ref(r: Any) -> Any:
            return f"ref:{r}" if isinstance(r, int) else ["const", tensor(r[1])]

        ops = [["tosa_operator", names.get(o[0], str(o[0])), o[2], [ref(r) for r in o[3]], [ref(r) for r in o[4]]] for o in operators]
        consts_form = [["tosa_operator", "CONST", c[1], [], [["const", tensor(c[2])]]] for c in consts]
        return [["tosa_block", name, [ref(r) for r in inputs], [ref(r) for r in outputs], [tensor(t) for t in tensors]], *ops, *consts_form]

    from tosa.Op import Op

    names = {v: k for k, v in vars(Op).items() if not k.startswith("_")}
    canonical = tosacanon.canonical(tosa)
    form: list[Any] = [["tosa_version", str(canonical[0])]]
    for region in canonical[1:]:
        for b in region[1]:
            form.extend(block(b))
    return form


_MASK = {"float": "<float>", "tensor_data": "<tensor>"}


def split(form: Any) -> tuple[str, list[Any], list[str]]:
    """A form's skeleton digest, its values in order and where each sits (a readable path)."""
    values: list[Any] = []
    paths: list[str] = []

    def walk(x: Any, path: str) -> Any:
        if isinstance(x, bool) or x is None or isinstance(x, str):
            return x
        if isinstance(x, int):
            values.append(x)
            paths.append(path)
            return "<int>"
        if isinstance(x, float):
            values.append(x)
            paths.append(path)
            return "<float>"
        if isinstance(x, list) and len(x) == 2 and x[0] in _MASK and isinstance(x[1], str):
            values.append(x[1])
            paths.append(path)
            return _MASK[x[0]]
        if isinstance(x, list) and len(x) == 2 and x[0] in ("list", "tuple") and isinstance(x[1], list):
            return [x[0], [walk(v, f"{path}[{i}]") for i, v in enumerate(x[1])]]
        if isinstance(x, list) and len(x) == 2 and x[0] == "dict" and isinstance(x[1], list):
            return ["dict", [[k, walk(v, f"{path}.{_key(k)}")] for k, v in x[1]]]
        if isinstance(x, list) and len(x) == 3 and x[0] == "namedtuple" and isinstance(x[2], dict):
            return ["namedtuple", x[1], {f: walk(v, f"{path}.{f}") for f, v in x[2].items()}]
        if isinstance(x, list):
            return [walk(v, f"{path}/{i}") for i, v in enumerate(x)]
        if isinstance(x, dict):
            return {k: walk(v, f"{path}.{k}") for k, v in x.items()}
        return repr(x)

    skeleton = walk(form, "")
    return digest_json(skeleton), values, paths


def _key(k: str) -> str:
    try:
        parsed = json.loads(k)
    except ValueError:
        return k
    return str(parsed) if not isinstance(parsed, list) else str(parsed[-1])


def readable(form: list[Any], path: str) -> str:
    """Where a value sits, by operator: ``tosa.RESCALE.default args[2]`` rather than ``/17/3[2]``."""
    parts = path.split("/", 2)
    if len(parts) < 3 or not parts[1].isdigit():
        return path
    index = int(parts[1])
    if index >= len(form) or not isinstance(form[index], list) or len(form[index]) < 3:
        return path
    node = form[index]
    if node[0] in ("placeholder", "get_attr", "call_function", "call_module", "output"):
        field = {"3": "args", "4": "kwargs", "5": "meta", "6": "holds"}.get(parts[2].split("[")[0].split(".")[0].split("/")[0], "?")
        rest = parts[2][len(parts[2].split("[")[0].split(".")[0].split("/")[0]):]
        target = short(node[2]) if node[0] == "call_function" else node[0]
        return f"{target} {field}{rest}"
    if node[0] == "tosa_operator":
        field = {"2": "attribute", "3": "inputs", "4": "outputs"}.get(parts[2].split("/")[0], "?")
        return f"TOSA {node[1]} {field}"
    return path


def short(target: str) -> str:
    """An operator's short name: ``RESCALE.default`` for ``tosa::RESCALE.default`` or its schema."""
    name = target.removeprefix("schema:").split("(")[0]
    return name.split("::")[-1]


# ---------------------------------------------------------------------------
# Observing the stock flow


class Observer:
    """The observations of one run: written to a file (the base run) or compared with one (an edited run)."""

    def __init__(self, path: str, base: bool):
        self.path = path
        self.base = base
        self.index = 0
        self.rows: list[dict[str, Any]] = []
        self.stopped = False
        self._pairs: set[tuple[Any, Any]] = set()
        self._previous_digest = ""
        if base:
            self._file = open(path, "w")
        else:
            self._file = open(path)

    def close(self) -> None:
        self._file.close()

    def observe(self, stage: str, name: str, form_of: Callable[[], list[Any]]) -> None:
        if self.stopped:
            return
        start = time.perf_counter()
        form = form_of()
        skeleton, values, paths = split(form)
        label = f"{stage}:{name}"
        if self.base:
            whole = digest_json([skeleton, values])
            ops = [n[2] for n in form if isinstance(n, list) and len(n) > 2 and n[0] == "call_function"]
            record = {"label": label, "skeleton": skeleton, "values": values, "changed": whole != self._previous_digest, "ops": ops}
            self._previous_digest = whole
            self._file.write(json.dumps(record) + "\n")
        else:
            line = self._file.readline()
            if not line:
                self._stop(label, "the base run made fewer observations")
                return
            base = json.loads(line)
            if base["label"] != label:
                self._stop(label, f"the base run observed {base['label']} here")
                return
            row = {"index": self.index, "stage": stage, "name": name, "changed": base["changed"]}
            if base["skeleton"] != skeleton:
                ops = [n[2] for n in form if isinstance(n, list) and len(n) > 2 and n[0] == "call_function"]
                row.update({"class": DECIDES, "difference": _difference(base["ops"], ops)})
                self.rows.append(row)
                self.stopped = True
            else:
                pairs = {(a, b) for a, b in zip(base["values"], values) if a != b}
                new = [(readable(form, p), a, b) for a, b, p in zip(base["values"], values, paths) if a != b and (a, b) not in self._pairs]
                computed = collections.Counter(where for where, _, _ in new)
                cls = COMPUTES if computed else CARRIES if base["changed"] else UNCHANGED
                row.update({
                    "class": INPUT if self.index == 0 else cls,
                    "differing values": len(pairs),
                    "computed": dict(computed) if self.index else {},
                    "examples": [list(e) for e in new[:3]] if self.index else [],
                })
                self._pairs |= pairs  # a pair seen at any earlier step is carried, not computed
                self.rows.append(row)
        self.index += 1
        self.seconds = getattr(self, "seconds", 0.0) + time.perf_counter() - start

    def _stop(self, label: str, why: str) -> None:
        self.rows.append({"index": self.index, "stage": label, "name": "", "class": "not compared", "difference": why})
        self.stopped = True


def _difference(base_ops: list[str], ops: list[str]) -> dict[str, Any]:
    """Where the operator sequences part, and which operators one has more of."""
    first = next((i for i, (a, b) in enumerate(zip(base_ops, ops)) if a != b), min(len(base_ops), len(ops)))
    delta = collections.Counter(base_ops)
    delta.subtract(collections.Counter(ops))
    return {
        "first operator that differs": first,
        "base": [short(o) for o in base_ops[first : first + 3]],
        "edited": [short(o) for o in ops[first : first + 3]],
        "base minus edited": {short(k): v for k, v in delta.items() if v},
        "operators": [len(base_ops), len(ops)],
    }


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    original = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextlib.contextmanager
def observing(observer: Observer) -> Iterator[None]:
    """Patch the stock flow's step boundaries to observe the program after each step (nothing else changes)."""
    import executorch.backends.arm._passes.arm_pass_manager as apm
    import executorch.backends.arm.tosa.backend as tosa_backend
    import executorch.exir.program._program as program_module
    import torchao.quantization.pt2e.quantize_pt2e as qpt2e
    from torch.fx.passes.infra.pass_manager import PassManager

    def named(fn: Any) -> str:
        return getattr(fn, "__name__", None) or type(fn).__name__

    class ObservedPassManager(PassManager):  # the annotation pipeline runs its passes through torch's PassManager
        def __init__(self, passes: Any = None, *args: Any, **kwargs: Any):
            wrapped = [_observed_pass(p) for p in (passes or [])]
            super().__init__(wrapped, *args, **kwargs)

    def _observed_pass(graph_pass: Any) -> Any:
        def run(gm: Any) -> Any:
            result = graph_pass(gm)
            module = result.graph_module if result is not None else gm
            observer.observe("annotation", type(graph_pass).__name__, lambda: program_form(module))
            return result

        run.__name__ = type(graph_pass).__name__
        return run

    original_adapter = apm._ExportedProgramGraphPassAdapter.call

    def adapter_call(self: Any, exported_program: Any) -> Any:
        result = original_adapter(self, exported_program)
        observer.observe("tosa", named(self.graph_pass), lambda: program_form(result.exported_program))
        return result

    def step(module: Any, name: str, stage: str) -> Any:
        original = getattr(module, name)

        def wrapper(model: Any, *args: Any, **kwargs: Any) -> Any:
            out = original(model, *args, **kwargs)
            observer.observe(stage, name, lambda: program_form(out if out is not None else model))
            return out

        return wrapper

    original_decompositions = torch.export.ExportedProgram.run_decompositions

    def run_decompositions(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = original_decompositions(self, *args, **kwargs)
        observer.observe("to_edge", "run_decompositions", lambda: program_form(out))
        return out

    original_gen = program_module._gen_edge_manager_for_partitioners

    def gen_edge(*args: Any, **kwargs: Any) -> Any:
        manager = original_gen(*args, **kwargs)
        observer.observe("to_edge", "edge program", lambda: program_form(manager.exported_program()))
        return manager

    original_preprocess = tosa_backend.TOSABackend._preprocess

    def preprocess(edge_program: Any, compile_spec: Any) -> Any:
        observer.observe("tosa", "partition input", lambda: program_form(edge_program))
        result = original_preprocess(edge_program, compile_spec)
        observer.observe("tosa", "serialized TOSA", lambda: tosa_form(bytes(result.processed_bytes)))
        return result

    with contextlib.ExitStack() as stack:
        stack.enter_context(_patched(apm, "GraphModulePassManager", ObservedPassManager))
        stack.enter_context(_patched(apm._ExportedProgramGraphPassAdapter, "call", adapter_call))
        for name in ("_fuse_conv_bn_", "_fuse_linear_bn_", "prepare"):
            stack.enter_context(_patched(qpt2e, name, step(qpt2e, name, "quantize")))
        stack.enter_context(_patched(torch.export.ExportedProgram, "run_decompositions", run_decompositions))
        stack.enter_context(_patched(program_module, "_gen_edge_manager_for_partitioners", gen_edge))
        stack.enter_context(_patched(tosa_backend.TOSABackend, "_preprocess", staticmethod(preprocess)))
        yield


def observed_flow(module: torch.nn.Module, example: tuple[Any, ...], target_name: str, observer: Observer) -> None:
    """The stock flow (export, quantization, ``to_edge_transform_and_lower``) with every step observed."""
    from executorch.exir import to_edge_transform_and_lower
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    from lowercache.targets import resolve

    target = resolve(target_name)
    with observing(observer):
        program = torch.export.export(module, tuple(example))
        observer.observe("export", "torch.export.export", lambda: program_form(program))
        spec = target.compile_spec()
        quantizer = target.quantizer(spec)
        original_annotate = quantizer.annotate

        def annotate(model: Any) -> Any:
            out = original_annotate(model)
            observer.observe("quantize", "annotate", lambda: program_form(model))
            return out

        quantizer.annotate = annotate
        prepared = prepare_pt2e(program.module(check_guards=False), quantizer)
        prepared(*example)
        observer.observe("quantize", "calibrate", lambda: program_form(prepared))
        converted = convert_pt2e(prepared)
        observer.observe("quantize", "convert_pt2e", lambda: program_form(converted))
        quantized = torch.export.export(converted, tuple(example))
        observer.observe("quantize", "re-export", lambda: program_form(quantized))
        partitioner = target.partitioner(spec)
        original_partition = partitioner.partition

        def partition(exported_program: Any) -> Any:
            result = original_partition(exported_program)
            observer.observe("to_edge", "partition", lambda: program_form(result.tagged_exported_program))
            return result

        partitioner.partition = partition
        edge = to_edge_transform_and_lower(quantized, partitioner=[partitioner])
        observer.observe("to_edge", "lowered program", lambda: program_form(edge.exported_program()))


# ---------------------------------------------------------------------------
# Runs and the summary


def run_one(model: str, target: str, edits: list[tuple[str, int]], workdir: str) -> dict[str, Any]:
    """The base run and one compared run per edit, for one model and target."""
    from lowercache.bench import weights

    base_path = os.path.join(workdir, f"{model}-{target}-base.jsonl")
    module, example = weights.MODELS[model]()
    base = Observer(base_path, base=True)
    start = time.perf_counter()
    observed_flow(module, example, target, base)
    base.close()
    result: dict[str, Any] = {"model": model, "target": target, "observations": base.index, "edits": {}}
    for kind, seed in edits:
        edited_module, edited_example = weights.edited(model, kind, seed)
        compared = Observer(base_path, base=False)
        observed_flow(edited_module, edited_example, target, compared)
        compared.close()
        result["edits"][f"{kind}:{seed}"] = compared.rows
    result["seconds"] = round(time.perf_counter() - start, 1)
    os.unlink(base_path)
    return result


def summarize(results: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    """Per step (stage, name): how often each class was seen, and where computed values sit."""
    table: dict[tuple[str, str], dict[str, Any]] = {}
    for result in results:
        for edit, rows in result["edits"].items():
            for row in rows:
                entry = table.setdefault((row["stage"], row["name"]), {
                    "classes": collections.Counter(), "computed": collections.Counter(), "decided": [], "runs": set()})
                entry["classes"][row["class"]] += 1
                entry["computed"].update(row.get("computed", {}))
                entry["runs"].add(f"{result['model']}/{result['target']}")
                if row["class"] == DECIDES:
                    entry["decided"].append(f"{result['model']}/{result['target']}/{edit}: {row['difference']}")
    return table


def _where(computed: collections.Counter) -> str:
    kinds: collections.Counter = collections.Counter()
    for where, n in computed.items():
        kinds[re.sub(r"\.\d+", "", where.split("[")[0].split("/")[0])] += n
    return ", ".join(f"{k} ({n})" for k, n in kinds.most_common(6))


def markdown(table: dict[tuple[str, str], dict[str, Any]]) -> str:
    lines = ["| stage | step | carries | computes | decides | unchanged | where computed values sit (count) |",
             "|---|---|---|---|---|---|---|"]
    seen: set[tuple[str, str]] = set()
    for (stage, name), entry in table.items():
        if (stage, name) in seen:
            continue
        seen.add((stage, name))
        c = entry["classes"]
        lines.append(f"| {stage} | {name} | {c[CARRIES]} | {c[COMPUTES]} | {c[DECIDES]} | {c[UNCHANGED]} | {_where(entry['computed'])} |")
    return "\n".join(lines)


def _jsonable(table: dict[tuple[str, str], dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"stage": s, "step": n, "classes": dict(e["classes"]), "computed": dict(e["computed"]),
             "decided": e["decided"], "runs": sorted(e["runs"])} for (s, n), e in table.items()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny_cnn,residual_cnn,transformer_block")
    parser.add_argument("--targets", default="tosa-int,ethos-u55-128,ethos-u85-256")
    parser.add_argument("--edits", default="retrained:1,retrained:2,block:1,head:1", help="kind:seed, comma separated")
    parser.add_argument("--out", default=None, help="directory for one JSON per model and target, and the summary")
    args = parser.parse_args(argv)
    edits = [(e.split(":")[0], int(e.split(":")[1])) for e in args.edits.split(",") if e]
    results = []
    with tempfile.TemporaryDirectory(prefix="census-values-") as workdir:
        for model in args.models.split(","):
            for target in args.targets.split(","):
                with contextlib.redirect_stdout(sys.stderr):  # Vela prints its summary
                    result = run_one(model, target, edits, workdir)
                results.append(result)
                print(f"{model} {target}: {result['observations']} observations, {result['seconds']} s", file=sys.stderr, flush=True)
                if args.out:
                    os.makedirs(args.out, exist_ok=True)
                    with open(os.path.join(args.out, f"{model}-{target}.json"), "w") as f:
                        json.dump(result, f, indent=1)
    table = summarize(results)
    text = markdown(table)
    print(text)
    if args.out:
        with open(os.path.join(args.out, "summary.json"), "w") as f:
            json.dump(_jsonable(table), f, indent=1)
        with open(os.path.join(args.out, "summary.md"), "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
