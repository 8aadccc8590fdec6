"""A one-line progress bar on stderr."""
from __future__ import annotations

import sys


class Progress:
    """A one-line progress bar on stderr for long reconstructions (silent when quiet or not a tty)."""

    def __init__(self, label: str, quiet: bool = False):
        self.label, self.quiet = label, quiet or not sys.stderr.isatty()

    def __call__(self, done: int, total: int, note: str = "") -> None:
        if self.quiet:
            return
        width = 30
        filled = int(width * done / max(total, 1))
        sys.stderr.write(f"\r{self.label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} {note}")
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()
