"""Which earlier records a new record keeps (``record/trust.kept_earlier``): the rule direct mode and ``run`` share."""

from __future__ import annotations

import pytest

from lowercache.record.trust import KEPT_EARLIER, earlier, earlier_said, from_earlier, judged_once, kept_earlier


def _keep(old, record, changed="in.txt changed"):
    stored: list[str] = []

    def keep(result: str, meta: dict) -> None:
        assert "earlier" not in meta and meta["result"] == result  # kept without its own list
        stored.append(result)

    kept = kept_earlier(old, record, lambda r: r["result"], lambda previous: changed, keep)
    return kept, stored


@pytest.mark.quick
def test_a_confirmed_record_for_other_inputs_and_another_result_is_kept_first():
    old = {"status": "confirmed", "result": "a", "earlier": ["b", "c"]}
    assert _keep(old, {"status": "unconfirmed", "result": "d"}) == (["a", "b", "c"], ["a"])
    # the new record's own result leaves the list: its latest record answers for it
    assert _keep(old, {"status": "unconfirmed", "result": "b"}) == (["a", "c"], ["a"])


@pytest.mark.quick
def test_what_is_not_kept():
    confirmed = {"status": "confirmed", "result": "a", "earlier": ["b"]}
    assert _keep(None, {"status": "unconfirmed", "result": "d"}) == ([], [])
    assert _keep(confirmed, {"status": "untrusted", "result": "d"}) == ([], [])  # an untrusted record keeps none
    assert _keep(confirmed, {"status": "confirmed", "result": "a"}, changed=None) == (["b"], [])  # same result
    assert _keep(confirmed, {"status": "unconfirmed", "result": "d"}, changed=None) == (["b"], [])  # same inputs
    unconfirmed = {"status": "unconfirmed", "result": "a", "earlier": ["b"]}
    assert _keep(unconfirmed, {"status": "confirmed", "result": "a"}, changed=None) == (["b"], [])
    assert _keep({"status": "confirmed", "earlier": ["b"]}, {"status": "unconfirmed", "result": "d"}) == ([], [])  # malformed


@pytest.mark.quick
def test_at_most_the_newest_four_are_kept_and_a_stored_list_is_checked():
    old = {"status": "confirmed", "result": "a", "earlier": ["b", "c", "d", "e", "f"]}
    kept, stored = _keep(old, {"status": "unconfirmed", "result": "g"})
    assert kept == ["a", "b", "c", "d"] and len(kept) == KEPT_EARLIER and stored == ["a"]
    assert earlier({"earlier": "abc"}) == [] and earlier({"earlier": ["x", 3, None]}) == ["x"]
    assert earlier_said([]) == ""
    assert earlier_said(["a stored output is missing or damaged", None]) == (
        "; 2 earlier records did not answer either (the newest: a stored output is missing or damaged)")


@pytest.mark.quick
def test_a_lookup_takes_the_newest_earlier_record_that_answers_and_says_why_none_did():
    latest = {"earlier": ["a", "b", "c"]}
    kept = {"a": {"why": "in.txt changed"}, "c": {"why": None}}
    assert from_earlier(latest, kept.get, lambda r: r["why"]) == ({"why": None}, "")
    assert from_earlier(latest, {"a": kept["a"]}.get, lambda r: r["why"]) == (
        None, "; 3 earlier records did not answer either (the newest: in.txt changed)")
    assert from_earlier({}, kept.get, lambda r: r["why"]) == (None, "")


@pytest.mark.quick
def test_whats_changed_is_judged_once_per_record():
    asked: list[int] = []
    changed = judged_once(lambda previous: asked.append(id(previous)) or "x changed")
    one, two = {}, {}
    assert [changed(one), changed(one), changed(two)] == ["x changed"] * 3 and asked == [id(one), id(two)]
