"""The dev cluster pytest plugin's prerequisite rule: skip where corosync tests cannot run, but
fail on CI (``CI=true``), where a skip would hide a broken setup."""

from __future__ import annotations

import pytest

from cpgbroker.dev import fixtures


def test_a_missing_prerequisite_skips_off_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"^no corosync$"):
        fixtures.unavailable("no corosync")


def test_a_missing_prerequisite_fails_on_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match=r"no corosync \(CI=true"):
        fixtures.unavailable("no corosync")


def test_cluster_support_names_the_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CI", "true")
    monkeypatch.setattr(fixtures, "check_environment", lambda: "devcluster needs root")
    with pytest.raises(pytest.fail.Exception, match="cannot run here: devcluster needs root"):
        fixtures.require_cluster_support()
    monkeypatch.delenv("CI")
    with pytest.raises(pytest.skip.Exception, match="cannot run here: devcluster needs root"):
        fixtures.require_cluster_support()


def test_the_plugin_offers_the_integration_fixtures() -> None:
    for name in ("cluster_support", "dev_cluster", "cluster", "cpg_on", "dispatch_until"):
        assert name in fixtures.__all__
    assert {"broker_set", "brokers"} <= set(fixtures.__all__)
