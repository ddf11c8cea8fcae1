"""cffi builder for ``cpgbroker.corosync._cpg``, the compiled part of our libcpg binding.

API mode: the module is compiled against the installed ``<corosync/cpg.h>``, so struct layouts
and enum values come from the real headers. ``setup.py`` runs it through ``cffi_modules`` on
``pip install .`` (or ``-e .``); ``python cffi_build/build_cpg.py`` builds it in place by hand.
Needs gcc and the Debian packages libcpg-dev and libcorosync-common-dev.
"""

from __future__ import annotations

from pathlib import Path

from cffi import FFI

_HERE = Path(__file__).resolve().parent

ffibuilder = FFI()
ffibuilder.cdef((_HERE / "cpg_binding.h").read_text())
ffibuilder.set_source(
    "cpgbroker.corosync._cpg",
    (_HERE / "cpg_binding.c").read_text(),
    # cs_strerror() lives in libcorosync_common, not libcpg.
    libraries=["cpg", "corosync_common"],
    extra_compile_args=["-O2", "-Wall", "-Wno-unused-function"],
)

if __name__ == "__main__":
    ffibuilder.compile(tmpdir=str(_HERE.parent / "src"), verbose=True)
