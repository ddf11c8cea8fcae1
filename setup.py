"""Build hook for the compiled corosync bindings (libcpg and libvotequorum); all package
metadata is in pyproject.toml."""

from setuptools import setup

setup(
    cffi_modules=[
        "cffi_build/build_cpg.py:ffibuilder",
        "cffi_build/build_quorum.py:ffibuilder",
    ]
)
