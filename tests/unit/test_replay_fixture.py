"""One recorded event log (``tests/fixtures/``) replayed into today's model gives the state
digests and the client output it gave when it was recorded: refactorings of the model must
leave its behaviour and its snapshot format alone. A member that joins half way through, by
a state update (snapshot, encode, decode, restore), ends in the same state too. The log replays
at the model version it was recorded at (``model_version``: release 0.1.0's), as a cluster of
that release being upgraded replays it."""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from pamqp import commands as C
from pamqp import frame as pframe
from pamqp.exceptions import PAMQPException

from cpgbroker.model import events as EV
from cpgbroker.model.broker import Broker
from cpgbroker.model.state import snapshot as S

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"


def load() -> tuple[list[Any], dict[str, Any]]:
    log = []
    with gzip.open(FIXTURES / "replay_events.jsonl.gz", "rt", encoding="utf-8") as f:
        for line in f:
            rec = json.loads(line)
            kind = getattr(EV, rec.pop("type"))
            args = {
                k: base64.b64decode(v["b64"])
                if isinstance(v, dict)
                else tuple(v)
                if isinstance(v, list)
                else v
                for k, v in rec.items()
            }
            log.append(kind(**args))
    expected = json.loads((FIXTURES / "replay_expected.json").read_text())
    return log, expected


@pytest.fixture(scope="module")
def recorded() -> tuple[list[Any], dict[str, Any]]:
    return load()


def effect_hash(h: Any, eff: Any) -> None:
    if isinstance(eff, EV.Send):
        # Whether it carries a confirm (a bool when the log was recorded; now a level whose
        # durable kind did not exist then).
        h.update(b"S%d:%d:" % (eff.conn, bool(eff.confirm)) + eff.data)
    else:
        h.update(repr(eff).encode())


def test_the_log_covers_what_it_claims(recorded: tuple[list[Any], dict[str, Any]]) -> None:
    """The fixture holds publishes, consumes, tx, dead-lettering, priorities and a member
    leaving (decoded from the client bytes themselves, not taken from the recorder's word)."""
    log, expected = recorded
    assert len(log) == expected["events"]
    methods: Counter[str] = Counter()
    args: Counter[str] = Counter()
    buf: dict[int, bytes] = {}
    for ev in log:
        if type(ev) is EV.ClientData:
            data = buf.get(ev.conn, b"") + ev.data
            while True:
                try:
                    used, _ch, fr = pframe.unmarshal(data)
                except (PAMQPException, ValueError, IndexError, KeyError, TypeError):
                    break
                if used == 0:
                    break
                data = data[used:]
                methods[type(fr).__name__ if not hasattr(fr, "name") else fr.name] += 1
                if isinstance(fr, C.Queue.Declare | C.Basic.Consume):
                    args.update(list(fr.arguments or {}))
            buf[ev.conn] = data
        elif type(ev) is EV.MemberLeft:
            methods["MemberLeft"] += 1
    for name in (
        "Basic.Publish",
        "Basic.Consume",
        "Basic.Ack",
        "Basic.Nack",
        "Tx.Select",
        "Tx.Commit",
        "Confirm.Select",
        "MemberLeft",
    ):
        assert methods[name] > 0, name
    for arg in ("x-dead-letter-exchange", "x-max-priority", "x-priority"):
        assert args[arg] > 0, arg


def test_replay_gives_the_recorded_digests_and_output(
    recorded: tuple[list[Any], dict[str, Any]],
) -> None:
    log, expected = recorded
    # At the model version it was recorded at (release 0.1.0's): a later release's model at
    # that version must be, bit for bit, the model that recorded it.
    b = Broker(version=expected["model_version"])
    out = hashlib.sha256()
    for n, ev in enumerate(log, 1):
        for eff in b.apply(ev):
            effect_hash(out, eff)
        want = expected["digests"].get(str(n))
        if want is not None:
            assert S.digest(b) == want, f"state digest after event {n}"
    assert S.digest(b) == expected["final_digest"]
    assert out.hexdigest() == expected["effects_sha256"]


def test_a_member_updated_half_way_ends_in_the_recorded_state(
    recorded: tuple[list[Any], dict[str, Any]],
) -> None:
    log, expected = recorded
    cut = expected["update_at"]
    old = Broker(version=expected["model_version"])
    for ev in log[:cut]:
        old.apply(ev)
    # The update: the snapshot streamed part by part, as the updater's child sends it.
    r = S.Restorer()
    for part in S.parts(old):
        r.feed(S.decode(S.encode(part)))
    new = r.finish()
    assert new.version.current == expected["model_version"]
    assert S.digest(new) == expected["digests"][str(cut)]
    for ev in log[cut:]:
        new.apply(ev)
    assert S.digest(new) == expected["final_digest"]
