"""Child-process side of the hash-seed determinism test (not a test module itself)."""

from __future__ import annotations

import hashlib
from typing import Any

from cpgbroker.model import events as EV
from cpgbroker.model import snapshot as S
from cpgbroker.model.broker import Broker

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
        out.append([S.digest(b), h.hexdigest()])
    return out
