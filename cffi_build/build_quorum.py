"""cffi builder for ``cpgbroker.corosync._quorum``, the compiled part of our libvotequorum binding.

API mode, like ``build_cpg.py``: compiled against the installed ``<corosync/votequorum.h>``.
``setup.py`` runs it through ``cffi_modules``; ``python cffi_build/build_quorum.py`` builds it
in place by hand. Needs gcc and the Debian package libvotequorum-dev.
"""

from __future__ import annotations

from pathlib import Path

from cffi import FFI

_HERE = Path(__file__).resolve().parent

ffibuilder = FFI()
ffibuilder.cdef((_HERE / "quorum_binding.h").read_text())
ffibuilder.set_source(
    "cpgbroker.corosync._quorum",
    (_HERE / "quorum_binding.c").read_text(),
    libraries=["votequorum"],
    extra_compile_args=["-O2", "-Wall", "-Wno-unused-function"],
)

if __name__ == "__main__":
    ffibuilder.compile(tmpdir=str(_HERE.parent / "src"), verbose=True)
