"""What a Communicator is built from and how it is taken apart: the collective steps of
its setup (which protocols every rank can run, whether every needed peer window is
mapped) and of its teardown, in the order that keeps every peer safe.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from commref.device_kernels import abi
from commref.transports.errors import CapabilityError
from commref.transports.gin.queue import QueueRegion
from commref.transports.windows import rank_nodes, register_window

from . import protocols, rma, topology, tuner
from .hierarchical import Hierarchy, node_shape
from .launch_record import HostWords, LaunchRecord, address_of
from .symmetric import describe_unmapped


def signal_words(options, nranks: int) -> tuple[int, int]:
    """(a device communicator's signal words, all of a communicator's): a device
    communicator's (device_api.DeviceComm: its own and the barriers'), then the host
    one-sided calls' (rma.py)."""
    device = (
        options.device_signals + abi.devcomm_reserved_signals(nranks, options.device_contexts)
        if options.device_window
        else 0
    )
    return device, device + rma.signal_words(options, nranks)


DEVICE_WINDOW_ALIGN = 4096  # bytes: where a device communicator's window starts in the connection window


@dataclass
class Connections:
    """A communicator's connections: the window (its `layout`; a device communicator's
    device window from `device_window_offset`), the GIN queue `region` and `proxy` (None
    without GIN peers), the host words its kernels write and poll, the launch record
    (CollArgs) filled with all of them; and its topology: this rank's NodeShape (or why
    "hierarchical" cannot run), the ring table the record points to, and whether GIN
    runs slower than memory (a network between hosts, or the wire model: tuner.plan)."""

    layout: Any
    device_window_offset: int
    window: Any
    region: Any
    proxy: Any
    host: HostWords
    record: LaunchRecord
    node_shape: Any
    ring_ranks: Any
    slow_network: bool


def connect(comm, device_signals: int) -> Connections:
    """Collective: registers the window of Communicator `comm` (its options, GIN plan,
    geometry and deadline, set before this is called), refuses unmapped peers
    (refuse_unmapped), starts the GIN proxy and fills the launch record."""
    world, o, gin, device, device_id = comm.world, comm.options, comm.gin, comm.device, comm.device_id
    max_channels, slot_bytes, nsteps, timeout = comm.max_channels, comm.slot_bytes, comm.nsteps, comm.timeout
    device_table = comm.device_table  # a table where the kernels read it
    rank, nranks, dev = world.rank, world.size, device_id or 0
    layout, nbytes = abi.window_layout(  # the collectives' channels, then p2p's (p2p.py)
        comm.window_channels, slot_bytes, nsteps, o.gin.queue if gin.used else 0, o.gin.counters, nranks, device_signals
    )
    # The device window (DevComm.windowOff): after the connections' regions, page aligned.
    device_window_offset = -(-nbytes // DEVICE_WINDOW_ALIGN) * DEVICE_WINDOW_ALIGN
    if o.device_window:
        nbytes = device_window_offset + o.device_window
    window = register_window(world, nbytes, device, dev)
    refuse_unmapped(world, window, device, gin.network, gin.peer_mask)
    region = QueueRegion(window, layout, o.gin.queue, o.gin.counters, device, dev) if gin.used else None
    proxy = gin.start_proxy(world, window, layout, region=region, device=device, device_id=dev)
    host = HostWords(world.abort_word, device, dev)
    record = LaunchRecord()
    a = record.record
    a["peerWindows"] = address_of(window.peer_table)
    a["errorRecord"] = host.error_address
    a["abortFlag"] = host.abort_address
    a["timeoutNs"] = int(timeout * 1e9)
    a["layout"] = layout
    a["rank"], a["nranks"] = rank, nranks
    gin.fill_args(a["gin"], comm.window_channels, nsteps, region)
    nodes = rank_nodes(world)  # collective: every rank builds the same rings and trees
    a["peers"] = topology.channel_peers(rank, nodes, max_channels)
    ring_ranks = device_table(topology.ring_ranks(nodes, max_channels))
    a["ringRanks"] = address_of(ring_ranks)
    slow_network = gin.used and (o.gin.wire_modeled or len({h for _, h in nodes}) > 1)
    return Connections(
        layout,
        device_window_offset,
        window,
        region,
        proxy,
        host,
        record,
        node_shape(nodes, rank),
        ring_ranks,
        slow_network,
    )


def protocol_refusals(world, device: str, kernels, places, gin, asked: str) -> dict[str, str]:
    """Collective: protocol -> why some rank cannot run it (collectives/protocols.py),
    the same on every rank. `places`: every rank's (host, pid, PCI bus id) on a GPU
    (gpu_stream.place_on_gpus); `gin`: the rank's GinPlan, whose connections may refuse
    some protocols (GinPlan.protocol_refusal). Refuses (CapabilityError) the protocol
    option `asked` where it is among them (tuner.protocol_refusal), before anything is
    allocated."""
    support = 0
    if device == "cpu":
        support = kernels.protocol_support
        mine = protocols.cpu_refusals(support)
    else:
        reach = world.allgather(protocols.nvlink_reach(places[world.rank][2]), what="GPU NVLinks")
        mine = protocols.gpu_refusals(world.rank, places, reach)
    for p in protocols.PROTOCOLS:
        why = gin.protocol_refusal(p, device, support)
        if why and p not in mine:
            mine[p] = why
    refusals = protocols.merge(world.allgather(mine, what="communicator protocols"))
    refusal = tuner.protocol_refusal(asked, refusals)
    if refusal:
        raise CapabilityError(f"rank {world.rank}: {refusal}")
    return refusals


def refuse_unmapped(world, window, device: str, network: str | None, peer_mask: int) -> None:
    """Collective: every rank refuses (CapabilityError) when any rank could not map
    the window of a peer it reaches over LSA, or on a GPU over GIN on network shm (the
    copy-engine proxy reaches those peers by CUDA IPC), naming why (not on one host, no
    peer access between two GPUs, CUDA IPC failed). The window is released first."""
    rank, nranks = world.rank, world.size
    gin_mapped = device == "cuda" and network == "shm"
    needed = [r for r in range(nranks) if gin_mapped or not (peer_mask >> r) & 1]
    missing = {
        r: window.unmapped.get(r, f"not on its host (its host team: {window.mapped_ranks})")
        for r in needed
        if window.peer_addresses[r] == 0
    }
    everyone = world.allgather(missing, what="window mappings")
    if not any(everyone):
        return
    window.close_peers()
    try:
        world.barrier(what="unusable window unmapped")
        window.free()
    except Exception:  # a peer failed as well: keep the memory rather than free it under a peer
        pass
    if gin_mapped and peer_mask:
        raise CapabilityError(
            f"rank {rank}: {describe_unmapped(rank, everyone)}; GIN on GPUs reaches "
            f"its peers' windows by CUDA IPC (ranks on one host with peer access)"
        )
    raise CapabilityError(
        f"rank {rank}: {describe_unmapped(rank, everyone)}; the LSA path needs "
        f"every peer's window mapped "
        f"(ranks on one host and, on GPUs, peer access; use path='auto' or 'gin')"
    )


ABORTED_DRAIN_S = 1.0  # how long close() lets an aborted communicator's GIN proxy drain
SPLIT_NOCOLOR = -1  # NCCL_SPLIT_NOCOLOR: Communicator.split's color of a rank that joins no child


def split(comm, color, key, overrides: dict, make):
    """Collective: Communicator.split of `comm`, the child made by `make` (the
    Communicator class) on the split world, which it then owns; None for SPLIT_NOCOLOR.
    The child has windows, FIFOs and a GIN proxy of its own, and the parent's options as
    resolved (device, GPU, timeout); close children before their parent (as NCCL asks of
    ncclCommDestroy)."""
    if not isinstance(color, (int, np.integer)) or isinstance(color, bool) or color < SPLIT_NOCOLOR:
        wanted = color  # every rank still takes part: the world's split names the bad rank everywhere
    else:
        wanted = None if color == SPLIT_NOCOLOR else int(color)
    world = comm.world.split(wanted, what="Communicator.split", key=key)
    if world is None:
        return None
    inherited = dict(device=comm.device, device_id=comm.device_id, timeout=comm.timeout)
    try:
        child = make(world, options=comm.options.replace(**{**inherited, **overrides}))
    except BaseException:
        world.free()
        raise
    child.owns_world = True
    return child


def hierarchy(comm, make):
    """Collective: the Hierarchy of `comm` (hierarchical.py), its intra- and inter-node
    children made by `make` (the Communicator class) on split worlds with comm's
    options, the algorithm left to their tuners."""
    shape, world = comm.node_shape, comm.world
    options = comm.options.replace(
        algorithm="auto",
        max_channels=comm.max_channels,
        threads=comm.threads,
        timeout=comm.timeout,
        device_id=comm.device_id,
    )
    intra = inter = None
    try:
        intra = make(world.split(shape.node, what="hierarchical: the node's ranks"), options=options)
        intra.owns_world = True
        inter = make(world.split(shape.local, what="hierarchical: one rank per node"), options=options)
        inter.owns_world = True
    except BaseException:
        for child in (inter, intra):
            if child is not None:
                child.close()
        raise
    return Hierarchy(shape, intra, inter, comm.nranks)


def release(comm) -> list[Exception]:
    """Collective: takes Communicator `comm` apart (its close()); returns the errors met
    on the way. What a failed constructor never built is absent (None here).

    The order keeps every peer safe: this rank's kernels are waited for (GPU), the
    GIN proxies deliver what their kernels posted before any proxy stops, every rank
    reaches a barrier (no kernel of the communicator runs any more), each rank closes
    its mappings of the peers' windows (CUDA IPC handles; also those of
    alloc_symmetric's windows), a second barrier, and only then each rank frees its
    own memory, which no peer maps or writes any longer.

    After a failure it still returns: the barriers have deadlines (`timeout`) and a
    ThreadWorld whose rank failed ends them at once. Memory a peer might still use (a
    barrier failed, or this rank's kernels did not finish within twice the timeout) is
    left allocated, not freed under a peer."""
    get = comm.__dict__.get
    world, timeout, gpu = comm.world, comm.timeout, comm.device == "cuda"
    hierarchy, stream, proxy, region = get("_hierarchy"), get("gpu_stream"), get("proxy"), get("gin_region")
    symmetric, window, host = get("_symmetric"), get("window"), get("_host")
    errors: list[Exception] = []
    if hierarchy is not None:  # its children first: collective, like the rest of close
        try:
            hierarchy.close()
        except Exception as e:
            errors.append(e)
    kernels_done = _wait_quietly(stream, timeout, errors) if gpu else True
    if proxy is not None:
        try:
            # After an abort a kernel may have left a queue slot claimed and unpublished
            # (wait.h): what can drain does so at once, and nothing waits a deadline for it.
            proxy.quiesce(min(timeout, ABORTED_DRAIN_S) if host is not None and host.aborted else timeout)
            world.barrier(what="GIN proxies drained")
        except Exception as e:
            errors.append(e)
        finally:
            proxy.stop()
    if region is not None and kernels_done:  # no kernel posts, no proxy reads any more
        region.close()
    if not gpu:  # launches are synchronous and peers keep their mappings alive themselves
        if symmetric is not None:
            symmetric.close()
        if window is not None:
            window.close()
        return errors
    peers_done = _barrier_quietly(world, timeout, "communicator closing: kernels done", errors)
    if kernels_done:  # our kernels no longer read the peers' windows
        if symmetric is not None:
            symmetric.close_peers()
        if window is not None:
            window.close_peers()
    if peers_done:  # else some peer is gone or failed: nothing will be freed, no second wait
        peers_done = _barrier_quietly(world, timeout, "communicator closing: peer windows unmapped", errors)
    if kernels_done and peers_done:
        if symmetric is not None:
            symmetric.free_all()
        if window is not None:
            window.free()
        try:
            if host is not None:
                host.close()
        except Exception as e:
            errors.append(e)
    return errors


def _wait_quietly(stream, timeout: float, errors: list) -> bool:
    """Waits (bounded) for this rank's kernels; False if they still run."""
    try:
        return stream.wait(stream.handle, time.monotonic() + 2 * timeout + 1)
    except Exception as e:  # a CUDA error (or no stream was made): nothing of ours runs any more
        errors.append(e)
        return True


def _barrier_quietly(world, timeout: float, what: str, errors: list) -> bool:
    try:
        world.barrier(what=what, timeout=timeout)
        return True
    except Exception as e:
        errors.append(e)
        return False
