"""Earlier releases of cpgbroker, built from this repository's history, for upgrade tests.

An upgrade test runs one cluster whose members run different releases: the current code on
some, an earlier release on others. ``tests/upgrade/releases.toml`` lists the releases the
current code upgrades from, each with the commit it was made from and the model versions it
applies; :func:`build` turns one into a Python interpreter on which
``python -m cpgbroker start --config X`` runs that release, for
:meth:`~cpgbroker.dev.brokers.BrokerSet.set_python`.

A release is built from the repository's own history, not fetched from a package index: the
tests then need no network and no published package, and the release is exactly what its
commit holds. The build is made cheap and offline: ``git archive`` of the commit (which leaves
nothing registered in the repository, unlike a worktree), a venv without pip, and the release
installed into it without its dependencies. The venv borrows those from the venv that runs the
build (a ``.pth`` file naming its site-packages directory), which is right as long as a release
needs nothing the current code does not; a release that does fails the check that imports it.
Only the release's own ``cpgbroker`` must not be shadowed by the current one, and it is not:
the borrowed directory is put on ``sys.path`` by a plain line of a ``.pth`` file, so the
``.pth`` files inside it (the current editable install among them) are not processed, and the
release's own site-packages comes first anyway. :func:`build` checks the result rather than
trust this reasoning: the interpreter it returns imports the release's version and model
version from a file inside the release's venv, or the build fails.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs

from cpgbroker.errors import CpgBrokerError

# Where the repository lists its releases (relative to the repository's top directory).
RELEASES_FILE = Path("tests/upgrade/releases.toml")

# Written last into a finished build: a build directory without it was interrupted.
MARKER = "built.json"

_SHA_RE = re.compile(r"^[0-9a-f]{40}$")

# Run by the check of a built interpreter. It imports the package, the command line that
# ``python -m cpgbroker`` runs (so every runtime dependency it needs is importable) and the
# compiled libcpg binding (so the extension was built and loads). The model versions a release
# applies: 0.1.0 has one, ``MODEL_VERSION``; later releases give a range, ``OLDEST`` to
# ``NEWEST`` of ``cpgbroker.model.versions``.
_PROBE = """\
import json, cpgbroker, cpgbroker.cli, cpgbroker.corosync.cpg
try:
    models = [cpgbroker.MODEL_VERSION] * 2
except AttributeError:
    from cpgbroker.model import versions
    models = [versions.OLDEST, versions.NEWEST]
print(json.dumps({"version": cpgbroker.__version__, "models": models, "file": cpgbroker.__file__}))
"""


class ReleaseError(CpgBrokerError):
    """A release could not be listed, built or checked; the text says why."""


class ReleaseUnavailable(ReleaseError):
    """The repository cannot build the release at all (no git checkout, or the commit is not in
    its history): a setup problem rather than a broken release, which tests may skip off CI."""


@attrs.frozen
class Release:
    """One earlier release: its version, the commit it was made from, and the lowest and
    highest model version it applies (the range a cluster of it and the current code must
    share)."""

    version: str
    commit: str
    model_versions: tuple[int, int]


@attrs.frozen
class Installed:
    """What an interpreter imports as cpgbroker: its version, the lowest and highest model
    version it applies, and the file it is imported from."""

    version: str
    model_versions: tuple[int, int]
    file: Path


def load(path: Path) -> list[Release]:
    """The releases ``path`` (a ``releases.toml``) lists, checked: a malformed entry is an
    error here rather than a puzzling build failure later."""
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ReleaseError(f"cannot read the releases file {path}: {e}") from e
    tables = data.get("release", [])
    if not isinstance(tables, list):
        raise ReleaseError(f"{path}: `release` must be an array of tables ([[release]])")
    out: list[Release] = []
    for i, table in enumerate(tables):
        where = f"{path}: release #{i + 1}"
        if not isinstance(table, dict):
            raise ReleaseError(f"{where} is not a table")
        unknown = set(table) - {"version", "commit", "model_versions"}
        if unknown:
            raise ReleaseError(f"{where}: unknown keys {sorted(unknown)}")
        version = table.get("version")
        commit = table.get("commit")
        models = table.get("model_versions")
        if not isinstance(version, str) or not version:
            raise ReleaseError(f"{where}: `version` must be a non-empty string")
        # A full sha: an abbreviated one may become ambiguous as history grows.
        if not isinstance(commit, str) or not _SHA_RE.match(commit):
            raise ReleaseError(f"{where} ({version}): `commit` must be a full 40-hex sha")
        if (
            not isinstance(models, list)
            or len(models) != 2
            or not all(type(m) is int for m in models)
            or models[0] > models[1]
        ):
            raise ReleaseError(
                f"{where} ({version}): `model_versions` must be [lowest, highest], two integers"
            )
        out.append(Release(version, commit, (models[0], models[1])))
    versions = [r.version for r in out]
    if len(set(versions)) != len(versions):
        raise ReleaseError(f"{path}: a version is listed twice: {versions}")
    return out


def default_cache(repo: Path) -> Path:
    """Where builds are kept unless told otherwise: inside the repository (ignored by git),
    so that they survive between test runs and go away with the checkout."""
    return repo / ".cache" / "releases"


def check_commit(repo: Path, commit: str) -> None:
    """Raise :class:`ReleaseUnavailable`, saying how to fix it, unless ``repo`` is a git
    checkout whose history holds ``commit``."""
    git = shutil.which("git")
    if git is None:
        raise ReleaseUnavailable("git is not installed: releases are built from git history")
    inside = subprocess.run(
        [git, "-C", str(repo), "rev-parse", "--is-shallow-repository"],
        capture_output=True,
        text=True,
    )
    if inside.returncode != 0:
        raise ReleaseUnavailable(
            f"{repo} is not a git checkout ({inside.stderr.strip()}): releases are built from "
            "the repository's history; run the tests from a clone"
        )
    found = subprocess.run(
        [git, "-C", str(repo), "cat-file", "-e", f"{commit}^{{commit}}"],
        capture_output=True,
    )
    if found.returncode == 0:
        return
    if inside.stdout.strip() == "true":
        raise ReleaseUnavailable(
            f"commit {commit} is not in the history of {repo}, a shallow clone: fetch the "
            "whole history (`git fetch --unshallow`; on CI, a checkout with fetch-depth 0)"
        )
    raise ReleaseUnavailable(
        f"commit {commit} is not in the history of {repo}: fetch it (`git fetch origin`, or "
        "`git fetch --unshallow` in a shallow clone) or correct tests/upgrade/releases.toml"
    )


def probe(python: Path, cwd: Path | None = None) -> Installed:
    """What ``python`` imports as cpgbroker, in this process's environment (the one a member
    it runs gets): a ``PYTHONPATH`` naming the current sources would show here."""
    try:
        done = subprocess.run(
            [str(python), "-c", _PROBE],
            capture_output=True,
            text=True,
            cwd=cwd,
            timeout=60,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ReleaseError(f"{python} cannot run: {e}") from e
    if done.returncode != 0:
        raise ReleaseError(f"{python} cannot import cpgbroker:\n{done.stderr.strip()}")
    try:
        got = json.loads(done.stdout.strip().splitlines()[-1])
        low, high = (int(m) for m in got["models"])
        return Installed(str(got["version"]), (low, high), Path(got["file"]))
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise ReleaseError(f"{python} printed no answer to the probe: {done.stdout!r}") from e


def build(release: Release, repo: Path, cache: Path | None = None) -> Path:
    """The Python interpreter of a venv that runs ``release``: built from ``repo``'s history
    into ``cache`` (:func:`default_cache` if None), or the earlier build found there.

    A finished build is kept under the release's commit and reused; a half-finished one (no
    marker: the builder was killed) is thrown away and built again. Builds hold a lock, so
    several test processes wanting the same release build it once.
    """
    repo = repo.resolve()
    cache = (default_cache(repo) if cache is None else cache).resolve()
    check_commit(repo, release.commit)
    cache.mkdir(parents=True, exist_ok=True)
    home = cache / release.commit
    with _locked(cache / f"{release.commit}.lock"):
        built = _finished(home, release, repo)
        if built is not None:
            return built
        if home.exists():
            shutil.rmtree(home)
        home.mkdir()
        python = _build(release, repo, home)
        installed = _verify(release, python, home, repo)
        stamp = {**_environment(), "release": _plain(release), "file": str(installed.file)}
        tmp = home / f"{MARKER}.tmp"
        tmp.write_text(json.dumps(stamp, indent=1) + "\n")
        os.replace(tmp, home / MARKER)
        return python


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _deps() -> list[str]:
    """The site-packages directories of the interpreter that builds: the release's venv borrows
    its dependencies from them."""
    paths = sysconfig.get_paths()
    return list(dict.fromkeys([paths["purelib"], paths["platlib"]]))


def _environment() -> dict[str, Any]:
    """What a build depends on besides its commit: a build made for another interpreter or
    other borrowed directories is not reused (its ``.pth`` would name the wrong ones)."""
    return {
        "python": sys.version,
        "base": os.path.realpath(getattr(sys, "_base_executable", sys.executable)),
        "deps": _deps(),
    }


def _plain(release: Release) -> dict[str, Any]:
    """The release as its build's marker holds it (JSON: lists, not tuples)."""
    return {
        "version": release.version,
        "commit": release.commit,
        "model_versions": list(release.model_versions),
    }


def _venv_python(home: Path) -> Path:
    return home / "venv" / "bin" / "python"


def _finished(home: Path, release: Release, repo: Path) -> Path | None:
    """The interpreter of a finished build in ``home`` that still works, else None."""
    try:
        stamp = json.loads((home / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if stamp.get("release") != _plain(release) or any(
        stamp.get(k) != v for k, v in _environment().items()
    ):
        return None
    python = _venv_python(home)
    # A quick import (a fraction of a second) rather than trusting the marker: the borrowed
    # venv may have been rebuilt without what the release imports.
    try:
        _verify(release, python, home, repo)
    except ReleaseError:
        return None
    return python


def _run(what: str, argv: list[str], cwd: Path | None = None) -> None:
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    try:
        done = subprocess.run(argv, capture_output=True, text=True, cwd=cwd, env=env, timeout=900)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ReleaseError(f"{what} failed: {e}") from e
    if done.returncode != 0:
        out = (done.stdout + done.stderr).strip().splitlines()
        raise ReleaseError(
            f"{what} failed ({' '.join(argv)}), exit status {done.returncode}:\n"
            + "\n".join(out[-40:])
        )


def _build(release: Release, repo: Path, home: Path) -> Path:
    src = home / "src"
    tar = home / "src.tar"
    _run("git archive", ["git", "-C", str(repo), "archive", "-o", str(tar), release.commit])
    with tarfile.open(tar) as t:
        # The "data" filter refuses members that would land outside ``src`` (Python 3.12 and
        # later warn without a filter; 3.11 has it from 3.11.4).
        if hasattr(tarfile, "data_filter"):
            t.extractall(src, filter="data")
        else:  # pragma: no cover - Python 3.11.0 to 3.11.3
            t.extractall(src)
    tar.unlink()

    # No pip of its own (ensurepip takes seconds): the borrowed site-packages has one.
    _run("creating the venv", [sys.executable, "-m", "venv", "--without-pip", str(home / "venv")])
    python = _venv_python(home)
    where = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=False,
    )
    if where.returncode != 0:
        raise ReleaseError(f"the new venv's {python} does not run: {where.stderr.strip()}")
    site = Path(where.stdout.strip())
    # Plain directory lines: appended to sys.path after the venv's own site-packages, their
    # own .pth files (the current editable cpgbroker's) left unprocessed.
    (site / "cpgbroker-release-deps.pth").write_text("\n".join(_deps()) + "\n")

    # --no-build-isolation: setuptools, wheel and cffi (setup.py compiles the corosync
    # bindings of cffi_build/) come from the borrowed site-packages, offline.
    # --ignore-installed: pip sees the current cpgbroker through the borrowed directory and
    # must neither count it as installed nor try to uninstall it.
    _run(
        f"installing cpgbroker {release.version} ({release.commit[:12]})",
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-index",
            "--no-deps",
            "--no-build-isolation",
            "--ignore-installed",
            str(src),
        ],
        cwd=home,
    )
    return python


def _verify(release: Release, python: Path, home: Path, repo: Path) -> Installed:
    """Check that ``python`` runs ``release`` itself (from the repository's directory, where
    the tests start members): from a file of its own venv, at the version and the model
    versions the releases file gives (the very range: a cluster's upgrade path is planned
    from it)."""
    got = probe(python, cwd=repo)
    venv = (home / "venv").resolve()
    file = got.file.resolve()
    if not file.is_relative_to(venv):
        raise ReleaseError(
            f"{python} imports cpgbroker from {file}, not from the release's venv {venv}: "
            "something puts other sources first (PYTHONPATH?)"
        )
    if got.version != release.version or got.model_versions != release.model_versions:
        raise ReleaseError(
            f"{python} (commit {release.commit}) runs cpgbroker {got.version} at model versions "
            f"{_span(got.model_versions)}; the releases file says {release.version} at "
            f"{_span(release.model_versions)}"
        )
    return got


def _span(models: tuple[int, int]) -> str:
    return f"{models[0]}..{models[1]}"
