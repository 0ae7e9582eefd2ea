"""The filesystem Tune writes the experiment's state through: local, with every file replaced whole.

Tune keeps the experiment's state (experiment_state-<time>.json, the searcher's state, tuner.pkl, each trial's
files) in a staging folder and copies it to the storage path every second (search.EXPERIMENT_STATE_PERIOD_S),
truncating each file and writing it again. A driver killed during a copy leaves a file cut short: seen in the
suite (2026-12-06), an empty experiment_state-<time>.json, which Tune then took as the newest state, failed to
read, and "restarted" the experiment with a trial that had no method. Here each file is written to a hidden
temporary file beside it and renamed over the old one when complete (os.replace, atomic on one filesystem):
a kill leaves the old file or the new one, never a part, and at most a stray temporary file that no pattern of
Tune's matches.
"""

from __future__ import annotations

import contextlib
import os
import secrets

import pyarrow as pa
import pyarrow.fs as pafs


class _ReplaceOnClose:
    """A binary file written under a temporary name and renamed to `path` on close, unless a write or the close
    itself failed (a full disk): then the temporary file goes and the old `path` stays. (An exception raised
    between writes by the caller's own code is not seen here: pyarrow's file closes the same way either way.)"""

    def __init__(self, path: str):
        folder, name = os.path.split(path)
        self.path = path
        self.temporary = os.path.join(folder, f".{name}.{secrets.token_hex(4)}.partial")
        self._file = open(self.temporary, "wb")
        self.closed = False
        self.failed = False

    def write(self, data) -> int:
        try:
            return self._file.write(data)
        except BaseException:
            self.failed = True
            raise

    def flush(self) -> None:
        try:
            self._file.flush()
        except BaseException:
            self.failed = True
            raise

    def tell(self) -> int:
        return self._file.tell()

    def writable(self) -> bool:
        return True

    def readable(self) -> bool:
        return False

    def seekable(self) -> bool:
        return False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self._file.close()  # flushes what is buffered: a full disk may refuse it here
        except BaseException:
            self.failed = True
            raise
        finally:
            if self.failed:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.temporary)
        if not self.failed:
            os.replace(self.temporary, self.path)


class ReplaceWholeFiles(pafs.FileSystemHandler):
    """pyarrow's LocalFileSystem, but a file opened for writing appears only when it is complete."""

    def __init__(self):
        self._local = pafs.LocalFileSystem()

    def __eq__(self, other):
        return isinstance(other, ReplaceWholeFiles)

    def __ne__(self, other):
        return not self == other

    def __reduce__(self):  # the handler travels to Ray's workers inside the run's config
        return ReplaceWholeFiles, ()

    def get_type_name(self) -> str:
        return "anchor-rm-replace-whole-files"

    def normalize_path(self, path):
        return self._local.normalize_path(path)

    def get_file_info(self, paths):
        return self._local.get_file_info(paths)

    def get_file_info_selector(self, selector):
        return self._local.get_file_info(selector)

    def create_dir(self, path, recursive):
        self._local.create_dir(path, recursive=recursive)

    def delete_dir(self, path):
        self._local.delete_dir(path)

    def delete_dir_contents(self, path, missing_dir_ok=False):
        self._local.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self):
        self._local.delete_dir_contents("/", accept_root_dir=True)

    def delete_file(self, path):
        self._local.delete_file(path)

    def move(self, src, dest):
        self._local.move(src, dest)

    def copy_file(self, src, dest):
        target = _ReplaceOnClose(dest)
        try:
            with self._local.open_input_stream(src) as source:
                while chunk := source.read(1 << 20):
                    target.write(chunk)
        except BaseException:  # a read error, Ctrl-C: the old dest stays
            target.failed = True
            raise
        finally:
            target.close()

    def open_input_stream(self, path):
        return self._local.open_input_stream(path)

    def open_input_file(self, path):
        return self._local.open_input_file(path)

    def open_output_stream(self, path, metadata):
        return pa.PythonFile(_ReplaceOnClose(path), mode="w")

    def open_append_stream(self, path, metadata):
        return self._local.open_append_stream(path)


def experiment_filesystem() -> pafs.FileSystem:
    """The filesystem for Tune's RunConfig(storage_filesystem=...) and Tuner.restore: paths are local paths."""
    return pafs.PyFileSystem(ReplaceWholeFiles())
