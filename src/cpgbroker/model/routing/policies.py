"""Policies: settings applied to queues and exchanges by name pattern, as RabbitMQ's.

Theory of operation
-------------------
A policy (``rabbitmqctl set_policy``, ``PUT /api/policies/{vhost}/{name}``) has a pattern (a
regular expression over names, matched as permissions are: model/access/permissions.py), what it
applies to (``queues``, ``exchanges`` or ``all``; RabbitMQ 3.12's ``classic_queues`` and
``quorum_queues`` too), a priority and a definition. At most one policy applies to a queue or
exchange: the matching one of the highest priority; among equals the one whose name sorts
first (RabbitMQ leaves that tie to the order its table happens to return, which is no rule a
replica could follow: ours is one every replica and every operator can).

What a definition may say, and how it combines with the queue's own arguments, is RabbitMQ's
(``rabbit_policies``, ``rabbit_amqqueue``):

* ``max-length``, ``max-length-bytes``, ``message-ttl``, ``expires``, ``delivery-limit``
  (quorum queues): when both set one, the smaller value holds;
* ``dead-letter-exchange``, ``dead-letter-routing-key``, ``overflow``: the queue's argument
  holds if it has one;
* ``alternate-exchange`` (exchanges): the exchange's argument holds if it has one;
* ``ha-mode``, ``ha-params``, ``ha-sync-mode``, ``ha-sync-batch-size``,
  ``ha-promote-on-shutdown``, ``ha-promote-on-failure``, ``queue-mode``, ``queue-version``,
  ``queue-master-locator``, ``max-in-memory-length``, ``max-in-memory-bytes``: accepted, so
  that definitions exported from RabbitMQ import whole, and without effect: every queue here
  is replicated to every member, and held in memory.

Changes are ordered admin events (model/operators/admin.py): every member re-applies the policies of
a vhost at the same event. Owns the policies of every vhost, in the order they were set.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from cpgbroker.model.access.permissions import compile_pattern
from cpgbroker.model.config import Policy
from cpgbroker.model.entities import Queue
from cpgbroker.model.routing.exchange import Exchange

APPLY_TO = ("queues", "exchanges", "all", "classic_queues", "quorum_queues")

# Keys that set a non-negative integer (the smaller of policy and argument holds), with the
# queue argument each stands for.
INT_KEYS = {
    "max-length": "x-max-length",
    "max-length-bytes": "x-max-length-bytes",
    "message-ttl": "x-message-ttl",
    "expires": "x-expires",
    "delivery-limit": "x-delivery-limit",
}
# Keys whose queue argument, if set, holds over the policy.
STR_KEYS = {
    "dead-letter-exchange": "x-dead-letter-exchange",
    "dead-letter-routing-key": "x-dead-letter-routing-key",
    "overflow": "x-overflow",
}
OVERFLOWS = ("drop-head", "reject-publish", "reject-publish-dlx")
# Accepted without effect (module docstring).
INERT_KEYS = (
    "ha-mode",
    "ha-params",
    "ha-sync-mode",
    "ha-sync-batch-size",
    "ha-promote-on-shutdown",
    "ha-promote-on-failure",
    "queue-mode",
    "queue-version",
    "queue-master-locator",
    "max-in-memory-length",
    "max-in-memory-bytes",
)
# Exchanges: which upstreams feed them (model/federation.py; a set: only "all").
FEDERATION_KEYS = ("federation-upstream", "federation-upstream-set")
KNOWN_KEYS = (*INT_KEYS, *STR_KEYS, "alternate-exchange", *FEDERATION_KEYS, *INERT_KEYS)


def matches_queue(p: Policy, q: Queue) -> bool:
    if p.apply_to == "exchanges":
        return False
    if p.apply_to == "classic_queues" and q.quorum:
        return False
    if p.apply_to == "quorum_queues" and not q.quorum:
        return False
    return _search(p.pattern, q.name)


def matches_exchange(p: Policy, ex: Exchange) -> bool:
    return p.apply_to in ("exchanges", "all") and _search(p.pattern, ex.name)


def _search(pattern: str, name: str) -> bool:
    m = compile_pattern(pattern)
    if m is True or m is False:
        return m
    return m.search(name.encode()) is not None


# What RabbitMQ calls a bad value of each key (rabbit_policies:validate_policy0).
_BAD_VALUE = {
    "max-length": "is not a valid maximum length",
    "max-length-bytes": "is not a valid maximum length in bytes",
    "message-ttl": "is not a valid message TTL",
    "expires": "is not a valid queue expiry",
    "delivery-limit": "is not a valid delivery limit",
    "overflow": "is not a valid overflow value",
    "dead-letter-exchange": "is not a valid dead letter exchange name",
    "dead-letter-routing-key": "is not a valid dead letter routing key",
    "alternate-exchange": "is not a valid alternate exchange name",
    "federation-upstream": "is not a valid federation upstream name",
    "federation-upstream-set": "is not a valid federation upstream set name",
}


def escaped_term(v: Any) -> str:
    """A JSON value as RabbitMQ's validation messages print it (an Erlang term, with the
    HTML escaping its management API applies to them): strings are binaries."""
    if isinstance(v, str):
        return f'&lt;&lt;"{v}"&gt;&gt;'
    if isinstance(v, bool):
        return "true" if v else "false"
    return str(v)


def validate(p: Policy) -> str | None:
    """What is wrong with ``p``, in RabbitMQ's words (``rabbit_policy:validate``), or None."""
    try:
        compile_pattern(p.pattern)
    except ValueError as e:
        return f"pattern should be regular expression but is invalid: {e}"
    if p.apply_to not in APPLY_TO:
        return f"apply-to '{p.apply_to}' unrecognised; should be 'queues', 'exchanges' or 'all'"
    if not p.definition:
        return "no policy provided"
    unknown = [(k, v) for k, v in p.definition.items() if k not in KNOWN_KEYS]
    if unknown:
        terms = ",".join(f"{{{escaped_term(k)},{escaped_term(v)}}}" for k, v in unknown)
        return f"[{terms}] are not recognised policy settings"
    for key, value in p.definition.items():
        if key in INT_KEYS:
            ok = not isinstance(value, bool) and isinstance(value, int) and value >= 0
            ok = ok and not (key == "expires" and value == 0)
        elif key == "overflow":
            ok = value in OVERFLOWS
        elif key in STR_KEYS or key == "alternate-exchange" or key in FEDERATION_KEYS:
            ok = isinstance(value, str)
        else:
            ok = True
        if not ok:
            return f"{escaped_term(value)} {_BAD_VALUE[key]}"
    return None


class Policies:
    __slots__ = ("by_vhost",)

    def __init__(self, seed: tuple[Policy, ...] = ()) -> None:
        # vhost -> policy name -> policy, in the order they were first set.
        self.by_vhost: dict[str, dict[str, Policy]] = {}
        for p in seed:
            self.put(p)

    def put(self, p: Policy) -> bool:
        """Set ``p`` (validated) in place of the policy of its name; whether it is new."""
        policies = self.by_vhost.setdefault(p.vhost, {})
        new = p.name not in policies
        policies[p.name] = p
        return new

    def delete(self, vhost: str, name: str) -> bool:
        policies = self.by_vhost.get(vhost)
        if policies is None or policies.pop(name, None) is None:
            return False
        if not policies:
            del self.by_vhost[vhost]
        return True

    def forget_vhost(self, vhost: str) -> None:
        self.by_vhost.pop(vhost, None)

    def all(self) -> list[Policy]:
        return [p for policies in self.by_vhost.values() for p in policies.values()]

    def restore(self, policies: list[Policy]) -> None:
        self.by_vhost.clear()
        for p in policies:
            self.put(p)

    def mark_applied(self, vhosts: Iterable[Any]) -> None:
        """After a restore: name on each queue and exchange the policy that applies (derived
        state; the effective limits it set were restored with the queues)."""
        for vh in vhosts:
            if vh.name not in self.by_vhost:
                continue
            for q in vh.queues.values():
                p = self.for_queue(q)
                q.policy = None if p is None else p.name
            for ex in vh.exchanges.values():
                self.apply_to_exchange(ex)

    def _best(self, vhost: str, fits: Any) -> Policy | None:
        best: Policy | None = None
        for p in self.by_vhost.get(vhost, {}).values():
            if fits(p) and (
                best is None
                or p.priority > best.priority
                or (p.priority == best.priority and p.name < best.name)
            ):
                best = p
        return best

    def for_queue(self, q: Queue) -> Policy | None:
        if q.vhost not in self.by_vhost:
            return None
        return self._best(q.vhost, lambda p: matches_queue(p, q))

    def for_exchange(self, ex: Exchange) -> Policy | None:
        if ex.vhost not in self.by_vhost:
            return None
        return self._best(ex.vhost, lambda p: matches_exchange(p, ex))

    def apply_to_queue(self, q: Queue) -> None:
        """Set ``q``'s effective limits from its arguments and the policy that applies to it
        (module docstring). The arguments were validated when it was declared."""
        p = self.for_queue(q)
        q.policy = None if p is None else p.name
        definition = {} if p is None else p.definition
        args = q.arguments
        values: dict[str, Any] = {}
        for key, arg in INT_KEYS.items():
            a, v = args.get(arg), definition.get(key)
            values[key] = v if a is None else a if v is None else min(a, v)
        for key, arg in STR_KEYS.items():
            a = args.get(arg)
            values[key] = a if a is not None else definition.get(key)
        q.max_length = values["max-length"]
        q.max_length_bytes = values["max-length-bytes"]
        q.ttl = values["message-ttl"]
        q.expires = values["expires"]
        # Classic queues have no delivery limit (RabbitMQ refuses the argument on them).
        q.delivery_limit = values["delivery-limit"] if q.quorum else None
        q.dlx = values["dead-letter-exchange"]
        # A routing key without an exchange does nothing, as RabbitMQ's argument check says.
        q.dlrk = values["dead-letter-routing-key"] if q.dlx is not None else None
        q.overflow = values["overflow"] or "drop-head"

    def definition_of(self, ex: Exchange) -> dict[str, Any]:
        """The definition of the policy that applies to ``ex`` ({} for none)."""
        if ex.policy is None:
            return {}
        return self.by_vhost[ex.vhost][ex.policy].definition

    def apply_to_exchange(self, ex: Exchange) -> None:
        p = self.for_exchange(ex)
        ex.policy = None if p is None else p.name
        ae = None if p is None else p.definition.get("alternate-exchange")
        ex.policy_alternate = ae if isinstance(ae, str) else None
