"""Typed, documented config sections loaded from TOML.

A section is a dataclass whose fields are declared with :func:`knob`, which
carries the field's documentation (shown by ``resilient config --explain``)
and, optionally, the allowed choices. :func:`load_section` turns a TOML table
into such a dataclass and rejects unknown keys and wrong types with a
:class:`~resilient.errors.ConfigError` that names the key, the file and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import tomllib
import typing
from typing import Any, Mapping

from resilient.errors import ConfigError


def knob(default: Any, doc: str, choices: tuple | None = None, coerce: tuple[type, ...] = ()) -> Any:
    """Declare a config field with its documentation and allowed values.

    ``coerce`` lists other types a value may have in TOML; such a value is
    converted to the field's type (``nnodes = 2`` for ``nnodes = "2"``). Only
    the field that opts in is loosened, every other knob keeps its strict type."""
    meta = {"doc": doc}
    if choices is not None:
        meta["choices"] = tuple(choices)
    if coerce:
        meta["coerce"] = tuple(coerce)
    return dataclasses.field(default=default, metadata=meta)


def _type_ok(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin is typing.Union:
        return any(_type_ok(value, a) for a in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is float:
        # TOML writes 1 for 1.0; an int is a fine float, a bool is not.
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin in (list, tuple):
        (inner, *_) = typing.get_args(tp) or (Any,)
        return isinstance(value, (list, tuple)) and all(
            inner is Any or _type_ok(v, inner) for v in value
        )
    if origin is dict or tp is dict:
        return isinstance(value, dict)
    if tp is Any:
        return True
    return isinstance(value, tp)


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def load_section(cls: type, table: Mapping[str, Any], where: str, source: str) -> Any:
    """Build dataclass ``cls`` from ``table``; ``where`` is the section path
    (``"train"``) and ``source`` the file it came from, both for messages."""
    if not isinstance(table, Mapping):
        raise ConfigError(
            f"{source}: [{where}] must be a table of keys, got {type(table).__name__}"
        )
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in table.items():
        name = f"{where}.{key}" if where else key
        if key not in fields or fields[key].metadata.get("internal"):
            close = difflib.get_close_matches(key, list(fields), n=1)
            prefix = f"{where}." if where else ""
            hint = f"; did you mean '{prefix}{close[0]}'?" if close else ""
            known = ", ".join(sorted(k for k, f in fields.items() if not f.metadata.get("internal")))
            raise ConfigError(
                f"{source}: unknown key '{name}'{hint} (known keys{f' of [{where}]' if where else ''}: {known})"
            )
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = load_section(tp, value, name, source)
            continue
        # type(), not isinstance: True must not pass as the int 1.
        if type(value) in fields[key].metadata.get("coerce", ()):
            value = tp(value)
        if not _type_ok(value, tp):
            raise ConfigError(
                f"{source}: '{name}' must be {_type_name(tp)}, got "
                f"{value!r} ({type(value).__name__}); {fields[key].metadata.get('doc', '')}"
            )
        if tp is float:
            value = float(value)
            if not math.isfinite(value):  # TOML has inf and nan; no knob means either
                raise ConfigError(f"{source}: '{name}' must be a finite number, got {value}")
        choices = fields[key].metadata.get("choices")
        if choices is not None and value not in choices:
            raise ConfigError(
                f"{source}: '{name}' = {value!r} is not one of "
                f"{', '.join(map(repr, choices))}"
            )
        kwargs[key] = value
    return cls(**kwargs)


_BOUNDS = {"at_least": ("≥", lambda v, b: v >= b), "above": (">", lambda v, b: v > b),
           "at_most": ("≤", lambda v, b: v <= b), "below": ("<", lambda v, b: v < b)}


def check_bounds(obj: Any, where: str, **bounds: Mapping[str, float]) -> None:
    """Refuse a section's numbers outside their range, with the knob's documentation (what it
    means, so what to give): ``check_bounds(cfg, "snapshot", at_least={"every": 0}, above=...)``.

    Why each section says its ranges: a negative interval or count was accepted and silently
    turned a tier off (``--set snapshot.every=-3``); the error must come while the config is
    read, before anything imports torch. Non-numbers ("auto") are the section's own to check;
    the comparisons are NaN-safe (``not v >= b``)."""
    docs = {f.name: f.metadata.get("doc", "") for f in dataclasses.fields(obj)}
    for kind, table in bounds.items():
        sign, ok = _BOUNDS[kind]
        for key, bound in table.items():
            value = getattr(obj, key)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if not ok(value, bound):
                raise ConfigError(f"'{where}.{key}' must be {sign} {bound}, got {value!r} ({docs.get(key, '')})")


def section_to_dict(obj: Any) -> dict:
    """A section (and nested sections) as plain TOML-able data."""
    return dataclasses.asdict(obj)


def explain(cls: type, prefix: str = "") -> list[str]:
    """One line per knob: ``section.key = default  # doc``."""
    lines = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("internal"):
            continue
        name = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(hints[f.name]):
            lines.extend(explain(hints[f.name], prefix=f"{name}."))
            continue
        default = f.default if f.default is not dataclasses.MISSING else "(required)"
        choices = f.metadata.get("choices")
        extra = f" [one of {', '.join(map(repr, choices))}]" if choices else ""
        lines.append(f"{name} = {default!r}  # {f.metadata.get('doc', '')}{extra}")
    return lines


def read_toml(path: str | os.PathLike, what: str) -> dict:
    """The table in TOML file ``path``; a :class:`ConfigError` naming ``what`` (e.g. "config
    file") for a directory, non-UTF-8 or invalid TOML, or an unreadable file.
    FileNotFoundError propagates: callers know where to look for the right file."""
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        from resilient.shipped import shipped_config  # `configs/NAME.toml` outside a checkout: the wheel's copy

        if (shipped := shipped_config(path)) is None:
            raise
        return read_toml(shipped, what)
    except IsADirectoryError:
        raise ConfigError(f"{what} {path} is a directory; pass a TOML file") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what} {path} is not UTF-8 text ({e.reason} at byte {e.start}); "
                          "it must be a UTF-8 TOML file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{what} {path} is not valid TOML: {e}") from None
    except OSError as e:
        raise ConfigError(f"cannot read {what} {path}: {e.strerror or e}; check the path and its permissions") from None
