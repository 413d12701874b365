"""The canonical TOSA form: one for a graph renamed or with its tensor list reordered, another for any other change."""

from __future__ import annotations

from lowercache.lowering.replay.tosacanon import canonical, equal_up_to_names

from tests.helpers.tosa import MODELS, constants_reordered, one_weight_changed, renamed, shuffled


def test_names_and_order_do_not_change_the_form_and_anything_else_does(partitions):
    for (model, family), tosa in partitions.items():
        form = canonical(tosa)
        for variant in (renamed(tosa, 1), shuffled(tosa, 2), shuffled(renamed(tosa, 3), 4), constants_reordered(tosa, 5)):
            assert variant != tosa and canonical(variant) == form and equal_up_to_names(variant, tosa), (model, family)
        assert not equal_up_to_names(one_weight_changed(tosa), tosa), (model, family)
    # another model, or the same model for another family's TOSA profile, is another graph
    forms = {key: canonical(tosa) for key, tosa in partitions.items()}
    assert forms[MODELS[0], "ethos-u55"] != forms[MODELS[1], "ethos-u55"]


def test_an_operator_attribute_is_part_of_the_form(partitions):
    """Every operator carries its attribute table's values (a convolution's stride, pad, accumulator type)."""
    form = canonical(partitions[MODELS[0], "ethos-u55"])
    attributes = [op[2] for region in form[1:] for block in region[1] for op in block[3] if op[2] is not None]
    names = {a[0] for a in attributes}
    assert "Conv2dAttribute" in names or "DepthwiseConv2dAttribute" in names, names
    conv = next(a for a in attributes if a[0] in ("Conv2dAttribute", "DepthwiseConv2dAttribute"))
    assert conv[1]["Stride"] and conv[1]["Pad"], conv


def test_verify_says_when_a_tosa_mismatch_is_only_names(partitions):
    from lowercache.lowering.flow import Artifacts
    from lowercache.verify import compare

    tosa = partitions[MODELS[0], "ethos-u85"]
    stock = Artifacts({"partition_0.tosa": tosa})
    (names,) = compare("cache", Artifacts({"partition_0.tosa": renamed(tosa, 5)}), stock)
    (weight,) = compare("cache", Artifacts({"partition_0.tosa": one_weight_changed(tosa)}), stock)
    assert "the same graph but for tensor names and order" in str(names)
    assert "names and order" not in str(weight)
