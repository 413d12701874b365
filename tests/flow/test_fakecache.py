"""FakeTensor's dispatch cache admits exactly the checked quantize/dequantize ops, and they stay exact."""

from __future__ import annotations

import contextlib
import io

import torch

import lowercache
from lowercache.speedups import fakecache
from lowercache.bench import models

from tests.helpers.oracle import reference


def test_admits_the_four_quantize_ops_on_the_pinned_toolchain():
    names = sorted(str(op) for op in fakecache.admitted())
    assert names == [
        "quantized_decomposed.dequantize_per_channel.default",
        "quantized_decomposed.dequantize_per_tensor.default",
        "quantized_decomposed.quantize_per_channel.default",
        "quantized_decomposed.quantize_per_tensor.default",
    ]
    assert fakecache.kernels_digest() == fakecache._PINNED


def test_registration_check_reads_the_dispatcher_record():
    here = "/site-packages/torch/ao/quantization/fx/_decomposed.py:12 :: (none) [ boxed ]"
    ok = f"name: x\nMeta: registered at {here}\nCompositeExplicitAutograd[alias]: registered at {here}\n"
    assert fakecache.meta_registered_by_decomposed(ok)
    other = ok.replace("torch/ao/quantization/fx/_decomposed.py", "mylib/override.py")
    assert not fakecache.meta_registered_by_decomposed(other)  # someone re-registered the Meta kernel
    assert not fakecache.meta_registered_by_decomposed(ok + f"CompositeImplicitAutograd: registered at {here}\n")
    assert not fakecache.meta_registered_by_decomposed("name: x\n")  # no Meta kernel at all


def test_cache_hits_agree_with_real_dispatch_and_bytes_with_stock():
    """torch's own cross-check re-runs the kernel on every cache hit and raises on any difference."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    admitted = fakecache.admitted()
    FakeTensorMode.cache.clear()
    module, example = models.tiny_cnn()
    with fakecache._patch.active():  # held open, so the entries outlive the lowering for a look
        with torch._dynamo.config.patch(fake_tensor_cache_crosscheck_enabled=True):
            with contextlib.redirect_stdout(io.StringIO()):
                artifacts = lowercache.lower(module, example, target="ethos-u55-128", use_cache=False)
        cached = {str(op) for op in admitted & {key.key[0] for key in FakeTensorMode.cache}}
    # quantize_per_channel does not occur in this graph (its weights are quantized ahead of time)
    assert cached == {
        "quantized_decomposed.quantize_per_tensor.default",
        "quantized_decomposed.dequantize_per_tensor.default",
        "quantized_decomposed.dequantize_per_channel.default",
    }
    assert artifacts.pte == reference("tiny_cnn", "ethos-u55-128")


def test_off_outside_lowercache():
    """Disabled, FakeTensor is stock again, and no entry made while enabled serves stock code."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert FakeTensorMode._validate_cache_key is not fakecache._validate_cache_key
    module, example = models.tiny_cnn()
    with contextlib.redirect_stdout(io.StringIO()):
        lowercache.lower(module, example, target="tosa-int", use_cache=False)
    assert FakeTensorMode._validate_cache_key is not fakecache._validate_cache_key
    assert not fakecache.admitted() & {key.key[0] for key in FakeTensorMode.cache}
