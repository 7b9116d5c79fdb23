"""Host memory a GPU maps: the flags that pin and map it, and the device address of it.

The launch's host words (collectives/launch_record.py: the error record, the abort word) and
GIN's queue and counters (transports/gin/queue.py: QueueRegion) live in such memory.
"""

from __future__ import annotations

# cudaHostAllocPortable | cudaHostAllocMapped, the same values as
# cudaHostRegisterPortable | cudaHostRegisterMapped.
CUDA_HOST_PORTABLE_MAPPED = 1 | 2


def mapped_device_pointer(ptr: int, device_id: int, registered: bool) -> int:
    """The device address of mapped host memory (what cudaHostGetDevicePointer returns,
    which CuPy does not wrap). With unified addressing it is the host address itself for
    cudaHostAlloc'd memory, and for registered memory where the device can use host
    pointers for it (cudaDevAttrCanUseHostPointerForRegisteredMem); otherwise ask
    cuda-python, and refuse when it is not installed."""
    from cupy.cuda import runtime

    if runtime.deviceGetAttribute(runtime.cudaDevAttrUnifiedAddressing, device_id) and (
        not registered or runtime.deviceGetAttribute(runtime.cudaDevAttrCanUseHostPointerForRegisteredMem, device_id)
    ):
        return ptr
    try:
        from cuda.bindings import runtime as cudart
    except ImportError:
        try:
            from cuda import cudart  # cuda-python before 12.6
        except ImportError:
            from commref.transports.errors import CapabilityError

            raise CapabilityError(
                f"device {device_id} cannot use host pointers for mapped host memory and "
                f"cuda-python (for cudaHostGetDevicePointer) is not installed"
            ) from None
    err, dptr = cudart.cudaHostGetDevicePointer(ptr, 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostGetDevicePointer of host address {ptr:#x} on device {device_id}: error {err}")
    return int(dptr)
