"""cffi builder for ``cpgbroker.corosync._cmap``: reads the running corosync's configuration
(``cmap``), so a member can refuse a ring that is not encrypted.

API mode, like ``build_cpg.py``: compiled against the installed ``<corosync/cmap.h>``.
``setup.py`` runs it through ``cffi_modules``; ``python cffi_build/build_cmap.py`` builds it in
place by hand. Needs gcc and the Debian package libcmap-dev.
"""

from __future__ import annotations

from pathlib import Path

from cffi import FFI

_HERE = Path(__file__).resolve().parent

ffibuilder = FFI()
ffibuilder.cdef((_HERE / "cmap_binding.h").read_text())
ffibuilder.set_source(
    "cpgbroker.corosync._cmap",
    (_HERE / "cmap_binding.c").read_text(),
    libraries=["cmap"],
    extra_compile_args=["-O2", "-Wall", "-Wno-unused-function"],
)

if __name__ == "__main__":
    ffibuilder.compile(tmpdir=str(_HERE.parent / "src"), verbose=True)
