"""Typed wrappers over corosync's libraries (CPG, votequorum): errors, pure event types, handles.

No trio and no model here: :mod:`cpgbroker.runtime` adapts the handles to trio."""
