"""The accelerator platform: streams, events, host-memory pinning, collective backend, memory stats.

Owns: the one small interface the engine uses, with `cuda` (NCCL), `npu` (torch_npu + HCCL) and
`cpu` (gloo; streams and events are no-ops, so work runs in program order) implementations. The same
engine code runs on all three, which is how CI tests the real logic multi-process on CPU.
Must never: be imported without torch (it is engine-only), hide a failed pin (callers report it).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
from typing import Any

import torch


log = logging.getLogger(__name__)

# cudaHostRegister flags
_CUDA_HOST_REGISTER_DEFAULT = 0x00
_CUDA_HOST_REGISTER_READ_ONLY = 0x08


class Platform:
    """CPU: no streams, no events; host memory is 'pinned' with mlock so VmLck shows it."""

    name = "cpu"
    backend = "gloo"
    has_streams = False
    registers_host_memory = False  # whether register_read_only can make file mappings DMA-able

    def device(self, local_rank: int = 0) -> torch.device:
        """This rank's device (ranks share devices round-robin), made the current one."""
        return torch.device("cpu")

    # ---- streams and events (no-ops on CPU: work is synchronous and in program order) ----------
    def new_stream(self, role: str) -> Any:
        return None

    def current_stream(self) -> Any:
        return None

    def set_stream(self, stream: Any) -> None:
        """Make `stream` current without a context manager (the hot path switches twice per block)."""

    def new_event(self, timing: bool = False) -> Any:
        return None

    def record(self, event: Any, stream: Any) -> None:
        pass

    def wait(self, stream: Any, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def host_wait(self, event: Any) -> None:
        """Block the host until `event` has completed (CPU: work ran in program order, nothing to wait for)."""

    # ---- host memory -----------------------------------------------------------------------------
    def pin(self, t: torch.Tensor) -> bool:
        """Make `t`'s memory DMA-able in place (one call for the whole tensor). False if refused."""
        return _mlock(t.data_ptr(), t.numel() * t.element_size())

    def unpin(self, t: torch.Tensor) -> None:
        _munlock(t.data_ptr(), t.numel() * t.element_size())

    def register_read_only(self, ptr: int, nbytes: int) -> bool:
        """Register a read-only file mapping for DMA (zero-copy weights). CPU: nothing to do."""
        return False

    def unregister(self, ptr: int) -> None:
        pass

    # ---- memory stats ----------------------------------------------------------------------------
    def memory_peak(self, device: torch.device) -> int:
        return 0

    def free_memory(self, device: torch.device) -> int:
        """Bytes the device could still allocate (0 where host memory is the device memory)."""
        return 0

    def elapsed_seconds(self, start: Any, end: Any) -> float | None:
        """Seconds between two recorded timing events, or None if they have not completed yet."""
        return None

    def reset_peak(self, device: torch.device) -> None:
        pass


class CudaPlatform(Platform):
    name = "cuda"
    backend = "nccl"
    has_streams = True
    registers_host_memory = True

    def device(self, local_rank: int = 0) -> torch.device:
        dev = torch.device("cuda", local_rank % max(1, torch.cuda.device_count()))
        torch.cuda.set_device(dev)
        return dev

    def new_stream(self, role: str) -> torch.cuda.Stream:
        # Weight traffic gets high priority so a long compute kernel queue never starves it.
        return torch.cuda.Stream(priority=-1)

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream()

    def set_stream(self, stream: torch.cuda.Stream) -> None:
        # torch.cuda.stream()'s context manager costs ~10 us per switch in Python; this is the
        # single call it ends in.
        torch._C._cuda_setStream(
            stream_id=stream.stream_id, device_index=stream.device_index, device_type=stream.device_type
        )

    def new_event(self, timing: bool = False) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=timing)

    def record(self, event: torch.cuda.Event, stream: torch.cuda.Stream) -> None:
        event.record(stream)

    def wait(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def synchronize(self) -> None:
        torch.cuda.synchronize()

    def host_wait(self, event: torch.cuda.Event) -> None:
        event.synchronize()

    def pin(self, t: torch.Tensor) -> bool:
        err = torch.cuda.cudart().cudaHostRegister(
            t.data_ptr(), t.numel() * t.element_size(), _CUDA_HOST_REGISTER_DEFAULT
        )
        if int(err) != 0:
            log.warning("cudaHostRegister failed err=%s bytes=%d", int(err), t.numel() * t.element_size())
            return False
        return True

    def unpin(self, t: torch.Tensor) -> None:
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())

    def register_read_only(self, ptr: int, nbytes: int) -> bool:
        err = torch.cuda.cudart().cudaHostRegister(ptr, nbytes, _CUDA_HOST_REGISTER_READ_ONLY)
        if int(err) != 0:
            log.info("read-only registration refused err=%s bytes=%d", int(err), nbytes)
            # Clear the error so a later, unrelated CUDA check does not report it.
            getattr(torch.cuda.cudart(), "cudaGetLastError", lambda: None)()
            return False
        return True

    def unregister(self, ptr: int) -> None:
        err = torch.cuda.cudart().cudaHostUnregister(ptr)
        if int(err) != 0:
            log.warning("cudaHostUnregister failed err=%s ptr=%#x", int(err), ptr)
            getattr(torch.cuda.cudart(), "cudaGetLastError", lambda: None)()

    def memory_peak(self, device: torch.device) -> int:
        return int(torch.cuda.max_memory_allocated(device))

    def free_memory(self, device: torch.device) -> int:
        free, _total = torch.cuda.mem_get_info(device)
        allocated = int(torch.cuda.memory_allocated(device))
        free = int(free) + int(torch.cuda.memory_reserved(device)) - allocated
        # under `--max-device-memory` (the allocator's per-process fraction) the cap bounds it too
        cap = int(torch.cuda.get_per_process_memory_fraction(device) * torch.cuda.get_device_properties(device).total_memory)
        return max(0, min(free, cap - allocated))

    def elapsed_seconds(self, start: Any, end: Any) -> float | None:
        if not end.query():
            return None
        return start.elapsed_time(end) / 1e3

    def reset_peak(self, device: torch.device) -> None:
        torch.cuda.reset_peak_memory_stats(device)


class NpuPlatform(CudaPlatform):
    """Ascend through torch_npu and HCCL. Written against torch_npu's documented API; untested here.

    torch_npu exposes no host-register call, so the arena is pinned by one `pin_memory()` of the whole
    arena (one allocation, not one per tensor); the driver's DMA memory is invisible to the cgroup.
    """

    name = "npu"
    backend = "hccl"
    registers_host_memory = False

    def __init__(self) -> None:
        import torch_npu  # noqa: F401  (registers torch.npu)

        self._npu = torch.npu  # type: ignore[attr-defined]

    def device(self, local_rank: int = 0) -> torch.device:
        dev = torch.device("npu", local_rank % max(1, self._npu.device_count()))
        self._npu.set_device(dev)
        return dev

    def new_stream(self, role: str) -> Any:
        return self._npu.Stream()

    def current_stream(self) -> Any:
        return self._npu.current_stream()

    def set_stream(self, stream: Any) -> None:
        self._npu.set_stream(stream)

    def new_event(self, timing: bool = False) -> Any:
        return self._npu.Event(enable_timing=timing)

    def synchronize(self) -> None:
        self._npu.synchronize()

    def pin(self, t: torch.Tensor) -> bool:
        return False  # the arena allocates pinned memory itself on NPU (see class docstring)

    def unpin(self, t: torch.Tensor) -> None:
        pass

    def register_read_only(self, ptr: int, nbytes: int) -> bool:
        return False

    def memory_peak(self, device: torch.device) -> int:
        return int(self._npu.max_memory_allocated(device))

    def free_memory(self, device: torch.device) -> int:
        free, _total = self._npu.mem_get_info(device)
        return int(free)

    def reset_peak(self, device: torch.device) -> None:
        self._npu.reset_peak_memory_stats(device)


def get_platform(device: torch.device | str) -> Platform:
    kind = torch.device(device).type
    if kind == "cpu":
        return Platform()
    if kind == "cuda":
        return CudaPlatform()
    if kind == "npu":
        return NpuPlatform()
    raise ValueError(f"unsupported device type {kind!r}; DLO runs on cuda, npu or cpu")


_libc: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return _libc


def _mlock(ptr: int, nbytes: int) -> bool:
    if nbytes == 0:
        return True
    rc = _lib().mlock(ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes))
    if rc != 0:
        log.info("mlock refused errno=%d bytes=%d: arena stays pageable", ctypes.get_errno(), nbytes)
        return False
    return True


def _munlock(ptr: int, nbytes: int) -> None:
    if nbytes:
        _lib().munlock(ctypes.c_void_p(ptr), ctypes.c_size_t(nbytes))


def leave_group(timeout_s: float = 5.0) -> bool:
    """Leave the default process group, waiting at most `timeout_s`; True if it was left cleanly.

    Tearing down an NCCL communicator waits for every peer and for in-flight work; a peer that is
    gone, or already exiting, can make that wait for ever (seen: `dlo serve` in allgather mode never
    exited after SIGTERM). The teardown runs in a daemon thread: when it does not finish in time the
    caller exits anyway (`os._exit`) and the driver reclaims the communicator with the process.
    """
    import threading

    import torch.distributed as dist

    if not dist.is_initialized():
        return True
    done = threading.Event()

    def destroy() -> None:
        try:
            dist.destroy_process_group()
        except Exception:  # a broken group after a fault: the process is exiting anyway
            log.debug("destroy_process_group failed", exc_info=True)
        done.set()

    threading.Thread(target=destroy, name="leave-group", daemon=True).start()
    if not done.wait(timeout_s):
        log.warning("leaving the process group took over %.0f s; exiting without it", timeout_s)
        return False
    return True


def cap_device_memory(device: torch.device | str, nbytes: int) -> float:
    """Cap this process's device allocator at `nbytes` (emulating a smaller device on a larger one,
    `dlo serve --max-device-memory`); returns the fraction of the device set. ValueError on a device
    without a capping allocator (cpu) or when `nbytes` exceeds the device's memory."""
    device = torch.device(device)
    if device.type == "cuda":
        mod = torch.cuda
    elif device.type == "npu":
        mod = getattr(torch, "npu")
    else:
        raise ValueError(f"--max-device-memory needs a cuda or npu device; this rank runs on {device.type}")
    index = device.index if device.index is not None else mod.current_device()
    total = int(mod.get_device_properties(index).total_memory)
    if nbytes > total:
        raise ValueError(f"--max-device-memory {nbytes} bytes is larger than the device's {total} bytes")
    fraction = nbytes / total
    mod.set_per_process_memory_fraction(fraction, index)
    return fraction


@functools.cache
def triton_modules() -> tuple[Any, Any] | None:
    """Triton and `triton.language` (one import per process; None where Triton does not import: not
    installed, or an install that does not match this torch), for the engine's own kernels."""
    try:
        import triton
        import triton.language as tl
    except Exception:
        return None
    return triton, tl
