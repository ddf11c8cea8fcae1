"""Hot standby's rule (runtime/replication/standby.py): the eldest ready member is the primary,
every other member turns clients away naming it, and the rule never moves the primary while it
lives."""

from __future__ import annotations

import pytest

from cpgbroker.cluster.codec import STATUS_NEW, STATUS_READY, Hello
from cpgbroker.cluster.membership import MemberInfo, Membership
from cpgbroker.errors import ConfigError
from cpgbroker.runtime.config.settings import load
from cpgbroker.runtime.replication.standby import HotStandby, primary_of


def _membership(*members: tuple[int, int | None]) -> Membership:
    m = Membership(members[0][0], 3, 7, b"", "")
    for member, status in members:
        m.members[member] = MemberInfo(member, status, f"amqp://10.0.0.{member}:5672")
    return m


def test_the_eldest_ready_member_is_primary_and_the_others_name_it() -> None:
    # Revealed in the order 30, 10, 20: 30 is the eldest; 10's lower id does not matter.
    ms = _membership((30, STATUS_READY), (10, STATUS_READY), (20, STATUS_READY))
    info = primary_of(ms)
    assert info is not None and info.member == 30
    for me in (10, 20):
        why = HotStandby(me, lambda: ms, lambda: True).refusal()
        assert (
            why
            == "this member is a hot-standby backup; the primary is amqp://10.0.0.30:5672: use it"
        )
    primary = HotStandby(30, lambda: ms, lambda: True)
    assert primary.refusal() is None
    assert primary.status() == {
        "mode": "hot-standby",
        "role": "primary",
        "primary": 30,
        "primary_url": "amqp://10.0.0.30:5672",
    }
    # The primary dies: the next eldest ready member takes over.
    del ms.members[30]
    assert HotStandby(10, lambda: ms, lambda: True).refusal() is None
    ms.members.clear()
    assert "no member is ready" in (HotStandby(20, lambda: ms, lambda: True).refusal() or "")


def test_members_that_become_ready_later_never_displace_the_primary() -> None:
    """Through the membership's own stream handling. A whole cluster restarts from its stores:
    member 3 holds the freshest state and serves first; 1 and 2, revealed before it, take a
    state update and become ready after it: 3 stays primary. Then 3 dies and comes back as a
    new member: it is a backup."""

    def hello(m: int, status: int, epoch: int) -> Hello:
        return Hello(m, status, 7, b"", f"amqp://n{m}", "", 0, epoch, 100 * epoch + m)

    ms = Membership(3, 3, 7, b"", "amqp://n3")
    ms.on_confchg([1, 2, 3], [1, 2, 3], [])
    for m, epoch in ((1, 1), (2, 1), (3, 2)):
        ms.on_hello(hello(m, STATUS_NEW, epoch))
    assert ms.ready_members == [3]
    for m in (1, 2):
        ms.on_hello(hello(m, STATUS_READY, 0))
    assert ms.ready_members == [1, 2, 3]
    assert primary_of(ms).member == 3  # type: ignore[union-attr]
    ms.on_confchg([1, 2], [], [3])
    assert primary_of(ms).member == 1  # type: ignore[union-attr]
    ms.on_confchg([1, 2, 4], [4], [])
    ms.on_hello(hello(4, STATUS_READY, 0))
    assert primary_of(ms).member == 1  # type: ignore[union-attr]


def test_the_mode_is_checked_in_the_configuration(tmp_path: object) -> None:
    from pathlib import Path

    base = Path(str(tmp_path))
    good = base / "good.toml"
    good.write_text('[cluster]\ngroup = "g"\nsize = 3\nmode = "hot-standby"\n')
    cfg = load(str(good))
    assert cfg.cluster is not None and cfg.cluster.mode == "hot-standby"
    default = base / "default.toml"
    default.write_text('[cluster]\ngroup = "g"\n')
    assert load(str(default)).cluster.mode == "active-active"  # type: ignore[union-attr]
    bad = base / "bad.toml"
    bad.write_text('[cluster]\ngroup = "g"\nmode = "primary-backup"\n')
    with pytest.raises(ConfigError, match=r"cluster\.mode must be"):
        load(str(bad))


@pytest.mark.parametrize(
    ("cluster", "extra", "error"),
    [
        ('mode = "hot-standby"\nreplication = "changes"', "", None),
        ('mode = "hot-standby"\nreplication = "changes"\nreplicate = "durable"', "", None),
        ('replication = "changes"', "", 'needs mode = "hot-standby"'),
        ('mode = "hot-standby"\nreplication = "state"', "", r"cluster\.replication must be"),
        ('mode = "hot-standby"\nreplicate = "durable"', "", 'needs replication = "changes"'),
        ('mode = "hot-standby"\nreplication = "changes"\nreplicate = "some"', "", "one of"),
        ('mode = "hot-standby"\nreplication = "changes"', '[store]\ndir = "/tmp/x"\n', None),
    ],
)
def test_shipping_changes_is_checked_in_the_configuration(
    tmp_path: object, cluster: str, extra: str, error: str | None
) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "c.toml"
    path.write_text(f'[cluster]\ngroup = "g"\nsize = 3\n{cluster}\n{extra}')
    if error is None:
        cfg = load(str(path))
        assert cfg.cluster is not None and cfg.cluster.replication == "changes"
        return
    with pytest.raises(ConfigError, match=error):
        load(str(path))
