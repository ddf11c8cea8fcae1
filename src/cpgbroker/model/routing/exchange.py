"""Exchanges and their routing: direct, fanout, topic, headers (and the default exchange).

A binding's destination is a queue or another exchange (exchange-to-exchange bindings). Each
exchange keeps its bindings in insertion order; routing results are de-duplicated preserving
order, so every replica enqueues into the same queues in the same order.

Headers exchanges compare a binding's arguments with a message's ``headers``. At model version
7 both are read with pamqp (:func:`headers_match`). From model version 8
(``versions.EXACT_FIELD_TABLES``) the headers are read with our codec (``wire/fieldtable.py``)
and compared as RabbitMQ 3.10.8's ``rabbit_exchange_type_headers`` does
(``model/routing/headersmatch.py``); see there for what that means and what still differs.
"""

from __future__ import annotations

from typing import Any, Union

import attrs

from cpgbroker.model.entities import IdList, Message, Queue, QueueBinding
from cpgbroker.model.routing.headersmatch import (
    ExactSpec,
    exact_names,
    exact_spec,
    headers_match_exact,
    sorted_headers,
)
from cpgbroker.wire.fieldtable import Table

EXCHANGE_TYPES = ("direct", "fanout", "topic", "headers")

Dest = Union[Queue, "Exchange"]


@attrs.define(eq=False)
class Binding:
    dest: Dest
    key: str
    args: dict[str, Any]
    # Topic bindings: the key split into words once, at bind time.
    words: tuple[str, ...] = ()
    # Derived (not replicated): the exchange's bind counter when it was made, which orders
    # routing results by binding age whatever index found them; and, for a queue, the record
    # the queue keeps of it (what unbinding strikes from ``Queue.bindings``).
    seq: int = 0
    qb: QueueBinding | None = None
    # Model version 8: the arguments a client sent, as our codec reads them (what a headers
    # exchange matches with); None at version 7 and for bindings no client sent (federation's,
    # the management API's), which are matched from ``args``.
    table: Table | None = None
    # Derived (not replicated): a headers binding's arguments as model version 8's matching
    # reads them (:func:`exact_spec`), made when it is bound.
    exact: ExactSpec | None = None


class _TopicNode:
    """One word position of the topic index: bindings whose pattern ends here, and the
    patterns that go on (by literal word, ``*`` and ``#`` alike)."""

    __slots__ = ("bindings", "children")

    def __init__(self) -> None:
        self.bindings: dict[Binding, None] = {}
        self.children: dict[str, _TopicNode] = {}


# Headers index: the bucket of bindings that only ask for a header's presence (or compare a
# value that cannot be a dict key).
_PRESENT = object()


def _hashable(v: Any) -> bool:
    try:
        hash(v)
    except TypeError:
        return False
    return True


@attrs.define(eq=False)
class Exchange:
    """An exchange and its bindings.

    Cost rule: binding, unbinding and routing cost what they touch, never every binding. The
    ordered ``bindings`` (the replicated state) is shadowed by derived indexes, rebuilt by
    :meth:`bind` when a snapshot is restored: ``by_dest`` (every binding to one destination:
    unbind, delete of the destination), ``by_dest_key`` (duplicate check), ``by_key`` and
    ``key_bindings`` (direct), a word trie (topic), header buckets (headers) and ``sources``
    (exchanges with a binding to this one: if-unused and delete). Routing results come out
    in binding order (``Binding.seq``), as a scan of ``bindings`` gave them."""

    name: str
    vhost: str
    type: str
    durable: bool
    auto_delete: bool
    internal: bool
    arguments: dict[str, Any]
    # In binding order, removal by identity in O(1).
    bindings: IdList[Binding] = attrs.Factory(IdList)
    # direct exchanges: routing key -> destinations, kept in step with ``bindings``.
    by_key: dict[str, list[Dest]] = attrs.Factory(dict)
    # topic exchanges: routing key -> destinations cache (pure function of the bindings;
    # cleared on every bind/unbind, never part of the replicated state).
    cache: dict[str, list[Dest]] = attrs.Factory(dict)
    deleted: bool = False
    # ---- derived indexes (snapshot.NOT_REPLICATED); dicts keyed by id() are looked up only,
    # never iterated, so their order does not matter.
    by_dest: dict[int, dict[Binding, None]] = attrs.Factory(dict)
    by_dest_key: dict[tuple[int, str], list[Binding]] = attrs.Factory(dict)
    key_bindings: dict[str, dict[Binding, None]] = attrs.Factory(dict)
    topic_root: _TopicNode = attrs.Factory(_TopicNode)
    header_buckets: dict[tuple[str, Any], dict[Binding, None]] = attrs.Factory(dict)
    header_always: dict[Binding, None] = attrs.Factory(dict)
    # headers exchanges at model version 8: bindings by the header name a message must have
    # to match (for x-match all its first compared name, for any each; values are compared as
    # RabbitMQ compares them, which no Python hash follows), and those that match every message.
    header_named: dict[str, dict[Binding, None]] = attrs.Factory(dict)
    header_exact_always: dict[Binding, None] = attrs.Factory(dict)
    # Source exchange -> how many of its bindings lead here.
    sources: dict[Exchange, int] = attrs.Factory(dict)
    bind_seq: int = 0
    # Derived (model/routing/policies.py, re-applied on restore): the policy that applies, by name,
    # and the alternate exchange it names.
    policy: str | None = None
    policy_alternate: str | None = None

    @property
    def alternate(self) -> str | None:
        # The exchange's own argument holds over a policy's, as in RabbitMQ.
        ae = self.arguments.get("alternate-exchange")
        return ae if isinstance(ae, str) else self.policy_alternate

    def find_binding(self, dest: Dest, key: str, args: dict[str, Any]) -> Binding | None:
        for b in self.by_dest_key.get((id(dest), key), _NO_BINDINGS):
            if b.args == args:
                return b
        return None

    def has_binding(self, dest: Dest, key: str, args: dict[str, Any]) -> bool:
        return self.find_binding(dest, key, args) is not None

    def bind(
        self, dest: Dest, key: str, args: dict[str, Any], table: Table | None = None
    ) -> Binding | None:
        """Add a binding; None if an identical one exists (bindings are idempotent).
        ``table``: the arguments as the client sent them (model version 8, ``Binding.table``:
        kept by headers exchanges, the only ones that read them)."""
        if self.find_binding(dest, key, args) is not None:
            return None
        words = tuple(_words(key)) if self.type == "topic" else ()
        self.bind_seq += 1
        if self.type != "headers":
            table = None
        b = Binding(dest, key, args, words, self.bind_seq, table=table)
        self.bindings.append(b)
        self.by_dest.setdefault(id(dest), {})[b] = None
        self.by_dest_key.setdefault((id(dest), key), []).append(b)
        t = self.type
        if t == "direct":
            self.key_bindings.setdefault(key, {})[b] = None
            dests = self.by_key.setdefault(key, [])
            if not any(d is dest for d in dests):
                dests.append(dest)
        elif t == "topic":
            node = self.topic_root
            for w in words:
                nxt = node.children.get(w)
                if nxt is None:
                    nxt = node.children[w] = _TopicNode()
                node = nxt
            node.bindings[b] = None
        elif t == "headers":
            for bucket in self._header_keys(args):
                self.header_buckets.setdefault(bucket, {})[b] = None
            b.exact = spec = exact_spec(args, table)
            names = exact_names(spec)
            if names is None:
                self.header_exact_always[b] = None
            for name in names or ():
                self.header_named.setdefault(name, {})[b] = None
            if _header_vacuous(args):
                self.header_always[b] = None
        if isinstance(dest, Exchange):
            dest.sources[self] = dest.sources.get(self, 0) + 1
        self.cache.clear()
        return b

    def unbind(self, dest: Dest, key: str, args: dict[str, Any]) -> Binding | None:
        """Remove one binding; returns it (None if there was none)."""
        b = self.find_binding(dest, key, args)
        if b is not None:
            self._forget(b)
            if self.type == "direct":
                self._reindex(key)
            self.cache.clear()
        return b

    def unbind_dest(self, dest: Dest) -> list[Binding]:
        """Remove every binding to ``dest`` (it is being deleted); returns them."""
        gone = list(self.by_dest.get(id(dest), _NO_BINDINGS))
        for b in gone:
            self._forget(b)
        if self.type == "direct":
            for key in dict.fromkeys(b.key for b in gone):
                self._reindex(key)
        if gone:
            self.cache.clear()
        return gone

    def clear_bindings(self) -> list[Binding]:
        """The exchange is deleted: every binding of it goes (returned, in order)."""
        gone = list(self.bindings)
        for b in gone:
            dest = b.dest
            if isinstance(dest, Exchange):
                _drop_source(dest, self)
        self.bindings.clear()
        self.by_dest.clear()
        self.by_dest_key.clear()
        self.key_bindings.clear()
        self.by_key.clear()
        self.topic_root = _TopicNode()
        self.header_buckets.clear()
        self.header_always.clear()
        self.header_named.clear()
        self.header_exact_always.clear()
        self.cache.clear()
        return gone

    def _forget(self, b: Binding) -> None:
        self.bindings.discard(b)
        dest = b.dest
        dk = id(dest)
        per_dest = self.by_dest[dk]
        del per_dest[b]
        if not per_dest:
            del self.by_dest[dk]
        same = self.by_dest_key[(dk, b.key)]
        same.remove(b)
        if not same:
            del self.by_dest_key[(dk, b.key)]
        t = self.type
        if t == "direct":
            kb = self.key_bindings[b.key]
            del kb[b]
            if not kb:
                del self.key_bindings[b.key]
        elif t == "topic":
            path = [self.topic_root]
            for w in b.words:
                path.append(path[-1].children[w])
            del path[-1].bindings[b]
            # Prune the branch it leaves empty.
            for i in range(len(b.words), 0, -1):
                node = path[i]
                if node.bindings or node.children:
                    break
                del path[i - 1].children[b.words[i - 1]]
        elif t == "headers":
            for bucket in self._header_keys(b.args):
                hb = self.header_buckets[bucket]
                del hb[b]
                if not hb:
                    del self.header_buckets[bucket]
            self.header_always.pop(b, None)
            self.header_exact_always.pop(b, None)
            assert b.exact is not None
            for name in exact_names(b.exact) or ():
                hn = self.header_named[name]
                del hn[b]
                if not hn:
                    del self.header_named[name]
        if isinstance(dest, Exchange):
            _drop_source(dest, self)

    def _reindex(self, key: str) -> None:
        dests: list[Dest] = []
        for b in self.key_bindings.get(key, _NO_BINDINGS):
            if not any(d is b.dest for d in dests):
                dests.append(b.dest)
        if dests:
            self.by_key[key] = dests
        else:
            self.by_key.pop(key, None)

    @staticmethod
    def _header_keys(args: dict[str, Any]) -> list[tuple[str, Any]]:
        """The buckets a headers binding is found under: for x-match all, its first compared
        key (a message without it cannot match); for any, every compared key."""
        mode = args.get("x-match", "all")
        if isinstance(mode, bytes):
            mode = mode.decode()
        with_x = mode in ("all-with-x", "any-with-x")
        want_any = mode in ("any", "any-with-x")
        out: list[tuple[str, Any]] = []
        for key, value in args.items():
            if key == "x-match" or (key.startswith("x-") and not with_x):
                continue
            out.append((key, value if value is not None and _hashable(value) else _PRESENT))
            if not want_any:
                break
        return out

    def match(self, routing_key: str, msg: Message, exact: bool = False) -> list[Dest]:
        """The destinations a message published with ``routing_key`` goes to, in binding
        order. ``exact`` (model version 8): a headers exchange reads the headers with our
        codec and compares as RabbitMQ 3.10.8 (:func:`headers_match_exact`)."""
        t = self.type
        if t == "direct":
            return self.by_key.get(routing_key, _EMPTY)
        if t == "fanout":
            return [b.dest for b in self.bindings]
        if t == "topic":
            hit = self.cache.get(routing_key)
            if hit is None:
                found: dict[Binding, None] = {}
                _topic_walk(self.topic_root, _words(routing_key), 0, found)
                hit = [b.dest for b in _in_order(found)]
                if len(self.cache) > 4096:
                    self.cache.clear()
                self.cache[routing_key] = hit
            return hit
        # headers
        if not self.bindings:
            return _EMPTY
        if exact:
            return self._match_exact(msg)
        headers = msg.headers()
        buckets = self.header_buckets
        cand: dict[Binding, None] = dict(self.header_always)
        for k, v in headers.items():
            if v is not None and _hashable(v):
                hb = buckets.get((k, v))
                if hb:
                    cand.update(hb)
            hb = buckets.get((k, _PRESENT))
            if hb:
                cand.update(hb)
        return [b.dest for b in _in_order(cand) if headers_match(b.args, headers)]

    def _match_exact(self, msg: Message) -> list[Dest]:
        data = sorted_headers(msg.header_table())
        cand: dict[Binding, None] = dict(self.header_exact_always)
        named = self.header_named
        for k, _ in data:
            hb = named.get(k)
            if hb:
                cand.update(hb)
        out: list[Dest] = []
        for b in _in_order(cand):
            assert b.exact is not None
            if headers_match_exact(b.exact, data):
                out.append(b.dest)
        return out


_NO_BINDINGS: tuple[Binding, ...] = ()


def _drop_source(dest: Exchange, src: Exchange) -> None:
    n = dest.sources[src] - 1
    if n:
        dest.sources[src] = n
    else:
        del dest.sources[src]


def _in_order(found: dict[Binding, None]) -> list[Binding]:
    return sorted(found, key=_seq) if len(found) > 1 else list(found)


def _seq(b: Binding) -> int:
    return b.seq


def _header_vacuous(args: dict[str, Any]) -> bool:
    """x-match all with nothing to compare matches every message."""
    return not Exchange._header_keys(args) and (
        args.get("x-match", "all") in ("all", "all-with-x", b"all", b"all-with-x")
    )


def _topic_walk(node: _TopicNode, words: list[str], i: int, found: dict[Binding, None]) -> None:
    """Every binding whose pattern matches ``words[i:]`` from ``node``: cost follows the
    patterns that match, not the bindings that exist."""
    children = node.children
    if i == len(words):
        found.update(node.bindings)
    else:
        nxt = children.get(words[i])
        if nxt is not None:
            _topic_walk(nxt, words, i + 1, found)
        star = children.get("*")
        if star is not None:
            _topic_walk(star, words, i + 1, found)
    hash_node = children.get("#")
    if hash_node is not None:
        # '#' takes zero or more words.
        for j in range(i, len(words) + 1):
            _topic_walk(hash_node, words, j, found)


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


__all__ = [
    "EXCHANGE_TYPES",
    "Binding",
    "Dest",
    "Exchange",
    "exact_spec",
    "headers_match",
    "headers_match_exact",
    "sorted_headers",
    "topic_match",
]
