"""Where the project is, learnt through any API (issue 51 §4): a record answers in another directory only once the same
inputs gave the same flow key in a second directory, or when the user opts in (``LOWERCACHE_PORTABLE_RECORDS``).

A factory that learns its checkout's name (``net_4``, ``net_6``) in a way no list of names foresees gets its own
bytes in a second clone, locally and through a shared Redis to an empty cache; a factory that cannot see its
place is answered in a third directory once two agreed.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.helpers.direct import PORTABLE_MODEL, explain, fresh, lower, make_project, served, tiny_project, until_served


# A miss goes through the worker's warm server (tests/process/conftest.py), as a user's does by default.
pytestmark = pytest.mark.usefixtures("through_server")

# The checkout's name, five ways no source scan names (the model's width is its last digit).
WHERE = {
    "find_spec": "Path(importlib.util.find_spec(__name__).origin).parent.name",
    "resources": "Path(str(importlib.resources.files(assets))).parent.name",
    "getfile": "Path(getfile(model)).parent.name",
    "traceback": "Path(traceback.format_stack()[-1].split('\"')[1]).parent.name",
    "spec": "Path(getattr(sys.modules[__name__], '__sp' 'ec__').origin).parent.name",
}
LOCATED = '''
import importlib.resources
import importlib.util
import sys
import traceback
from inspect import getfile
from pathlib import Path

import torch

spec = importlib.util.spec_from_file_location("located_assets", "assets/__init__.py")
assets = importlib.util.module_from_spec(spec)
spec.loader.exec_module(assets)


def model():
    width = int({where}.rsplit("_", 1)[-1])
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, width, 3), torch.nn.ReLU())
    return net.eval(), (torch.randn(1, 3, 8, 8),)
'''


def located(root: Path, where: str) -> Path:
    project = tiny_project(root, LOCATED.format(where=WHERE[where]))
    (project / "assets").mkdir()
    (project / "assets" / "__init__.py").write_text("")
    return project


def clone(project: Path, where: Path) -> Path:
    shutil.copytree(project, where, ignore=shutil.ignore_patterns("out", "fresh", "__pycache__"))
    return where


@pytest.mark.parametrize("where", sorted(WHERE))
def test_a_second_clone_that_sees_its_place_gets_its_own_bytes(tmp_path, where):
    cache = tmp_path / "cache"
    first = located(tmp_path / "a" / "net_4", where)
    served_first = until_served(first, cache)
    second = clone(first, tmp_path / "b" / "net_6")
    manifest, pte, _ = lower(second, cache)
    assert not served(manifest) and "another directory" in explain(second, cache)
    assert pte == fresh(second, tmp_path) and pte != served_first
    # The record now says its result depends on where it is: a third clone named as the first is not answered either.
    third = clone(first, tmp_path / "c" / "net_4")
    manifest, pte, _ = lower(third, cache)
    assert not served(manifest) and "lowered differently in another directory" in explain(third, cache)
    assert pte == fresh(third, tmp_path)


def test_through_redis_a_second_clone_with_an_empty_cache_gets_its_own_bytes(tmp_path, redis_url):
    env = {"LOWERCACHE_REMOTE": redis_url, "LOWERCACHE_HMAC_KEY": "location-test-key"}
    first = located(tmp_path / "a" / "net_4", "find_spec")
    served_first = until_served(first, tmp_path / "cache-a", env)
    second = clone(first, tmp_path / "b" / "net_6")
    manifest, pte, _ = lower(second, tmp_path / "cache-b", env=env)
    assert not served(manifest) and "another directory" in explain(second, tmp_path / "cache-b")
    assert pte == fresh(second, tmp_path) and pte != served_first


def test_a_record_confirmed_in_two_directories_answers_in_a_third_through_redis(tmp_path, redis_url):
    """Two runners at two paths lowered the same inputs to the same key: a third, with an empty cache, is served."""
    env = {"LOWERCACHE_REMOTE": redis_url, "LOWERCACHE_HMAC_KEY": "location-test-key"}
    first = make_project(tmp_path / "a" / "proj", model=PORTABLE_MODEL)
    until_served(first, tmp_path / "cache-a", env)
    second = clone(first, tmp_path / "b" / "proj")
    manifest, _, _ = lower(second, tmp_path / "cache-b", env=env)
    assert not served(manifest) and "confirmed in no second directory" in explain(second, tmp_path / "cache-b")
    assert manifest["direct"]["record"] == "confirmed", manifest["direct"]
    third = clone(first, tmp_path / "c" / "proj")
    manifest, pte, _ = lower(third, tmp_path / "cache-c", env=env)
    assert served(manifest) and manifest["steps"][0]["tier"] == "remote", explain(third, tmp_path / "cache-c")
    assert pte == fresh(third, tmp_path)


def test_opting_in_answers_in_another_directory_at_once_but_not_for_a_record_seen_to_depend_on_it(tmp_path):
    cache, portable = tmp_path / "cache", {"LOWERCACHE_PORTABLE_RECORDS": "1"}
    first = make_project(tmp_path / "a" / "proj", model=PORTABLE_MODEL)
    until_served(first, cache)
    second = clone(first, tmp_path / "b" / "proj")
    manifest, pte, _ = lower(second, cache, env=portable)
    assert served(manifest), explain(second, cache)
    assert pte == fresh(second, tmp_path)

    bound = located(tmp_path / "d" / "net_4", "find_spec")
    until_served(bound, cache)
    elsewhere = clone(bound, tmp_path / "e" / "net_6")
    for _ in range(2):  # lowers differently there, then confirms there: a record bound to its place
        manifest, _, _ = lower(elsewhere, cache)
        assert not served(manifest)
    third = clone(bound, tmp_path / "f" / "net_8")
    manifest, pte, _ = lower(third, cache, env=portable)
    assert not served(manifest) and "lowered differently in another directory" in explain(third, cache)
    assert pte == fresh(third, tmp_path)


def test_the_same_path_answers_as_before(tmp_path):
    """A CI runner that checks out at one fixed path: the record made there answers there, whatever the code sees."""
    first = located(tmp_path / "ci" / "net_4", "find_spec")
    cache = tmp_path / "cache"
    served_first = until_served(first, cache)
    shutil.rmtree(first)
    again = located(tmp_path / "ci" / "net_4", "find_spec")  # a fresh checkout at the same path
    manifest, pte, _ = lower(again, cache)
    assert served(manifest) and pte == served_first == fresh(again, tmp_path), explain(again, cache)
