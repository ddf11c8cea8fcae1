"""The admin plane trusts no one: every request carries the member's secret, on loopback too;
the secret is generated at first start, private to the broker's user, and read by the CLI."""

from __future__ import annotations

import json
import logging
import os
import socket
import stat
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import trio

from cpgbroker.errors import ConfigError
from cpgbroker.runtime.admin import endpoint, secret


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def status_cli(home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``cpgbroker status ARGS`` as a user whose home is ``home``, with no secret in the
    environment."""
    env = {**os.environ, "HOME": str(home)}
    env.pop("CPGBROKER_ADMIN_TOKEN", None)
    env.pop("CPGBROKER_ADMIN_SECRET_FILE", None)
    return subprocess.run(
        [sys.executable, "-m", "cpgbroker", "status", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


async def _ask(port: int, request: bytes) -> bytes:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(request)
        out = b""
        while chunk := await stream.receive_some(4096):
            out += chunk
        return out


async def test_every_request_needs_the_secret_401_without_403_wrong(
    caplog: pytest.LogCaptureFixture,
) -> None:
    calls: list[str] = []

    async def control(path: str, args: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        calls.append(path)
        return 202, {}

    caplog.set_level(logging.INFO, logger="cpgbroker.admin")
    async with trio.open_nursery() as nursery:
        _h, port = await nursery.start(
            endpoint.serve_admin, "127.0.0.1:0", lambda _d: {"state": "ready"}, control, "s3cret"
        )
        for auth, code in (
            (b"", b"401"),
            (b"Authorization: Basic czNjcmV0\r\n", b"401"),
            (b"Authorization: Bearer nope-nope\r\n", b"403"),
            (b"Authorization: Bearer \xff\xfe\r\n", b"403"),
        ):
            for req in (
                b"GET /status HTTP/1.0\r\n" + auth + b"\r\n",
                b"POST /stop HTTP/1.0\r\n" + auth + b"Content-Length: 2\r\n\r\n{}",
            ):
                answer = await _ask(port, req)
                assert answer.startswith(b"HTTP/1.1 " + code), answer
                assert b'"state"' not in answer
                if code == b"401":
                    assert b"WWW-Authenticate: Bearer" in answer
        assert calls == []
        ok = b"Authorization: Bearer s3cret\r\n"
        answer = await _ask(port, b"GET /status HTTP/1.0\r\n" + ok + b"\r\n")
        assert answer.startswith(b"HTTP/1.1 200") and b'"ready"' in answer
        answer = await _ask(port, b"POST /stop HTTP/1.0\r\n" + ok + b"Content-Length: 2\r\n\r\n{}")
        assert answer.startswith(b"HTTP/1.1 202") and calls == ["/stop"]
        nursery.cancel_scope.cancel()
    refused = [r.getMessage() for r in caplog.records if "refused" in r.getMessage()]
    assert len(refused) == 8 and all("peer=127.0.0.1" in m for m in refused)
    assert not any("nope-nope" in m or "s3cret" in m for m in caplog.messages)


async def test_the_endpoint_cannot_be_started_without_a_secret() -> None:
    with pytest.raises(ValueError, match="secret"):
        await endpoint.serve_admin("127.0.0.1:0", lambda _d: {})


def test_the_secret_is_generated_once_private_and_then_reused(tmp_path: Path) -> None:
    path = tmp_path / "home" / ".cpgbroker" / "admin.secret"
    value, created = secret.load_or_create(path)
    assert created and len(value) >= 40
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert secret.load_or_create(path) == (value, False)
    assert secret.read_secret(path) == value
    assert list(path.parent.iterdir()) == [path]  # no temporary file left behind
    other, _ = secret.load_or_create(tmp_path / "other.secret")
    assert other != value


def test_members_sharing_a_file_agree_on_one_secret(tmp_path: Path) -> None:
    path = tmp_path / "shared.secret"
    got: list[str] = []
    barrier = threading.Barrier(8)

    def start() -> None:
        barrier.wait()
        got.append(secret.load_or_create(path)[0])

    threads = [threading.Thread(target=start) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 8 and len(set(got)) == 1


def test_a_secret_others_can_read_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "admin.secret"
    secret.load_or_create(path)
    os.chmod(path, 0o644)
    with pytest.raises(ConfigError, match=r"readable by others.*chmod 600"):
        secret.load_or_create(path)


def test_the_cli_says_where_the_secret_is_missing(tmp_path: Path) -> None:
    out = status_cli(tmp_path, "--url", "http://127.0.0.1:9")
    assert out.returncode == 1
    assert f"no admin secret at {tmp_path}/.cpgbroker/admin.secret" in out.stderr


async def test_a_standalone_broker_generates_its_secret_and_the_cli_uses_it(
    tmp_path: Path,
) -> None:
    from cpgbroker.runtime.config import settings
    from cpgbroker.runtime.process import main as runtime_main

    port = free_port()
    path = tmp_path / "admin.secret"
    toml = tmp_path / "cpgbroker.toml"
    toml.write_text(
        f'[server]\nlisten = ["127.0.0.1:0"]\nadmin = "127.0.0.1:{port}"\n'
        f'admin_secret_file = "{path}"\n'
    )

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return status_cli(tmp_path, *args)

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(runtime_main.serve, settings.load(str(toml)))
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
            # The configuration tells the CLI both the address and where the secret is.
            out = await trio.to_thread.run_sync(cli, "--config", str(toml), "--json")
            assert out.returncode == 0, out.stderr
            assert json.loads(out.stdout)["connections"] == {"local": 0, "shadow": 0}
            out = await trio.to_thread.run_sync(cli, "--url", f"http://127.0.0.1:{port}")
            assert out.returncode == 1 and "no admin secret" in out.stderr
            nursery.cancel_scope.cancel()


async def test_the_admin_endpoint_over_https_with_the_cli_verifying_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    import trustme

    from cpgbroker.runtime.config import settings
    from cpgbroker.runtime.process import main as runtime_main

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1")
    cert.private_key_and_cert_chain_pem.write_to_path(str(tmp_path / "member.pem"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    other = trustme.CA()
    other.cert_pem.write_to_path(str(tmp_path / "other-ca.pem"))
    port = free_port()
    toml = tmp_path / "cpgbroker.toml"
    toml.write_text(
        f'[server]\nlisten = ["127.0.0.1:0"]\nadmin = "127.0.0.1:{port}"\n'
        f'admin_secret_file = "{tmp_path}/admin.secret"\nadmin_tls = true\n'
        f'[tls]\ncertfile = "{tmp_path}/member.pem"\nkeyfile = "{tmp_path}/member.pem"\n'
        f'cacertfile = "{tmp_path}/ca.pem"\n'
    )

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return status_cli(tmp_path, "--json", *args)

    caplog.set_level(logging.INFO, logger="cpgbroker.admin")
    secret_file = str(tmp_path / "admin.secret")
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            await nursery.start(runtime_main.serve, settings.load(str(toml)))
            # The configuration gives the https address, the secret and the CA to trust.
            out = await trio.to_thread.run_sync(cli, "--config", str(toml))
            assert out.returncode == 0, out.stderr
            assert "connections" in json.loads(out.stdout)
            url = f"https://127.0.0.1:{port}"
            out = await trio.to_thread.run_sync(
                cli,
                "--url",
                url,
                "--secret-file",
                secret_file,
                "--cacert",
                str(tmp_path / "other-ca.pem"),
            )
            assert out.returncode == 1 and "CERTIFICATE_VERIFY_FAILED" in out.stderr
            out = await trio.to_thread.run_sync(
                cli, "--url", f"http://127.0.0.1:{port}", "--secret-file", secret_file
            )
            assert out.returncode == 1 and "cannot reach" in out.stderr
            nursery.cancel_scope.cancel()
    # The member logs both refused handshakes as it logs refused requests: at warning.
    refused = [r for r in caplog.records if "admin TLS handshake failed" in r.getMessage()]
    assert len(refused) == 2 and {r.levelno for r in refused} == {logging.WARNING}
