"""``cpgbroker ctl``: rabbitmqctl's commands against a real standalone broker, through the real
command line (admin options anywhere, rabbitmqctl's own before or after the command), checked
by what an AMQP client then sees and by rabbitmqctl's table output."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pika
import pika.exceptions
import pytest
from test_mgmt_write import Api, _connect, _standalone

from cpgbroker.cli import _admin_options
from cpgbroker.runtime.admin import ctl
from cpgbroker.runtime.admin.adminclient import AdminTarget


def _ctl(api: Api, *argv: str) -> tuple[int, str]:
    out = io.StringIO()
    rc = ctl.run(AdminTarget(api.base, "s3cret-token"), list(argv), out)
    return rc, out.getvalue()


async def test_rabbitmqctl_commands_change_the_broker(tmp_path: Path) -> None:
    def work(api: Api, port: int) -> None:
        assert _ctl(api, "add_user", "alice", "a-pw") == (0, 'Adding user "alice" ...\n')
        assert _ctl(api, "set_user_tags", "alice", "monitoring")[0] == 0
        rc, text = _ctl(api, "list_users")
        assert rc == 0 and "alice\t[monitoring]" in text.splitlines()
        assert text.splitlines()[:2] == ["Listing users ...", "user\ttags"]
        assert _ctl(api, "add_vhost", "orders")[0] == 0
        assert (
            _ctl(api, "-p", "orders", "set_permissions", "alice", "^alice\\.", ".*", ".*")[0] == 0
        )
        conn = _connect(port, "alice", "a-pw", "orders")
        ch = conn.channel()
        ch.queue_declare("alice.q", durable=True)
        for i in range(5):
            ch.basic_publish("", "alice.q", b"%d" % i)
        # Global options after the command too, as rabbitmqctl takes them.
        rc, text = _ctl(api, "list_queues", "name", "messages", "-p", "orders", "-q")
        assert (rc, text) == (0, "name\tmessages\nalice.q\t5\n")
        rc, _ = _ctl(
            api,
            "-p",
            "orders",
            "set_policy",
            "--apply-to",
            "queues",
            "cap",
            "^alice\\.",
            '{"max-length": 2}',
        )
        assert rc == 0
        rc, text = _ctl(
            api,
            "-p",
            "orders",
            "-q",
            "--no-table-headers",
            "list_queues",
            "name",
            "messages",
            "policy",
        )
        assert text == "alice.q\t2\tcap\n"
        rc, text = _ctl(api, "-p", "orders", "list_policies", "--formatter", "json")
        assert json.loads(text)[0]["definition"] == '{"max-length": 2}'
        assert _ctl(api, "-p", "orders", "purge_queue", "alice.q")[0] == 0
        assert ch.queue_declare("alice.q", passive=True).method.message_count == 0
        assert _ctl(api, "change_password", "alice", "b-pw")[0] == 0
        with pytest.raises(pika.exceptions.ProbableAuthenticationError):
            _connect(port, "alice", "a-pw", "orders")
        _connect(port, "alice", "b-pw", "orders").close()
        rc, text = _ctl(api, "list_connections", "user", "state")
        assert "alice\trunning" in text
        # Export, delete, import: the vhost, its queue and its policy come back.
        defs = tmp_path / "defs.json"
        assert _ctl(api, "export_definitions", str(defs))[0] == 0
        conn.close()
        assert _ctl(api, "delete_vhost", "orders")[0] == 0
        assert "orders" not in _ctl(api, "list_vhosts", "-q")[1].split()
        assert _ctl(api, "import_definitions", str(defs))[0] == 0
        rc, text = _ctl(api, "-p", "orders", "-q", "list_queues", "name", "policy")
        assert text == "name\tpolicy\nalice.q\tcap\n"
        # Errors: exit status 1, the member's reason on stderr, nothing changed.
        assert _ctl(api, "delete_user", "nobody")[0] == 1
        assert _ctl(api, "-p", "orders", "set_policy", "p", ".*", "{not json")[0] == 1
        assert _ctl(api, "-p", "orders", "set_policy", "p", ".*", '{"bogus": 1}')[0] == 1
        assert _ctl(api, "-p", "orders", "-q", "list_policies")[1].count("\n") == 2

    await _standalone(tmp_path, work)


def test_admin_options_are_taken_anywhere_on_the_line() -> None:
    mine, rest = _admin_options(
        ["-p", "v", "--url", "http://h:1", "list_queues", "--token=t", "name", "-q"]
    )
    assert mine == ["--url", "http://h:1", "--token=t"]
    assert rest == ["-p", "v", "list_queues", "name", "-q"]


def test_the_command_line_lists_the_commands() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "cpgbroker.cli", "ctl", "help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    for name in ("add_user", "set_permissions", "set_policy", "list_queues", "import_definitions"):
        assert name in out
