"""``-f plain``: the blocks of ``blocks.py`` as plain text, without importing Rich (a pre-commit hook's output is a
pipe, and Rich's import alone costs a third of a small scan).

The characters are the ones ``text.py`` gets from a colourless Rich console: this module mirrors Rich's (15.0)
layout of a borderless ``box.SIMPLE_HEAD`` table with ``pad_edge=False`` (``Table._calculate_column_widths``,
``_collapse_widths``, ``_ratio.ratio_reduce``, ``Measurement``, ``Padding``), and its wrapping of text
(``Text.wrap``, ``_wrap.divide_line``, ``cells.chop_cells``, ``Text.truncate``, ``Text.expand_tabs``).
``tests/test_render.py`` holds the two drawers equal, against whichever Rich is installed. Widths are terminal
cells: East Asian wide characters take two, combining and control characters none (Rich's own table differs
from ``unicodedata`` only in rare code points).
"""

from __future__ import annotations

import re
from itertools import pairwise

from ..inventory import Report
from .blocks import Block, Column, Grid, report_blocks

_WORD = re.compile(r"\s*\S+\s*")
_TRAILING_SPACE = re.compile(r"\s+$")
_CONTROL = {c: None for c in (7, 8, 11, 12, 13)}  # what rich.text.Text removes from its text


def render(report: Report, *, width: int = 120, verbose: bool = False, quiet: bool = False) -> str:
    return draw(report_blocks(report, width=width, verbose=verbose, quiet=quiet), width)


def draw(blocks: list[Block], width: int) -> str:
    """The blocks as lines of at most ``width`` cells, without trailing blanks (logs, diffs, golden files)."""
    out: list[str] = []
    for block in blocks:
        if isinstance(block, Grid):
            out += _grid(block, width)
        else:
            out += _wrap(_clean("".join(s.text for s in block.spans)), width)
    # a table whose columns cannot all shrink enough is cut at the page's edge, as Console.print crops it
    return "".join((_set_cell_size(s, width) if cell_len(s) > width else s).rstrip() + "\n" for s in out)


# -- cells --------------------------------------------------------------------------------------------------------


def _clean(text: str) -> str:
    return text.translate(_CONTROL)


def _char_width(ch: str) -> int:
    import unicodedata

    code = ord(ch)
    if code < 32 or 0x7F <= code < 0xA0 or unicodedata.combining(ch) or unicodedata.category(ch) in ("Mn", "Me", "Cf"):
        return 0
    return 2 if unicodedata.east_asian_width(ch) in ("W", "F") else 1


def cell_len(text: str) -> int:
    if text.isascii() and text.isprintable():
        return len(text)
    return sum(_char_width(ch) for ch in text)


def _set_cell_size(text: str, total: int) -> str:
    """``text`` cropped or padded with blanks to ``total`` cells (a wide character cut in two becomes a blank)."""
    size = cell_len(text)
    if size <= total:
        return text + " " * (total - size)
    out, used = [], 0
    for ch in text:
        w = _char_width(ch)
        if used + w > total:
            break
        out.append(ch)
        used += w
    return "".join(out) + " " * (total - used)


def _chop(word: str, width: int) -> list[str]:
    """``word`` in pieces of at most ``width`` cells (rich.cells.chop_cells)."""
    pieces, piece, used = [], "", 0
    for ch in word:
        w = _char_width(ch)
        if piece and used + w > width:
            pieces.append(piece)
            piece, used = "", 0
        piece += ch
        used += w
    if piece:
        pieces.append(piece)
    return pieces


def _break_offsets(text: str, width: int, fold: bool) -> list[int]:
    """Where a line of ``text`` breaks to fit ``width``: between words, a word keeping its trailing blanks; a word
    wider than the width folded (or left whole, to be cut, when not ``fold``). As rich._wrap.divide_line."""
    breaks: list[int] = []
    offset = 0
    for match in _WORD.finditer(text):
        start, word = match.start(), match.group(0)
        length = cell_len(word.rstrip())
        if width - offset >= length:
            offset += cell_len(word)
        elif length > width:
            if fold:
                pieces = _chop(word, width)
                for i, piece in enumerate(pieces):
                    if start:
                        breaks.append(start)
                    if i == len(pieces) - 1:
                        offset = cell_len(piece)
                    else:
                        start += len(piece)
            else:
                if start:
                    breaks.append(start)
                offset = cell_len(word)
        elif offset and start:
            breaks.append(start)
            offset = cell_len(word)
    return breaks


def _truncate(text: str, width: int, overflow: str, pad: bool = False) -> str:
    length = cell_len(text)
    if length > width:
        text = _set_cell_size(text, width - 1) + "…" if overflow == "ellipsis" else _set_cell_size(text, width)
    elif pad and length < width:
        text += " " * (width - length)
    return text


def _expand_tabs(text: str, size: int = 8) -> str:
    """Each tab a blank, then blanks to the next multiple of ``size`` cells (rich.text.Text.expand_tabs)."""
    out, position = [], 0
    for part in re.split(r"(?<=\t)", text):
        if part.endswith("\t"):
            part = part[:-1] + " "
            position += cell_len(part)
            if position % size:
                part += " " * (size - position % size)
                position += size - position % size
        else:
            position += cell_len(part)
        out.append(part)
    return "".join(out)


def _rstrip_end(text: str, width: int) -> str:
    """Trailing blanks beyond ``width`` characters dropped (rich.text.Text.rstrip_end)."""
    if len(text) > width and (blanks := _TRAILING_SPACE.search(text)):
        return text[: len(text) - min(len(blanks.group(0)), len(text) - width)]
    return text


def _wrap(text: str, width: int, *, justify: str = "default", overflow: str = "fold", no_wrap: bool = False) -> list[str]:
    """``text`` in lines that fit ``width`` cells, justified (padded) as asked (rich.text.Text.wrap)."""
    lines: list[str] = []
    for paragraph in text.split("\n"):
        if "\t" in paragraph:
            paragraph = _expand_tabs(paragraph)
        if no_wrap:
            pieces = [paragraph]
        else:
            cuts = [0, *_break_offsets(paragraph, width, fold=overflow == "fold"), len(paragraph)]
            pieces = [_rstrip_end(paragraph[a:b], width) for a, b in pairwise(cuts)]
        for piece in pieces:
            if justify == "left":
                piece = _truncate(piece, width, overflow, pad=True)
            elif justify == "right":
                piece = _truncate(piece.rstrip(), width, overflow)
                piece = " " * (width - cell_len(piece)) + piece
            lines.append(_truncate(piece, width, overflow))
    return lines


# -- tables -------------------------------------------------------------------------------------------------------


def _paddings(n: int) -> list[tuple[int, int]]:
    """Each column's (left, right) padding: one blank each side, none at the table's outer edges (pad_edge=False)."""
    return [(0 if i == 0 else 1, 0 if i == n - 1 else 1) for i in range(n)]


def _text_measure(text: str) -> tuple[int, int]:
    """(longest word, longest line) in cells: rich.text.Text.__rich_measure__."""
    lines = text.splitlines()
    longest_line = max((cell_len(s) for s in lines), default=0)
    words = text.split()
    return (max(cell_len(w) for w in words) if words else longest_line), longest_line


def _measure_column(column: Column, cells: list[str], pad: int, limit: int) -> tuple[int, int]:
    """A column's (minimum, maximum) width with its padding, within ``limit`` cells (Table._measure_column)."""
    if limit < 1:
        return 0, 0
    if column.width is not None:
        w = min(column.width + pad, limit)
        return w, w
    lows, highs = [], []
    for text in cells:
        if limit - pad < 1:  # rich.padding.Padding.__rich_measure__
            lows.append(limit)
            highs.append(limit)
            continue
        low, high = _text_measure(text)
        low, high = min(max(0, low), high), max(0, low, high)  # Measurement.normalize
        low, high = min(low, limit), min(high, limit)  # Measurement.get(text) within the same limit
        if high < 1:
            low = high = 0
        lows.append(min(low + pad, limit))
        highs.append(min(high + pad, limit))
    low, high = min(max(lows, default=1), limit), min(max(highs, default=limit), limit)
    if column.max_width is not None:
        low, high = min(low, column.max_width + pad), min(high, column.max_width + pad)
    return low, high


def _ratio_reduce(total: int, ratios: list[int], maximums: list[int], values: list[int]) -> list[int]:
    ratios = [r if m else 0 for r, m in zip(ratios, maximums, strict=True)]
    total_ratio = sum(ratios)
    if not total_ratio:
        return values[:]
    out = []
    for ratio, maximum, value in zip(ratios, maximums, values, strict=True):
        if ratio and total_ratio > 0:
            cut = min(maximum, round(ratio * total / total_ratio))
            out.append(value - cut)
            total -= cut
            total_ratio -= ratio
        else:
            out.append(value)
    return out


def _collapse(widths: list[int], wrapable: list[bool], max_width: int) -> list[int]:
    """Narrow the widest wrapable columns, step by step, until the table fits (Table._collapse_widths)."""
    total = sum(widths)
    excess = total - max_width
    if any(wrapable):
        while total and excess > 0:
            widest = max(w for w, ok in zip(widths, wrapable, strict=True) if ok)
            second = max(w if ok and w != widest else 0 for w, ok in zip(widths, wrapable, strict=True))
            ratios = [1 if (w == widest and ok) else 0 for w, ok in zip(widths, wrapable, strict=True)]
            if not any(ratios) or widest == second:
                break
            widths = _ratio_reduce(excess, ratios, [min(excess, widest - second)] * len(widths), widths)
            total = sum(widths)
            excess = total - max_width
    return widths


def _column_widths(grid: Grid, cells: list[list[str]], page_width: int) -> list[int]:
    pads = [left + right for left, right in _paddings(len(grid.columns))]
    max_width = page_width - (len(grid.columns) - 1)  # one divider between two columns
    widths = [_measure_column(c, cells[i], pads[i], max_width)[1] or 1 for i, c in enumerate(grid.columns)]
    if sum(widths) > max_width:
        widths = _collapse(widths, [c.width is None and not c.no_wrap for c in grid.columns], max_width)
        if sum(widths) > max_width:
            widths = _ratio_reduce(sum(widths) - max_width, [1] * len(widths), widths, widths)
        widths = [_measure_column(c, cells[i], pads[i], w)[1] for i, (c, w) in enumerate(zip(grid.columns, widths, strict=True))]
    return widths


def _grid(grid: Grid, page_width: int) -> list[str]:
    columns = grid.columns
    # each column's cells, the header first
    cells = [[_clean(c.header), *(_clean(row[i].text) for row in grid.rows)] for i, c in enumerate(columns)]
    widths = _column_widths(grid, cells, page_width)
    table_width = sum(widths) + len(columns) - 1
    out = _wrap(_clean(grid.title), table_width, justify="left") if grid.title else []
    paddings = _paddings(len(columns))
    for r in range(len(grid.rows) + 1):
        rendered: list[list[str]] = []
        for column, width, (left, right), column_cells in zip(columns, widths, paddings, cells, strict=True):
            inner = width - left - right
            if inner < 1:  # rich.console.Console.render draws nothing narrower than a cell
                rendered.append([])
                continue
            lines = _wrap(column_cells[r], inner, justify=column.justify, overflow=column.overflow, no_wrap=column.no_wrap)
            rendered.append([" " * left + _set_cell_size(s, inner) + " " * right for s in lines])
        height = max(1, *(len(lines) for lines in rendered))
        if r == 0:  # headers sit on the header row's last line, cells on a row's first
            rendered = [[" " * w] * (height - len(lines)) + lines for lines, w in zip(rendered, widths, strict=True)]
        for k in range(height):
            out.append(" ".join(lines[k] if k < len(lines) else " " * w for lines, w in zip(rendered, widths, strict=True)))
        if r == 0:
            out.append("─" * table_width)
    return out
