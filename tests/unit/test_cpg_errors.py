"""Every cs_error_t maps to its own exception class, with corosync's text in the message."""

from __future__ import annotations

import pytest

from cpgbroker import errors
from cpgbroker.corosync._cpg import lib
from cpgbroker.corosync.cpg import CPG_MAX_NAME_LENGTH, group_name
from cpgbroker.corosync.errors import (
    CpgBadHandle,
    CpgConnectionLost,
    CpgFatalError,
    CpgInvalidParam,
    CpgLibraryError,
    CpgNameTooLong,
    CpgTryAgain,
    CpgUnknownError,
    CsError,
    error_class,
    make_error,
    strerror,
)

CODES = {
    name: getattr(lib, name)
    for name in dir(lib)
    if name.startswith("CS_ERR_") and isinstance(getattr(lib, name), int)
}


def test_all_corosync_error_codes_are_known() -> None:
    # corotypes.h of corosync 3.1 has 29 error values besides CS_OK.
    assert len(CODES) == 29
    assert lib.CS_OK == 1 and lib.CS_ERR_TRY_AGAIN == 6 and lib.CS_ERR_LIBRARY == 2


@pytest.mark.parametrize("name", sorted(CODES))
def test_each_code_has_its_own_class_under_one_root(name: str) -> None:
    code = CODES[name]
    cls = error_class(code)
    assert cls.code == code
    assert issubclass(cls, CsError) and issubclass(cls, errors.CpgError)
    assert issubclass(cls, errors.CpgBrokerError)
    others = {error_class(c) for n, c in CODES.items() if n != name}
    assert cls not in others
    err = make_error(code, "cpg_join")
    assert type(err) is cls
    assert err.cs_code == code
    # cs_strerror's text and the failing call are in the message.
    assert name in str(err) and "cpg_join" in str(err)
    assert err.strerror == strerror(code) == name


def test_try_again_is_transient_everything_else_is_fatal() -> None:
    assert not issubclass(CpgTryAgain, CpgFatalError)
    fatal = [error_class(c) for n, c in CODES.items() if n != "CS_ERR_TRY_AGAIN"]
    assert all(issubclass(cls, CpgFatalError) for cls in fatal)


def test_dead_handle_errors_say_so() -> None:
    assert CpgLibraryError.handle_dead and CpgBadHandle.handle_dead
    assert issubclass(CpgConnectionLost, CpgLibraryError)
    assert CpgConnectionLost("cpg_dispatch").cs_code == lib.CS_ERR_LIBRARY
    assert "lost the connection" in str(CpgConnectionLost("cpg_dispatch"))
    assert not CpgTryAgain.handle_dead


def test_unknown_code_still_raises_a_cpg_error() -> None:
    err = make_error(77, "cpg_dispatch")
    assert isinstance(err, CpgUnknownError) and isinstance(err, CpgFatalError)
    assert err.cs_code == 77 and "(77)" in str(err)


def test_detail_overrides_the_generic_hint() -> None:
    err = make_error(lib.CS_ERR_LIBRARY, "cpg_model_initialize", "corosync is not running in n1")
    assert str(err) == ("cpg_model_initialize: CS_ERR_LIBRARY (2): corosync is not running in n1")


def test_group_names_are_checked_before_reaching_corosync() -> None:
    assert group_name("queue-ops") == b"queue-ops"
    assert group_name(b"x" * CPG_MAX_NAME_LENGTH) == b"x" * 128
    with pytest.raises(CpgNameTooLong, match="129 bytes, CPG allows at most 128"):
        group_name(b"x" * 129)
    with pytest.raises(CpgNameTooLong):
        group_name("é" * 65)  # 130 bytes in UTF-8
    with pytest.raises(CpgInvalidParam):
        group_name(b"")
