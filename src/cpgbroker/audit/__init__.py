"""``cpgbroker audit``: a PySpark job that proves, from what a cluster run recorded, that the
cluster kept its promises (replica consistency, total order, delivery guarantees) and measures
how it performed. See ``docs/audit.md``.

Library use::

    from cpgbroker.audit import AuditConfig, get_session, run_audit

    spark = get_session("local[2]")
    verdict = run_audit(spark, AuditConfig(out="audit-out", events=["run/"], history=["run/"],
                                           faults=["run/"]))
    assert verdict["ok"], verdict["failed"]

Needs the ``audit`` extra (``pip install 'cpgbroker[audit]'``: pyspark, matplotlib) and Java.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from cpgbroker.audit.ingest import InputError, InputProblem
    from cpgbroker.audit.job import AuditConfig, run_audit
    from cpgbroker.audit.session import get_session

__all__ = ["AuditConfig", "InputError", "InputProblem", "get_session", "run_audit"]

# Imported on first use, so that `cpgbroker audit --help` and a missing pyspark are handled by
# the command line rather than failing on import.
_WHERE = {
    "AuditConfig": "job",
    "run_audit": "job",
    "InputError": "ingest",
    "InputProblem": "ingest",
    "get_session": "session",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        return getattr(importlib.import_module(f"cpgbroker.audit.{_WHERE[name]}"), name)
    raise AttributeError(f"module 'cpgbroker.audit' has no attribute {name!r}")
