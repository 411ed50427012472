"""A file that is parsed once and parsed again whenever it changes, without a restart: key
files, token files. One place for the reload rules every such file follows."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Generic, TypeVar

from pdserve.common.errors import ConfigError

logger = logging.getLogger(__name__)

T = TypeVar("T")


def file_stamp(path: Path) -> tuple[int, int, int]:
    """What tells a changed file: modification time (ns), size and inode (an editor that writes
    a new file and renames it over the old one changes the inode)."""
    st = path.stat()
    return st.st_mtime_ns, st.st_size, st.st_ino


class WatchedFile(Generic[T]):
    """``value`` = ``parse(text, source)`` of ``path``, parsed again by ``refresh`` when the file
    changed (``file_stamp``), looked at at most every ``poll_interval_s`` (``clock``: monotonic
    seconds, injected in tests).

    Construction raises ``ConfigError`` when the file cannot be read or parsed (a service must
    not start on a bad file); later, a file that cannot be read or parsed leaves the last good
    value in place, with a warning (a half-written edit must not lock everyone out). ``what``
    names the file in messages ("key file"); ``parse`` never puts secrets in its errors.
    """

    def __init__(self, path: Path, parse: Callable[[str, str], T], what: str, *,
                 poll_interval_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self.what = what
        self._parse = parse
        self._poll_interval_s = poll_interval_s
        self._clock = clock
        try:
            self._stamp = file_stamp(path)
            self.value: T = parse(path.read_text(), str(path))
        except OSError as exc:
            raise ConfigError(f"{path}: cannot read the {what}: {exc.strerror}") from None
        self._next_check_s = clock() + poll_interval_s
        self.num_reloads = 0

    def refresh(self, *, force: bool = False) -> bool:
        """Parse the file again if it changed (or ``force``), at most every
        ``poll_interval_s`` unless forced; True when ``value`` was replaced."""
        now = self._clock()
        if not force and now < self._next_check_s:
            return False
        self._next_check_s = now + self._poll_interval_s
        try:
            stamp = file_stamp(self.path)
            if stamp == self._stamp and not force:
                return False
            value = self._parse(self.path.read_text(), str(self.path))
        except OSError as exc:
            logger.warning("%s %s unreadable (keeping what it held): %s", self.what, self.path,
                           exc.strerror)
            return False
        except ConfigError as exc:
            logger.warning("%s %s changed but is invalid (keeping what it held): %s", self.what,
                           self.path, exc.message)
            return False
        self._stamp = stamp
        self.value = value
        self.num_reloads += 1
        logger.info("%s %s reloaded", self.what, self.path)
        return True
