"""Second runs are direct (issue 51 §7): an idle warm server confirms the records its ``lower`` children made, by
re-running their factory and export (no lowering) under the one confirm rule, so the next command is a direct hit."""

from __future__ import annotations

import json
import time

import pytest

from tests.helpers.server import WAIT, Server, wait_until


@pytest.fixture
def server(tmp_path):
    server = Server(tmp_path)
    server.start()
    yield server
    server.close()


def latest_record(server: Server, target: str) -> str:
    explained = server("explain", "model.py:model", "-t", target).stdout
    return next((line for line in explained.splitlines() if "latest record:" in line), "")


def confirmed_in_background(server: Server, *targets: str) -> None:
    """Wait (no sleep taken as an assertion) until the server has confirmed each target's record."""
    for target in targets:
        assert wait_until(lambda: "latest record: confirmed: " in latest_record(server, target), WAIT), latest_record(server, target)
        assert "in the background, by the warm server" in latest_record(server, target)


def test_a_build_right_after_a_cold_one_is_all_direct_hits(server):
    (server.project / "lowercache.toml").write_text('targets = ["tosa-fp", "tosa-int"]\n[models.net]\nmodel = "model.py:model"\n')
    cold = server("build")
    assert cold.returncode == 0, cold.stderr[-3000:]
    report = lambda: json.loads((server.project / "build" / "build-report.json").read_text())["pairs"]  # noqa: E731
    assert {(r["outcome"], r["how"]) for r in report()} == {("miss", "worker")}
    first = {t: (server.project / "build" / "net" / t / "model.pte").read_bytes() for t in ("tosa-fp", "tosa-int")}
    confirmed_in_background(server, "tosa-fp", "tosa-int")

    warm = server("build")
    assert warm.returncode == 0, warm.stderr[-3000:]
    assert {(r["outcome"], r["how"]) for r in report()} == {("hit", "direct")}
    for target, pte in first.items():
        assert (server.project / "build" / "net" / target / "model.pte").read_bytes() == pte


def test_lower_twice_the_second_is_direct_and_equals_a_fresh_lowering(server):
    first = server("lower", "model.py:model", "-t", "tosa-fp", "-o", "out")
    assert first.returncode == 0, first.stderr[-3000:]
    assert json.loads((server.project / "out" / "manifest.json").read_text())["direct"]["record"] == "unconfirmed"
    confirmed_in_background(server, "tosa-fp")
    second = server("lower", "model.py:model", "-t", "tosa-fp", "-o", "out")
    assert second.returncode == 0, second.stderr[-3000:]
    manifest = json.loads((server.project / "out" / "manifest.json").read_text())
    assert manifest["direct"]["outcome"] == "hit" and manifest["direct"]["torch_imported"] is False
    fresh = server("lower", "model.py:model", "-t", "tosa-fp", "-o", "fresh", "--no-cache", "--no-server")
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    assert (server.project / "out" / "model.pte").read_bytes() == (server.project / "fresh" / "model.pte").read_bytes()


def test_a_factory_that_lowers_differently_each_time_is_untrusted_by_the_background_run(server):
    model = (server.project / "model.py").read_text()
    (server.project / "model.py").write_text(model.replace("    torch.manual_seed(0)\n", ""))
    first = server("lower", "model.py:model", "-t", "tosa-fp", "-o", "out")
    assert first.returncode == 0, first.stderr[-3000:]
    assert wait_until(lambda: "latest record: untrusted: " in latest_record(server, "tosa-fp"), WAIT), latest_record(server, "tosa-fp")
    assert "identical inputs lowered differently" in latest_record(server, "tosa-fp")
    again = server("lower", "model.py:model", "-t", "tosa-fp", "-o", "out")
    assert again.returncode == 0 and "direct mode: served" not in again.stderr


def test_with_server_confirm_off_the_record_waits_for_the_next_run(server):
    """``LOWERCACHE_SERVER_CONFIRM=0`` on the client: the idle server keeps no request to confirm, and the next run
    confirms the record as a run without a server does; the run after it is a direct hit with the same bytes."""
    off = {"LOWERCACHE_SERVER_CONFIRM": "0"}
    first = server("lower", "model.py:model", "-t", "tosa-fp", "-o", "out", **off)
    assert first.returncode == 0, first.stderr[-3000:]
    pte = (server.project / "out" / "model.pte").read_bytes()
    manifest = lambda: json.loads((server.project / "out" / "manifest.json").read_text())["direct"]  # noqa: E731
    assert manifest()["record"] == "unconfirmed"
    assert server.status()["served"] == "1"
    time.sleep(3)  # three times the idle second after which a kept request would be confirmed
    assert "latest record: unconfirmed" in latest_record(server, "tosa-fp"), latest_record(server, "tosa-fp")
    assert server.status()["records"].startswith("0 to confirm when idle, 0 confirmation runs"), server.status()
    second = server("lower", "model.py:model", "-t", "tosa-fp", "-o", "out", **off)
    assert second.returncode == 0, second.stderr[-3000:]
    assert manifest()["record"] == "confirmed" and (server.project / "out" / "model.pte").read_bytes() == pte
    third = server("lower", "model.py:model", "-t", "tosa-fp", "-o", "out", **off)
    assert third.returncode == 0, third.stderr[-3000:]
    assert manifest()["outcome"] == "hit" and (server.project / "out" / "model.pte").read_bytes() == pte
