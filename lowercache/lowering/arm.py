"""The Arm integration: cached steps hooked into ExecuTorch's Arm backend.

Two hook points, both wrapped rather than subclassed (the backends are
``@final`` and looked up by class name):

- ``TOSABackend._preprocess``: one partition's edge program to TOSA bytes
  (the ~146-pass pipeline, node visitors, serialization). Step kind ``tosa``.
  Its key is computed before the call, because the call mutates its input.
  Within it, ``process_call_function`` (imported by name into the same
  module) is wrapped to note each TOSA tensor's module path, read only, for
  Vela's per-layer labels (``lowercache/delegation.py``).
- ``vela_compile`` as imported into ``ethosu/backend.py``: TOSA bytes to the
  Ethos-U command stream. Step kind ``vela``.

While installed, the hooks record into the active :class:`~lowercache.cache.steps.Session`
and pass straight through when there is none. Installing them also turns on
the in-flow speed-ups that keep output bytes identical: shared provenance
(``provenance.py``), observer qparams steps (``qparams.py``), per-pass
records (``passes.py``), reuse of unchanged nodes' fake-tensor values
during retraces (``retrace.py``), fast copies of the nodes a pass leaves
alone (``fastcopy.py``), deferred GraphModule code generation
(``lazycode.py``), free attribute names (``attrnames.py``), skipped
decomposition re-traces that have nothing to decompose
(``decompositions.py``), FakeTensor's cache for quantize/dequantize ops
(``fakecache.py``), one-frame stack lines for the nodes passes stamp
(``callsite.py``), dead-code elimination that asks about side effects
only for nodes without users (``deadcode.py``), one C++ registry walk
per collection of CompositeImplicitAutograd operators (``ciaops.py``),
reachability as bit sets in the partitioner (``partitioner.py``) and the
permute propagation's rounds retraced where they changed (``propagate.py``).
They also put partitions in discovery order (``partitionorder.py``), which stock leaves to the
string-hash seed, so the output is the same in every process. Calls that ask for debug
artifacts on disk run uncached (a hit would not write them).
"""

from __future__ import annotations

import contextlib
import functools
import io
import os
import tempfile
import threading
from typing import Any

from . import partitionorder, passes, qparams, rebind
from .replay import regionsplice
from .specdigest import compile_spec_digest, pass_insertions_digest
from .switches import Switches
from .. import delegation
from ..speedups import registry
from ..speedups.patching import Patch
from ..targets.arm_ethosu import ETHOSU_MODULE, VELA_SCRATCH_PREFIX
from ..targets.arm_tosa import TOSA_MODULE
from ..cache.hashing import Unhashable, digest, digest_json, program_parts
from ..cache.steps import current_session
from ..cache.store import Entry
from ..cache.toolchain import toolchain_parts
from . import arithmetic

HOOK_MODULES = (TOSA_MODULE, ETHOSU_MODULE)  # the Arm families' hook points (targets/arm_*.py)
_lock = threading.Lock()
_originals: dict[str, Any] = {}
_naming = threading.local()  # .modules: the TOSA tensor name -> module path map of the partition this thread lowers


def tosa_parts(edge_program: Any, compile_spec: Any) -> dict[str, str] | None:
    """Key parts of one partition's TOSA lowering, or None when it must not be cached."""
    if compile_spec._get_intermediate_path() or compile_spec.tosa_debug_mode is not None:
        return None
    insertions = pass_insertions_digest()
    if insertions is None:
        return None
    try:
        parts = {f"program.{k}": v for k, v in program_parts(edge_program).items()}
    except Unhashable:
        return None
    parts["compile_spec"] = compile_spec_digest(compile_spec)
    parts["pass_insertions"] = insertions
    if regionsplice.engaged():  # the spliced TOSA differs from stock's in names: its own entry
        parts["pipeline"] = regionsplice.VERSION
    parts.update(arithmetic.step_parts())
    return parts


def _vela_config_digest(args: list[str]) -> str:
    """Digest of every Vela config file named by ``--config``, resolved as Vela does."""
    from ethosu.vela import architecture_features

    contents = []
    for arg in args:
        if not arg.startswith("--config="):
            continue
        name = arg.split("=", 1)[1]
        parts = os.path.normpath(name).split(os.path.sep)
        if len(parts) == 2 and not name.startswith((".", "~", os.path.sep)):
            path = os.path.join(architecture_features.CONFIG_FILES_PATH, name)
        else:
            path = os.path.expanduser(name)
        with open(path, "rb") as f:
            contents.append([name, digest(f.read())])
    return digest_json(contents)


def vela_parts(tosa: bytes, args: list[str], verbose: bool, placements: Any) -> dict[str, str] | None:
    try:
        config = _vela_config_digest(args)
    except OSError:
        return None  # let Vela report the missing file itself
    return {
        "tosa": digest(tosa),
        "flags": digest_json(list(args)),
        "config_files": config,
        "verbose": str(bool(verbose)),
        "block_placements": digest_json(dict(placements or {})),
        "vela": toolchain_parts()["vela"],
        "packing": _vela_packing_digest(),
        "lowercache_src": toolchain_parts()["lowercache_src"],
    }


@functools.lru_cache(maxsize=1)
def _vela_packing_digest() -> str:
    """Digest of the ExecuTorch module that runs Vela and packs its output into the delegate's
    blocks (``arm_vela.py``): its block format differs between releases (1.5 added external blocks)."""
    import inspect

    with open(inspect.getsourcefile(_originals["vela"]), "rb") as f:
        return digest(f.read())


def _vela_legacy(original: Any) -> bool:
    """ExecuTorch 1.4's ``vela_compile`` takes no ``block_placements`` and returns the stream as bytes."""
    import inspect

    return "block_placements" not in inspect.signature(original).parameters


def _tosa_preprocess(edge_program: Any, compile_spec: Any) -> Any:
    from executorch.exir.backend.backend_details import PreprocessResult

    original = _originals["tosa"]
    session = current_session()
    if session is None:
        return original(edge_program, compile_spec)
    parts = tosa_parts(edge_program, compile_spec)
    index = len(session.outputs.get("tosa", []))

    def compute() -> Entry:
        _naming.modules = {}
        try:
            result = original(edge_program, compile_spec)
            modules = _naming.modules
        finally:
            _naming.modules = None
        return Entry(meta={"tensor_modules": modules}, blobs={"tosa": bytes(result.processed_bytes)})

    entry = session.run("tosa", f"partition {index}", parts, compute)
    return PreprocessResult(processed_bytes=entry.blobs["tosa"])


def _process_call_function(node: Any, *args: Any, **kwargs: Any) -> Any:
    """Each TOSA operator's output tensor is named after its node: note the node's module path (read only)."""
    modules = getattr(_naming, "modules", None)
    if modules is not None:
        path = delegation.module_path(node)
        if path is not None:
            modules[node.name] = path
    return _originals["process_call_function"](node, *args, **kwargs)


def _vela_compile(
    tosa_flatbuffer: bytes,
    args: list[str],
    verbose: bool = False,
    intermediate_path: str | None = None,
    block_placements: Any = None,
) -> Any:
    original = _originals["vela"]
    legacy = _vela_legacy(original)
    # Called as the installed release's vela_compile is: ExecuTorch 1.4's has no block_placements
    # (given one, it raises as stock would).
    extra = () if legacy and block_placements is None else (block_placements,)
    session = current_session()
    if session is None or intermediate_path is not None:
        return original(tosa_flatbuffer, args, verbose, intermediate_path, *extra)
    parts = vela_parts(tosa_flatbuffer, args, verbose, block_placements)
    index = len(session.outputs.get("vela", []))

    def compute() -> Entry:
        with tempfile.TemporaryDirectory(prefix=VELA_SCRATCH_PREFIX) as tmp:
            printed = io.StringIO()
            with contextlib.redirect_stdout(printed):
                result = original(tosa_flatbuffer, args, verbose, tmp, *extra)
            stream = result if legacy else result.processed_bytes
            blobs = {"command_stream": bytes(stream), "summary.txt": printed.getvalue().encode()}
            outdir = os.path.join(tmp, "output")
            for name in sorted(os.listdir(outdir)):
                if name.endswith(".csv"):
                    with open(os.path.join(outdir, name), "rb") as f:
                        blobs[f"output/{name}"] = f.read()
        external = []
        for i, block in enumerate(() if legacy else result.external_blocks):
            blobs[f"external/{i}"] = bytes(block.payload)
            external.append({"key": block.key, "alignment": block.alignment, "placement": block.placement})
        return Entry(meta={"external_blocks": external}, blobs=blobs)

    entry = session.run("vela", f"partition {index}", parts, compute)
    if session.replay_output:
        print(entry.blobs["summary.txt"].decode(), end="")
    if legacy:
        return entry.blobs["command_stream"]
    from executorch.backends.arm.arm_vela import VelaCompileResult, VelaExternalBlock

    blocks = tuple(
        VelaExternalBlock(key=b["key"], payload=entry.blobs[f"external/{i}"], alignment=b["alignment"], placement=b["placement"])
        for i, b in enumerate(entry.meta.get("external_blocks", []))
    )
    return VelaCompileResult(entry.blobs["command_stream"], blocks)


_permanent = False


def _wrap_module(module_name: str) -> None:
    """Wrap the hook point that lives in ``module_name`` (once)."""
    import importlib

    module = importlib.import_module(module_name)
    if module_name == TOSA_MODULE and "tosa" not in _originals:
        _originals["tosa"] = module.TOSABackend._preprocess
        module.TOSABackend._preprocess = staticmethod(_tosa_preprocess)
        _originals["process_call_function"] = module.process_call_function
        module.process_call_function = _process_call_function
    if module_name == ETHOSU_MODULE and "vela" not in _originals:
        _originals["vela"] = module.vela_compile
        module.vela_compile = _vela_compile


def _unwrap_modules() -> None:
    import importlib

    if "tosa" in _originals:
        importlib.import_module(TOSA_MODULE).TOSABackend._preprocess = staticmethod(_originals.pop("tosa"))
        importlib.import_module(TOSA_MODULE).process_call_function = _originals.pop("process_call_function")
    if "vela" in _originals:
        importlib.import_module(ETHOSU_MODULE).vela_compile = _originals.pop("vela")


# Patches of the flow's own, on whenever the hooks are: observer qparams as
# steps (``qparams``), a recorder of every pass (``passes``) and partitions in
# discovery order (``partitionorder``, the one deliberate difference: README).
_FLOW_PATCHES = {"qparams": qparams, "passes": passes, "partitionorder": partitionorder}
# Speed-ups that live with the flow (they use its regions or its steps), switched by the registry like the others.
_FLOW_SPEEDUPS = {"regions": regionsplice, "rebind": rebind}
_switches = Switches(registry.ARM, _FLOW_PATCHES, _FLOW_SPEEDUPS)
_switch_on = _switches.on
_switch_off = _switches.off


def _apply() -> None:
    for name in HOOK_MODULES:
        _wrap_module(name)
    _switch_on()


def _undo() -> None:
    _switch_off()
    if not _permanent:
        _unwrap_modules()


def spec_after_quantize(spec: Any) -> None:
    """The one side effect of the stock quantization stage on the spec, which a hit on the stage reproduces: the Arm
    quantizer materializes the compile spec's default pass-pipeline config (the partitioner serializes it)."""
    spec._get_pass_pipeline_config()


def import_quantizer() -> None:
    """Import what the stock quantization stage imports, which a hit on the stage skips: the Arm quantizer, which loads
    the quantized kernels' out variants that ``to_executorch`` needs."""
    import executorch.backends.arm.quantizer  # noqa: F401


def backend_source_parts() -> dict[str, str]:
    """The Arm backend's sources are in every key already (``toolchain_parts``'s ``arm_backend_src``)."""
    return {}


def import_backend() -> None:
    """Import the Arm backend's modules the hooks wrap, and the speed-ups' patches: seconds in a new process, nothing in
    the warm server's child. Only on a miss: a hit needs none of it."""
    import importlib

    for name in HOOK_MODULES:
        importlib.import_module(name)


_hooks = Patch(_apply, _undo)
install = _hooks.enable  # wrap the Arm hook points (reference counted, so nesting is safe)
uninstall = _hooks.disable
hooks = _hooks.active


def install_permanently(module_name: str) -> None:
    """Used by ``lowercache run``: wrap a hook module for the life of the process."""
    global _permanent
    with _lock:
        if not _permanent:
            _switch_on()
        _permanent = True
        _wrap_module(module_name)
