"""The event registry (model/eventtypes.py): every kind of model event is described once and
travels through both of its formats, the CPG batch and the store's journal."""

from __future__ import annotations

import typing

import pytest

from cpgbroker.cluster import codec
from cpgbroker.model import events
from cpgbroker.model.eventtypes import BY_CLASS, EVENT_TYPES
from cpgbroker.model.versions import NEWEST, OLDEST
from cpgbroker.runtime.member.eventlog import TYPE_NAMES
from cpgbroker.store import records
from eventsamples import model_events


def test_every_kind_of_model_event_is_registered_once_with_distinct_numbers() -> None:
    kinds = set(typing.get_args(events.Event))
    assert {t.cls for t in EVENT_TYPES} == kinds
    assert len(BY_CLASS) == len(EVENT_TYPES)
    for field in ("journal", "name"):
        values = [getattr(t, field) for t in EVENT_TYPES]
        assert len(set(values)) == len(values), field
    cpg = [t.cpg for t in EVENT_TYPES if t.cpg is not None]
    assert len(set(cpg)) == len(cpg)
    # The cluster's own control events use the other CPG numbers.
    control = {codec.T_HELLO, codec.T_CHECKPOINT, codec.T_PROGRESS, codec.T_UPDATE_REQUEST}
    control |= {codec.T_ERROR_CHECK, codec.T_STOP}
    assert not control & set(cpg)
    assert all(OLDEST <= t.since <= NEWEST for t in EVENT_TYPES)
    assert {t.cls.__name__: t.name for t in EVENT_TYPES} == TYPE_NAMES


def test_the_samples_cover_every_kind() -> None:
    assert {type(ev) for ev in model_events()} == set(BY_CLASS)


@pytest.mark.parametrize("ev", model_events(), ids=lambda ev: type(ev).__name__)
@pytest.mark.parametrize("failed", [False, True])
def test_every_kind_journals_under_its_number_and_reads_back(
    ev: events.Event, failed: bool
) -> None:
    payload = records.encode(ev, failed)
    assert payload[0] & ~records.FAILED == BY_CLASS[type(ev)].journal
    assert records.decode(payload) == (ev, failed)


@pytest.mark.parametrize("ev", model_events(), ids=lambda ev: type(ev).__name__)
def test_every_multicast_kind_travels_under_its_number_and_reads_back(ev: events.Event) -> None:
    number = BY_CLASS[type(ev)].cpg
    if number is None:
        # Applied by each member on its own: never in a CPG batch.
        with pytest.raises(Exception, match="cannot encode"):
            codec.encode(ev)
        return
    blob = codec.encode(ev)
    assert blob[0] == number
    sender = getattr(ev, "member", None) or (getattr(ev, "conn", 0) >> 32)
    assert codec.decode_batch(codec.HEADER + blob, sender) == [ev]
