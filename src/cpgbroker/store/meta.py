"""The store's metadata file: which cluster it belongs to, what it starts from, clean or dirty.

One small JSON file, replaced atomically (write, fsync, rename, fsync the directory), so it
always says one consistent thing about the files beside it:

``state``
    ``serving``: the journal after ``base_seq`` is being written; the store was not closed
    (a crash, a kill, a power cut): recovery replays the journal to its last whole record.
    ``clean``: the member stopped cleanly after fsyncing event ``last_seq``.
    ``replacing``: the member was installing a state update over this store when it stopped;
    what the files hold is neither the old state nor the new one, so nothing is recovered.
``base_seq`` / ``snapshot``
    The event the journal replays from and the snapshot file holding the model as of that
    event (none: the empty initial state, ``base_seq`` 0).
``group`` / ``model_version``
    A store of another cluster, or of a model version this software cannot replay, is never
    recovered (never silently merged into this cluster). ``model_version`` is the newest
    version the journal may hold (model/versions.py): raised before the first event of a newer
    version is journaled, so an older release refuses the store instead of misreading it.
``base_version``
    The model version of the base when it is the empty state (no snapshot says it): the
    version the cluster started at. Absent (releases before 0.2.0): ``model_version``.
``epoch``
    The history epoch (cluster/membership.py): a forced boot from a minority starts a new one,
    so its state wins over stores that never saw it.
``settings``
    The checksum of the model settings file a member keeps beside (runtime/member/storelink.py)
    when it last wrote this file. Releases before 0.2.0 neither keep that file nor write this
    key: a store they wrote after (a member rolled back, then upgraded again) no longer matches,
    so its settings file, older than its journal, is not used.
"""

from __future__ import annotations

import json
import os
from typing import Any

import attrs

from cpgbroker.store.disk import Disk, StoreCorrupt

NAME = "meta.json"
FORMAT = 1
SERVING = "serving"
CLEAN = "clean"
REPLACING = "replacing"
STATES = (SERVING, CLEAN, REPLACING)


@attrs.frozen
class Meta:
    group: str
    model_version: int
    epoch: int
    base_seq: int
    snapshot: str | None
    state: str
    last_seq: int = 0
    base_version: int | None = None
    settings: str | None = None

    def to_json(self) -> dict[str, Any]:
        out = attrs.asdict(self)
        for key in ("base_version", "settings"):
            if out[key] is None:
                del out[key]  # as releases before 0.2.0 write it
        out["format"] = FORMAT
        return out


def path(directory: str) -> str:
    return os.path.join(directory, NAME)


def load(disk: Disk, directory: str) -> Meta | None:
    """The metadata of the store in ``directory``; None if there is no store there."""
    p = path(directory)
    if not disk.exists(p):
        return None
    raw = disk.read(p)
    try:
        d = json.loads(raw)
        if d.get("format") != FORMAT:
            raise StoreCorrupt(f"{p}: store format {d.get('format')} is not {FORMAT}")
        m = Meta(
            group=str(d["group"]),
            model_version=int(d["model_version"]),
            epoch=int(d["epoch"]),
            base_seq=int(d["base_seq"]),
            snapshot=None if d["snapshot"] is None else str(d["snapshot"]),
            state=str(d["state"]),
            last_seq=int(d.get("last_seq", 0)),
            base_version=None if d.get("base_version") is None else int(d["base_version"]),
            settings=None if d.get("settings") is None else str(d["settings"]),
        )
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise StoreCorrupt(f"{p}: offset 0: unreadable metadata ({e})") from e
    if m.state not in STATES:
        raise StoreCorrupt(f"{p}: unknown store state {m.state!r}")
    return m


def save(disk: Disk, directory: str, m: Meta) -> None:
    data = json.dumps(m.to_json(), sort_keys=True, indent=1).encode() + b"\n"
    disk.write_atomic(path(directory), data)
