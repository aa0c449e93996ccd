"""The full-fidelity CSV download of a run's metrics."""

from __future__ import annotations

import csv
import io
from collections.abc import Iterator

from sqlalchemy import text
from sqlalchemy.engine import Connection

from .queries import run_row


def csv_cell(value: str) -> str:
    """A text cell a spreadsheet will not run: `=`, `+`, `-`, `@` (and tab/CR) get a `'`."""
    return "'" + value if value[:1] in ("=", "+", "-", "@", "\t", "\r") else value


def csv_rows(conn: Connection, run_id: str, names: list[str] | None) -> Iterator[str]:
    """Full-fidelity wide CSV: one row per step, one column per metric; repr() of floats.

    Written by the csv module (a name with a comma or a quote stays one column); metric
    names are text from the trainer, so they are defused against formula injection.
    """
    row = run_row(conn, run_id)
    all_names = [
        r[0]
        for r in conn.execute(
            text("SELECT name FROM latest WHERE run_pk=:pk ORDER BY name"), {"pk": row.pk}
        )
    ]
    cols = [n for n in all_names if not names or n in names]
    buf = io.StringIO()
    out = csv.writer(buf, lineterminator="\n")

    def line(cells: list[str]) -> str:
        buf.seek(0)
        buf.truncate()
        out.writerow(cells)
        return buf.getvalue()

    yield line(["step", *(csv_cell(c) for c in cols)])
    col_of = {n: i for i, n in enumerate(cols)}
    cur_step, cur = None, [""] * len(cols)
    res = conn.exec_driver_sql(
        "SELECT step, name, value FROM metrics WHERE run_pk=? ORDER BY step", (row.pk,)
    )
    for step, name, value in res:
        if name not in col_of:
            continue
        if step != cur_step:
            if cur_step is not None:
                yield line([str(cur_step), *cur])
            cur_step, cur = step, [""] * len(cols)
        cur[col_of[name]] = "nan" if value is None else repr(float(value))
    if cur_step is not None:
        yield line([str(cur_step), *cur])
