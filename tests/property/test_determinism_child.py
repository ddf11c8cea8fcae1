"""Child-process side of the hash-seed determinism test (not a test module itself)."""

from __future__ import annotations

import hashlib
from typing import Any

from cpgbroker.model import events as EV
from cpgbroker.model.broker import Broker
from cpgbroker.model.changes import ChangeLog
from cpgbroker.model.shipping import Shipper
from cpgbroker.model.state import snapshot as S

__test__ = False


def run(path: str) -> list[list[str]]:
    with open(path, "rb") as f:
        logs = S.decode(f.read())
    out = []
    for raw_log in logs:
        b = Broker()
        h = hashlib.sha256()
        for raw in raw_log:
            ev: Any = getattr(EV, raw[0])(*raw[1:])
            for eff in b.apply(ev):
                h.update(repr(eff).encode())
        out.append([S.digest(b), h.hexdigest(), *shipped(raw_log)])
    return out


def shipped(raw_log: list[Any]) -> list[str]:
    """A hot-standby primary's change batches for the log, and its backup's replica."""
    b = Broker()
    b.record_changes(ChangeLog())
    shipper, replica = Shipper(), Broker()
    h = hashlib.sha256()
    for i, raw in enumerate(raw_log):
        b.apply(getattr(EV, raw[0])(*raw[1:]))
        if i % 3 == 0:
            batch = shipper.batch(b)
            h.update(batch)
            replica.apply(EV.Changes(batch))
    return [h.hexdigest(), S.digest(replica)]
