"""Strict reading of JSON documents: every failure names the file and the field path.

Profiles, schedules and configs are data, never code: they are read with :mod:`json` only, and each
field is checked for presence and type here, so that a damaged file fails at load time with
``<file>: <field>: <problem>`` instead of deep inside the solver or the runtime.
"""

from __future__ import annotations

import builtins
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TypeAlias

from deft.errors import ContractError

#: A JSON value as deft writes and reads it: what :func:`json.dumps` accepts (a tuple is written as a
#: list) and, as a special case, what :func:`json.loads` returns. The containers are the read-only,
#: covariant ``Sequence``/``Mapping`` so that a ``list[int]`` or a ``dict[str, float]`` is a JSON value
#: as it stands; code that reads one narrows with ``isinstance`` (:class:`Fields` does it field by field).
JsonValue: TypeAlias = "str | int | float | bool | Sequence[JsonValue] | Mapping[str, JsonValue] | None"
#: A JSON object: profiles, schedules and configs on disk, and the free-form ``meta`` they carry.
JsonDict: TypeAlias = "dict[str, JsonValue]"


def read_json(path: str | Path, kind: str) -> JsonDict:
    """Read a JSON object from ``path``; raise :class:`ContractError` naming the file on any failure."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ContractError(str(p), "<file>", f"no such {kind} file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ContractError(str(p), "<file>", f"cannot read {kind} file: {e}") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise ContractError(str(p), "<file>", f"not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    if not isinstance(doc, dict):
        raise ContractError(str(p), "<root>", f"expected a JSON object, got {type(doc).__name__}")
    return doc


def write_json(path: str | Path, doc: Mapping[str, JsonValue]) -> None:
    """Write atomically (temp file + rename) so a crash never leaves a half-written profile."""
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n", encoding="utf-8")
    tmp.replace(p)


class Fields:
    """Typed access to one JSON object, remembering where it came from for error messages."""

    def __init__(self, doc: object, source: str, where: str) -> None:
        if not isinstance(doc, dict):
            raise ContractError(source, where or "<root>", f"expected an object, got {type(doc).__name__}")
        self.doc: JsonDict = doc
        self.source = source
        self.where = where

    def _path(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def _get(self, key: builtins.str, default: JsonValue, required: builtins.bool) -> JsonValue:
        if key not in self.doc:
            if required:
                raise ContractError(self.source, self._path(key), "missing")
            return default
        return self.doc[key]

    def error(self, key: str, problem: str) -> ContractError:
        return ContractError(self.source, self._path(key), problem)

    def int(self, key: str, default: int | None = None, *, minimum: int | None = None) -> int:
        v = self._get(key, default, default is None)
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.error(key, f"expected an integer, got {v!r}")
        if minimum is not None and v < minimum:
            raise self.error(key, f"expected an integer >= {minimum}, got {v}")
        return v

    def float(self, key: str, default: float | None = None, *, minimum: float | None = 0.0) -> float:
        v = self._get(key, default, default is None)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise self.error(key, f"expected a finite number, got {v!r}")
        if minimum is not None and v < minimum:
            raise self.error(key, f"expected a number >= {minimum}, got {v}")
        return float(v)

    def bool(self, key: str, default: bool | None = None) -> bool:
        v = self._get(key, default, default is None)
        if not isinstance(v, bool):
            raise self.error(key, f"expected true or false, got {v!r}")
        return v

    def str(self, key: builtins.str, default: builtins.str | None = None, *,
            choices: tuple[builtins.str, ...] | None = None) -> builtins.str:
        v = self._get(key, default, default is None)
        if not isinstance(v, str):
            raise self.error(key, f"expected a string, got {v!r}")
        if choices is not None and v not in choices:
            raise self.error(key, f"expected one of {', '.join(choices)}, got {v!r}")
        return v

    def opt_str(self, key: builtins.str) -> builtins.str | None:
        v = self.doc.get(key)
        if v is not None and not isinstance(v, str):
            raise self.error(key, f"expected a string or null, got {v!r}")
        return v

    def list(self, key: builtins.str, default: builtins.list[JsonValue] | None = None) -> builtins.list[JsonValue]:
        v = self._get(key, default, default is None)
        if not isinstance(v, list):
            raise self.error(key, f"expected a list, got {type(v).__name__}")
        return v

    def dict(self, key: builtins.str, default: JsonDict | None = None) -> JsonDict:
        v = self._get(key, default, default is None)
        if not isinstance(v, dict):
            raise self.error(key, f"expected an object, got {type(v).__name__}")
        return v

    def sub(self, key: builtins.str) -> Fields:
        return Fields(self._get(key, None, True), self.source, self._path(key))

    def items(self, key: builtins.str) -> builtins.list[Fields]:
        return [Fields(x, self.source, f"{self._path(key)}[{i}]") for i, x in enumerate(self.list(key))]
