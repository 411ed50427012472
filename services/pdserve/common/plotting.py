"""matplotlib for every plot pdserve draws: the Agg backend (files, no screen), imported once.

matplotlib is a core dependency (every number a user would rather see plotted gets a PNG), but
a trimmed install may lack it: then ``pyplot()`` returns None and callers print one line and go
on, so no command or benchmark fails for want of a plot.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType
from typing import Any

MISSING_NOTE = "matplotlib is not installed: no plot (pip install matplotlib)"


def save_figure(figure: Any, path: Path, *, dpi: int = 120) -> None:
    """Lay ``figure`` out, write it to ``path`` (its folder made if missing) and close it."""
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=dpi)
    import matplotlib.pyplot as plt

    plt.close(figure)


def pyplot() -> ModuleType | None:
    """``matplotlib.pyplot`` on the Agg backend, or None (after one line on stderr) without it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(MISSING_NOTE, file=sys.stderr)
        return None
    return plt
