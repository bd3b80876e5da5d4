"""What `toppings-launch` prints: one line (or a table row) per server whenever one changes."""

from __future__ import annotations

import sys

from toppings.scripts.launch.procs import ServerProc


class Reporter:
    """Prints one line per server (URL, pid, cores, state) whenever one of them changes."""

    COLUMNS = ("server", "url", "pid", "cores", "workers", "gpu", "state", "restarts", "exit")

    def __init__(self) -> None:
        self.console = None
        if sys.stderr.isatty():  # a table for a person; key=value lines for a log file
            try:
                from rich.console import Console

                self.console = Console(stderr=True, highlight=False)
            except ImportError:
                pass
        self._last: list[tuple] = []

    def update(self, servers: list[ServerProc]) -> None:
        rows = [_row(s) for s in servers]
        if rows == self._last:
            return
        self._last = rows
        if self.console is None:
            for row in rows:
                print("  ".join(f"{k}={v}" for k, v in zip(self.COLUMNS, row)), file=sys.stderr)
            return
        from rich.table import Table

        table = Table(*self.COLUMNS, box=None, pad_edge=False)
        for row in rows:
            table.add_row(*row)
        self.console.print(table)

    def note(self, text: str) -> None:
        if self.console is None:
            print(f"toppings-launch: {text}", file=sys.stderr)
        else:
            self.console.print(f"[bold]toppings-launch:[/bold] {text}")


def _row(s: ServerProc) -> tuple[str, ...]:
    return (str(s.index), s.url, str(s.pid or "-"), _cores_text(s.cores), str(s.num_workers),
            "-" if s.gpu is None else str(s.gpu), s.state.value, str(s.restarts),
            "-" if s.last_exit is None else str(s.last_exit))  # fmt: skip


def _cores_text(cores: tuple[int, ...]) -> str:
    """(0, 1, 2, 5) -> "0-2,5"."""
    parts, start = [], None
    for i, c in enumerate(cores):
        start = c if start is None else start
        if i + 1 == len(cores) or cores[i + 1] != c + 1:
            parts.append(str(c) if c == start else f"{start}-{c}")
            start = None
    return ",".join(parts)
