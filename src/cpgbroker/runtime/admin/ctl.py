"""``cpgbroker ctl``: ``rabbitmqctl``'s everyday commands, with its names, arguments and table
output, over a member's management API (runtime/mgmt/reads.py, runtime/mgmt/writes.py).

It proves itself with the member's admin secret, as ``rabbitmqctl`` does with the Erlang
cookie: whoever may read the secret file on a member's machine may administer the cluster.
Any member answers for the whole cluster, and a change made through one is on every member
once the command returns (the API answers after every member applied it).

Blocking (urllib): one command makes a request or two and exits.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from cpgbroker.runtime.admin.adminclient import AdminTarget


class CtlError(Exception):
    """A command the member refused, or could not be reached for: printed, exit status 1."""


def call(t: AdminTarget, method: str, path: str, body: Any = None, timeout: float = 60.0) -> Any:
    """One API request; its JSON answer (None for an empty one). CtlError for an HTTP error,
    with the member's reason."""
    data = None if body is None else json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {t.secret}", "Content-Type": "application/json"}
    req = urllib.request.Request(t.base + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=t.ssl_context) as resp:
            raw = resp.read()
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            answer = json.loads(raw)
            reason = answer.get("reason", answer) if isinstance(answer, dict) else answer
        except ValueError:
            reason = raw.decode(errors="replace") or e.reason
        raise CtlError(f"{e.code}: {reason}") from None
    except OSError as e:
        raise CtlError(f"cannot reach {t.base}: {e}") from None
    return json.loads(raw) if raw.strip() else None


def _q(*parts: str) -> str:
    return "/".join(urllib.parse.quote(p, safe="") for p in parts)


# Default columns of the list commands, as rabbitmqctl 3.10 shows them.
DEFAULT_COLUMNS = {
    "list_queues": ["name", "messages"],
    "list_exchanges": ["name", "type"],
    "list_bindings": [
        "source_name",
        "source_kind",
        "destination_name",
        "destination_kind",
        "routing_key",
        "arguments",
    ],
    "list_connections": ["user", "peer_host", "peer_port", "state"],
    "list_channels": ["pid", "user", "consumer_count", "messages_unacknowledged"],
    "list_consumers": [
        "queue_name",
        "channel_pid",
        "consumer_tag",
        "ack_required",
        "prefetch_count",
        "active",
        "arguments",
    ],
}


def _cell(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_cell(v) for v in value) + "]"
    if isinstance(value, dict):
        return "[" + ", ".join(f"{{{k},{_cell(v)}}}" for k, v in value.items()) + "]"
    return "" if value is None else str(value)


class Output:
    def __init__(self, ns: argparse.Namespace, out: TextIO) -> None:
        self.quiet = ns.quiet
        self.headers = not ns.no_table_headers
        self.json = ns.formatter == "json"
        self.out = out

    def info(self, text: str) -> None:
        if not self.quiet and not self.json:
            print(text, file=self.out)

    def table(self, columns: list[str], rows: list[dict[str, Any]]) -> None:
        if self.json:
            print(json.dumps([{c: r.get(c) for c in columns} for r in rows]), file=self.out)
            return
        if self.headers:
            print("\t".join(columns), file=self.out)
        for r in rows:
            print("\t".join(_cell(r.get(c)) for c in columns), file=self.out)


def _binding_row(b: dict[str, Any]) -> dict[str, Any]:
    return {
        "source_name": b["source"],
        "source_kind": "exchange",
        "destination_name": b["destination"],
        "destination_kind": b["destination_type"],
        "routing_key": b["routing_key"],
        "arguments": b["arguments"],
        "vhost": b["vhost"],
        "properties_key": b["properties_key"],
    }


def _channel_row(c: dict[str, Any]) -> dict[str, Any]:
    return {**c, "pid": c.get("name")}


def _consumer_rows(queues: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "queue_name": q["name"],
            "channel_pid": d["channel_details"]["name"],
            "consumer_tag": d["consumer_tag"],
            "ack_required": d["ack_required"],
            "prefetch_count": d["prefetch_count"],
            "active": True,
            "arguments": d["arguments"],
        }
        for q in queues
        for d in q.get("consumer_details", [])
    ]


def parser() -> argparse.ArgumentParser:
    def common(defaults: bool) -> argparse.ArgumentParser:
        # rabbitmqctl takes these before or after the command; after it, they must not
        # reset what was given before (hence no defaults there).
        c = argparse.ArgumentParser(add_help=False)
        d = (lambda v: v) if defaults else (lambda v: argparse.SUPPRESS)
        c.add_argument("-p", "--vhost", default=d("/"), help="the virtual host (default /)")
        c.add_argument(
            "-q", "--quiet", action="store_true", default=d(False), help="no informational line"
        )
        c.add_argument(
            "--no-table-headers", action="store_true", default=d(False), help="no header row"
        )
        c.add_argument("--formatter", choices=("table", "json"), default=d("table"))
        return c

    p = argparse.ArgumentParser(
        prog="cpgbroker ctl",
        description="rabbitmqctl's everyday commands against a cluster member",
        parents=[common(True)],
    )
    after = common(False)
    sub = p.add_subparsers(dest="cmd", required=True, metavar="COMMAND")

    def cmd(name: str, help: str, *args: str, optional: tuple[str, ...] = ()) -> Any:
        c = sub.add_parser(name, help=help, parents=[after])
        for a in args:
            c.add_argument(a)
        for a in optional:
            c.add_argument(a, nargs="?")
        return c

    cmd("add_user", "add a user", "username", "password")
    cmd("delete_user", "delete a user", "username")
    cmd("change_password", "change a user's password", "username", "password")
    tags = cmd("set_user_tags", "set a user's tags (none: no tags)", "username")
    tags.add_argument("tags", nargs="*")
    cmd("list_users", "list users and their tags")
    cmd("add_vhost", "add a virtual host", "name")
    cmd("delete_vhost", "delete a virtual host, its queues and its clients", "name")
    cmd("list_vhosts", "list virtual hosts")
    cmd("set_permissions", "set a user's permissions", "username", "conf", "write", "read")
    cmd("clear_permissions", "clear a user's permissions", "username")
    cmd("list_permissions", "list the permissions in a virtual host")
    cmd("list_user_permissions", "list a user's permissions", "username")
    pol = cmd("set_policy", "set a policy", "name", "pattern", "definition")
    pol.add_argument("--priority", type=int, default=0)
    pol.add_argument(
        "--apply-to", default="all", choices=("queues", "exchanges", "all"), dest="apply_to"
    )
    cmd("clear_policy", "clear a policy", "name")
    cmd("list_policies", "list the policies of a virtual host")
    for name in DEFAULT_COLUMNS:
        c = sub.add_parser(
            name, help=f"{name.replace('_', ' ')} (columns as rabbitmqctl)", parents=[after]
        )
        c.add_argument("columns", nargs="*")
    cmd("purge_queue", "remove every ready message of a queue", "queue")
    dq = cmd("delete_queue", "delete a queue", "queue")
    dq.add_argument("--if-empty", action="store_true")
    dq.add_argument("--if-unused", action="store_true")
    cmd("close_connection", "close a client connection", "connection", optional=("reason",))
    cmd("export_definitions", "write definitions (users, topology, policies) to a file", "path")
    cmd("import_definitions", "read definitions from a file (RabbitMQ's format)", "path")
    return p


def run(t: AdminTarget, argv: list[str], out: TextIO = sys.stdout) -> int:
    ns = parser().parse_args(argv)
    try:
        COMMANDS[ns.cmd](t, ns, Output(ns, out))
    except CtlError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 1
    return 0


Command = Callable[[AdminTarget, argparse.Namespace, Output], None]


def _user_put(t: AdminTarget, name: str, changes: dict[str, Any]) -> None:
    """Change one thing of an existing user (the API's PUT replaces the user whole)."""
    current = call(t, "GET", f"/api/users/{_q(name)}")
    body: dict[str, Any] = {"tags": ",".join(current["tags"])}
    if "password" not in changes:
        body["password_hash"] = current["password_hash"]
        body["hashing_algorithm"] = current["hashing_algorithm"]
    call(t, "PUT", f"/api/users/{_q(name)}", {**body, **changes})


def add_user(t: AdminTarget, ns: argparse.Namespace, o: Output) -> None:
    o.info(f'Adding user "{ns.username}" ...')
    call(t, "PUT", f"/api/users/{_q(ns.username)}", {"password": ns.password, "tags": ""})


def delete_user(t: AdminTarget, ns: argparse.Namespace, o: Output) -> None:
    o.info(f'Deleting user "{ns.username}" ...')
    call(t, "DELETE", f"/api/users/{_q(ns.username)}")


def change_password(t: AdminTarget, ns: argparse.Namespace, o: Output) -> None:
    o.info(f'Changing password for user "{ns.username}" ...')
    _user_put(t, ns.username, {"password": ns.password})


def set_user_tags(t: AdminTarget, ns: argparse.Namespace, o: Output) -> None:
    o.info(f'Setting tags for user "{ns.username}" to [{", ".join(ns.tags)}] ...')
    _user_put(t, ns.username, {"tags": ",".join(ns.tags)})


def list_users(t: AdminTarget, ns: argparse.Namespace, o: Output) -> None:
    o.info("Listing users ...")
    rows = call(t, "GET", "/api/users")
    o.table(["user", "tags"], [{"user": u["name"], "tags": u["tags"]} for u in rows])


def add_vhost(t: AdminTarget, ns: argparse.Namespace, o: Output) -> None:
    o.info(f'Adding vhost "{ns.name}" ...')
    call(t, "PUT", f"/api/vhosts/{_q(ns.name)}")


def delete_vhost(t: AdminTarget, ns: argparse.Namespace, o: Output) -> None:
    o.info(f'Deleting vhost "{ns.name}" ...')
    call(t, "DELETE", f"/api/vhosts/{_q(ns.name)}")


def list_vhosts(t: AdminTarget, ns: argparse.Namespace, o: Output) -> None:
    o.info("Listing vhosts ...")
    o.table(["name"], call(t, "GET", "/api/vhosts"))


def set_permissions(t: AdminTarget, ns: argparse.Namespace, o: Output) -> None:
    o.info(f'Setting permissions for user "{ns.username}" in vhost "{ns.vhost}" ...')
    perms = {"configure": ns.conf, "write": ns.write, "read": ns.read}
    call(t, "PUT", f"/api/permissions/{_q(ns.vhost, ns.username)}", perms)


def clear_permissions(t: AdminTarget, ns: argparse.Namespace, o: Output) -> None:
    o.info(f'Clearing permissions for user "{ns.username}" in vhost "{ns.vhost}" ...')
    call(t, "DELETE", f"/api/permissions/{_q(ns.vhost, ns.username)}")


def list_permissions(t: AdminTarget, ns: argparse.Namespace, o: Output) -> None:
    o.info(f'Listing permissions for vhost "{ns.vhost}" ...')
    rows = call(t, "GET", f"/api/vhosts/{_q(ns.vhost)}/permissions")
    o.table(["user", "configure", "write", "read"], rows)


def list_user_permissions(t: AdminTarget, ns: argparse.Namespace, o: Output) -> None:
    o.info(f'Listing permissions for user "{ns.username}" ...')
    rows = call(t, "GET", f"/api/users/{_q(ns.username)}/permissions")
    o.table(["vhost", "configure", "write", "read"], rows)


def set_policy(t: AdminTarget, ns: argparse.Namespace, o: Output) -> None:
    try:
        definition = json.loads(ns.definition)
    except ValueError as e:
        raise CtlError(f"the definition is not JSON: {e}") from None
    o.info(
        f'Setting policy "{ns.name}" for pattern "{ns.pattern}" to "{ns.definition}" '
        f'with priority "{ns.priority}" for vhost "{ns.vhost}" ...'
    )
    body = {
        "pattern": ns.pattern,
        "definition": definition,
        "priority": ns.priority,
        "apply-to": ns.apply_to,
    }
    call(t, "PUT", f"/api/policies/{_q(ns.vhost, ns.name)}", body)


def clear_policy(t: AdminTarget, ns: argparse.Namespace, o: Output) -> None:
    o.info(f'Clearing policy "{ns.name}" on vhost "{ns.vhost}" ...')
    call(t, "DELETE", f"/api/policies/{_q(ns.vhost, ns.name)}")


def list_policies(t: AdminTarget, ns: argparse.Namespace, o: Output) -> None:
    o.info(f'Listing policies for vhost "{ns.vhost}" ...')
    rows = call(t, "GET", f"/api/policies/{_q(ns.vhost)}")
    cols = ["vhost", "name", "pattern", "apply-to", "definition", "priority"]
    o.table(cols, [{**r, "definition": json.dumps(r["definition"])} for r in rows])


def _listing(path: str, what: str, shape: Callable[[AdminTarget, Any], list[Any]]) -> Command:
    def command(t: AdminTarget, ns: argparse.Namespace, o: Output) -> None:
        vhost_path = path.format(vhost=_q(ns.vhost))
        o.info(what.format(vhost=ns.vhost))
        o.table(ns.columns or DEFAULT_COLUMNS[ns.cmd], shape(t, call(t, "GET", vhost_path)))

    return command


def purge_queue(t: AdminTarget, ns: argparse.Namespace, o: Output) -> None:
    o.info(f'Purging queue "{ns.queue}" in vhost "{ns.vhost}" ...')
    call(t, "DELETE", f"/api/queues/{_q(ns.vhost, ns.queue)}/contents")


def delete_queue(t: AdminTarget, ns: argparse.Namespace, o: Output) -> None:
    o.info(f'Deleting queue "{ns.queue}" on vhost "{ns.vhost}" ...')
    flags = {"if-empty": str(ns.if_empty).lower(), "if-unused": str(ns.if_unused).lower()}
    call(t, "DELETE", f"/api/queues/{_q(ns.vhost, ns.queue)}?{urllib.parse.urlencode(flags)}")


def close_connection(t: AdminTarget, ns: argparse.Namespace, o: Output) -> None:
    reason = ns.reason or ""
    o.info(f'Closing connection "{ns.connection}", reason: {reason} ...')
    headers = {"Authorization": f"Bearer {t.secret}", "X-Reason": urllib.parse.quote(reason)}
    req = urllib.request.Request(
        t.base + f"/api/connections/{_q(ns.connection)}", headers=headers, method="DELETE"
    )
    try:
        with urllib.request.urlopen(req, timeout=60, context=t.ssl_context):
            pass
    except urllib.error.HTTPError as e:
        raise CtlError(f"{e.code}: no connection {ns.connection!r}") from None
    except OSError as e:
        raise CtlError(f"cannot reach {t.base}: {e}") from None


def export_definitions(t: AdminTarget, ns: argparse.Namespace, o: Output) -> None:
    text = json.dumps(call(t, "GET", "/api/definitions"), indent=2)
    if ns.path == "-":
        print(text, file=o.out)
        return
    Path(ns.path).write_text(text + "\n")
    o.info(f'Exported definitions for all virtual hosts to "{ns.path}"')


def import_definitions(t: AdminTarget, ns: argparse.Namespace, o: Output) -> None:
    source = sys.stdin.read() if ns.path == "-" else Path(ns.path).read_text()
    try:
        defs = json.loads(source)
    except ValueError as e:
        raise CtlError(f"{ns.path} is not JSON: {e}") from None
    o.info(f'Importing definitions in JSON from a file at "{ns.path}" ...')
    call(t, "POST", "/api/definitions", defs, timeout=600)
    o.info("Imported definitions: every member has them.")


COMMANDS: dict[str, Command] = {
    "add_user": add_user,
    "delete_user": delete_user,
    "change_password": change_password,
    "set_user_tags": set_user_tags,
    "list_users": list_users,
    "add_vhost": add_vhost,
    "delete_vhost": delete_vhost,
    "list_vhosts": list_vhosts,
    "set_permissions": set_permissions,
    "clear_permissions": clear_permissions,
    "list_permissions": list_permissions,
    "list_user_permissions": list_user_permissions,
    "set_policy": set_policy,
    "clear_policy": clear_policy,
    "list_policies": list_policies,
    "list_queues": _listing(
        "/api/queues/{vhost}",
        "Timeout: 60.0 seconds ...\nListing queues for vhost {vhost} ...",
        lambda t, rows: rows,
    ),
    "list_exchanges": _listing(
        "/api/exchanges/{vhost}", "Listing exchanges for vhost {vhost} ...", lambda t, rows: rows
    ),
    "list_bindings": _listing(
        "/api/bindings/{vhost}",
        "Listing bindings for vhost {vhost}...",
        lambda t, rows: [_binding_row(b) for b in rows],
    ),
    "list_connections": _listing(
        "/api/connections", "Listing connections ...", lambda t, rows: rows
    ),
    "list_channels": _listing(
        "/api/channels", "Listing channels ...", lambda t, rows: [_channel_row(x) for x in rows]
    ),
    "list_consumers": _listing(
        "/api/queues/{vhost}",
        "Listing consumers in vhost {vhost} ...",
        lambda t, rows: _consumer_rows(
            [call(t, "GET", f"/api/queues/{_q(r['vhost'], r['name'])}") for r in rows]
        ),
    ),
    "purge_queue": purge_queue,
    "delete_queue": delete_queue,
    "close_connection": close_connection,
    "export_definitions": export_definitions,
    "import_definitions": import_definitions,
}
