"""Fast checks of the seeded model builders: determinism, edit locality, export.

Nothing here lowers a model; the whole file runs in seconds.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch
from torch import nn

from lowercache.bench import models

CHEAP = (*models.SMALL, "mobilenet_v2")


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Run the tiny forward passes single-threaded.

    Intra-op threads buy nothing on these inputs, and on a shared machine
    OpenMP spin-waiting made them 10-100x slower.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.state_dict())


def _digest(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> str:
    h = hashlib.sha256()
    for key, tensor in sorted(model.state_dict().items()):
        h.update(key.encode())
        h.update(tensor.detach().contiguous().numpy().tobytes())
    for tensor in inputs:
        h.update(tensor.contiguous().numpy().tobytes())
    return h.hexdigest()


def _leaf_types(model: nn.Module) -> dict[str, str]:
    return {name: type(m).__name__ for name, m in model.named_modules() if not list(m.children())}


def _in_block(name: str, block: str) -> bool:
    return name == block or name.startswith(block + ".")


def _block_path(name: str, model: nn.Module) -> str:
    return models._vit_layer_path(model, 6) if name == "deit_tiny" else models.EDITED_BLOCKS[name]


def _check_deterministic(name: str) -> None:
    m1, x1 = models.MODELS[name]()
    m2, x2 = models.MODELS[name]()
    s1, s2 = _state(m1), _state(m2)
    assert s1.keys() == s2.keys()
    assert all(torch.equal(s1[k], s2[k]) for k in s1)
    assert all(torch.equal(a, b) for a, b in zip(x1, x2, strict=True))
    assert not m1.training


def _check_edits(name: str) -> None:
    base, x = models.MODELS[name]()
    block = _block_path(name, base)
    with torch.no_grad():
        y = base(*x)
    base_state, base_types = _state(base), _leaf_types(base)

    structure, xs = models.MODELS[name](edit="structure")
    assert all(torch.equal(a, b) for a, b in zip(x, xs, strict=True))
    s = _state(structure)
    assert s.keys() == base_state.keys()
    assert all(torch.equal(base_state[k], s[k]) for k in s), "structure edit must not touch any weight"
    types = _leaf_types(structure)
    changed = {n for n in types if types[n] != base_types.get(n)} | (base_types.keys() - types.keys())
    assert changed and all(_in_block(n, block) for n in changed), changed
    with torch.no_grad():
        assert not torch.equal(structure(*x), y)

    weights, xw = models.MODELS[name](edit="weights")
    assert all(torch.equal(a, b) for a, b in zip(x, xw, strict=True))
    w = _state(weights)
    assert w.keys() == base_state.keys()
    assert _leaf_types(weights) == base_types
    differ = {k for k in w if not torch.equal(base_state[k], w[k])}
    assert differ and all(_in_block(k, block) for k in differ), differ
    block_weights = {k for k in w if _in_block(k, block) and k.endswith(".weight")}
    assert block_weights <= differ
    with torch.no_grad():
        assert not torch.equal(weights(*x), y)


def test_registry() -> None:
    assert set(models.MODELS) == set(models.SMALL) | set(models.LARGE)
    assert not set(models.SMALL) & set(models.LARGE)
    assert set(models.EDITED_BLOCKS) == set(models.MODELS)


@pytest.mark.parametrize("name", CHEAP)
def test_deterministic(name: str) -> None:
    _check_deterministic(name)


@pytest.mark.parametrize("name", CHEAP)
def test_seed_changes_weights_and_inputs(name: str) -> None:
    m0, x0 = models.MODELS[name](seed=0)
    m1, x1 = models.MODELS[name](seed=1)
    s0, s1 = _state(m0), _state(m1)
    assert any(not torch.equal(s0[k], s1[k]) for k in s0)
    assert not torch.equal(x0[0], x1[0])


@pytest.mark.parametrize("name", CHEAP)
def test_edits_are_local(name: str) -> None:
    _check_edits(name)


@pytest.mark.parametrize("name", CHEAP)
def test_builder_leaves_global_rng_alone(name: str) -> None:
    state = torch.random.get_rng_state()
    models.MODELS[name](edit="weights")
    assert torch.equal(torch.random.get_rng_state(), state)


@pytest.mark.parametrize("name", models.SMALL)
@pytest.mark.parametrize("edit", (None, "structure"))
def test_small_models_export(name: str, edit: str | None) -> None:
    model, inputs = models.MODELS[name](edit=edit)
    ep = torch.export.export(model, inputs)
    assert torch.allclose(ep.module()(*inputs), model(*inputs))


def test_mobilenet_v2_shape_and_export() -> None:
    model, inputs = models.mobilenet_v2()
    assert inputs[0].shape == (1, 3, 96, 96)
    assert sum(isinstance(m, nn.Conv2d) for m in model.modules()) == 52
    ep = torch.export.export(model, inputs)
    assert ep.module()(*inputs).shape == (1, 1000)
    _, small = models.mobilenet_v2(size=64)
    assert small[0].shape == (1, 3, 64, 64)


def test_residual_cnn_has_about_30_convs() -> None:
    model, _ = models.residual_cnn()
    assert 28 <= sum(isinstance(m, nn.Conv2d) for m in model.modules()) <= 32
    assert any(isinstance(m, nn.BatchNorm2d) for m in model.modules())


def test_transformer_block_has_no_sdpa() -> None:
    model, inputs = models.transformer_block()
    ep = torch.export.export(model, inputs)
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert not any("attention" in t for t in targets), targets
    assert any("softmax" in t for t in targets)


def test_unknown_edit_is_rejected() -> None:
    with pytest.raises(ValueError):
        models.tiny_cnn(edit="nonsense")


def test_calibration_samples() -> None:
    _, inputs = models.residual_cnn()
    samples = models.calibration_samples(inputs, n=3)
    assert len(samples) == 3
    for sample in samples:
        assert [t.shape for t in sample] == [t.shape for t in inputs]
        assert not torch.equal(sample[0], inputs[0])
    assert not torch.equal(samples[0][0], samples[1][0])
    again = models.calibration_samples(inputs, n=3)
    assert all(torch.equal(a[0], b[0]) for a, b in zip(samples, again, strict=True))
    other = models.calibration_samples(inputs, n=3, seed=2)
    assert not torch.equal(samples[0][0], other[0][0])


def test_same_weights_in_a_fresh_process() -> None:
    """Same arguments give the same bytes in another interpreter, and no transformers import."""
    code = (
        "import hashlib, importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('m', {models.__file__!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "assert 'transformers' not in sys.modules\n"
        "for name in ('tiny_cnn', 'mobilenet_v2'):\n"
        "    model, inputs = m.MODELS[name](edit='weights')\n"
        "    h = hashlib.sha256()\n"
        "    for key, tensor in sorted(model.state_dict().items()):\n"
        "        h.update(key.encode())\n"
        "        h.update(tensor.detach().contiguous().numpy().tobytes())\n"
        "    for tensor in inputs:\n"
        "        h.update(tensor.contiguous().numpy().tobytes())\n"
        "    print(h.hexdigest())\n"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    expected = [_digest(*models.MODELS[n](edit="weights")) for n in ("tiny_cnn", "mobilenet_v2")]
    assert out.stdout.split() == expected


@pytest.mark.parametrize("name", ("resnet", "deit_tiny"))
def test_transformers_models(name: str) -> None:
    pytest.importorskip("transformers")
    _check_deterministic(name)
    _check_edits(name)
