"""A section of ``cpgbroker.toml`` read into its attrs class: each field is a key, written
once, with its default and its validation; cattrs converts the TOML table into the class.

A field's metadata says where its key is, when that is not the obvious place:

* ``key``: its name in the file, when not the field's (``"dir"``); None: not read from the
  file at all (a ``--flag``, a section of its own, a value the broker sets).
* ``section``: the table it is in, for a class whose keys are in several (``[server]`` and
  ``[log]``); without it, in whichever table the class is read from.
* ``scale``: the file gives a whole number of units of that many (``segment_mib``: MiB,
  held in bytes).
* ``verbatim``: the value is taken as the file gives it, not converted to the field's type
  (``[limits]``: hashed into the members' digest as release 0.1.0 took them, an integer
  ``low_watermark_ratio`` as an integer).

A field with an attrs ``converter`` is handed the value from the file as it is (a
``HOST:PORT`` that stands for an array of one); the others are converted to their type, a
boolean only from ``true`` or ``false``. Every error is a :class:`ConfigError` naming the key
as the class's ``KEY`` spells it (``cluster.size``): an unknown key, a missing one, a value of
the wrong type, or one a validator refuses (in its own words). An array of tables
(``[[users]]``) is read entry by entry (:func:`structure_array`); its unknown keys are
said of ``[[users]]``.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any, TypeVar

import attrs
import cattrs
from attrs import AttrsInstance
from cattrs.errors import AttributeValidationNote, ClassValidationError, ForbiddenExtraKeysError
from cattrs.gen import make_dict_structure_fn, override

from cpgbroker.errors import ConfigError

T = TypeVar("T", bound=AttrsInstance)
Validator = Callable[[Any, "attrs.Attribute[Any]", Any], None]


class Invalid(ValueError):
    """A refusal of a value from the file: "must be ...", said of its key."""


def _boolean(value: object, _type: object) -> bool:
    if not isinstance(value, bool):
        raise Invalid("must be true or false")
    return value


def _whole(scale: int) -> Callable[[object, object], int]:
    def structure(value: object, _type: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise Invalid("must be an integer")
        return value * scale

    return structure


def _verbatim(value: object, _type: object) -> object:
    return value


def _override(field: attrs.Attribute[Any], section: str) -> Any:
    if field.metadata.get("section", section) != section or field.metadata.get("key", "") is None:
        return override(omit=True)
    hook: Callable[[object, object], object] | None = None
    if "scale" in field.metadata:
        hook = _whole(field.metadata["scale"])
    elif field.metadata.get("verbatim"):
        hook = _verbatim
    return override(rename=field.metadata.get("key"), struct_hook=hook)


_converter = cattrs.Converter(
    forbid_extra_keys=True, prefer_attrib_converters=True, detailed_validation=True
)
_converter.register_structure_hook(bool, _boolean)


_made: dict[tuple[type[Any], str], Callable[..., Any]] = {}


def _structure_fn(cls: type[Any], section: str) -> Callable[..., Any]:
    """cattrs' function reading ``[section]`` into a ``cls`` (made once)."""
    if (cls, section) not in _made:
        keys: dict[str, Any] = {f.name: _override(f, section) for f in attrs.fields(cls)}
        _made[cls, section] = make_dict_structure_fn(cls, _converter, **keys)
    return _made[cls, section]


def structure(cls: type[T], raw: object, section: str, table: str = "") -> T:
    """The table ``[section]`` of the file as a ``cls`` (its other fields: their defaults);
    ``table``: what errors call it, when not ``[section]`` (an entry of ``[[section]]``)."""
    table = table or f"[{section}]"
    if not isinstance(raw, dict):
        raise ConfigError(f"{table} must be a table")
    try:
        made: T = _structure_fn(cls, section)(raw, cls)
        return made
    except ClassValidationError as group:
        raise ConfigError(_message(group.exceptions[0], group.cl, section, table)) from None


def structure_array(cls: type[T], raw: object, section: str) -> tuple[T, ...]:
    """The array of tables ``[[section]]`` of the file, each entry a ``cls``."""
    if not isinstance(raw, list):
        raise ConfigError(f"{section} must be an array of tables ([[{section}]])")
    return tuple(structure(cls, entry, section, f"[[{section}]]") for entry in raw)


def structure_sections(cls: type[T], data: dict[str, Any], sections: tuple[str, ...]) -> T:
    """A ``cls`` whose keys are in several tables of the file: each field from the table its
    metadata's ``section`` names, the first of ``sections`` by default."""
    parts = {section: structure(cls, data.get(section, {}), section) for section in sections}
    return attrs.evolve(  # type: ignore[misc]  # (T is bound to attrs classes)
        parts[sections[0]],
        **{
            f.name: getattr(parts[f.metadata["section"]], f.name)
            for f in attrs.fields(cls)
            if f.metadata.get("section") in sections[1:]
        },
    )


def _message(e: BaseException, cls: type[Any], section: str, table: str) -> str:
    if isinstance(e, ConfigError):
        return str(e)
    if isinstance(e, ForbiddenExtraKeysError):
        return f"unknown {table} key(s): {', '.join(sorted(e.extra_fields))}"
    notes = getattr(e, "__notes__", ())
    note = next((n for n in notes if isinstance(n, AttributeValidationNote)), None)
    if note is None:
        return f"[{section}]: {e}"
    field = attrs.fields_dict(cls)[note.name]
    if isinstance(e, KeyError):
        return f"[{section}] entry is missing {field.metadata.get('key', field.name)!r}"
    if isinstance(e, Invalid):
        return f"{key(cls, field)} {e}"
    return f"{key(cls, field)} must be {getattr(note.type, '__name__', note.type)} ({e})"


def key(cls: type[Any], field: attrs.Attribute[Any]) -> str:
    """A field's key as its class's ``KEY`` spells it: ``cluster.size``, ``[store] dir``."""
    return str(cls.KEY).format(field.metadata.get("key", field.name))


def check(test: Callable[[Any], bool], why: str) -> Validator:
    """A validator: ``test(value)``, or "KEY " + ``why`` (which may say ``{value!r}``)."""

    def validate(instance: Any, field: attrs.Attribute[Any], value: Any) -> None:
        if not test(value):
            raise ConfigError(f"{key(type(instance), field)} {why.format(value=value)}")

    return validate


def one_of(choices: Collection[str]) -> Validator:
    """A validator: one of ``choices``, said as ``"a" or "b"`` when there are two."""
    if len(choices) == 2:
        said = " or ".join(f'"{c}"' for c in choices)
    else:
        said = f"one of {', '.join(choices)}"
    return check(lambda v: v in choices, f"must be {said}, not {{value!r}}")


def parse_listen(addr: str) -> tuple[str, int]:
    """``HOST:PORT`` or ``[V6]:PORT`` -> (host, port)."""
    addr = addr.strip()
    if addr.startswith("["):
        host, sep, port = addr[1:].partition("]:")
    else:
        host, sep, port = addr.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ConfigError(f"listen address {addr!r} is not HOST:PORT")
    p = int(port)
    if not 0 <= p <= 65535:
        raise ConfigError(f"listen port {p} out of range")
    return host, p


def one_or_many(value: Any) -> Any:
    """A converter: a string stands for an array of one; an array becomes a tuple."""
    if isinstance(value, str):
        return (value,)
    return tuple(value) if isinstance(value, list) else value


def addresses(instance: Any, field: attrs.Attribute[Any], value: Any) -> None:
    """A validator: an array of ``HOST:PORT`` strings, each checked."""
    if not isinstance(value, tuple) or not all(isinstance(a, str) for a in value):
        raise ConfigError(f'{key(type(instance), field)} must be an array of "HOST:PORT" strings')
    for addr in value:
        parse_listen(addr)


def address(_instance: Any, _field: attrs.Attribute[Any], value: str) -> None:
    """A validator: a ``HOST:PORT``, or "" for none."""
    if value:
        parse_listen(value)
