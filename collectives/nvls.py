"""The NVLS AllReduce's policy (kernels/nvls.cu, include/commref/multimem.h): what it
reduces, where it runs, which variant a call takes, and whether a GPU offers NVLink
multicast.

A call of algorithm "nvls" runs over the LSA team only, on buffers from
Communicator.alloc_symmetric, and reduces only the (dtype, op) pairs NVLink multicast
reduces (multimem.ld_reduce): `refusal` says why not otherwise, before anything is
launched. The kernel reads through a multimem handle; in this version the handle is the
LSA emulation (every rank's copy loaded and folded in rank order) on the CPU engine and
on GPUs alike: `multicast_support` reports what the device offers, and nothing binds a
multicast object to the windows yet.
"""

from __future__ import annotations

NVLS = "nvls"
ONE_SHOT, TWO_SHOT = "one_shot", "two_shot"
VARIANTS = (ONE_SHOT, TWO_SHOT)

# What NVLink multicast reduces (multimem.h, multimemSupported): op -> dtypes. avg is a
# sum divided once at the end, as in every kernel.
_SUM = ("float32", "float64", "float16", "bfloat16", "int32", "uint32", "int64", "uint64")
_MIN_MAX = ("float16", "bfloat16", "int32", "uint32", "int64", "uint64")
SUPPORTED: dict[str, tuple[str, ...]] = {"sum": _SUM, "avg": _SUM, "min": _MIN_MAX, "max": _MIN_MAX}

# Up to this many bytes "auto" runs one-shot (every rank reduces the whole buffer:
# one barrier's wait, no stores to peers), above it two-shot (each element reduced once
# in the job). NCCL's symmetric kernels make the same switch by size; this threshold is
# not measured here (the emulation's cost is not multicast's).
ONE_SHOT_MAX_BYTES = 64 * 1024


def supported(dtype: str, op: str | None) -> bool:
    return op in SUPPORTED and dtype in SUPPORTED[op]


def variant(nbytes: int, asked: str = "auto") -> str:
    """The variant a call of `nbytes` runs, asked for as `asked` ("auto": by size).
    One-shot in place runs two-shot in the kernel (nvls.cu says why)."""
    if asked != "auto":
        return asked
    return ONE_SHOT if nbytes <= ONE_SHOT_MAX_BYTES else TWO_SHOT


def refusal(spec_name: str, dtype: str, op, route, peer_mask: int, router_refusal: str | None) -> str | None:
    """Why a call of algorithm "nvls" cannot run: the collective (the tuner names the
    collectives that have it), GIN peers, buffers that are not symmetric (`route`:
    routes.Route), or a (dtype, op) multicast does not reduce; None where it runs."""
    if spec_name != "allreduce":
        return None  # tuner.plan: "implemented for allreduce only"
    if peer_mask:
        peers = [r for r in range(peer_mask.bit_length()) if peer_mask >> r & 1]
        return (
            f"algorithm 'nvls' runs over LSA only (a multimem handle spans the LSA team), "
            f"and ranks {peers} are reached over GIN"
        )
    if route.direct is None:
        why = router_refusal or "its buffers are not symmetric"
        return (
            f"algorithm 'nvls' needs sendbuf and recvbuf from Communicator.alloc_symmetric on every rank "
            f"(a multimem handle stands for the same offset in every rank's window): {why}"
        )
    if not supported(dtype, op):
        ops = "; ".join(f"{o}: {', '.join(d)}" for o, d in SUPPORTED.items())
        return f"algorithm 'nvls' cannot reduce {dtype} with op {op!r}: NVLink multicast reduces only {ops}"
    return None


def multicast_support(device: str, device_id: int = 0) -> str | None:
    """None where device `device_id` reports NVLink multicast
    (CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED), else why not. No driver call on the CPU
    engine, nor without CuPy seeing a GPU."""
    if device != "cuda":
        return "the CPU engine has no NVLink multicast: multimem is emulated by LSA loads and stores"
    try:
        import cupy

        if not cupy.is_available():
            return "no CUDA device is available"
    except Exception:  # noqa: BLE001 - no CuPy, or no usable driver
        return "CuPy does not see a CUDA device"
    try:
        from cuda.bindings import driver as cu
    except ImportError:
        try:
            from cuda import cuda as cu  # cuda-python before 12.6
        except ImportError:
            return "cuda-python is not installed (it queries the multicast attribute)"
    attr = getattr(cu.CUdevice_attribute, "CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED", None)
    if attr is None:
        return "this cuda-python has no CU_DEVICE_ATTRIBUTE_MULTICAST_SUPPORTED"
    err, dev = cu.cuDeviceGet(device_id)[:2]
    if err != cu.CUresult.CUDA_SUCCESS:
        (err,) = cu.cuInit(0)
        err, dev = cu.cuDeviceGet(device_id)[:2]
    if err != cu.CUresult.CUDA_SUCCESS:
        return f"cuDeviceGet({device_id}) failed: {err}"
    err, value = cu.cuDeviceGetAttribute(attr, dev)[:2]
    if err != cu.CUresult.CUDA_SUCCESS:
        return f"cuDeviceGetAttribute(MULTICAST_SUPPORTED) failed: {err}"
    return None if value else f"device {device_id} does not support NVLink multicast (MULTICAST_SUPPORTED = 0)"
