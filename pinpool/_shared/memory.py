"""Shared, file-backed pool memory: :class:`SharedMemory`, its arguments, what its region holds now,
and whether :meth:`SharedMemory.open_mapping` creates or attaches (docs/shared-memory.md)."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import stat
import threading
import weakref
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from .._errors import ConfigError, PoolStateError
from .._host import libc as _libc
from .._units import format_bytes, parse_size
from . import files as _files
from .format import (
    GENERATION_AT,
    NotRegion,
    RegionInfo,
    align,
    open_checked,
    read_trailer,
    region_file_bytes,
    region_info,
    write_field,
)
from .intents import Intents
from .mapping import SharedMapping, Unlinker, attach_mapping, create_mapping

T = TypeVar("T")


def _check_flags(create: object, keep: object, mode: object, adopt: object) -> None:
    for name, value in (("create", create), ("keep", keep), ("adopt", adopt)):
        if not isinstance(value, bool):
            raise ConfigError(f"SharedMemory({name}={value!r}): must be True or False")
    if isinstance(mode, bool) or not isinstance(mode, int) or not 0 <= mode <= 0o777:
        raise ConfigError(f"SharedMemory(mode={mode!r}): must be a permission mode such as 0o600")
    if mode & 0o600 != 0o600 or mode & 0o022:
        raise ConfigError(
            f"SharedMemory(mode={mode:#o}): the owner must be able to read and write the region and nobody "
            "else to write it (use 0o600, or 0o640 / 0o644 for readers of other users)"
        )


class SharedMemory:
    """Pool memory shared between processes: a ``MAP_SHARED`` mapping of a file on tmpfs or hugetlbfs,
    or of a memfd (``path=None``), or of an ``fd`` handed on, that may outlive its creator; ``create=False``
    attaches. The file is created or opened when a pool maps it (docs/shared-memory.md: every argument)."""

    def __init__(
        self,
        path: str | os.PathLike[str] | None = None,
        *,
        create: bool = True,
        keep: bool = False,
        mode: int = 0o600,
        fd: int | None = None,
        huge_page_size: int | str | None = None,
        adopt: bool = False,
    ) -> None:
        _check_flags(create, keep, mode, adopt)
        if adopt and (create or path is None):
            raise ConfigError(
                f"SharedMemory(adopt=True, create={create}, path={path!r}): adopting takes over a named region "
                "whose creator died; give its path with create=False"
            )
        huge = None if huge_page_size is None else parse_size(huge_page_size, what="huge_page_size")
        self._create = create
        self._keep = keep
        self._adopt = adopt
        self._mode = mode
        self._lock = threading.Lock()
        self._live: weakref.ref[SharedMapping] | None = None
        self._made: tuple[int, int] | None = None  # (st_dev, st_ino) of the file this object created
        self._path: str | None = None
        self._directory = self._name = ""
        self._given_fd: int | None = None
        self._memfd_flags = 0
        if path is not None and fd is not None:
            raise ConfigError("SharedMemory(path=..., fd=...): give one: a path to open, or a descriptor handed on")
        if fd is not None:
            self._page_size = self._take_fd(fd, keep)
        elif path is not None:
            self._page_size = self._take_path(path)
        else:
            self._page_size = self._take_memfd(create, keep, huge, huge_page_size)
        if huge is not None and huge != self._page_size:
            raise ConfigError(
                f"SharedMemory(huge_page_size={huge_page_size!r}): {self._where()} has "
                f"{format_bytes(self._page_size)} pages, not {format_bytes(huge)}"
                + (" (it is not on hugetlbfs)" if self._page_size == _libc.PAGE_SIZE else "")
            )

    def _take_fd(self, fd: int, keep: bool) -> int:
        if isinstance(fd, bool) or not isinstance(fd, int) or fd < 0:
            raise ConfigError(f"SharedMemory(fd={fd!r}): must be an open file descriptor (an int >= 0)")
        if keep:
            raise ConfigError(
                "SharedMemory(fd=..., keep=True): a descriptor has no name to keep or remove; its file lives "
                "as long as its owner keeps it (and any mapping of it)"
            )
        try:
            st = os.fstat(fd)
            f_type, f_bsize = _libc.fstatfs(fd)
        except OSError as exc:
            raise ConfigError(f"SharedMemory(fd={fd}): not an open descriptor ({exc.strerror or exc})") from None
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"SharedMemory(fd={fd}): the descriptor is not a regular file (mode {st.st_mode:#o})")
        self._given_fd = fd
        return _files.page_size_of(f_type, f_bsize, f"fd {fd}")

    def _take_path(self, path: str | os.PathLike[str]) -> int:
        if isinstance(path, bytes) or not isinstance(path, str | os.PathLike):
            raise ConfigError(f"SharedMemory(path={path!r}): must be a str or os.PathLike path, or None")
        text = os.fspath(path)
        if not isinstance(text, str) or not text:
            raise ConfigError(f"SharedMemory(path={path!r}): must be a non-empty str path")
        self._path = os.path.abspath(text)
        self._directory, self._name = os.path.split(self._path)
        if not self._name or text.endswith("/"):
            raise ConfigError(f"SharedMemory(path={text!r}): name a file, not a directory")
        os.close(_files.open_region_directory(self._path))  # checked now; the file is opened when mapped
        f_type, f_bsize = _libc.statfs(self._directory)
        return _files.page_size_of(f_type, f_bsize, f"path {self._path!r}")

    def _take_memfd(self, create: bool, keep: bool, huge: int | None, huge_page_size: object) -> int:
        if not create:
            raise ConfigError(
                "SharedMemory(create=False) needs something to attach to: a path= of an existing region, or "
                "the fd= another process handed on"
            )
        if keep:
            raise ConfigError(
                "SharedMemory(path=None, keep=True): a memfd has no name to keep; it lives while a descriptor "
                "or a mapping refers to it. Give a path on /dev/shm or a hugetlbfs mount to keep a region"
            )
        self._memfd_flags = os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING
        if huge is None:
            return _libc.PAGE_SIZE
        if (size_flag := _files.HUGE_PAGE_SIZES.get(huge)) is None:
            raise ConfigError(
                f"SharedMemory(huge_page_size={huge_page_size!r}): a memfd's huge pages are 2 MiB or 1 GiB"
            )
        self._memfd_flags |= os.MFD_HUGETLB | size_flag
        return huge

    @property
    def path(self) -> str | None:
        """The region's file, absolute; None for a memfd or a descriptor handed on."""
        return self._path

    @property
    def fd(self) -> int | None:
        """The descriptor to hand on: the ``fd=`` given, else the region's own while a pool maps it."""
        if self._given_fd is not None:
            return self._given_fd
        mapping = self._mapping
        return None if mapping is None else mapping.fd

    @property
    def keep(self) -> bool:
        """Whether the creator leaves the file in place when it lets go (settable, e.g. at shutdown)."""
        return self._keep

    @keep.setter
    def keep(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise ConfigError(f"SharedMemory.keep = {value!r}: must be True or False")
        if value and self._path is None:
            raise ConfigError("SharedMemory.keep = True: only a region with a path can be kept")
        self._keep = value
        if (mapping := self._mapping) is not None and mapping._unlinker is not None:
            mapping._unlinker.keep = value
            mapping._set_keep_flag(value)

    @property
    def page_size(self) -> int:
        """The page the region is made of (the huge page on hugetlbfs): chunks and buffers align to it."""
        return self._page_size

    @property
    def _mapping(self) -> SharedMapping | None:
        mapping = None if self._live is None else self._live()
        return None if mapping is None or mapping.unmapped else mapping

    def __repr__(self) -> str:
        return f"SharedMemory({self._where()}, create={self._create}, keep={self._keep})"

    def _where(self) -> str:
        if self._path is not None:
            return repr(self._path)
        if self._given_fd is not None:
            return f"fd={self._given_fd}"
        return "memfd"

    def _read_file(self, read: Callable[[int], T], *, write: bool = False) -> T | None:
        """``read`` of a descriptor of the region's file as it is now, or None without one."""
        mapping = self._mapping
        fd = mapping.fd if mapping is not None else self._given_fd
        if fd is not None:
            return read(fd)
        if self._path is None:
            return None
        dir_fd = _files.open_region_directory(self._path)
        try:
            fd = open_checked(self._name, dir_fd, os.O_RDWR if write else os.O_RDONLY, _files.region_file_problem)
        finally:
            os.close(dir_fd)
        if fd is None:
            return None
        try:
            return read(fd)
        finally:
            os.close(fd)

    def resident_bytes(self, nbytes: int) -> int:
        """Bytes of a pool of ``nbytes`` the region's file holds in memory already (its trailer's page not counted)."""
        data = align(self._check_nbytes(nbytes), self._page_size)
        st = self._read_file(os.fstat)
        if st is None:
            return 0
        beyond = max(0, st.st_size - data) // self._page_size * self._page_size
        return min(data, max(0, st.st_blocks * 512 - beyond))

    def new_bytes(self, nbytes: int) -> int:
        """Memory that mapping and faulting the region for ``nbytes`` newly takes: file size less held."""
        total = region_file_bytes(self._check_nbytes(nbytes), self._page_size)
        st = self._read_file(os.fstat)
        return total if st is None else max(0, total - st.st_blocks * 512)

    @property
    def generation(self) -> int:
        """The region's generation number: 0 when created, then what :meth:`set_generation` stored."""
        mapping = self._mapping
        return self._info("has no generation").generation if mapping is None else mapping.generation

    @property
    def region_id(self) -> str:
        """The region's identity (32 hex digits, new at each creation): key a saved index on it and the generation."""
        mapping = self._mapping
        return self._info("has no identity").region_id if mapping is None else mapping.region_id

    def _info(self, lacking: str) -> RegionInfo:
        if (info := self._region()) is None:
            raise ConfigError(f"shared memory {self._where()} holds no pinpool region yet: it {lacking}")
        return info

    def _region(self) -> RegionInfo | None:
        def info(fd: int) -> RegionInfo:
            st = os.fstat(fd)
            return region_info(self._path or self._where(), st, read_trailer(fd, st.st_size))

        try:
            return self._read_file(info)
        except (OSError, NotRegion):
            return None

    def set_generation(self, value: int) -> None:
        """Store ``value`` as the region's generation in the file's trailer: every process sees it at once."""
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 1 << 64:
            raise ConfigError(f"generation={value!r} must be an integer in [0, 2**64)")
        if (mapping := self._mapping) is not None:
            mapping.set_generation(value)
            return

        def store(fd: int) -> bool:
            size = os.fstat(fd).st_size
            try:
                read_trailer(fd, size)  # refuse a file that holds no region
            except NotRegion as exc:
                raise ConfigError(f"shared memory {self._where()} {exc.problem}") from None
            write_field(fd, size, GENERATION_AT, value.to_bytes(8, "little"), self._where(), page_size=self._page_size)
            return True

        if self._read_file(store, write=True) is None:
            raise ConfigError(f"shared memory {self._where()} holds no pinpool region yet: nothing to set")

    def writing(self, first_page: int, count: int) -> contextlib.AbstractContextManager[None]:
        """Mark pages ``[first_page, first_page + count)`` of the pool "being written" in the region, for
        the ``with`` block: write to them inside it (a device copy: synchronized before it ends). A process
        killed inside leaves the mark: :meth:`suspect_pages` names those pages to its successor."""
        mapping = self._mapping
        if mapping is None:
            raise PoolStateError(f"{self!r}.writing(): no pool maps the region in this process (enter the pool)")
        return self._intents_of(mapping).writing(first_page, count)

    def _intents_of(self, mapping: SharedMapping) -> Intents:
        if mapping._intents is None:
            mapping._intents = Intents(mapping.fd, mapping.file_bytes, self._where(), page_size=self._page_size)
        return mapping._intents

    def suspect_pages(self) -> tuple[range, ...]:
        """The page runs a writer that died inside :meth:`writing` may have left half-written (a run
        of ``range(0, num_pages)`` for a slot something else wrote), sorted; a live writer's are not."""
        return self._suspects(clear=False)

    def clear_suspect_pages(self) -> tuple[range, ...]:
        """Forget dead writers' marks (once the server dropped those pages from its index): the runs cleared."""
        return self._suspects(clear=True)

    def _suspects(self, *, clear: bool) -> tuple[range, ...]:
        mapping = self._mapping
        if mapping is not None:
            return self._intents_of(mapping).suspects(clear=clear)

        def read(fd: int) -> tuple[range, ...]:
            return Intents(fd, os.fstat(fd).st_size, self._where(), page_size=self._page_size).suspects(clear=clear)

        if (found := self._read_file(read, write=clear)) is None:
            raise ConfigError(f"shared memory {self._where()} holds no pinpool region yet: no pages to suspect")
        return found

    def _check_nbytes(self, nbytes: int) -> int:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ConfigError(f"a shared memory region of nbytes={nbytes!r}: must be a positive int")
        return nbytes

    def open_mapping(
        self, nbytes: int, record: Mapping[str, object], *, allocate: Sequence[tuple[int, int]] | None = None
    ) -> SharedMapping:
        """Create or attach to the region for a pool of ``nbytes`` described by ``record``; map it ``MAP_SHARED``.
        ``allocate``: the ``(offset, nbytes)`` ranges of the data the pool pins at entry (an elastic pool's floor),
        the only ones allocated in the file now; None: all of it."""
        self._check_nbytes(nbytes)
        if not isinstance(record, Mapping):
            raise ConfigError(f"record={record!r} must be a mapping of JSON values (see layout_record)")
        try:
            record_json = json.dumps(record, sort_keys=True, separators=(",", ":"))
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"record must hold JSON values only: {exc}") from None
        with self._lock:
            if self._mapping is not None:
                raise PoolStateError(
                    f"{self!r} is mapped by another pool in this process already; a SharedMemory is mapped by one "
                    "pool at a time (make another SharedMemory(path, create=False) to map the region twice)"
                )
            if self._path is None:
                fd = os.dup(self._given_fd) if self._given_fd is not None else _files.new_memfd(self._memfd_flags)
                where = f"fd {self._given_fd}" if self._given_fd is not None else "memfd"
                try:
                    mapping = self._map(self._create, fd, nbytes, record_json, where, None, allocate=allocate)
                except BaseException:
                    os.close(fd)
                    raise
            else:
                mapping = self._open_path(nbytes, record_json, allocate)
            self._live = weakref.ref(mapping)
            return mapping

    def _open_path(self, nbytes: int, record_json: str, allocate: Sequence[tuple[int, int]] | None) -> SharedMapping:
        assert self._path is not None
        where = repr(self._path)
        dir_fd = _files.open_region_directory(self._path)  # closed below; an unlinker keeps a duplicate of its own
        try:
            if self._create and not _files.names_file(dir_fd, self._path, self._made):
                # Made whole under a temporary name, then linked into place: never seen half-made.
                fd, temp = _files.create_temp_file(dir_fd, self._path, self._mode)
                try:
                    st = os.fstat(fd)
                    identity = (st.st_dev, st.st_ino)
                    publishing = functools.partial(_files.publish, dir_fd, self._path, temp)
                    unlink = self._unlinker_for(dir_fd, identity)
                    mapping = self._map(True, fd, nbytes, record_json, where, unlink, publishing, allocate=allocate)
                except BaseException:  # an interrupt too: no temporary file, no half-made region left
                    st = os.fstat(fd)
                    os.close(fd)
                    _files.remove_file(dir_fd, temp, (st.st_dev, st.st_ino))
                    _files.remove_file(dir_fd, self._name, (st.st_dev, st.st_ino))
                    raise
                self._made = identity
                return mapping
            fd = _files.open_region_file(dir_fd, self._path)
            try:
                st = os.fstat(fd)
                # This object made it and kept it (a pool opened again): it is still the creator.
                made = self._made == (st.st_dev, st.st_ino)
                if self._adopt and not made:
                    made = self._check_orphan(fd, st)
                unlinker = self._unlinker_for(dir_fd, (st.st_dev, st.st_ino)) if made else None
                mapping = self._map(False, fd, nbytes, record_json, where, unlinker, allocate=allocate)
                if self._adopt:
                    mapping._set_keep_flag(self._keep)  # doctor shows what the adopter will do
                return mapping
            except BaseException:
                os.close(fd)
                raise
        finally:
            os.close(dir_fd)

    def _check_orphan(self, fd: int, st: os.stat_result) -> bool:
        """For ``adopt=True``: :class:`ConfigError` unless the region is an orphan (its creator gone, on
        this host, and no other process maps it): this process then removes it when it lets go, unless kept."""
        try:
            info = region_info(self._where(), st, read_trailer(fd, st.st_size))
        except NotRegion:
            return True  # attaching says what the file holds
        if info.creator_alive is False:
            try:  # held (our open file's lock) until attaching turns it into the mapping's LOCK_SH
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ConfigError(
                    f"SharedMemory({self._where()}, adopt=True): its creator is gone, but a running process maps it "
                    "(it was re-attached already): only one process adopts a region; attach without adopt=True"
                ) from None
            return True
        if info.creator_alive:
            why = f"its creator (pid {info.created_pid}) is running: only it removes the region"
        elif info.created_pid is None:
            why = "its trailer names no creator pinpool can look for"
        else:
            why = f"it was made on host {info.created_host!r}, where pinpool cannot tell whether its creator lives"
        raise ConfigError(
            f"SharedMemory({self._where()}, adopt=True): {why}. Attach without adopt=True (an attacher never "
            "removes the file), or stop its creator first"
        )

    def _unlinker_for(self, dir_fd: int, identity: tuple[int, int]) -> Callable[[], Unlinker]:
        return lambda: Unlinker(os.dup(dir_fd), self._name, identity, keep=self._keep)

    def _map(
        self, create: bool, fd: int, nbytes: int, record_json: str, where: str,
        unlinker: Callable[[], Unlinker] | None, publish: Callable[[], None] | None = None, *,
        allocate: Sequence[tuple[int, int]] | None = None,
    ) -> SharedMapping:  # fmt: skip
        page_size, path, directory = self._page_size, self._path, self._directory
        if create:
            return create_mapping(
                fd, nbytes, record_json, where, page_size=page_size, keep=self._keep, seal=bool(self._memfd_flags),
                path=path, directory=directory, unlinker=unlinker, publish=publish, allocate=allocate,
            )  # fmt: skip
        return attach_mapping(
            fd, nbytes, record_json, where, page_size=page_size, path=path, directory=directory, unlinker=unlinker,
            allocate=allocate,
        )  # fmt: skip
