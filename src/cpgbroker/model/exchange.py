"""Exchanges and their routing: direct, fanout, topic, headers (and the default exchange).

A binding's destination is a queue or another exchange (exchange-to-exchange bindings). Each
exchange keeps its bindings in insertion order; routing results are de-duplicated preserving
order, so every replica enqueues into the same queues in the same order.

Headers exchanges compare a binding's arguments with a message's ``headers``. At model version
7 both are read with pamqp (:func:`headers_match`). From model version 8
(``versions.EXACT_FIELD_TABLES``) the headers are read with our codec (``wire/fieldtable.py``)
and compared as RabbitMQ 3.10.8's ``rabbit_exchange_type_headers`` does
(:func:`headers_match_exact`); see there for what that means and what still differs.
"""

from __future__ import annotations

import datetime
import decimal
from typing import Any, Union

import attrs

from cpgbroker.model.entities import IdList, Message, Queue, QueueBinding
from cpgbroker.wire.fieldtable import (
    ARRAY,
    BOOL,
    BYTE_ARRAY,
    DECIMAL,
    DOUBLE,
    FLOAT,
    INTEGER_KINDS,
    LONG_L,
    LONG_STRING,
    TABLE,
    TIMESTAMP,
    VOID,
    VOID_0,
    Field,
    Table,
)

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
    # Derived (model/policies.py, re-applied on restore): the policy that applies, by name,
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
            names = _exact_names(spec)
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
            for name in _exact_names(b.exact) or ():
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


# ---------------------------------------------------------------- headers at model version 8
#
# RabbitMQ 3.10.8 (``rabbit_exchange_type_headers``, read) sorts the binding's arguments and the
# message's headers by name (stably: a name given twice keeps its order) and walks both at
# once: ``x-match`` is always skipped, other names starting with ``x-`` unless x-match is
# ``all-with-x`` or ``any-with-x``; a header the binding does not name is passed over; a name
# the message lacks fails ``all``; a void binding value asks for presence only; other values
# match when Erlang's ``==`` holds between the two *values*, whatever their field types. So
# (measured on a RabbitMQ 3.10.8 node): a long 1 matches a short 1, a double 1.0 and a timestamp
# 1, not a boolean true; a long string matches a byte array of the same bytes; a decimal matches
# only a decimal of the same scale and mantissa (1.0 is not 1); a double 1.1 does not match the
# 32-bit float 1.1 (read as 1.100000023841858); -0.0 matches 0; 2**53+1 does not match the
# double 2**53 (numbers compare exactly); arrays and tables match only with the same field
# types inside (a table {a: long 1} does not match {a: short 1}); and with a header given twice
# the binding's value is compared with the first of them in the walk (its first on the wire),
# the second one then with the binding's next name. An x-match other than those four long
# strings reads as ``all``.
#
# Values here are Python stand-ins on which ``==`` is Erlang's: integers (every integer type
# and timestamps) and floats as such (Python compares int and float exactly, as Erlang's ``==``
# does); booleans, decimals, arrays and tables as tagged tuples, long strings and byte arrays
# as bytes; a void as None. NaN (which RabbitMQ 3.10.8 cannot read at all: its parser has no
# clause for a non-finite double, and the publishing connection is closed) equals nothing.
#
# A binding a client made at model version 8 keeps the arguments it sent (``Binding.table``,
# replicated), read with our codec: values inside arrays and tables compare with their field
# types, as RabbitMQ's (``l`` and ``L`` are both ``long`` there). A binding without them (made
# at version 7, or by federation or the management API) is matched from its arguments as pamqp
# decoded them (or as JSON gave them), which lost the types inside arrays and tables: there
# integers of any width compare as one type, 32- and 64-bit floats as one, long strings and
# byte arrays as one; and a timestamp argument above 2**32 that is a whole number of seconds
# reads as seconds.

_TAG_BOOL = "t"
_TAG_DECIMAL = "D"
_TAG_ARRAY = "A"
_TAG_TABLE = "F"

# The type classes values inside arrays and tables are compared with (see above).
_CLASS_OF_KIND: dict[int, str] = {k: "int" for k in INTEGER_KINDS}
_CLASS_OF_KIND.update(
    {
        TIMESTAMP: "T",
        FLOAT: "float",
        DOUBLE: "float",
        BOOL: "t",
        DECIMAL: "D",
        LONG_STRING: "bin",
        BYTE_ARRAY: "bin",
        ARRAY: "A",
        TABLE: "F",
    }
)

_VOID_BINDING = object()  # a binding value that asks for the header's presence only
_VOID_KINDS = (VOID, VOID_0)
_EPOCH = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
_MATCH_MODES = ("all", "any", "all-with-x", "any-with-x")

# (x-match any, -with-x, typed, the binding's names and values sorted by name)
ExactSpec = tuple[bool, bool, bool, tuple[tuple[str, Any], ...]]


# RabbitMQ's types (``rabbit_binary_parser``), which values inside arrays and tables compare
# with when the binding's own table is known.
_TYPE_OF_KIND: dict[int, str] = {k: chr(k) for k in _CLASS_OF_KIND}
_TYPE_OF_KIND[LONG_L] = "l"


def _erl_field(f: Field, typed: bool = True) -> Any:
    """The stand-in of a header value (our codec's :class:`Field`); inside arrays and tables
    with RabbitMQ's field types (``typed``) or only their classes (a binding from pamqp's
    values)."""
    kind = f.kind
    if kind == BOOL:
        return (_TAG_BOOL, f.value)
    if kind == DECIMAL:
        data = f.data
        return (_TAG_DECIMAL, data[0], int.from_bytes(data[1:5], "big"))
    if kind in (LONG_STRING, BYTE_ARRAY):
        return f.data[4:]
    if kind in (ARRAY, TABLE):
        types = _TYPE_OF_KIND if typed else _CLASS_OF_KIND
        inner = f.value
        if isinstance(inner, Table):
            return (
                _TAG_TABLE,
                tuple([(k, types.get(x.kind, "V"), _erl_field(x, typed)) for k, x in inner]),
            )
        assert isinstance(inner, list)
        return (_TAG_ARRAY, tuple([(types.get(x.kind, "V"), _erl_field(x, typed)) for x in inner]))
    return f.value  # integers, timestamps, floats; None for a void


def _timestamp_seconds(dt: datetime.datetime) -> int:
    """The u64 pamqp read into ``dt``: seconds, or milliseconds where it read them (above
    2**32), as far as the datetime tells (module comment)."""
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=datetime.UTC)
    us = (dt - _EPOCH) // datetime.timedelta(microseconds=1)
    if us % 1_000_000 == 0 and 0 <= us // 1_000_000 <= 0xFFFFFFFF:
        return us // 1_000_000
    return (us + 500) // 1000


def _decimal_key(v: decimal.Decimal) -> Any:
    sign, digits, exponent = v.as_tuple()
    if not isinstance(exponent, int):
        return object()  # not a value a decimal field holds: equal to nothing
    mantissa = int("".join(map(str, digits)) or "0")
    if exponent > 0:
        mantissa *= 10**exponent
        exponent = 0
    # pamqp reads the mantissa as a signed 32-bit integer: its bits are the unsigned one sent.
    return (_TAG_DECIMAL, -exponent, (-mantissa if sign else mantissa) & 0xFFFFFFFF)


def _erl_py(v: Any) -> Any:
    """The stand-in of a binding argument value (as pamqp decoded it, or as the management
    API's JSON gave it)."""
    if isinstance(v, bool):
        return (_TAG_BOOL, v)
    if isinstance(v, (int, float)) or v is None:
        return v
    if isinstance(v, str):
        return v.encode()
    if isinstance(v, (bytes, bytearray, memoryview)):
        return bytes(v)
    if isinstance(v, decimal.Decimal):
        return _decimal_key(v)
    if isinstance(v, datetime.datetime):
        return _timestamp_seconds(v)
    if isinstance(v, (list, tuple)):
        return (_TAG_ARRAY, tuple([(_class_of_py(x), _erl_py(x)) for x in v]))
    if isinstance(v, dict):
        return (
            _TAG_TABLE,
            tuple([(str(k), _class_of_py(x), _erl_py(x)) for k, x in v.items()]),
        )
    return object()  # nothing a field table decodes to: equal to nothing


def _class_of_py(v: Any) -> str:
    if isinstance(v, bool):
        return "t"
    if isinstance(v, int):
        return "int"
    if isinstance(v, float):
        return "float"
    if isinstance(v, (str, bytes, bytearray, memoryview)):
        return "bin"
    if isinstance(v, decimal.Decimal):
        return "D"
    if isinstance(v, datetime.datetime):
        return "T"
    if isinstance(v, (list, tuple)):
        return "A"
    if isinstance(v, dict):
        return "F"
    return "V"


def exact_spec(args: dict[str, Any], table: Table | None = None) -> ExactSpec:
    """A binding's arguments as model version 8 matches them, as RabbitMQ's ``parse_x_match``
    and sorted table: from the client's ``table`` when known, else from ``args``."""
    if table is not None:
        x_match = table.get("x-match")
        raw = x_match.long_string() if x_match is not None else None
        mode = raw.decode("utf-8", "replace") if raw is not None else "all"
        entries = [(k, _VOID_BINDING if f.kind in _VOID_KINDS else _erl_field(f)) for k, f in table]
    else:
        m = args.get("x-match")
        mode = m if isinstance(m, str) else "all"
        entries = [(k, _VOID_BINDING if v is None else _erl_py(v)) for k, v in args.items()]
    if mode not in _MATCH_MODES:
        mode = "all"
    pattern = tuple(sorted(entries, key=_name))
    return (mode.startswith("any"), mode.endswith("-with-x"), table is not None, pattern)


def _exact_names(spec: ExactSpec) -> list[str] | None:
    """The header names a message must have one of to match ``spec`` (for all, its first
    compared name; for any, each); None when every message matches (all, nothing compared)."""
    want_any, with_x, _, pattern = spec
    names = [k for k, _ in pattern if k != "x-match" and (with_x or not k.startswith("x-"))]
    if not names:
        return [] if want_any else None
    # A name given twice is one bucket.
    return list(dict.fromkeys(names)) if want_any else names[:1]


def _name(entry: tuple[str, Any]) -> str:
    # Names sort as RabbitMQ sorts binaries: bytewise, which for UTF-8 is code point order.
    return entry[0]


def sorted_headers(headers: Table) -> list[tuple[str, Field]]:
    """A message's headers as RabbitMQ matches them: sorted by name, stably."""
    return sorted(headers.entries, key=_name)


def headers_match_exact(spec: ExactSpec, data: list[tuple[str, Field]]) -> bool:
    """RabbitMQ 3.10.8's ``headers_match`` (module comment): ``spec`` from :func:`exact_spec`,
    ``data`` from :func:`sorted_headers`."""
    want_any, with_x, typed, pattern = spec
    all_ok, any_ok = True, False
    i = j = 0
    np_, nd = len(pattern), len(data)
    while True:
        if want_any:
            if any_ok:
                return True
        elif not all_ok:
            return False
        if i == np_:
            return any_ok if want_any else all_ok
        pk, pv = pattern[i]
        if pk == "x-match" or (not with_x and pk.startswith("x-")):
            i += 1
            continue
        if j == nd:
            # No more headers: every name still to compare fails.
            return any_ok if want_any else False
        dk, field = data[j]
        if pk > dk:
            j += 1
            continue
        if pk < dk:
            all_ok = False
            i += 1
            continue
        if pv is _VOID_BINDING or pv == _erl_field(field, typed):
            any_ok = True
        else:
            all_ok = False
        i += 1
        j += 1
