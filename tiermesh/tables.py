"""Tables that fit the terminal: wide as columns when every word fits, stacked one block per row when not.

Rich squeezes a table wider than the console by narrowing its widest columns first, below their longest word,
and cuts what no longer fits with an ellipsis, headers included: at 80 columns (a laptop's terminal, and what
rich assumes when stdout is a pipe, as in ``make demo | cat``) the demo's ten-column results table showed
``accu…``, ``bala…``, ``serv…``. A :class:`FitTable` sizes the columns itself: each at least its longest word,
the rest of the width shared out toward each column's longest line, cells wrapped at spaces. Where even the
longest words do not fit side by side it prints each row as a block of ``header: value`` lines instead, so
nothing is cut at any width.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from rich.cells import cell_len
from rich.console import Console, ConsoleOptions, Group, RenderResult
from rich.table import Table
from rich.text import Text

__all__ = ["FitTable"]

_PAD = 2  # a cell's padding, one space each side (rich's default)


class FitTable:
    """A titled table of plain-text cells (``None`` prints as ``-``) that never truncates at any width."""

    def __init__(self, title: str, headers: Sequence[str], rows: Iterable[Sequence[str | None]]) -> None:
        self.title = title
        self.headers = list(headers)
        self.rows = [[c if c is not None else "-" for c in row] for row in rows]
        for row in self.rows:
            if len(row) != len(self.headers):
                raise ValueError(f"a row of {len(row)} cells under {len(self.headers)} headers")

    def widths(self, max_width: int) -> list[int] | None:
        """Each column's text width in a table ``max_width`` wide (borders and padding counted), or ``None``
        where the longest words alone do not fit."""
        columns = [[h, *(row[i] for row in self.rows)] for i, h in enumerate(self.headers)]
        least = [max(cell_len(w) for c in col for w in c.split() or [""]) for col in columns]
        most = [max(cell_len(c) for c in col) for col in columns]
        room = max_width - (len(columns) + 1) - _PAD * len(columns)  # a border beside every column
        if sum(least) > room:
            return None
        widths = list(least)
        spare = room - sum(widths)
        while spare > 0:  # to the column furthest from its longest line, one cell at a time
            short = max(range(len(widths)), key=lambda i: most[i] - widths[i])
            if most[short] <= widths[short]:
                break
            widths[short] += 1
            spare -= 1
        return widths

    def wide(self, widths: Sequence[int]) -> Table:
        table = Table(title=self.title)
        for h, w in zip(self.headers, widths, strict=True):
            table.add_column(h, width=w)
        for row in self.rows:
            table.add_row(*(Text(c) for c in row))
        return table

    def stacked(self) -> Group:
        """One block per row: its first cell as the block's heading, then ``header: value`` per other cell."""
        blocks: list[Text | Table] = [Text(self.title, style="italic")]
        for row in self.rows:
            grid = Table.grid(padding=(0, 1))
            grid.add_column(style="bold")
            grid.add_column(overflow="fold")
            for h, c in zip(self.headers[1:], row[1:], strict=True):
                grid.add_row(Text(f"{h}:"), Text(c))
            blocks += [Text(f"{self.headers[0]} {row[0]}", style="bold"), grid]
        return Group(*blocks)

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        widths = self.widths(options.max_width)
        yield self.wide(widths) if widths is not None else self.stacked()
