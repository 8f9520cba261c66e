"""Markdown tables from a suite's JSON result, whatever its layout.

A result is read as: scalars (one line of ``name: value``), tables (a list of dicts, or a dict whose
values are all dicts, one row each) and nested dicts (read the same way, their names prefixed).
Inside a row, nested dicts become dotted columns (``public.queued``) and lists of numbers one cell;
floats keep four significant digits.
"""

from __future__ import annotations

__all__ = ["markdown"]


def cell(value) -> str:
    """One table cell: floats to four significant digits, lists joined, ``None`` empty."""
    if value is None:
        return ""
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (list, tuple)):
        return ", ".join(cell(v) for v in value)
    return str(value).replace("|", "\\|").replace("\n", " ")


def is_rows(value) -> bool:
    """A list of dicts, or a dict (of two entries or more) whose values are all dicts."""
    if isinstance(value, list):
        return bool(value) and all(isinstance(v, dict) for v in value)
    return isinstance(value, dict) and len(value) > 1 and all(isinstance(v, dict) for v in value.values())


def flat(row: dict, prefix: str = "") -> dict:
    """``row`` with nested dicts as dotted keys and lists of dicts counted (``[n rows]``)."""
    out = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flat(value, name + "."))
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            out[name] = f"[{len(value)} rows]"
        else:
            out[name] = value
    return out


def table(rows: list[dict]) -> list[str]:
    """A markdown table of ``rows``: one column per key, in the order the keys first appear."""
    rows = [flat(r) for r in rows]
    columns = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in columns) + " |" for r in rows]
    return lines


def markdown(result, title: str = "") -> list[str]:
    """The lines of ``result`` as markdown: its scalars on one line, then each of its tables under
    its name (``title`` prefixes the names of nested parts)."""
    if is_rows(result):
        rows = result if isinstance(result, list) else [{"": k, **v} for k, v in result.items()]
        return ([f"*{title}*", ""] if title else []) + table(rows) + [""]
    if not isinstance(result, dict):
        return [f"{title}: {cell(result)}" if title else cell(result), ""]
    scalars = {k: v for k, v in result.items() if not isinstance(v, (dict, list)) or
               (isinstance(v, list) and not is_rows(v))}
    lines = []
    if scalars:
        lines += [("*" + title + "*: " if title else "") + "; ".join(f"{k}: {cell(v)}" for k, v in scalars.items()), ""]
    for key, value in result.items():
        if key not in scalars:
            lines += markdown(value, f"{title}.{key}" if title else key)
    return lines
