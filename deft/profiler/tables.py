"""Tidy tables shared by the trace parsers: rows are dataclasses (one fact per row), printed as text.

The parsers (:mod:`deft.profiler.kineto`, :mod:`deft.profiler.nsys`) turn a trace into lists of rows
(kernels, ranges, collectives, per-step bucket times), in the spirit of HolisticTraceAnalysis; this
module only renders and reduces them, so the parsers stay free of presentation code.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, TypeAlias

if TYPE_CHECKING:  # pragma: no cover
    from _typeshed import DataclassInstance

#: A row: a dataclass instance (one field per column) or a mapping of column name to value.
Row: TypeAlias = "DataclassInstance | Mapping[str, object]"


def as_dicts(rows: Iterable[Row]) -> list[dict[str, object]]:
    """Rows (dataclasses or mappings) as plain dicts, in order."""
    out: list[dict[str, object]] = []
    for r in rows:
        if isinstance(r, Mapping):
            out.append(dict(r))
        else:
            out.append({f.name: getattr(r, f.name) for f in dataclasses.fields(r)})
    return out


def _cell(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"
        return f"{v:.6g}"
    if isinstance(v, (tuple, list)):
        return ",".join(_cell(x) for x in v)
    return str(v)


def format_table(rows: Iterable[Row], columns: Sequence[str] | None = None, max_width: int = 60) -> str:
    """A fixed-width text table of ``rows``; ``columns`` selects and orders the fields."""
    rows = list(rows)
    dicts = as_dicts(rows)
    if not dicts:
        return "(no rows)"
    cols = list(columns) if columns is not None else list(dicts[0])
    # a column may also name a property of a dataclass row (e.g. a derived duration)
    cells = [[_cell(d[c] if c in d else getattr(r, c, None))[:max_width] for c in cols]
             for r, d in zip(rows, dicts, strict=True)]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    return "\n".join(lines)


def median(values: Sequence[float]) -> float:
    """Median; the per-bucket reduction over profiler steps (robust to one slow warm-up step)."""
    if not values:
        raise ValueError("median of no values")
    return float(statistics.median(values))
