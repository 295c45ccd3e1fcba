"""Where the tests find the `hbmio` command: $HBMIO_CLI, else PATH, else beside the interpreter
(where `pip install .` puts it)."""
import os
import shutil
import sys
from pathlib import Path


def hbmio_command():
    for candidate in (os.environ.get("HBMIO_CLI"), shutil.which("hbmio"), str(Path(sys.executable).parent / "hbmio")):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None
