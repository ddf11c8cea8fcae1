"""Build hook for the compiled libcpg binding; all package metadata is in pyproject.toml."""

from setuptools import setup

setup(cffi_modules=["cffi_build/build_cpg.py:ffibuilder"])
