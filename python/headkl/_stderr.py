"""Mesa's ``XDG_RUNTIME_DIR`` lines kept off the caller's stderr.

Where ``XDG_RUNTIME_DIR`` is unset or not a folder, Mesa's Vulkan drivers
(through libwayland) print "error: XDG_RUNTIME_DIR is invalid or not set in
the environment." from C each time a Vulkan or wgpu device is enumerated or
opened: noise, since headkl draws nothing. The ``headkl`` command sets the
variable at its entry; a library must not change its caller's environment,
so instead the native calls that enumerate or open devices run with file
descriptor 2 sent to a temporary file, and every line it caught except
Mesa's is written back to the real stderr when the call returns (nothing
else is lost, only delayed until then). Where the variable names a folder
Mesa prints nothing, and the call runs as it is.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
from typing import Callable, TypeVar

T = TypeVar("T")

# One redirection at a time: two threads each saving and restoring fd 2
# would leave it pointing at the other's temporary file.
_LOCK = threading.RLock()


def _runtime_dir_missing() -> bool:
    """Whether Mesa would print its line: the variable is unset or not a folder."""
    folder = os.environ.get("XDG_RUNTIME_DIR")
    return not folder or not os.path.isdir(folder)


def _is_mesa_line(line: bytes) -> bool:
    """Mesa's (libwayland's) complaint about ``XDG_RUNTIME_DIR``, in any of its wordings."""
    return b"XDG_RUNTIME_DIR" in line and (b"not set" in line or b"invalid" in line)


def _without_mesa_lines(text: bytes) -> bytes:
    return b"".join(line for line in text.splitlines(keepends=True) if not _is_mesa_line(line))


def quiet_mesa(call: Callable[..., T], *args, **kwargs) -> T:
    """``call(*args, **kwargs)`` with Mesa's ``XDG_RUNTIME_DIR`` lines
    dropped from what it writes to file descriptor 2; the rest is written
    back to fd 2 once it returns (or raises). ``os.environ`` is never
    touched. Where fd 2 cannot be duplicated or no temporary file can be
    made, the call runs as it is."""
    if not _runtime_dir_missing():
        return call(*args, **kwargs)
    with _LOCK:
        try:
            saved = os.dup(2)
        except OSError:  # no fd 2 to keep: nothing to quiet either
            return call(*args, **kwargs)
        try:
            capture = tempfile.TemporaryFile()
        except OSError:
            os.close(saved)
            return call(*args, **kwargs)
        with capture:
            try:
                # Python's own buffered text goes out first, in order.
                sys.stderr.flush()
            except Exception:  # noqa: BLE001 - a replaced or closed sys.stderr: nothing to flush
                pass
            try:
                os.dup2(capture.fileno(), 2)
            except OSError:
                os.close(saved)
                return call(*args, **kwargs)
            try:
                return call(*args, **kwargs)
            finally:
                os.dup2(saved, 2)
                os.close(saved)
                _write_back(capture)


def _write_back(capture) -> None:
    """Writes what ``capture`` caught, less Mesa's lines, to fd 2."""
    try:
        capture.seek(0)
        kept = _without_mesa_lines(capture.read())
        while kept:
            kept = kept[os.write(2, kept) :]
    except OSError:  # stderr gone: the lines have nowhere to go
        pass
