"""What one rank of a bench job costs its host, for the launcher's check before `--np`
starts any rank (transports/host_limits.py): its private memory, its /dev/shm and its
threads, from the same geometry the Communicator asks for."""

from __future__ import annotations

from commref.collectives.options import CommOptions
from commref.collectives.verify import DTYPES
from commref.transports import host_limits
from commref.transports.gin.options import Network, Path

from . import plugins
from .arguments import kept_iteration_times, sweep_sizes
from .series import communicator_kwargs, series_of

# Private memory of a bench rank beyond the interpreter's, per byte of the largest size's
# sendbuf + recvbuf: the buffers, their inputs and expected results, and the baseline's.
# Measured: all_gather -e 32M on 2 ranks (48 MiB of buffers), RssAnon 232 MiB at its
# peak against 46 MiB at start: 3.9x.
BENCH_BUFFER_FACTOR = 4
# -I 1: bytes per kept iteration time (a float in a list, the allgathered lists and the
# statistics' copies), every rank holding every rank's.
ITERATION_TIME_BYTES = 64


def connection_window_bytes(options: CommOptions, nranks: int) -> int:
    """Bytes of the connection window a CPU Communicator with `options` registers on each
    of `nranks` ranks of one host (its FIFOs, flags and GIN queue: the size
    Communicator.__init__ asks abi.window_layout for, from the same defaults)."""
    from commref.collectives import tuner
    from commref.device_kernels import abi

    gin = options.gin.path != Path.LSA
    network = (options.gin.network.value if options.gin.network != Network.AUTO else Network.SHM.value) if gin else None
    defaults = tuner.defaults("cpu", nranks, network)
    channels = options.max_channels or defaults.max_channels
    nsteps = options.nsteps or defaults.nsteps
    signals = 0
    if options.device_window:
        signals = abi.devcomm_reserved_signals(nranks, options.device_contexts) + options.device_signals
    return (
        abi.window_layout(
            channels + abi.p2p_channels(nranks),
            options.slot_bytes or defaults.slot_bytes,
            nsteps,
            options.gin.queue if gin else 0,
            options.gin.counters,
            nranks,
            signals,
        )[1]
        + options.device_window
    )


def rank_tasks(options: CommOptions, nranks: int) -> int:
    """Threads of one CPU rank: the interpreter's and MPI's (3 measured with one channel,
    counted as the channel's plus RANK_TASKS), one per channel (a CPU block is an OS
    thread) and the GIN proxy's."""
    from commref.collectives import tuner

    channels = options.max_channels or tuner.defaults("cpu", nranks).max_channels
    return host_limits.RANK_TASKS + channels + (1 if options.gin.path != Path.LSA else 0)


def sweep_footprint(args, nranks: int) -> host_limits.Footprint:
    """One rank of `commref bench COLLECTIVE --np nranks`: every series' connection
    window, the symmetric buffers of -R 2 series and MPICH's segment in /dev/shm; the
    largest size's buffers in private memory."""
    plugin = plugins.get(args.collective)
    itemsize = DTYPES[args.datatype].itemsize
    largest = sweep_sizes(args.minbytes, args.maxbytes, args.stepfactor, args.stepbytes)[-1]
    c = plugin.counts(largest, itemsize, nranks)
    buffers = (c.send + c.recv) * itemsize
    shm, tasks = host_limits.MPICH_SHM_PER_RANK, 0
    for s in series_of(args):
        options = CommOptions.from_kwargs(device="cpu", **communicator_kwargs(args, s))
        shm += connection_window_bytes(options, nranks) + (buffers + 2 * 4096 if s.register == 2 else 0)
        tasks = max(tasks, rank_tasks(options, nranks))
    kept = ITERATION_TIME_BYTES * kept_iteration_times(args, nranks)
    return host_limits.Footprint(host_limits.RANK_MEMORY + BENCH_BUFFER_FACTOR * buffers + kept, shm, tasks)


def program_footprint(buffer_bytes: int, communicators: int, nranks: int) -> host_limits.Footprint:
    """One rank of a bench program (programs.py): `communicators` communicators alive at
    once, each with a GIN connection window of the default geometry, MPICH's segment and
    `buffer_bytes` of buffers in /dev/shm (symmetric ones), and those buffers in private
    memory as the sweep's are counted."""
    options = CommOptions.from_kwargs(device="cpu", path="gin")
    shm = host_limits.MPICH_SHM_PER_RANK + communicators * connection_window_bytes(options, nranks) + buffer_bytes
    return host_limits.Footprint(
        host_limits.RANK_MEMORY + BENCH_BUFFER_FACTOR * buffer_bytes, shm, rank_tasks(options, nranks)
    )
