"""Exchanges and their routing: direct, fanout, topic, headers (and the default exchange).

A binding's destination is a queue or another exchange (exchange-to-exchange bindings). Each
exchange keeps its bindings in insertion order; routing results are de-duplicated preserving
order, so every replica enqueues into the same queues in the same order.
"""

from __future__ import annotations

from typing import Any, Union

import attrs

from cpgbroker.model.entities import Message, Queue

EXCHANGE_TYPES = ("direct", "fanout", "topic", "headers")

Dest = Union[Queue, "Exchange"]


@attrs.define(eq=False)
class Binding:
    dest: Dest
    key: str
    args: dict[str, Any]
    # Topic bindings: the key split into words once, at bind time.
    words: tuple[str, ...] = ()


@attrs.define(eq=False)
class Exchange:
    name: str
    vhost: str
    type: str
    durable: bool
    auto_delete: bool
    internal: bool
    arguments: dict[str, Any]
    bindings: list[Binding] = attrs.Factory(list)
    # direct exchanges: routing key -> destinations, kept in step with ``bindings``.
    by_key: dict[str, list[Dest]] = attrs.Factory(dict)
    # topic exchanges: routing key -> destinations cache (pure function of the bindings;
    # cleared on every bind/unbind, never part of the replicated state).
    cache: dict[str, list[Dest]] = attrs.Factory(dict)
    # Destinations (by identity) that bind to this exchange, for if-unused and auto-delete.
    deleted: bool = False

    @property
    def alternate(self) -> str | None:
        ae = self.arguments.get("alternate-exchange")
        return ae if isinstance(ae, str) else None

    def has_binding(self, dest: Dest, key: str, args: dict[str, Any]) -> bool:
        return any(b.dest is dest and b.key == key and b.args == args for b in self.bindings)

    def bind(self, dest: Dest, key: str, args: dict[str, Any]) -> bool:
        """Add a binding; False if an identical one exists (bindings are idempotent)."""
        if self.has_binding(dest, key, args):
            return False
        words = tuple(_words(key)) if self.type == "topic" else ()
        self.bindings.append(Binding(dest, key, args, words))
        if self.type == "direct":
            dests = self.by_key.setdefault(key, [])
            if not any(d is dest for d in dests):
                dests.append(dest)
        self.cache.clear()
        return True

    def unbind(self, dest: Dest, key: str, args: dict[str, Any]) -> bool:
        for i, b in enumerate(self.bindings):
            if b.dest is dest and b.key == key and b.args == args:
                del self.bindings[i]
                self._reindex(key)
                self.cache.clear()
                return True
        return False

    def unbind_dest(self, dest: Dest) -> int:
        """Remove every binding to ``dest`` (it is being deleted); returns how many."""
        before = len(self.bindings)
        keys = [b.key for b in self.bindings if b.dest is dest]
        self.bindings = [b for b in self.bindings if b.dest is not dest]
        for key in keys:
            self._reindex(key)
        self.cache.clear()
        return before - len(self.bindings)

    def _reindex(self, key: str) -> None:
        if self.type != "direct":
            return
        dests: list[Dest] = []
        for b in self.bindings:
            if b.key == key and not any(d is b.dest for d in dests):
                dests.append(b.dest)
        if dests:
            self.by_key[key] = dests
        else:
            self.by_key.pop(key, None)

    def match(self, routing_key: str, msg: Message) -> list[Dest]:
        t = self.type
        if t == "direct":
            return self.by_key.get(routing_key, _EMPTY)
        if t == "fanout":
            return [b.dest for b in self.bindings]
        if t == "topic":
            hit = self.cache.get(routing_key)
            if hit is None:
                words = _words(routing_key)
                hit = [b.dest for b in self.bindings if topic_match(b.words, words)]
                if len(self.cache) > 4096:
                    self.cache.clear()
                self.cache[routing_key] = hit
            return hit
        # headers
        if not self.bindings:
            return _EMPTY
        headers = msg.headers()
        return [b.dest for b in self.bindings if headers_match(b.args, headers)]


_EMPTY: list[Dest] = []


def _words(key: str) -> list[str]:
    # RabbitMQ reads an empty key as zero words: "#" matches it, "*" does not.
    return key.split(".") if key else []


def topic_match(pattern: tuple[str, ...] | list[str], words: list[str]) -> bool:
    """AMQP topic matching: ``*`` is exactly one word, ``#`` zero or more words."""
    # Iterative backtracking over the last '#': linear for the usual patterns.
    p = w = 0
    star_p = -1
    star_w = 0
    np_, nw = len(pattern), len(words)
    while w < nw:
        if p < np_ and pattern[p] == "#":
            star_p = p
            star_w = w
            p += 1
        elif p < np_ and (pattern[p] == "*" or pattern[p] == words[w]):
            p += 1
            w += 1
        elif star_p != -1:
            p = star_p + 1
            star_w += 1
            w = star_w
        else:
            return False
    while p < np_ and pattern[p] == "#":
        p += 1
    return p == np_


def headers_match(args: dict[str, Any], headers: dict[str, Any]) -> bool:
    """The headers exchange: x-match ``all`` (default) or ``any`` (and RabbitMQ's ``-with-x``
    variants that also compare ``x-`` keys). A binding value that is void matches presence."""
    mode = args.get("x-match", "all")
    if isinstance(mode, bytes):
        mode = mode.decode()
    with_x = mode in ("all-with-x", "any-with-x")
    want_any = mode in ("any", "any-with-x")
    for key, value in args.items():
        if key == "x-match" or (key.startswith("x-") and not with_x):
            continue
        present = key in headers
        ok = present and (value is None or headers[key] == value)
        if want_any and ok:
            return True
        if not want_any and not ok:
            return False
    # No keys to compare: "all" is vacuously true, "any" has nothing that matched.
    return not want_any
