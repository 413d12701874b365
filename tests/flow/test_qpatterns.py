"""qpatterns: a conv-bn pattern exported once and handed out as copies annotates a graph as a fresh export does.

The conv-bn annotators match only graphs that keep their batch norms, that is quantization-aware training's
(``prepare_qat_pt2e``); the post-training flow exports the same 12 patterns and matches none. So the models here are
trained-mode conv-bn(-relu) stacks, 1-d and 2-d, with and without an in-place ReLU, each prepared with the patterns
served from the kept exports and compared, graph, annotations and observers, with stock's (the speed-up off).
"""

from __future__ import annotations

import warnings

import pytest

torch = pytest.importorskip("torch")

from lowercache.speedups import qpatterns  # noqa: E402
from lowercache.speedups import registry  # noqa: E402

nn = torch.nn


class ConvBn(nn.Module):
    def __init__(self, dims: int, relu: str):
        super().__init__()
        conv, bn = (nn.Conv1d, nn.BatchNorm1d) if dims == 1 else (nn.Conv2d, nn.BatchNorm2d)
        self.conv, self.bn, self.relu, self.head = conv(3, 4, 3), bn(4), relu, conv(4, 2, 1)

    def forward(self, x):
        y = self.bn(self.conv(x))
        if self.relu == "relu":
            y = torch.nn.functional.relu(y)
        elif self.relu == "relu_":
            y = torch.nn.functional.relu_(y)
        return self.head(y)


CASES = [(2, "relu"), (2, "relu_"), (2, "none"), (1, "relu")]


def prepared(dims: int, relu: str) -> str:
    """The prepared QAT graph as text, with every node's quantization annotation and each observer's settings."""
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import XNNPACKQuantizer, get_symmetric_quantization_config
    from torchao.quantization.pt2e.quantize_pt2e import prepare_qat_pt2e

    torch.manual_seed(dims)
    model = ConvBn(dims, relu).train()
    example = (torch.randn(1, 3, *([8] * dims)),)
    exported = torch.export.export(model, example).module()
    quantizer = XNNPACKQuantizer()
    quantizer.set_global(get_symmetric_quantization_config(is_per_channel=True, is_qat=True))
    gm = prepare_qat_pt2e(exported, quantizer)
    annotations = [(n.name, repr(n.meta.get("quantization_annotation"))) for n in gm.graph.nodes]
    observers = [(name, repr(m)) for name, m in gm.named_modules() if "observer" in name or "fake_quant" in name]
    return "\n".join([str(gm.graph), *map(str, annotations), *map(str, observers)])


def test_the_pins_are_the_installed_sources():
    assert registry.audited("qpatterns") and qpatterns.sources_digest() == qpatterns._AUDITED_DIGEST


@pytest.fixture(scope="module")
def kept():
    """The 12 patterns exported and kept once (by a 1-d conv-bn model's preparation, which must be stock's too)."""
    stock = prepared(1, "none")
    qpatterns.forget()
    qpatterns.reset_stats()
    with qpatterns.active():
        first = prepared(1, "none")
    assert first == stock
    assert qpatterns.stats() == {"exported": 12, "copied": 12, "kept": 12}
    yield
    qpatterns.forget()


@pytest.mark.parametrize("dims,relu", CASES)
def test_copies_of_kept_patterns_annotate_as_fresh_exports(kept, dims, relu):
    stock = prepared(dims, relu)
    assert "QuantizationAnnotation(" in stock and "activation_post_process" in stock
    qpatterns.reset_stats()
    with qpatterns.active():
        served = prepared(dims, relu)  # every pattern a copy of a kept one
    assert qpatterns.stats() == {"exported": 0, "copied": 12, "kept": 12}
    assert served == stock


def test_the_annotators_do_match_here_so_a_wrong_pattern_would_show(kept):
    """A pattern served for the wrong closure (with and without the ReLU swapped) changes what is annotated."""
    stock = prepared(2, "relu")
    right = dict(qpatterns._kept)
    swapped = {key: right[next(k for k in right if k[1] is key[1] and k[2] != key[2])] for key in right}
    qpatterns._kept.clear()
    qpatterns._kept.update(swapped)
    try:
        with qpatterns.active():
            wrong = prepared(2, "relu")
    finally:
        qpatterns._kept.clear()
        qpatterns._kept.update(right)
    assert wrong != stock


def test_a_copy_is_made_without_warnings_and_shares_only_the_frozen_specs(kept):
    original = next(iter(qpatterns._kept.values()))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        copy = qpatterns._copy(original)
    assert copy.graph is not original.graph and str(copy.graph) == str(original.graph)
    assert copy._out_spec is original._out_spec
    assert copy.graph._codegen is not original.graph._codegen and "__deepcopy__" not in vars(copy.graph._codegen)
    assert copy.graph._codegen.pytree_info.orig_args is not original.graph._codegen.pytree_info.orig_args


def test_a_pattern_it_does_not_know_is_exported_every_time():
    from torchao.quantization.pt2e.utils import _get_aten_graph_module_for_pattern as stock_export

    class Add(nn.Module):
        def forward(self, x, y):
            return x + y

    qpatterns.reset_stats()
    with qpatterns.active():
        from executorch.backends.xnnpack.quantizer import xnnpack_quantizer_utils as holder

        pattern = holder._get_aten_graph_module_for_pattern(Add(), (torch.randn(2), torch.randn(2)))
    assert qpatterns.stats()["exported"] == qpatterns.stats()["copied"] == 0
    assert str(pattern.graph) == str(stock_export(Add(), (torch.randn(2), torch.randn(2))).graph)


@pytest.mark.parametrize("setting", ["no_grad", "dynamo_config"])
def test_a_changed_export_setting_exports_again_and_matches_stock_under_it(kept, setting):
    """What a user may change between two preparations in one process (grad mode, dynamo's configuration) is part of
    the key: the kept patterns are not served under it; the patterns are exported again, as stock does."""
    import torch._dynamo.config

    def under():
        if setting == "no_grad":
            return torch.no_grad()
        return torch._dynamo.config.patch(cache_size_limit=torch._dynamo.config.cache_size_limit + 1)

    with under():
        stock = prepared(2, "relu")
    before = dict(qpatterns._kept)
    qpatterns.reset_stats()
    try:
        with qpatterns.active(), under():
            served = prepared(2, "relu")
        assert qpatterns.stats() == {"exported": 12, "copied": 12, "kept": 24}
    finally:  # the module's own 12 only, for the tests after
        qpatterns._kept.clear()
        qpatterns._kept.update(before)
    assert served == stock
