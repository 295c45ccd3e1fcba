"""What every peer script needs to measure the same way hbmio bench does: process CPU time and
an emptied page cache before a cold run."""
import json
import os
import resource
import subprocess


def cpu_seconds(who=resource.RUSAGE_SELF):
    r = resource.getrusage(who)
    return r.ru_utime + r.ru_stime


def drop_cache(path):
    """Empties the page cache (root) or evicts this file's pages; returns which it did."""
    subprocess.run(["sync"], check=True)
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "drop_caches"
    except OSError:  # not root: evict this file's pages only
        with open(path, "rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        return "fadvise_dontneed"


def json_lines(path=None, **fields):
    """A function that prints one record as a JSON line (with `fields` added) and appends it to
    `path` when given: how every peer script reports."""
    def emit(rec):
        rec.update(fields)
        line = json.dumps(rec)
        print(line, flush=True)
        if path:
            with open(path, "a") as f:
                f.write(line + "\n")
    return emit
