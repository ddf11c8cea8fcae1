"""Build hook for the compiled corosync bindings (libcpg, libvotequorum and libcmap); all package
metadata is in pyproject.toml."""

from setuptools import setup

setup(
    cffi_modules=[
        "cffi_build/build_cpg.py:ffibuilder",
        "cffi_build/build_quorum.py:ffibuilder",
        "cffi_build/build_cmap.py:ffibuilder",
    ]
)
