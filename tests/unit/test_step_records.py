"""A step record's JSON form is what ``dataclasses.asdict`` gives, built without its generic deep copy."""

from __future__ import annotations

import dataclasses
import json

import pytest

from lowercache.cache.steps import StepRecord

pytestmark = pytest.mark.quick


@pytest.mark.parametrize("record", [
    StepRecord(kind="pass", name="FuseViewCopyTransformPass", outcome="ran", seconds=0.25, nodes={"retraced": 3, "copied": 9}),
    StepRecord(kind="tosa", name="partition 0", outcome="hit", key="k" * 32, parts={"program": "a" * 32, "spec": "b"},
               saved=1.5, output="c" * 32, note="n", tier="local"),
    StepRecord(kind="flow", name="", outcome="miss"),
    StepRecord(kind="odd", name="x", outcome="miss", parts={"nested": {"list": [1, 2]}}),  # type: ignore[dict-item]
])
def test_to_json_is_asdict(record):
    made = record.to_json()
    assert made == dataclasses.asdict(record)
    assert list(made) == list(dataclasses.asdict(record))  # the same field order, so the manifest's text is the same
    assert json.dumps(made) == json.dumps(dataclasses.asdict(record))


def test_to_json_shares_nothing_mutable_with_the_record():
    record = StepRecord(kind="odd", name="x", outcome="miss", parts={"a": "1", "nested": {"b": [1]}}, nodes={"n": 1})  # type: ignore[dict-item]
    made = record.to_json()
    made["parts"]["a"] = "changed"
    made["parts"]["nested"]["b"].append(2)
    made["nodes"]["n"] = 2
    assert record.parts == {"a": "1", "nested": {"b": [1]}} and record.nodes == {"n": 1}
    plain = StepRecord(kind="pass", name="p", outcome="ran", parts={"a": "1"}, nodes={"n": 1})
    made = plain.to_json()
    made["parts"]["a"], made["nodes"]["n"] = "changed", 2
    assert plain.parts == {"a": "1"} and plain.nodes == {"n": 1}
