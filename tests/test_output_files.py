"""dsnorm.output_files: where an output file cannot be written, and writing one whole or not at all."""

import os

import pytest


def test_write_file_is_whole_or_nothing(tmp_path, monkeypatch):
    from dsnorm.output_files import write_file

    out = tmp_path / "out.json"
    out.write_text('{"keep": 1}\n')
    out.chmod(0o640)
    write_file(str(out), "new\n")
    assert out.read_text() == "new\n" and (out.stat().st_mode & 0o777) == 0o640
    # Through a symbolic link: the file it names is replaced, the link stays a link.
    os.symlink(out, tmp_path / "link")
    write_file(str(tmp_path / "link"), b"via link\n")
    assert os.path.islink(tmp_path / "link") and out.read_text() == "via link\n"
    # A write that fails part-way (a full disk) leaves the old file as it was and no temporary file.
    real_fdopen = os.fdopen

    class Full:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            self.f.write(data[:3])
            raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fdopen", lambda fd, mode: Full(real_fdopen(fd, mode)))
    with pytest.raises(OSError, match="No space"):
        write_file(str(out), "x" * 100)
    assert out.read_text() == "via link\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "out.json"]


def test_write_file_writes_pipes_and_linked_files_in_place(tmp_path):
    # A rename would turn a pipe or device (/dev/stdout, /dev/null) into a regular file and split a
    # file with two names (found by review of the first version).
    import stat
    import threading

    from dsnorm.output_files import write_file

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=lambda: got.append(open(fifo, "rb").read()))
    reader.start()
    write_file(str(fifo), "through the pipe\n")
    reader.join(10)
    assert got == [b"through the pipe\n"] and stat.S_ISFIFO(os.stat(fifo).st_mode)
    one, two = tmp_path / "one.json", tmp_path / "two.json"
    one.write_text("old\n")
    os.link(one, two)
    write_file(str(one), "new\n")
    assert two.read_text() == "new\n" and os.path.samefile(one, two)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "one.json", "two.json"]


def test_output_path_problem(tmp_path, monkeypatch):
    from dsnorm.output_files import output_path_problem

    existing = tmp_path / "out.json"
    existing.write_text("{}")
    assert output_path_problem(str(existing)) is None and output_path_problem(str(tmp_path / "new.json")) is None
    assert output_path_problem(str(tmp_path)) == "is a directory (name a file)"
    assert output_path_problem(str(tmp_path / "new") + "/") == "ends in a separator (name a file)"
    for missing in ("no/x.json", "no/.", "no/..", "no/../x.json"):
        assert output_path_problem(f"{tmp_path}/{missing}") == "no such directory", missing  # as typed: no pathlib
    os.symlink(tmp_path / "no" / "target", tmp_path / "dangling")
    assert output_path_problem(str(tmp_path / "dangling")) == "is a dangling symbolic link"
    # A directory the user cannot write to: an existing writable file in it can still be rewritten
    # (as open(path, "w") would), a new file cannot be created.
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if os.path.isdir(p) else real_access(p, mode))
    assert output_path_problem(str(existing)) is None
    assert output_path_problem(str(tmp_path / "new.json")) == "not writable (its directory)"
