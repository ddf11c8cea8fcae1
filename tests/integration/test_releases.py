"""Earlier releases built from the repository's history (cpgbroker.dev.releases), the harness of
the upgrade tests: tests/upgrade/releases.toml is sound, each release builds into an interpreter
that runs that release and not the current code, builds are reused and rebuilt as they should
be, and a cluster whose members all run 0.1.0 serves a client on real corosync."""

from __future__ import annotations

import concurrent.futures
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pika
import pytest
from brokerclients import connect

from cpgbroker.dev import releases as release_builds
from cpgbroker.dev.brokers import BrokerSet
from cpgbroker.dev.fixtures import unavailable

REPO = Path(__file__).resolve().parents[2]
LISTED = release_builds.load(REPO / release_builds.RELEASES_FILE)
PERSISTENT = pika.BasicProperties(delivery_mode=2)


def _commits_or_skip() -> None:
    """Off CI a clone without the releases' history skips (saying how to fetch it)."""
    for release in LISTED:
        try:
            release_builds.check_commit(REPO, release.commit)
        except release_builds.ReleaseUnavailable as e:
            unavailable(str(e))


def test_the_releases_file_lists_0_1_0_at_model_version_7() -> None:
    by_version = {r.version: r for r in LISTED}
    assert by_version["0.1.0"].model_versions == (7, 7)
    assert by_version["0.1.0"].commit.startswith("321146f")


def test_every_release_commit_is_in_the_history() -> None:
    _commits_or_skip()


def test_every_built_release_runs_its_own_version_and_model_version(
    releases: dict[str, str],
) -> None:
    assert set(releases) == {r.version for r in LISTED}
    for release in LISTED:
        got = release_builds.probe(Path(releases[release.version]), cwd=REPO)
        low, high = release.model_versions
        assert got.version == release.version
        # 0.1.0 names one model version (MODEL_VERSION), later releases a range.
        assert low <= got.model_versions[0] <= got.model_versions[1] <= high, (release, got)
        assert got.model_versions == release.model_versions
        # The release's own files, never the current sources.
        assert got.file.is_relative_to(release_builds.default_cache(REPO) / release.commit)
        assert not got.file.is_relative_to(REPO / "src")


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("[[release]]\nversion = '1'\ncommit = '321146f'\nmodel_versions = [7, 7]\n", "40-hex"),
        (f"[[release]]\nversion = '1'\ncommit = '{'a' * 40}'\nmodel_versions = [8, 7]\n", "two"),
        (f"[[release]]\nversion = '1'\ncommit = '{'a' * 40}'\nmodel_versions = 7\n", "lowest"),
        (f"[[release]]\nversion = '1'\ncommit = '{'a' * 40}'\nmodels = [7, 7]\n", "unknown"),
        ("[[release]]\ncommit = 'x'\n", "version"),
        ("release = 1\n", "array of tables"),
        ("[[release]\n", "cannot read"),
    ],
)
def test_a_malformed_releases_file_is_refused(tmp_path: Path, text: str, complaint: str) -> None:
    path = tmp_path / "releases.toml"
    path.write_text(text)
    with pytest.raises(release_builds.ReleaseError, match=complaint):
        release_builds.load(path)


def test_a_commit_the_history_lacks_says_how_to_fetch_it(tmp_path: Path) -> None:
    _commits_or_skip()
    older = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "HEAD~1"], capture_output=True, text=True
    )
    if older.returncode != 0:
        unavailable(f"the repository has no HEAD~1: {older.stderr.strip()}")
    shallow = tmp_path / "shallow"
    subprocess.run(
        ["git", "clone", "-q", "--depth", "1", "--no-checkout", f"file://{REPO}", str(shallow)],
        check=True,
    )
    with pytest.raises(release_builds.ReleaseUnavailable, match="git fetch --unshallow"):
        release_builds.check_commit(shallow, older.stdout.strip())
    with pytest.raises(release_builds.ReleaseUnavailable, match="not a git checkout"):
        release_builds.check_commit(tmp_path, LISTED[0].commit)


def test_a_build_is_made_once_reused_and_made_again_when_half_finished(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _commits_or_skip()
    release = LISTED[0]
    cache = tmp_path / "cache"
    made: list[Path] = []
    real_build = release_builds._build

    def counting(r: release_builds.Release, repo: Path, home: Path) -> Path:
        made.append(home)
        return real_build(r, repo, home)

    monkeypatch.setattr(release_builds, "_build", counting)
    # Two builders at once (two test processes): the lock lets one build, the other reuses it.
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        pythons = list(pool.map(lambda _: release_builds.build(release, REPO, cache), range(2)))
    assert pythons[0] == pythons[1] == cache / release.commit / "venv" / "bin" / "python"
    assert len(made) == 1
    marker = cache / release.commit / release_builds.MARKER
    assert release_builds.build(release, REPO, cache) == pythons[0]
    assert len(made) == 1

    # Killed halfway: no marker, a venv without the release. Thrown away and built again.
    marker.unlink()
    installed = list((cache / release.commit / "venv").glob("lib/python*/site-packages/cpgbroker"))
    assert len(installed) == 1
    shutil.rmtree(installed[0])
    assert release_builds.build(release, REPO, cache) == pythons[0]
    assert len(made) == 2
    assert marker.exists()
    assert release_builds.probe(pythons[0]).version == release.version


def test_a_build_that_runs_something_else_than_the_release_is_refused(tmp_path: Path) -> None:
    _commits_or_skip()
    release = LISTED[0]
    # The releases file claiming another version or model version than the commit holds.
    wrong = release_builds.Release("9.9.9", release.commit, (1, 1))
    with pytest.raises(release_builds.ReleaseError, match=r"runs cpgbroker 0\.1\.0 at model"):
        release_builds.build(wrong, REPO, tmp_path / "a")
    # The current sources put first (PYTHONPATH): the check looks at where cpgbroker comes
    # from, not only at its version number (which a release and main may share for a while).
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", str(REPO / "src"))
        with pytest.raises(release_builds.ReleaseError, match="not from the release's venv"):
            release_builds.build(release, REPO, tmp_path / "b")


def _mapped_bindings(pid: int) -> set[str]:
    """The files of the compiled corosync bindings the process has loaded."""
    maps = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {line.split()[-1] for line in maps if "/cpgbroker/corosync/_" in line}


@pytest.mark.integration
def test_a_cluster_of_0_1_0_members_serves_a_client(
    broker_set: Callable[..., BrokerSet], releases: dict[str, str]
) -> None:
    python = releases["0.1.0"]
    bs = broker_set(store=True, python=python)
    venv = Path(python).parent.parent
    for n in (1, 2, 3):
        # 0.1.0's status does not say which release it runs (the current code's "software"
        # does): the member's process shows it, the release's interpreter and the release's
        # compiled libcpg binding.
        status = bs.status(n)
        assert status is not None and status["state"] == "ready"
        assert "software" not in status, status["software"]
        pid = bs.procs[n].pid
        assert Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0] == python.encode()
        bindings = _mapped_bindings(pid)
        assert bindings and all(Path(b).is_relative_to(venv) for b in bindings), bindings

    conn = connect(bs, 1)
    # What a client is told (the model's server-properties).
    assert conn._impl.server_properties["version"] == "0.1.0"
    ch = conn.channel()
    ch.confirm_delivery()
    ch.queue_declare("upgrade.q", durable=True)
    ch.basic_publish("", "upgrade.q", b"kept by 0.1.0", PERSISTENT)  # raises unless confirmed
    got = connect(bs, 2).channel()
    method, props, body = got.basic_get("upgrade.q", auto_ack=True)
    assert method is not None and body == b"kept by 0.1.0"
    assert props.delivery_mode == 2
    bs.converged([1, 2, 3])
    status = bs.status(3)
    assert status is not None
    assert status["queues"]["/:upgrade.q"]["ready"] == 0
