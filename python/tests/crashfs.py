"""CrashFS: a FUSE file system that loses power on demand, for testing what a save leaves behind.

It keeps the whole file system in memory and models what survives a power cut:
  - file data survives up to the last fsync/fdatasync of that file; with `tear`, any subset of
    the 4 KiB pages written since then may survive too (a torn write);
  - a directory operation (create, mkdir, link, unlink, rmdir, rename, RENAME_EXCHANGE) survives
    once every directory it changes has been fsynced after it (POSIX promises no more: a new
    checkpoint directory needs an fsync of its parent); of those not yet made durable, any prefix
    in the order they were made survives as well (journaling file systems commit in order).
Every operation is logged; after each one the file system records the crash states a power cut
right there could leave (one per surviving prefix of directory operations). `load(state)` then
serves such a state through the mount, as the machine would find it after a reboot. `fail(k, errno)`
makes the k-th logged operation of the given kinds fail instead (EIO, ENOSPC: a disk error or a
full disk at that step).

Where it differs from LazyFS (the model): state lives in memory, not in a backing directory (the
checkpoints tested are small); directory operations are lost or kept as ordered prefixes, where
LazyFS passes them straight to the underlying file system (kept at once); and a crash is a state
computed from the log rather than a command sent to a running mount, so a campaign checks every
point of one recorded save instead of re-running the save per point. The mount uses direct_io, so
the kernel caches nothing: O_DIRECT opens work, and what a reader sees is what the model holds.
"""
from __future__ import annotations

import errno
import os
import stat
import subprocess
import threading
import time
from dataclasses import dataclass, field

import mfusepy

PAGE = 4096
RENAME_NOREPLACE, RENAME_EXCHANGE = 1, 2


@dataclass
class State:
    """What the disk holds after a power cut at one point: the tree, and each file's bytes."""
    after: int                       # the number of logged operations before the cut
    prefix: int                      # directory operations kept (of those logged)
    tree: dict                       # dir inode -> {name: inode}
    files: dict                      # file inode -> bytes
    kinds: dict                      # inode -> "f" or "d"
    torn: bool = False


@dataclass
class _Inode:
    kind: str                        # "f" or "d"
    mode: int
    data: bytearray = field(default_factory=bytearray)
    synced: bytes = b""              # what a power cut leaves of the data
    dirty: set = field(default_factory=set)  # pages written since the last fsync


class CrashFS(mfusepy.Operations):
    use_ns = True  # utimens gets nanoseconds (ignored here)

    def __init__(self, tear=False, seed=1):
        self.mutex = threading.RLock()
        self.tear = tear
        self.seed = seed
        self.log = []                # (kind, detail) of every logged operation
        self.states = []             # crash states recorded while recording
        self.recording = False
        self.failures = {}           # log index -> errno to return instead
        self.fail_kinds = set()
        self._reset({1: {}}, {1: "d"}, {})

    # --- the model -------------------------------------------------------------------------
    def _reset(self, tree, kinds, files):
        self.inodes = {}
        for ino, kind in kinds.items():
            node = _Inode(kind, 0o755 if kind == "d" else 0o644)
            if kind == "f":
                node.data = bytearray(files.get(ino, b""))
                node.synced = bytes(node.data)
            self.inodes[ino] = node
        self.tree = {d: dict(e) for d, e in tree.items()}
        self.base_tree = {d: dict(e) for d, e in tree.items()}  # the tree the directory log starts from
        self.meta = []               # directory operations since base_tree, in order
        self.unsynced = {}           # index in meta -> directories still to be fsynced for it to survive
        self.next_ino = max(kinds) + 1
        self.handles = {}
        self.next_fh = 1

    def make_durable(self):
        """Everything as it is now survives (the starting point of a campaign)."""
        with self.mutex:
            for node in self.inodes.values():
                node.synced = bytes(node.data)
                node.dirty.clear()
            self.base_tree = {d: dict(e) for d, e in self.tree.items()}
            self.meta, self.unsynced = [], {}

    def start(self, fail=None, fail_kinds=()):
        """Starts logging (and recording crash states); `fail`: {log index: errno}."""
        with self.mutex:
            self.log, self.states, self._seen = [], [], set()
            self.failures = dict(fail or {})
            self.fail_kinds = set(fail_kinds)
            self.recording = True

    def stop(self):
        with self.mutex:
            self.recording = False
            self.failures = {}

    def _resolve(self, path):
        ino = 1
        for part in [p for p in path.split("/") if p]:
            entries = self.tree.get(ino)
            if entries is None or part not in entries:
                raise mfusepy.FuseOSError(errno.ENOENT if entries is not None else errno.ENOTDIR)
            ino = entries[part]
        return ino

    def _parent(self, path):
        head, name = os.path.split(path.rstrip("/"))
        return self._resolve(head or "/"), name

    def _event(self, kind, detail):
        """Logs an operation; raises the injected error where one is planned for it."""
        if not self.recording:
            return
        index = len(self.log)
        if kind in self.fail_kinds or not self.fail_kinds:
            if index in self.failures:
                self.log.append((kind + " FAILED", detail))
                raise mfusepy.FuseOSError(self.failures[index])
        self.log.append((kind, detail))

    def snapshot(self) -> State:
        """The state as it is now, all of it durable (for load() to return to)."""
        with self.mutex:
            files = {ino: bytes(n.data) for ino, n in self.inodes.items() if n.kind == "f"}
            kinds = {ino: n.kind for ino, n in self.inodes.items()}
            return State(0, 0, {d: dict(e) for d, e in self.tree.items()}, files, kinds)

    def _record(self):
        """The crash states of a power cut right after the last logged operation (each distinct
        one once: most writes change nothing that survives)."""
        if not self.recording:
            return
        files = {ino: n.synced for ino, n in self.inodes.items() if n.kind == "f"}
        kinds = {ino: n.kind for ino, n in self.inodes.items()}
        data_key = tuple(sorted((ino, id(b)) for ino, b in files.items()))  # synced bytes are replaced, never changed
        pending = sorted(self.unsynced)
        for prefix in range(len(pending) + 1):
            kept = [i for i in range(len(self.meta)) if i not in self.unsynced or i in pending[:prefix]]
            key = (tuple(kept), data_key)
            if key in self._seen:
                continue
            self._seen.add(key)
            tree = {d: dict(e) for d, e in self.base_tree.items()}
            for i in kept:
                _apply(tree, self.meta[i])
            self.states.append(State(len(self.log), len(kept), tree, files, kinds))
        if self.tear:
            # One torn variant: every other page written since the last fsync made it to disk.
            torn = {}
            for ino, n in self.inodes.items():
                if n.kind != "f" or not n.dirty:
                    continue
                data = bytearray(n.synced[:len(n.data)].ljust(len(n.data), b"\0"))
                for page in sorted(n.dirty)[::2]:
                    data[page * PAGE:(page + 1) * PAGE] = n.data[page * PAGE:(page + 1) * PAGE]
                torn[ino] = bytes(data)
            if torn:
                tree = {d: dict(e) for d, e in self.base_tree.items()}
                for op in self.meta:
                    _apply(tree, op)
                self.states.append(State(len(self.log), len(self.meta), tree, {**files, **torn}, kinds, torn=True))

    def _meta(self, op):
        self.unsynced[len(self.meta)] = {op[1]} if op[0] != "rename" else {op[1], op[3]}
        self.meta.append(op)
        _apply(self.tree, op)

    def load(self, state: State):
        """Serves `state` from now on, as the disk after a reboot."""
        with self.mutex:
            self._reset(state.tree, state.kinds, state.files)
            # Inodes no directory names are gone after the reboot.
            named = {1} | {ino for entries in self.tree.values() for ino in entries.values()}
            self.inodes = {ino: n for ino, n in self.inodes.items() if ino in named}
            self.tree = {d: e for d, e in self.tree.items() if d in named}
            self.make_durable()

    # --- FUSE operations ---------------------------------------------------------------------
    def getattr(self, path, fh=None):
        with self.mutex:
            ino = self.handles[fh] if fh is not None and fh in self.handles else self._resolve(path)
            n = self.inodes[ino]
            size = len(n.data) if n.kind == "f" else 0
            links = sum(1 for entries in self.tree.values() for i in entries.values() if i == ino)
            mode = (stat.S_IFDIR if n.kind == "d" else stat.S_IFREG) | n.mode
            now = time.time()
            return {"st_mode": mode, "st_ino": ino, "st_nlink": max(links, 1), "st_size": size, "st_uid": os.getuid(),
                    "st_gid": os.getgid(), "st_atime": now, "st_mtime": now, "st_ctime": now, "st_blocks": (size + 511) // 512,
                    "st_blksize": PAGE}

    def readdir(self, path, fh):
        with self.mutex:
            return [".", ".."] + sorted(self.tree[self._resolve(path)])

    def opendir(self, path):
        with self.mutex:
            ino = self._resolve(path)
            return self._handle(ino)

    def releasedir(self, path, fh):
        with self.mutex:
            self.handles.pop(fh, None)
        return 0

    def fsyncdir(self, path, datasync, fh):
        with self.mutex:
            self._event("fsync dir", path)
            ino = self._resolve(path)
            for i in list(self.unsynced):
                self.unsynced[i].discard(ino)
                if not self.unsynced[i]:
                    del self.unsynced[i]
            self._record()
        return 0

    def _handle(self, ino):
        fh = self.next_fh
        self.next_fh += 1
        self.handles[fh] = ino
        return fh

    def create(self, path, mode, fi=None):
        with self.mutex:
            parent, name = self._parent(path)
            if name in self.tree[parent]:
                raise mfusepy.FuseOSError(errno.EEXIST)
            self._event("create", path)
            ino = self.next_ino
            self.next_ino += 1
            self.inodes[ino] = _Inode("f", mode & 0o7777)
            self._meta(("link", parent, name, ino))
            self._record()
            return self._handle(ino)

    def open(self, path, flags):
        with self.mutex:
            ino = self._resolve(path)
            if flags & os.O_TRUNC:
                self._truncate(ino, 0, path)
            return self._handle(ino)

    def release(self, path, fh):
        with self.mutex:
            self.handles.pop(fh, None)
        return 0

    def flush(self, path, fh):
        return 0

    def read(self, path, size, offset, fh):
        with self.mutex:
            return bytes(self.inodes[self.handles[fh]].data[offset:offset + size])

    def write(self, path, data, offset, fh):
        with self.mutex:
            self._event("write", f"{path} [{offset}, {offset + len(data)})")
            n = self.inodes[self.handles[fh]]
            if len(n.data) < offset:
                n.data.extend(b"\0" * (offset - len(n.data)))
            n.data[offset:offset + len(data)] = data
            n.dirty.update(range(offset // PAGE, (offset + len(data) + PAGE - 1) // PAGE))
            self._record()
            return len(data)

    def _truncate(self, ino, length, path):
        self._event("truncate", f"{path} to {length}")
        n = self.inodes[ino]
        del n.data[length:]
        n.data.extend(b"\0" * (length - len(n.data)))
        n.dirty.add(length // PAGE)
        self._record()

    def truncate(self, path, length, fh=None):
        with self.mutex:
            self._truncate(self.handles[fh] if fh in self.handles else self._resolve(path), length, path)
        return 0

    def fsync(self, path, datasync, fh):
        with self.mutex:
            self._event("fdatasync" if datasync else "fsync", path)
            n = self.inodes[self.handles[fh]]
            n.synced = bytes(n.data)
            n.dirty.clear()
            self._record()
        return 0

    def mkdir(self, path, mode):
        with self.mutex:
            parent, name = self._parent(path)
            if name in self.tree[parent]:
                raise mfusepy.FuseOSError(errno.EEXIST)
            self._event("mkdir", path)
            ino = self.next_ino
            self.next_ino += 1
            self.inodes[ino] = _Inode("d", mode & 0o7777)
            self.tree[ino] = {}
            self.base_tree.setdefault(ino, {})
            self._meta(("link", parent, name, ino))
            self._record()
        return 0

    def unlink(self, path):
        with self.mutex:
            parent, name = self._parent(path)
            if name not in self.tree[parent]:
                raise mfusepy.FuseOSError(errno.ENOENT)
            self._event("unlink", path)
            self._meta(("unlink", parent, name))
            self._record()
        return 0

    def rmdir(self, path):
        with self.mutex:
            parent, name = self._parent(path)
            ino = self.tree[parent].get(name)
            if ino is None:
                raise mfusepy.FuseOSError(errno.ENOENT)
            if self.tree.get(ino):
                raise mfusepy.FuseOSError(errno.ENOTEMPTY)
            self._event("rmdir", path)
            self._meta(("unlink", parent, name))
            self._record()
        return 0

    def link(self, target, source):
        with self.mutex:
            ino = self._resolve(source)
            parent, name = self._parent(target)
            if name in self.tree[parent]:
                raise mfusepy.FuseOSError(errno.EEXIST)
            self._event("link", f"{source} -> {target}")
            self._meta(("link", parent, name, ino))
            self._record()
        return 0

    def rename2(self, old, new, flags):
        with self.mutex:
            sdir, sname = self._parent(old)
            ddir, dname = self._parent(new)
            if sname not in self.tree[sdir]:
                raise mfusepy.FuseOSError(errno.ENOENT)
            there = self.tree[ddir].get(dname)
            if flags & RENAME_EXCHANGE and there is None:
                raise mfusepy.FuseOSError(errno.ENOENT)
            if flags & RENAME_NOREPLACE and there is not None:
                raise mfusepy.FuseOSError(errno.EEXIST)
            if there is not None and not flags & RENAME_EXCHANGE and self.inodes[there].kind == "d" and self.tree.get(there):
                raise mfusepy.FuseOSError(errno.ENOTEMPTY)
            self._event("exchange" if flags & RENAME_EXCHANGE else "rename", f"{old} -> {new}")
            self._meta(("rename", sdir, sname, ddir, dname, flags))
            self._record()
        return 0

    def rename(self, old, new):
        return self.rename2(old, new, 0)

    def chmod(self, path, mode):
        with self.mutex:
            self.inodes[self._resolve(path)].mode = mode & 0o7777
        return 0

    def chown(self, path, uid, gid):
        return 0

    def utimens(self, path, times=None):
        return 0

    def statfs(self, path):
        return {"f_bsize": PAGE, "f_frsize": PAGE, "f_blocks": 1 << 20, "f_bfree": 1 << 19, "f_bavail": 1 << 19,
                "f_files": 1 << 16, "f_ffree": 1 << 15, "f_namemax": 255}


def _apply(tree, op):
    if op[0] == "link":
        _, parent, name, ino = op
        tree.setdefault(parent, {})[name] = ino
    elif op[0] == "unlink":
        _, parent, name = op
        tree.get(parent, {}).pop(name, None)
    elif op[0] == "rename":
        _, sdir, sname, ddir, dname, flags = op
        src = tree.get(sdir, {}).get(sname)
        if src is None:
            return
        if flags & RENAME_EXCHANGE:
            dst = tree.get(ddir, {}).get(dname)
            if dst is None:
                return
            tree[sdir][sname], tree[ddir][dname] = dst, src
        else:
            del tree[sdir][sname]
            tree.setdefault(ddir, {})[dname] = src


class _Fuse(mfusepy.FUSE):
    # mfusepy drops rename's flags under FUSE 3; RENAME_EXCHANGE needs them.
    def rename_fuse_3(self, old, new, flags):
        return self.operations.rename2(old.decode(), new.decode(), flags)


class Mount:
    """CrashFS mounted at `where` by a thread of this process, unmounted on exit."""

    def __init__(self, where, fs: CrashFS):
        self.where, self.fs = str(where), fs
        os.makedirs(self.where, exist_ok=True)
        self.thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self):
        # hard_remove: a file still open is really unlinked or renamed over, not hidden under a
        # .fuse_hidden name by libfuse (a step of its own that a crash could cut in two); CrashFS
        # keeps open files by handle.
        _Fuse(self.fs, self.where, foreground=True, nothreads=True, direct_io=True, hard_remove=True, attr_timeout=0,
              entry_timeout=0, negative_timeout=0)

    def __enter__(self):
        self.thread.start()
        deadline = time.monotonic() + 10
        while not os.path.ismount(self.where):
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"CrashFS did not mount at {self.where} (is /dev/fuse usable, and mounting allowed here?)")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc):
        subprocess.run(["fusermount3", "-u", "-z", self.where], check=False, capture_output=True)
        self.thread.join(timeout=10)
