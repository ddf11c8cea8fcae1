"""Queue arguments (x-message-ttl, x-max-length, x-dead-letter-exchange, x-max-priority, ...):
what a declare may set, RabbitMQ's checks and texts, and how values are named in its
inequivalent-redeclare errors."""

from __future__ import annotations

from typing import Any

from cpgbroker.errors import ChannelError, ReplyCode
from cpgbroker.model.entities import (
    MAX_PRIORITY,
    Queue,
    ready_messages,
)

R = ReplyCode


def fmt(v: Any, typed: bool = False) -> str:
    if v is None:
        return "none"
    text = ("'true'" if v else "'false'") if isinstance(v, bool) else f"'{v}'"
    return f"the value {text} of type '{amqp_type(v)}'" if typed else text


# Queue arguments we implement; they must match on redeclare (RabbitMQ's equivalence check).
QUEUE_ARGS = (
    "x-message-ttl",
    "x-expires",
    "x-max-length",
    "x-max-length-bytes",
    "x-overflow",
    "x-dead-letter-exchange",
    "x-dead-letter-routing-key",
    "x-max-priority",
    "x-queue-type",
    "x-single-active-consumer",
    "x-delivery-limit",
    "x-replicate",
)

# x-replicate refused where it cannot hold (cpgbroker's own argument; docs/operations.md,
# "Member-local connections"). The cluster replicates connections, not queues, so whether a
# queue is replicated is decided by the listener its client connected to.
NOT_REPLICABLE = (
    "a queue declared here is replicated: declare queues that must not be replicated on a "
    "member-local listener ([cluster] local_listen)"
)
NOT_LOCAL = (
    "this broker is not a cluster's replica (a member-local listener, or standalone): "
    "declare replicated queues on a cluster member's AMQP port"
)


def apply_queue_args(q: Queue, args: dict[str, Any], replicated: bool = False) -> None:
    """Validate a new queue's declare arguments (RabbitMQ's checks and wording) and set the
    limits and policies they ask for. ``replicated``: whether this broker is a cluster's
    replica, which ``x-replicate`` (when given) must match."""

    def invalid(key: str, why: str) -> ChannelError:
        return ChannelError(
            R.PRECONDITION_FAILED,
            f"invalid arg '{key}' for queue '{q.name}' in vhost '{q.vhost}': {why}",
        )

    def int_arg(key: str, minimum: int) -> int | None:
        if key not in args:
            return None
        v = args[key]
        if isinstance(v, bool) or not isinstance(v, int):
            raise invalid(key, f"{{unacceptable_type,{type(v).__name__}}}")
        if v < minimum:
            raise invalid(key, f"{{value_negative,{v}}}" if v < 0 else f"{{value_zero,{v}}}")
        return v

    q.ttl = int_arg("x-message-ttl", 0)
    q.expires = int_arg("x-expires", 1)
    q.max_length = int_arg("x-max-length", 0)
    q.max_length_bytes = int_arg("x-max-length-bytes", 0)
    overflow = args.get("x-overflow", "drop-head")
    if overflow not in ("drop-head", "reject-publish", "reject-publish-dlx"):
        raise invalid("x-overflow", f"{{unknown_overflow,{overflow}}}")
    q.overflow = str(overflow)
    dlx = args.get("x-dead-letter-exchange")
    if dlx is not None and not isinstance(dlx, str):
        raise invalid("x-dead-letter-exchange", "{unacceptable_type,not a string}")
    q.dlx = dlx
    dlrk = args.get("x-dead-letter-routing-key")
    if dlrk is not None:
        if not isinstance(dlrk, str):
            raise invalid("x-dead-letter-routing-key", "{unacceptable_type,not a string}")
        if dlx is None:
            raise invalid(
                "x-dead-letter-routing-key", "Key x-dead-letter-exchange should be present"
            )
    q.dlrk = dlrk
    replicate = args.get("x-replicate")
    if replicate is not None:
        if not isinstance(replicate, bool):
            raise invalid("x-replicate", f"{{unacceptable_type,{type(replicate).__name__}}}")
        if replicate != replicated:
            raise invalid("x-replicate", NOT_LOCAL if replicate else NOT_REPLICABLE)
    qtype = args.get("x-queue-type", "classic")
    if qtype not in ("classic", "quorum"):
        raise invalid("x-queue-type", f"unsupported queue type '{qtype}'")
    top = args.get("x-max-priority")
    if top is not None and (isinstance(top, bool) or not isinstance(top, int)):
        # (RabbitMQ words this one check differently from the others.)
        raise invalid("x-max-priority", f'"expected integer, got {amqp_type(top)}"')
    top = int_arg("x-max-priority", 0)
    if top is not None and top > MAX_PRIORITY:
        raise invalid("x-max-priority", f"{{max_value_exceeded,{top}}}")
    if top is not None and qtype == "quorum":
        # Every queue here is replicated, but an application written against us should
        # still declare on RabbitMQ, whose quorum queues refuse priorities.
        raise ChannelError(
            R.PRECONDITION_FAILED,
            f"invalid arg 'x-max-priority' for queue '{q.name}' in vhost '{q.vhost}' "
            "of queue type rabbit_quorum_queue",
        )
    q.messages = ready_messages(args)
    q.quorum = qtype == "quorum"
    if q.quorum:
        # As RabbitMQ: a quorum queue is durable and outlives its declarer.
        for bad, prop in (
            (not q.durable, "non-durable"),
            (q.exclusive_owner is not None, "exclusive-owner"),
            (q.auto_delete, "auto-delete"),
        ):
            if bad:
                raise ChannelError(
                    R.PRECONDITION_FAILED,
                    f"invalid property '{prop}' for queue '{q.name}' in vhost '{q.vhost}'",
                )
    elif "x-delivery-limit" in args:
        raise ChannelError(
            R.PRECONDITION_FAILED,
            f"invalid arg 'x-delivery-limit' for queue '{q.name}' in vhost '{q.vhost}' "
            "of queue type rabbit_classic_queue",
        )
    q.delivery_limit = int_arg("x-delivery-limit", 0)
    sac = args.get("x-single-active-consumer", False)
    if not isinstance(sac, bool):
        raise invalid("x-single-active-consumer", f"{{unacceptable_type,{amqp_type(sac)}}}")
    q.single_active = sac


def amqp_type(v: object) -> str:
    """The field-table type name of a decoded argument, as RabbitMQ names it in errors."""
    for t, name in (
        (bool, "bool"),
        (str, "longstr"),
        (bytes, "longstr"),
        (float, "double"),
        (dict, "table"),
        (list, "array"),
    ):
        if isinstance(v, t):
            return name
    if isinstance(v, int):
        # What the value travelled as, as pika and most clients encode a Python int.
        return "signedint" if -(1 << 31) <= v < (1 << 31) else "long"
    return "void" if v is None else type(v).__name__
