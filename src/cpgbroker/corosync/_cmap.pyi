# Type stub for the cffi-compiled module built from cffi_build/; its objects are dynamic.
from typing import Any

ffi: Any
lib: Any
