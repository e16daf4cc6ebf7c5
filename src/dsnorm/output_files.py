"""The files dsnorm's commands write (``--json``, ``--plot``): checked before the command's work
(:func:`output_path_problem`, :func:`same_file`; :func:`json_path_refused` says on stderr why a
``--json`` path cannot be written), then written whole or not at all (:func:`write_file`;
:func:`write_output` says on stderr why a file could not be). Used by ``dsnorm sites``, ``dsnorm
count`` and ``dsnorm bench``."""

from __future__ import annotations

import os
import sys
from typing import Iterable, Optional


def output_path_problem(path: str) -> Optional[str]:
    """Why a file cannot be written at ``path`` (the CLIs check before their work, not after it), or None."""
    if os.path.isdir(path):
        return "is a directory (name a file)"
    if path.endswith(("/", os.sep)):
        return "ends in a separator (name a file)"
    if os.path.exists(path):  # an existing file is rewritten in place: its directory's mode does not matter
        return None if os.access(path, os.W_OK) else "not writable"
    if os.path.islink(path):
        return "is a dangling symbolic link"
    # The directory as open() resolves it: not normalised first ("new/.." needs "new" to exist).
    parent = os.path.dirname(path) or "."
    if not os.path.isdir(parent):
        return "no such directory"
    return None if os.access(parent, os.W_OK) else "not writable (its directory)"


def same_file(a: Optional[str], b: Optional[str]) -> bool:
    """Whether two paths name one file: an existing one under any name (links included), or, for a
    file not yet made, the same normalised path."""
    if not a or not b or a == "-" or b == "-":
        return False
    try:
        if os.path.exists(a) and os.path.exists(b):
            return os.path.samefile(a, b)
    except OSError:
        return False
    return os.path.realpath(a) == os.path.realpath(b)


def json_path_refused(command: str, path: Optional[str], inputs: Iterable = ()) -> bool:
    """For ``dsnorm <command> --json PATH`` (``-``: stdout): say on stderr why PATH cannot be
    written and return True, before the command's work; False when it can, or none was given.
    ``inputs``: ``(option, path)`` pairs of what the command reads, which the output must not replace."""
    if not path or path == "-":
        return False
    problem = output_path_problem(path)
    for option, other in inputs:
        if problem is None and same_file(path, other):
            problem = f"is the {option} file the command reads (it would be overwritten)"
    if problem:
        print(f"dsnorm {command}: error: --json {path}: {problem}", file=sys.stderr)
    return problem is not None


def _write_to_std_stream(st: os.stat_result, data: bytes) -> bool:
    """Append ``data`` to our stdout or stderr when the file ``st`` describes is that stream's file
    (``--json /dev/stdout`` with stdout redirected to a file: reopening it would truncate what was
    printed before, a rename would replace it); False when it is neither."""
    for stream in (sys.stdout, sys.stderr):
        try:
            fd = stream.fileno()
            fst = os.fstat(fd)
        except (AttributeError, OSError, ValueError):  # a replaced stream (pytest's capture) has no fd
            continue
        if (fst.st_dev, fst.st_ino) == (st.st_dev, st.st_ino):
            stream.flush()
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            return True
    return False


def write_output(command: str, label: str, path: str, data) -> bool:
    """:func:`write_file` for ``dsnorm <command>``'s output file: True when written; when it cannot
    be, say so on stderr, naming ``label``, and return False (the command exits 2). A closed pipe
    (``--json /dev/stdout | head``) propagates as BrokenPipeError: cli.main stops quietly."""
    try:
        write_file(path, data)
    except BrokenPipeError:
        raise
    except OSError as e:
        print(f"dsnorm {command}: error: cannot write {label}: {e.strerror or e}", file=sys.stderr)
        return False
    return True


def write_file(path: str, data) -> None:
    """Write ``data`` (str or bytes) to ``path``. A new file, or a regular file of ours with no other
    name, is written whole or not at all: into a temporary file beside it, then renamed over it (a
    failed write, a full disk, leaves the old file as it was; its permission bits are kept, and a
    symbolic link is written through). Anything else is written in place, as ``open(path, "w")``
    would: a device, pipe or terminal (``/dev/null``), a file with other hard links or another owner
    (a rename would split or take it over), a directory that takes no new file. The file our stdout
    or stderr writes to (``/dev/stdout``) gets ``data`` after what was printed there.

    Raises:
        OSError: the file cannot be written.
    """
    import stat
    import tempfile

    if isinstance(data, str):
        data = data.encode("utf-8")
    try:
        st = os.stat(path)  # through links: what open() would write
    except FileNotFoundError:
        st = None
    if st is not None and _write_to_std_stream(st, data):
        return
    target = os.path.realpath(path)
    directory = os.path.dirname(target) or "."
    replaceable = st is None or (stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_uid == os.geteuid())
    if not replaceable or not os.access(directory, os.W_OK):
        with open(path, "wb") as f:
            f.write(data)
        return
    fd, tmp = tempfile.mkstemp(prefix=".dsnorm-", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        if st is not None:
            os.chmod(tmp, stat.S_IMODE(st.st_mode))
        else:  # what open() would give a new file: 0o666 less the umask
            umask = os.umask(0)
            os.umask(umask)
            os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
