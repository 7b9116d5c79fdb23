"""The failure paths on a GPU, ranks as threads of one process on one GPU: each case
must end in the error it names, on every rank, well before the communicator's deadline
(a hang is the failure these guard against).

    python tests/gpu/failures_gpu.py            # every case
    python tests/gpu/failures_gpu.py abort      # some of: mismatch abort proxy residency

- mismatch: rank 1 calls AllReduce with max where rank 0 calls it with sum: CommMismatch
  on both, raised at synchronize (the kernels compare the call descriptors).
- abort: rank 1 raises before its call while rank 0's kernel waits for it: rank 0's
  kernel sees the abort word and leaves; CommAborted at synchronize.
- proxy: the GIN copy-engine proxy's copy fails (planted): the proxy raises the abort
  word, and the host raises the proxy's error or CommAborted.
- residency: more ranks x channels than the GPU can hold at once (the driver's
  occupancy answer, not a stand-in): CapabilityError before anything is launched.
Prints one line per case; exits non-zero if any case ends otherwise.
"""

import os
import sys
import time

import numpy as np

from commref import CapabilityError, CommAborted, CommMismatch, ThreadWorld
from commref.collectives.communicator import Communicator
from commref.collectives.gpu_stream import use_rank_gpu
from commref.device_kernels import abi
from commref.transports.gin import cuda_driver

TIMEOUT = float(os.environ.get("COMMREF_TIMEOUT", 20))  # the communicators' deadline; every case ends before it
COUNT = 1 << 16


class Planted(RuntimeError):
    pass


def _stream():
    import cupy

    s = cupy.cuda.Stream(non_blocking=True)
    s.use()
    return s


def _call(world, comm, op="sum"):
    import cupy

    x = cupy.ones(COUNT, np.float32)
    comm.allreduce(x, x, op)
    comm.synchronize()


def mismatch(world):
    use_rank_gpu(world)
    _stream()
    comm = Communicator(world, "cuda", max_channels=1, timeout=TIMEOUT)
    try:
        _call(world, comm, "max" if world.rank == 1 else "sum")
    except CommMismatch as e:
        return type(e).__name__, str(e)
    finally:
        comm.close()
    return None, "the call completed"


def abort(world):
    use_rank_gpu(world)
    _stream()
    with Communicator(world, "cuda", max_channels=1, timeout=TIMEOUT) as comm:
        world.barrier(what="communicators ready")
        if world.rank == 1:
            time.sleep(0.5)  # rank 0's kernel is waiting for this rank by now
            raise Planted("rank 1 fails before its call")
        try:
            _call(world, comm)
        except CommAborted as e:
            return type(e).__name__, str(e)
    return None, "the call completed"


def proxy(world):
    use_rank_gpu(world)
    _stream()
    comm = Communicator(world, "cuda", path="gin", max_channels=1, timeout=TIMEOUT)
    try:
        _call(world, comm)
    except Exception as e:  # noqa: BLE001 - the proxy's ProxyError, or CommAborted
        return type(e).__name__, str(e)
    finally:
        try:
            comm.close()
        except Exception:  # noqa: BLE001 - the job failed already
            pass
    return None, "the call completed"


def residency(world):
    use_rank_gpu(world)
    _stream()
    comm = Communicator(world, "cuda", max_channels=abi.MAX_CHANNELS, timeout=TIMEOUT)
    try:
        spec = comm.kernel_spec("allreduce", "float32", "sum")
        comm.gpu_stream.check_residency(comm.kernels, "commref_ring_allreduce", spec, abi.MAX_CHANNELS, comm.threads)
    except CapabilityError as e:
        return type(e).__name__, str(e)
    finally:
        comm.close()
    return None, "the blocks were accepted"


def residency_ranks() -> int:
    """Enough ranks that they with MAX_CHANNELS blocks each cannot be resident at once."""

    def probe(world):
        use_rank_gpu(world)
        comm = Communicator(world, "cuda", max_channels=1)
        try:
            spec = comm.kernel_spec("allreduce", "float32", "sum")
            return comm.kernels.max_active_blocks("commref_ring_allreduce", spec, comm.threads), comm.kernels.sm_count
        finally:
            comm.close()

    ((per_sm, sms),) = ThreadWorld.run(1, probe, timeout=60)
    return per_sm * sms // abi.MAX_CHANNELS + 1


CASES = {
    "mismatch": ("CommMismatch",),
    "abort": ("CommAborted",),
    "proxy": ("ProxyError", "CommAborted"),
    "residency": ("CapabilityError",),
}


def run(name: str) -> bool:
    """One case; True when every rank (in abort: every rank but the failing one) ended in
    the expected error before the deadline."""
    expected, outcome = CASES[name], {}
    nranks = residency_ranks() if name == "residency" else 2

    def body(world):
        outcome[world.rank] = globals()[name](world)

    saved = cuda_driver.CudaDriver.copy
    if name == "proxy":

        def copy(self, *args):
            raise Planted("planted copy-engine failure")

        cuda_driver.CudaDriver.copy = copy
    t0 = time.monotonic()
    try:
        ThreadWorld.run(nranks, body, timeout=TIMEOUT * 3)
    except Planted:  # abort: rank 1's own exception; the others' outcomes are what count
        pass
    except Exception as e:  # noqa: BLE001 - reported below as this case's outcome
        outcome.setdefault(-1, (type(e).__name__, str(e)))
    finally:
        cuda_driver.CudaDriver.copy = saved
    elapsed = time.monotonic() - t0
    ranks = [r for r in range(nranks) if not (name == "abort" and r == 1)]
    results = [outcome.get(r, (None, "no outcome")) for r in ranks] + ([outcome[-1]] if -1 in outcome else [])
    ok = all(kind in expected for kind, _ in results) and elapsed < TIMEOUT
    first = " ".join(results[0][1].split())[:160]
    print(
        f"{'ok  ' if ok else 'FAIL'} {name}: {nranks} ranks, {[k for k, _ in results]} in {elapsed:.1f} s "
        f"(expected {' or '.join(expected)} before the {TIMEOUT:g} s deadline): {first}",
        flush=True,
    )
    return ok


def main(argv) -> int:
    names = argv or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print(f"unknown case {unknown[0]!r}: the cases are {' '.join(CASES)}")
        return 2
    return 0 if all([run(n) for n in names]) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
