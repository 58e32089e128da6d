"""Strict reading of JSON documents: every failure names the file and the field path.

Profiles, schedules and configs are data, never code: they are read with :mod:`json` only, and each
field is checked for presence and type here, so that a damaged file fails at load time with
``<file>: <field>: <problem>`` instead of deep inside the solver or the runtime.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from deft.errors import ContractError


def read_json(path: str | Path, kind: str) -> dict[str, Any]:
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


def write_json(path: str | Path, doc: dict[str, Any]) -> None:
    """Write atomically (temp file + rename) so a crash never leaves a half-written profile."""
    p = Path(path)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=False) + "\n", encoding="utf-8")
    tmp.replace(p)


class Fields:
    """Typed access to one JSON object, remembering where it came from for error messages."""

    def __init__(self, doc: Any, source: str, where: str) -> None:
        if not isinstance(doc, dict):
            raise ContractError(source, where or "<root>", f"expected an object, got {type(doc).__name__}")
        self.doc = doc
        self.source = source
        self.where = where

    def _path(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def _get(self, key: str, default: Any, required: bool) -> Any:
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

    def str(self, key: str, default: str | None = None, *, choices: tuple[str, ...] | None = None) -> str:
        v = self._get(key, default, default is None)
        if not isinstance(v, str):
            raise self.error(key, f"expected a string, got {v!r}")
        if choices is not None and v not in choices:
            raise self.error(key, f"expected one of {', '.join(choices)}, got {v!r}")
        return v

    def opt_str(self, key: str) -> str | None:
        v = self.doc.get(key)
        if v is not None and not isinstance(v, str):
            raise self.error(key, f"expected a string or null, got {v!r}")
        return v

    def list(self, key: str, default: list[Any] | None = None) -> list[Any]:
        v = self._get(key, default, default is None)
        if not isinstance(v, list):
            raise self.error(key, f"expected a list, got {type(v).__name__}")
        return v

    def dict(self, key: str, default: dict[str, Any] | None = None) -> dict[str, Any]:
        v = self._get(key, default, default is None)
        if not isinstance(v, dict):
            raise self.error(key, f"expected an object, got {type(v).__name__}")
        return v

    def sub(self, key: str) -> Fields:
        return Fields(self._get(key, None, True), self.source, self._path(key))

    def items(self, key: str) -> list[Fields]:
        return [Fields(x, self.source, f"{self._path(key)}[{i}]") for i, x in enumerate(self.list(key))]
