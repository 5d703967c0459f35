"""Ring memory: fixed slots of shared memory, allocated once by the producer.

Two backends behind one interface (``num_slots``, ``slot_bytes``, ``slot(i)``, ``spec()``,
``close()``):

- ``HostRing``: a file in /dev/shm whose space is reserved up front with posix_fallocate, so an
  undersized /dev/shm fails at creation with the bytes needed instead of a SIGBUS later. Page-locked
  with cudaHostRegister when CUDA is available, so copies to the GPU run at full PCIe speed.
- ``CudaRing``: one device allocation (cuMemAlloc, outside PyTorch's caching allocator), exported
  once with cuIpcGetMemHandle and opened once per consumer connection. The GPU is named by UUID,
  so processes with different CUDA_VISIBLE_DEVICES agree on it.

Only the creator (the producer) owns the memory; consumers attach read-only where the backend
allows it. Slot states are not in the shared memory: they live in the producer (common.slots).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import stat
import warnings
from pathlib import Path

import torch

from common.naming import SEGMENT_PREFIX, SHM_DIR, segment_name, sweep_stale_segments


class RingMemoryError(RuntimeError):
    """The ring's memory cannot be had (too little /dev/shm or GPU memory, bad spec...)."""


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    raise AssertionError


def _pin(ptr: int, size: int, read_only: bool) -> bool:
    """cudaHostRegister the range when CUDA is available; False when it is not or fails."""
    if size == 0 or not torch.cuda.is_available():
        return False
    flags = 8 if read_only else 0  # cudaHostRegisterReadOnly
    err = torch.cuda.cudart().cudaHostRegister(ptr, size, flags)
    return int(err) == 0


def _unpin(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


def _slot(flat: torch.Tensor, index: int, num_slots: int, slot_bytes: int) -> torch.Tensor:
    """Slot ``index`` of a ring's bytes ``flat``: a view, no copy."""
    if not 0 <= index < num_slots:
        raise IndexError(f"slot {index} outside ring of {num_slots}")
    return flat[index * slot_bytes : (index + 1) * slot_bytes]


class HostRing:
    """A ring in a /dev/shm segment."""

    backend = "host"

    def __init__(self, path: Path, num_slots: int, slot_bytes: int, owner: bool, fd: int, buf: mmap.mmap) -> None:
        self.path = path
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.owner = owner
        self._fd = fd
        self._mmap = buf
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a read-only mapping: torch warns it is not writable
            self._flat = torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)
        self._ptr = self._flat.data_ptr()
        self.pinned = _pin(self._ptr, len(buf), read_only=not owner)
        self._send_buffers: list[memoryview] | None = None

    @classmethod
    def create(cls, run_tag: str, role: str, num_slots: int, slot_bytes: int) -> HostRing:
        """Make the segment, reserving all its bytes now. Removes stale segments of dead owners first."""
        if num_slots < 1 or slot_bytes < 1:
            raise ValueError("a ring needs at least one slot of at least one byte")
        sweep_stale_segments()
        size = num_slots * slot_bytes
        free = _shm_free_bytes()
        if free < size:
            raise RingMemoryError(
                f"/dev/shm has {_human(free)} free but the ring needs {size} bytes ({_human(size)}: "
                f"{num_slots} slots x {slot_bytes} bytes). Enlarge /dev/shm (e.g. docker --shm-size) "
                f"or lower ring.num_slots / batching.token_budget."
            )
        path = SHM_DIR / segment_name(run_tag, role)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                    raise RingMemoryError(
                        f"/dev/shm could not reserve {size} bytes ({_human(size)}) for the ring at {path}: "
                        f"{exc.strerror}. Enlarge /dev/shm or lower ring.num_slots / batching.token_budget."
                    ) from None
                raise
            buf = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        return cls(path, num_slots, slot_bytes, owner=True, fd=fd, buf=buf)

    @classmethod
    def attach(cls, spec: dict) -> HostRing:
        """Map a producer's segment read-only, after checking the spec cannot point elsewhere."""
        path = Path(spec["path"])
        num_slots, slot_bytes = int(spec["num_slots"]), int(spec["slot_bytes"])
        if path.parent != SHM_DIR or not path.name.startswith(SEGMENT_PREFIX + ".") or "/" in path.name:
            raise RingMemoryError(f"refusing to map {path}: not a ring segment of this project in {SHM_DIR}")
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except FileNotFoundError:
            raise RingMemoryError(f"ring segment {path} does not exist (producer gone?)") from None
        try:
            info = os.fstat(fd)
            size = num_slots * slot_bytes
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
                raise RingMemoryError(f"refusing to map {path}: not a regular file owned by this user")
            if info.st_size != size:
                raise RingMemoryError(f"ring segment {path} has {info.st_size} bytes, the spec says {size}")
            buf = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, num_slots, slot_bytes, owner=False, fd=fd, buf=buf)

    def slot(self, index: int) -> torch.Tensor:
        return _slot(self._flat, index, self.num_slots, self.slot_bytes)

    def send_buffer(self, index: int) -> memoryview:
        """Slot ``index`` as a buffer ZeroMQ sends from without a copy (made for every slot on the first call)."""
        if self._send_buffers is None:
            self._send_buffers = [memoryview(self.slot(i).numpy()) for i in range(self.num_slots)]
        return self._send_buffers[index]

    def spec(self) -> dict:
        return {
            "backend": self.backend,
            "path": str(self.path),
            "num_slots": self.num_slots,
            "slot_bytes": self.slot_bytes,
        }

    def close(self) -> None:
        if self._mmap is None:
            return
        if self.pinned:
            _unpin(self._ptr)
        self._flat = self._send_buffers = None
        try:
            self._mmap.close()
        except BufferError:
            pass  # views still alive elsewhere; the mapping goes when they do
        os.close(self._fd)
        self._mmap = None
        if self.owner:
            self.path.unlink(missing_ok=True)


def _shm_free_bytes() -> int:
    st = os.statvfs(SHM_DIR)
    return st.f_bavail * st.f_frsize


# -- CUDA ----------------------------------------------------------------------------------------


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_char * 64)]


class _Driver:
    """The few CUDA driver calls the ring needs (libcuda ships with every NVIDIA driver)."""

    _lib = None

    @classmethod
    def lib(cls):
        if cls._lib is None:
            lib = ctypes.CDLL("libcuda.so.1")
            u64, size_t = ctypes.c_uint64, ctypes.c_size_t
            lib.cuMemAlloc_v2.argtypes = [ctypes.POINTER(u64), size_t]
            lib.cuMemFree_v2.argtypes = [u64]
            lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(_IpcHandle), u64]
            lib.cuIpcOpenMemHandle_v2.argtypes = [ctypes.POINTER(u64), _IpcHandle, ctypes.c_uint]
            lib.cuIpcCloseMemHandle.argtypes = [u64]
            lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
            cls._lib = lib
        return cls._lib

    @classmethod
    def check(cls, code: int, what: str) -> None:
        if code != 0:
            msg = ctypes.c_char_p()
            cls.lib().cuGetErrorString(code, ctypes.byref(msg))
            raise RingMemoryError(f"{what} failed: CUDA error {code} ({(msg.value or b'?').decode()})")


class _DevicePointer:
    """Exposes raw device memory to torch.as_tensor through __cuda_array_interface__."""

    def __init__(self, ptr: int, size: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (size,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


def device_uuid(index: int) -> str:
    return str(torch.cuda.get_device_properties(index).uuid)


def local_device_of(uuid: str) -> int | None:
    """Index, in this process's CUDA_VISIBLE_DEVICES numbering, of the GPU with this UUID."""
    for index in range(torch.cuda.device_count()):
        if device_uuid(index) == uuid:
            return index
    return None


class CudaRing:
    """A ring in one device allocation shared by CUDA IPC."""

    backend = "cuda"

    def __init__(self, device: int, ptr: int, num_slots: int, slot_bytes: int, owner: bool, handle: bytes) -> None:
        self.device = torch.device("cuda", device)
        self.num_slots = num_slots
        self.slot_bytes = slot_bytes
        self.owner = owner
        self._ptr = ptr
        self._handle = handle
        self._flat = torch.as_tensor(_DevicePointer(ptr, num_slots * slot_bytes), device=self.device)

    @classmethod
    def create(cls, device: int, num_slots: int, slot_bytes: int) -> CudaRing:
        """Allocate the ring on ``device`` (a local index) and export it once."""
        if num_slots < 1 or slot_bytes < 1:
            raise ValueError("a ring needs at least one slot of at least one byte")
        size = num_slots * slot_bytes
        torch.cuda.set_device(device)
        torch.cuda.init()
        free, _ = torch.cuda.mem_get_info(device)
        if free < size:
            raise RingMemoryError(
                f"GPU {device} has {_human(free)} free but the ring needs {size} bytes ({_human(size)}: "
                f"{num_slots} slots x {slot_bytes} bytes). Lower ring.num_slots / batching.token_budget or use ring.backend=host."
            )
        lib = _Driver.lib()
        ptr = ctypes.c_uint64()
        _Driver.check(lib.cuMemAlloc_v2(ctypes.byref(ptr), size), f"allocating {size} bytes on GPU {device}")
        handle = _IpcHandle()
        try:
            _Driver.check(
                lib.cuIpcGetMemHandle(ctypes.byref(handle), ptr.value), "exporting the ring (cuIpcGetMemHandle)"
            )
        except BaseException:
            lib.cuMemFree_v2(ptr.value)
            raise
        # Not bytes(handle.reserved): a c_char array stops at its first NUL byte.
        handle_bytes = ctypes.string_at(ctypes.addressof(handle), ctypes.sizeof(handle))
        return cls(device, ptr.value, num_slots, slot_bytes, owner=True, handle=handle_bytes)

    @classmethod
    def attach(cls, spec: dict) -> CudaRing:
        """Open a producer's ring on the producer's GPU, found by UUID among this process's GPUs.

        Readers on another GPU copy from it over the peer link (``slot(i).to(their_device)``).
        """
        handle_bytes = bytes.fromhex(spec["handle"])
        if len(handle_bytes) != 64:
            raise RingMemoryError("a CUDA IPC handle has 64 bytes")
        local = local_device_of(spec["gpu_uuid"])
        if local is None:
            visible = os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
            raise RingMemoryError(
                f"the producer's ring is on GPU {spec['gpu_uuid']}, which this process cannot see "
                f"(CUDA_VISIBLE_DEVICES={visible}): make that GPU visible to the trainer or use ring.backend=host"
            )
        torch.cuda.set_device(local)
        torch.cuda.init()
        torch.cuda.synchronize(local)  # makes the primary context current on this thread
        handle = _IpcHandle()
        ctypes.memmove(ctypes.addressof(handle), handle_bytes, 64)
        ptr = ctypes.c_uint64()
        lazy_peer_access = 1
        _Driver.check(
            _Driver.lib().cuIpcOpenMemHandle_v2(ctypes.byref(ptr), handle, lazy_peer_access),
            f"opening the producer's ring (GPU {spec['gpu_uuid']}, local cuda:{local})",
        )
        return cls(local, ptr.value, int(spec["num_slots"]), int(spec["slot_bytes"]), owner=False, handle=handle_bytes)

    def slot(self, index: int) -> torch.Tensor:
        return _slot(self._flat, index, self.num_slots, self.slot_bytes)

    def spec(self) -> dict:
        return {
            "backend": self.backend,
            "handle": self._handle.hex(),
            "gpu_uuid": device_uuid(self.device.index),
            "num_slots": self.num_slots,
            "slot_bytes": self.slot_bytes,
        }

    def close(self) -> None:
        if self._ptr is None:
            return
        torch.cuda.synchronize(self.device)
        self._flat = None
        lib = _Driver.lib()
        if self.owner:
            lib.cuMemFree_v2(self._ptr)
        else:
            lib.cuIpcCloseMemHandle(self._ptr)
        self._ptr = None


RingBuffer = HostRing | CudaRing


def create_ring(
    backend: str, *, num_slots: int, slot_bytes: int, run_tag: str = "run", role: str = "ring", device: int = 0
) -> RingBuffer:
    """Make a ring of ``backend`` ("host" or "cuda")."""
    if backend == "host":
        return HostRing.create(run_tag, role, num_slots, slot_bytes)
    if backend == "cuda":
        return CudaRing.create(device, num_slots, slot_bytes)
    raise ValueError(f"ring.backend must be 'host' or 'cuda', got {backend!r}")


def attach_ring(spec: dict) -> RingBuffer:
    """Open the ring a WELCOME describes."""
    backend = spec.get("backend")
    try:
        if backend == "host":
            return HostRing.attach(spec)
        if backend == "cuda":
            if not torch.cuda.is_available():
                raise RingMemoryError("the producer's ring is in GPU memory but this process has no CUDA")
            return CudaRing.attach(spec)
    except (KeyError, TypeError, ValueError) as exc:
        raise RingMemoryError(f"malformed ring description: {exc}") from None
    raise RingMemoryError(f"unknown ring backend {backend!r}")
