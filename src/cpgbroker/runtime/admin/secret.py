"""The admin secret: what every request to a member's admin endpoint must carry.

As ``rabbitmqctl`` and the Erlang cookie: the broker generates a random secret the first time it
starts, in a file only its user may read (0600), and the CLI on the same machine reads that
file. Whoever can read the file may stop the cluster; whoever cannot is refused, also on
loopback (any local user reaches a loopback port).

Several members may share one file (a dev cluster on one machine): the first to start creates
it atomically (written under a temporary name, then hard-linked into place), the others read
it.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from pathlib import Path

from cpgbroker.errors import ConfigError

# Where the broker keeps its secret when ``[server] admin_secret_file`` is not set: the home of
# the user running it, like ``~/.erlang.cookie``. ``cluster init`` writes an explicit path.
DEFAULT_PATH = "~/.cpgbroker/admin.secret"
# 256 bits, URL-safe so that it fits in a header and a shell variable.
SECRET_BYTES = 32


def secret_path(configured: str) -> Path:
    return Path(configured or DEFAULT_PATH).expanduser()


def _check_private(path: Path) -> None:
    mode = path.stat().st_mode
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        # As Erlang refuses a cookie others can read: a readable secret is no secret.
        raise ConfigError(
            f"the admin secret {path} is readable by others (mode {stat.filemode(mode)}): "
            f"chmod 600 {path}"
        )


def read_secret(path: Path) -> str:
    """The secret in ``path`` (the CLI's side); a ConfigError that says what to do if not."""
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        raise ConfigError(
            f"no admin secret at {path}: the broker writes it when it first starts; pass "
            "--secret-file (or --config with the member's configuration)"
        ) from None
    except PermissionError:
        raise ConfigError(
            f"cannot read the admin secret {path}: run as the broker's user or root"
        ) from None
    if not text:
        raise ConfigError(f"the admin secret {path} is empty")
    return text


def load_or_create(path: Path) -> tuple[str, bool]:
    """The member's secret, generated if the file does not exist yet; (secret, created)."""
    with contextlib.suppress(FileNotFoundError):
        _check_private(path)
        return read_secret(path), False
    if not path.parent.exists():
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_urlsafe(SECRET_BYTES) + "\n")
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
            created = True
        except FileExistsError:
            # Another member sharing the file was first: use its secret.
            created = False
    finally:
        tmp.unlink()
    _check_private(path)
    return read_secret(path), created
