"""docs/integrations.md states the lines an adopter deletes and adds: the figures line_counts.py
counts on the installed packages and the drop-ins."""

from __future__ import annotations

from pathlib import Path

from line_counts import counts

DOC = Path(__file__).resolve().parents[3] / "docs" / "integrations.md"


def test_the_documented_line_counts_are_the_counted_ones() -> None:
    text = DOC.read_text()
    rows = counts()
    missing = [
        f"| {what} | {deleted or '—'} | {added} |"
        for what, (deleted, added) in rows.items()
        if f"| {what} | {deleted or '—'} | {added} |" not in text
    ]
    assert rows and not missing, f"docs/integrations.md lacks these rows: {missing}"
