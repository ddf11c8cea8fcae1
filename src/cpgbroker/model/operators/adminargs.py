"""The arguments and answers of operators' changes (model/operators/admin.py): RabbitMQ's management
API answers, and the checks every op makes of the JSON it is given, so that a malformed
request is the same 400 on every replica and never an error of the member."""

from __future__ import annotations

import base64
import hashlib
import urllib.parse
from typing import Any

from cpgbroker.errors import AMQPError, CpgBrokerError, ReplyCode
from cpgbroker.model.access.permissions import compile_pattern

R = ReplyCode
Answer = tuple[int, Any]

# Names RabbitMQ refuses for users and vhosts would be refused by ours too; NUL is ours alone
# to refuse (permissions.TRUSTED uses it).
_BAD_NAME_CHARS = "\x00"


class AdminError(CpgBrokerError):
    """A request the model refuses: the HTTP status and RabbitMQ's body."""

    def __init__(self, status: int, error: str, reason: str) -> None:
        super().__init__(f"{status} {error}: {reason}")
        self.status = status
        self.body = {"error": error, "reason": reason}


def bad_request(reason: str) -> AdminError:
    return AdminError(400, "bad_request", reason)


def not_found() -> AdminError:
    return AdminError(404, "Object Not Found", "Not Found")


def amqp_answer(e: AMQPError) -> Answer:
    """What RabbitMQ's management API answers when the AMQP operation it made on a user's
    behalf failed (``rabbit_mgmt_util:with_channel``): 404 for NOT_FOUND, 401 for
    ACCESS_REFUSED, 400 otherwise, with the close's reply text."""
    if e.code == R.NOT_FOUND:
        return 404, {"error": "not_found", "reason": e.reply_text}
    if e.code == R.ACCESS_REFUSED:
        return 401, {"error": "not_authorised", "reason": "Access refused."}
    return 400, {"error": "bad_request", "reason": e.reply_text}


def properties_key(key: str, args: dict[str, Any]) -> str:
    """A binding's ``properties_key`` (its id in ``/api/bindings/.../{props}``), as RabbitMQ
    makes it: the routing key form-encoded ("~" for none), and when the binding has
    arguments, "~" and a hash of them (ours is another hash than RabbitMQ's, stable for one
    binding: clients take the key from a listing)."""
    shown = urllib.parse.quote_plus(key, safe="") if key else ""
    if not args:
        return shown or "~"
    digest = hashlib.sha256(repr(sorted(json_value(args).items())).encode()).digest()
    return f"{shown}~{base64.urlsafe_b64encode(digest[:6]).decode()}"


def json_value(value: Any) -> Any:
    """A field-table value as RabbitMQ's JSON shows it (bytes as text, decimals as numbers)."""
    if isinstance(value, dict):
        return {str(k): json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_value(v) for v in value]
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).decode("utf-8", "replace")
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    try:
        return float(value)  # Decimal
    except (TypeError, ValueError):
        return str(value)


def text_arg(args: dict[str, Any], key: str, default: str | None = None) -> str:
    v = args.get(key, default)
    if not isinstance(v, str):
        raise bad_request(f"{key} must be a string")
    return v


def name_arg(args: dict[str, Any], key: str) -> str:
    v = text_arg(args, key)
    if any(c in v for c in _BAD_NAME_CHARS) or len(v.encode()) > 255:
        raise bad_request(f"{key} is not a valid name")
    return v


def bool_arg(args: dict[str, Any], key: str, default: bool) -> bool:
    v = args.get(key, default)
    if isinstance(v, str) and v in ("true", "false"):
        return v == "true"  # RabbitMQ's API takes both
    if not isinstance(v, bool):
        raise bad_request(f"{key} must be true or false")
    return v


def int_arg(args: dict[str, Any], key: str, default: int) -> int:
    v = args.get(key, default)
    if isinstance(v, str) and v.isdigit() and v.isascii():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 63:
        raise bad_request(f"{key} must be a non-negative integer")
    return v


def table_arg(args: dict[str, Any], key: str) -> dict[str, Any]:
    v = args.get(key) or {}
    if not isinstance(v, dict):
        raise bad_request(f"{key} must be a JSON object")
    return v


def tags_arg(v: Any) -> tuple[str, ...]:
    """RabbitMQ takes tags as a list or as one comma-separated string."""
    if isinstance(v, str):
        return tuple(t.strip() for t in v.split(",") if t.strip())
    if isinstance(v, list) and all(isinstance(t, str) for t in v):
        return tuple(t.strip() for t in v if t.strip())
    raise bad_request("tags must be a list of strings or a comma-separated string")


def limit_arg(limits: dict[str, Any], key: str) -> int | None:
    v = limits.get(key)
    if v is None or (isinstance(v, int) and not isinstance(v, bool) and v < 0):
        return None  # RabbitMQ's -1: no limit
    if isinstance(v, bool) or not isinstance(v, int):
        raise bad_request(f"limit {key} must be an integer")
    return v


def validate_pattern(pattern: str) -> str:
    try:
        compile_pattern(pattern)
    except ValueError as e:
        return f"{pattern!r} is not a valid regular expression: {e}"
    return ""
