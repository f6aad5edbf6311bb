"""JSON as plans and profiles are read: checked, never unpickled. Every field of
:class:`autopar.plans.Plan` and of its sections is checked against its type
annotation before a Plan is built from it.

:func:`build` turns parsed JSON into a dataclass, field by field, and raises
PlanFormatError naming the first field whose value is not of its declared type
(``int``, ``float``, ``str``, ``bool``, ``list[...]``, ``dict[str, ...]``, ``X | None``,
``Any`` or a nested dataclass). :func:`strict_loads` parses JSON refusing NaN and
Infinity, which no plan or hardware profile may hold.
"""

from __future__ import annotations

import json
import math
import types
import typing
from dataclasses import MISSING, fields, is_dataclass
from typing import Any, TypeVar

from autopar.errors import PlanFormatError

__all__ = ["build", "strict_loads", "type_name"]

T = TypeVar("T")


def _refuse_constant(name: str) -> float:
    """``json.loads``'s hook for NaN and Infinity: always refused."""
    raise ValueError(f"{name} is not a number a plan or profile may hold")


def strict_loads(text: str | bytes) -> Any:
    """``json.loads`` of ``text`` that refuses NaN, Infinity and -Infinity (Python's json
    module accepts them; no other JSON reader does). Raises ``ValueError`` (a
    ``json.JSONDecodeError`` for bad syntax, a ``UnicodeDecodeError`` for bytes that are
    not UTF-8 text, such as a pickle)."""
    return json.loads(text, parse_constant=_refuse_constant)


def type_name(tp: Any) -> str:
    """A reader's name of type annotation ``tp``: "an integer", "a list of strings", ..."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return "any JSON value"
    if origin in (typing.Union, types.UnionType):
        named = [type_name(a) for a in args if a is not type(None)]
        return " or ".join(named) + (" or null" if type(None) in args else "")
    if origin is list:
        return f"a list of {_plural(args[0])}"
    if origin is dict:
        return f"an object of {_plural(args[1])}"
    if is_dataclass(tp):
        return f"an object with the fields of {tp.__name__}"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        tp, getattr(tp, "__name__", str(tp)))


def _plural(tp: Any) -> str:
    """``type_name`` of the elements of a list or object, in the plural."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list:
        return f"lists of {_plural(args[0])}"
    if origin is dict:
        return f"objects of {_plural(args[1])}"
    if is_dataclass(tp):
        return f"{tp.__name__} objects"
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_plural(a) if a is not type(None) else "nulls" for a in args)
    return {int: "integers", float: "numbers", str: "strings", bool: "booleans",
            Any: "JSON values"}.get(tp, str(tp))


def build(cls: type[T], data: Any, where: str = "") -> T:
    """An instance of dataclass ``cls`` from parsed JSON ``data``, each field checked
    against its annotation. Fields with defaults may be left out; unknown ones are
    refused. ``where`` names ``data`` in messages (``"pipeline"``, ``'modules["x"]'``).

    Raises:
        PlanFormatError: ``data`` is not an object, lacks a required field, has an
            unknown field, or a field's value is not of its type.
    """
    label = f"the plan's {where}" if where else "the plan"
    if not isinstance(data, dict):
        raise PlanFormatError(f"{label} must be {type_name(cls)}, got {_shown(data)}; "
                              "re-run `autopar plan` to write a valid plan")
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls)}
    missing = [n for n, f in known.items()
               if f.default is MISSING and f.default_factory is MISSING and n not in data]
    if missing:
        raise PlanFormatError(f"{label} is missing the field(s) {', '.join(missing)}; "
                              "re-run `autopar plan` to write a complete plan")
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise PlanFormatError(f"{label} has unknown field(s) {', '.join(unknown)} (this "
                              f"autopar's {cls.__name__} has {', '.join(known)}); remove "
                              "them, or re-run `autopar plan`")
    values = {name: _value(hints[name], value, f"{where}.{name}" if where else name)
              for name, value in data.items()}
    return cls(**values)


def _value(tp: Any, v: Any, where: str) -> Any:
    """``v`` checked against annotation ``tp`` (nested dataclasses built)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return v
    if origin in (typing.Union, types.UnionType):
        if v is None and type(None) in args:
            return None
        for a in args:
            if a is not type(None) and _fits(a, v):
                return _value(a, v, where)
        return _wrong(tp, v, where)
    if is_dataclass(tp):
        return build(tp, v, where)
    if origin is list:
        if not isinstance(v, list):
            return _wrong(tp, v, where)
        return [_value(args[0], x, f"{where}[{k}]") for k, x in enumerate(v)]
    if origin is dict:
        if not isinstance(v, dict):
            return _wrong(tp, v, where)
        return {k: _value(args[1], x, f"{where}[{json.dumps(k)}]") for k, x in v.items()}
    if not _fits(tp, v):
        return _wrong(tp, v, where)
    return float(v) if tp is float else v


def _fits(tp: Any, v: Any) -> bool:
    """Whether ``v`` has the outer JSON type of ``tp`` (the first check of :func:`_value`)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return True
    if is_dataclass(tp) or origin is dict:
        return isinstance(v, dict)
    if origin is list:
        return isinstance(v, list)
    if tp is bool:
        return isinstance(v, bool)
    if tp is int:
        return isinstance(v, int) and not isinstance(v, bool)
    if tp is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    return isinstance(v, tp) if isinstance(tp, type) else False


def _wrong(tp: Any, v: Any, where: str) -> Any:
    raise PlanFormatError(f"the plan's field '{where}' must be {type_name(tp)}, got "
                          f"{_shown(v)}; fix it or re-run `autopar plan` to write a valid plan")


def _shown(v: Any) -> str:
    """``v`` for a message: its JSON text, cut at 60 characters."""
    try:
        text = json.dumps(v)
    except (TypeError, ValueError):
        text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."
