"""Plain-text output of the ``dsnorm`` tools: the width it fits, wrapped prose and aligned tables.

Every tool's default text fits ``COLUMNS`` characters a line, so that it reads in a terminal
without wrapping; wide forms (``dsnorm sites --wide``, Markdown, JSON) keep every column.
"""

from __future__ import annotations

import textwrap
from typing import Sequence

COLUMNS = 120


def wrap(text: str, subsequent: str = "", width: int = COLUMNS, indent: str = "") -> list:
    """``text`` as lines of at most ``width`` characters, the first indented by ``indent``, the
    others by ``subsequent`` (words longer than a line, such as paths, are not broken)."""
    return textwrap.wrap(text, width=width, initial_indent=indent, subsequent_indent=subsequent,
                         break_long_words=False, break_on_hyphens=False) or [""]


def table(headers: Sequence, rows: Sequence[Sequence], right: Sequence[bool] = (), gap: int = 2) -> list:
    """Lines of an aligned table: a header, a rule, the rows. Column ``i`` is right-aligned where
    ``right[i]`` (numbers), else left-aligned; trailing spaces are dropped."""
    widths = [max([len(str(h))] + [len(str(r[i])) for r in rows]) for i, h in enumerate(headers)]

    def line(cells):
        out = [str(c).rjust(w) if i < len(right) and right[i] else str(c).ljust(w)
               for i, (c, w) in enumerate(zip(cells, widths))]
        return (" " * gap).join(out).rstrip()

    return [line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows]


def split_table(headers: Sequence, rows: Sequence[Sequence], keep: int, right: Sequence[bool] = (),
                width: int = COLUMNS, gap: int = 2) -> list:
    """:func:`table`, split into several tables one below the other when its lines would be wider
    than ``width``: each repeats the first ``keep`` columns and takes as many of the others as fit
    (at least one)."""
    widths = [max([len(str(h))] + [len(str(r[i])) for r in rows]) for i, h in enumerate(headers)]
    right = list(right) + [False] * (len(headers) - len(right))
    groups, current, used = [], [], sum(widths[:keep]) + gap * max(0, keep - 1)
    for i in range(keep, len(headers)):
        if current and used + gap + widths[i] > width:
            groups.append(current)
            current, used = [], sum(widths[:keep]) + gap * max(0, keep - 1)
        current.append(i)
        used += gap + widths[i]
    groups.append(current)
    lines: list = []
    for n, group in enumerate(groups):
        cols = list(range(keep)) + group
        if n:
            lines.append("")
        lines += table([headers[i] for i in cols], [[r[i] for i in cols] for r in rows],
                       [right[i] for i in cols], gap)
    return lines
