"""What every bench section hands back, and the CSV writer behind the tables."""

from __future__ import annotations

import csv
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path


class NotMeasured(Exception):
    """A section cannot run here (a part missing, a command failing); the
    message is the reason printed in the report."""


def require_rows(rows: list[dict], errors: list[str], what: str) -> None:
    """NotMeasured when a section measured no row at all: the reason is
    `what` and every point's failure (each point fails on its own, into
    `errors`, so that one failing does not hide the others)."""
    if not rows:
        raise NotMeasured(f"{what}: " + "; ".join(errors))


@dataclass
class Table:
    """Rows behind one table of the report; written to `<name>.csv`."""

    name: str
    title: str
    rows: list[dict]
    columns: list[str] | None = None  # default: keys of the first row
    show: bool = True  # False: CSV only (raw per-run rows), the report links it

    def cols(self) -> list[str]:
        if self.columns:
            return self.columns
        seen: list[str] = []
        for r in self.rows:
            for k in r:
                if k not in seen:
                    seen.append(k)
        return seen


@dataclass
class Headline:
    """One figure of the summary table (ratios measured in one run on one box)."""

    figure: str
    value: float | str | None
    goal: str = ""
    source: str = ""


@dataclass
class Section:
    key: str
    title: str
    status: str = "ok"  # "ok" | "not measured"
    reason: str = ""
    intro: list[str] = field(default_factory=list)
    tables: list[Table] = field(default_factory=list)
    plots: list[tuple[str, str]] = field(default_factory=list)  # (png file name, caption)
    notes: list[str] = field(default_factory=list)
    headlines: list[Headline] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def add_table_if_rows(self, name: str, title: str, rows: list[dict]) -> None:
        """Table `name` of `rows` when there are any: a part of the section
        that measured nothing shows no empty table (its failures are in the
        notes)."""
        if rows:
            self.tables.append(Table(name, title, rows))

    def note_unmeasured(self, errors: list[str]) -> None:
        """One note naming the points that could not be measured, if any."""
        if errors:
            self.notes.append("not measured: " + "; ".join(errors))


def write_csv(table: Table, out: Path) -> Path:
    """`table` as out/<name>.csv."""
    return write_rows(table.rows, out / f"{table.name}.csv", table.cols())


def write_rows(rows: list[dict], path: Path, cols: list[str] | None = None) -> Path:
    """Rows as a CSV file (columns: `cols`, default the first row's keys)."""
    cols = cols or list(rows[0])
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=cols, extrasaction="ignore")
        w.writeheader()
        for r in rows:
            w.writerow({k: ("" if r.get(k) is None else r.get(k)) for k in cols})
    return path


def mean(values: list[float]) -> float:
    vals = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.fmean(vals) if vals else math.nan


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0 or any(isinstance(x, float) and math.isnan(x) for x in (a, b)):
        return None
    return a / b


def fmt(v, digits: int = 3) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if math.isnan(v):
            return "–"
        if abs(v) >= 1000:
            return f"{v:,.0f}"
        if v != int(v) and abs(v - round(v)) < 0.05 and abs(v) < 100:  # 0.9998 must not print as 1.0
            return f"{v:.4g}"
        return f"{v:.{digits}g}" if abs(v) < 1 else f"{v:.{max(1, digits - 2)}f}"
    return str(v)
