"""Collectives composed of sends and receives in groups (algorithm "p2p"), as NCCL users
and nccl-tests build them: gather, scatter and alltoallv (Communicator methods, nccl4py's
names and argument order), and nccl-tests' two point-to-point programs sendrecv and
hypercube (no nccl4py method: composed here from send and recv).

Every function here runs on any `comm` with `rank`, `nranks` and nccl4py's
send(buf, peer), recv(buf, peer) and group(): a Communicator, or a baseline built on a
library's send and recv (bench/baselines.py). Counts and displacements are elements.

    gather      every rank's sendbuf (count elements) lands in block r of the root's
                recvbuf (nranks * count); recvbuf is only looked at on the root.
    scatter     block r of the root's sendbuf (nranks * count) lands in rank r's recvbuf;
                sendbuf is only looked at on the root.
    alltoallv   sendcounts[j] elements from sendbuf[sdispls[j]:] go to rank j and land
                at rdispls[rank] of rank j's recvbuf; recvcounts[i] must equal rank i's
                sendcounts[rank]: a disagreement fails on both ranks with the send's and
                recv's CommMismatch (a send and a recv are posted for every peer, count 0
                included, so that 0 against a nonzero count shows too).
    sendrecv    nccl-tests' ring shift: sendbuf to rank + 1, recvbuf from rank - 1.
    hypercube   nccl-tests' hypercube_perf: an allgather by recursive doubling, step k
                exchanging 2^k blocks with rank ^ 2^k; power-of-two ranks only. Each step
                is a group of its own (it sends what the step before received), so a
                hypercube cannot be posted inside a group.

Each call but hypercube is one group of sends and receives, its members recorded
together (a call inside a user's group joins it); the rank's own block is a local copy
made when the call is posted (numpy or CuPy assignment). As NCCL requires of a group's
members, calls of one group must not depend on each other's data. In place: gather's
sendbuf may be block `rank` of its recvbuf, scatter's recvbuf block `rank` of its
sendbuf, hypercube's sendbuf block `rank` of its recvbuf (NCCL's layouts).

The alltoallv layout of `commref check` and `commref bench` (alltoallv_layout) is
nccl-tests' alltoallv: block j of nranks blocks of `count` elements goes to rank j,
rank s sending rank d the first (count - 1 - s - d) mod count elements of its block
(0 where count is 0): deterministic, uneven, the same count both ways of a pair, and 0
for some pairs at small counts (all of them at count 1).
"""

from __future__ import annotations

import functools

import numpy as np

from . import groups

P2P = "p2p"  # the algorithm of every collective here (catalogue.Collective.composed)


def _algorithm(comm, name: str, algorithm) -> None:
    if algorithm not in (None, "auto", P2P):
        raise ValueError(f"rank {comm.rank}: {name} runs algorithm {P2P!r} only, not {algorithm!r}")


def _root(comm, root) -> int:
    n = comm.nranks
    if not isinstance(root, (int, np.integer)) or isinstance(root, bool) or not 0 <= int(root) < n:
        raise ValueError(f"rank {comm.rank}: root must be a rank in [0, {n}), got {root!r}")
    return int(root)


def _flat(comm, buf, name: str):
    """`buf` as one dimension of its elements (itself or a view, never a copy)."""
    if buf is None:
        raise TypeError(f"rank {comm.rank}: {name} is required")
    flags = getattr(buf, "flags", None)
    if flags is None or not hasattr(buf, "reshape"):
        raise TypeError(f"rank {comm.rank}: {name} must be an array, got {type(buf).__name__}")
    if not flags.c_contiguous:
        raise ValueError(f"rank {comm.rank}: {name} must be C-contiguous")
    return buf if buf.ndim == 1 else buf.reshape(-1)  # itself: a repeated call finds its kept operations


def _same_dtype(comm, s, r) -> None:
    if s.dtype != r.dtype:
        raise TypeError(f"rank {comm.rank}: sendbuf dtype {s.dtype} differs from recvbuf dtype {r.dtype}")


def _copy(dst, src) -> None:
    """The rank's own block (a no-op in place)."""
    if dst.size:
        dst[...] = src


def gather(comm, sendbuf, recvbuf, root: int, *, stream=None, algorithm=None) -> None:
    """ncclGather (Communicator.gather): every rank's sendbuf (count elements) lands in
    block `rank` of the root's recvbuf (nranks * count); recvbuf is only looked at on the
    root. A group of sends and receives (algorithm "p2p"); in place: sendbuf == recvbuf +
    rank * count."""
    _algorithm(comm, "gather", algorithm)
    root, r, n = _root(comm, root), comm.rank, comm.nranks
    s = _flat(comm, sendbuf, "sendbuf")
    c = s.size
    if r != root:
        with comm.group():
            comm.send(s, root, stream=stream)
        return
    out = _flat(comm, recvbuf, "recvbuf")
    _same_dtype(comm, s, out)
    if out.size != n * c:
        raise ValueError(
            f"rank {r}: gather root needs recvbuf of nranks * sendcount = {n} * {c} = {n * c} elements, got {out.size}"
        )
    with comm.group():
        for p in range(n):
            if p != r:
                comm.recv(out[p * c : (p + 1) * c], p, stream=stream)
        _copy(out[r * c : (r + 1) * c], s)


def scatter(comm, sendbuf, recvbuf, root: int, *, stream=None, algorithm=None) -> None:
    """ncclScatter (Communicator.scatter): block r of the root's sendbuf (nranks * count)
    lands in rank r's recvbuf (count); sendbuf is only looked at on the root. In place:
    recvbuf == sendbuf + rank * count."""
    _algorithm(comm, "scatter", algorithm)
    root, r, n = _root(comm, root), comm.rank, comm.nranks
    out = _flat(comm, recvbuf, "recvbuf")
    c = out.size
    if r != root:
        with comm.group():
            comm.recv(out, root, stream=stream)
        return
    s = _flat(comm, sendbuf, "sendbuf")
    _same_dtype(comm, s, out)
    if s.size != n * c:
        raise ValueError(
            f"rank {r}: scatter root needs sendbuf of nranks * recvcount = {n} * {c} = {n * c} elements, got {s.size}"
        )
    with comm.group():
        for p in range(n):
            if p != r:
                comm.send(s[p * c : (p + 1) * c], p, stream=stream)
        _copy(out, s[r * c : (r + 1) * c])


def _counts(comm, what: str, values, buf_size: int, displs) -> list[tuple[int, int]]:
    """[(count, displacement)] per peer, each a whole number, inside a buffer of buf_size."""
    n, r = comm.nranks, comm.rank
    counts, displs = list(values), list(displs)
    if len(counts) != n or len(displs) != n:
        raise ValueError(
            f"rank {r}: alltoallv {what}counts and their displacements need {n} entries each, "
            f"got {len(counts)} and {len(displs)}"
        )
    out = []
    for j, (k, d) in enumerate(zip(counts, displs)):
        if any(not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0 for v in (k, d)):
            raise ValueError(
                f"rank {r}: alltoallv {what}counts[{j}] and its displacement must be whole numbers, got {k!r} and {d!r}"
            )
        if d + k > buf_size:
            raise ValueError(
                f"rank {r}: alltoallv {what}counts[{j}] = {k} at displacement {d} runs past the "
                f"{buf_size} elements of {what}buf"
            )
        out.append((int(k), int(d)))
    return out


def alltoallv(comm, sendbuf, sendcounts, sdispls, recvbuf, recvcounts, rdispls, *, stream=None, algorithm=None) -> None:
    """Communicator.alltoallv: sendcounts[j] elements from sendbuf[sdispls[j]:] go to rank
    j and land at rdispls[rank] of rank j's recvbuf (elements). recvcounts[i] must equal
    rank i's sendcounts[rank]: where they differ both ranks raise CommMismatch. Out of
    place only."""
    _algorithm(comm, "alltoallv", algorithm)
    r, n = comm.rank, comm.nranks
    s, out = _flat(comm, sendbuf, "sendbuf"), _flat(comm, recvbuf, "recvbuf")
    _same_dtype(comm, s, out)
    sends = _counts(comm, "send", sendcounts, s.size, sdispls)
    recvs = _counts(comm, "recv", recvcounts, out.size, rdispls)
    if sends[r][0] != recvs[r][0]:
        raise ValueError(
            f"rank {r}: alltoallv sendcounts[{r}] = {sends[r][0]} and recvcounts[{r}] = {recvs[r][0]} "
            "differ (this rank's own block)"
        )
    (k, sd), (_, rd) = sends[r], recvs[r]
    with comm.group():
        for p in range(n):
            if p != r:
                (ks, ds), (kr, dr) = sends[p], recvs[p]
                comm.send(s[ds : ds + ks], p, stream=stream)
                comm.recv(out[dr : dr + kr], p, stream=stream)
        _copy(out[rd : rd + k], s[sd : sd + k])


def sendrecv(comm, sendbuf, recvbuf, *, stream=None, algorithm=None) -> None:
    """nccl-tests' sendrecv: sendbuf to rank + 1, recvbuf (as many elements) from rank - 1.
    On a Communicator, outside a group, the same call on the same arrays again skips
    to its launch (p2p.P2pLauncher.again)."""
    launcher = getattr(getattr(comm, "_scheduler", None), "p2p", None)
    repeat = ("sendrecv", id(sendbuf), id(recvbuf)) if launcher and stream is algorithm is None else None
    if repeat and not groups.grouping() and launcher.again(repeat, (sendbuf, recvbuf)):
        return
    _algorithm(comm, "sendrecv", algorithm)
    r, n = comm.rank, comm.nranks
    s, out = _flat(comm, sendbuf, "sendbuf"), _flat(comm, recvbuf, "recvbuf")
    _same_dtype(comm, s, out)
    if s.size != out.size:
        raise ValueError(f"rank {r}: sendrecv needs sendbuf and recvbuf of equal count, got {s.size} and {out.size}")
    if n == 1:
        _copy(out, s)
        return
    with comm.group():
        comm.send(s, (r + 1) % n, stream=stream)
        comm.recv(out, (r - 1) % n, stream=stream)
    if repeat and s is sendbuf and out is recvbuf and not groups.grouping():
        launcher.keep_sequence(repeat, [("send", s, (r + 1) % n), ("recv", out, (r - 1) % n)])


def device_refusal(device: str) -> str | None:
    """Why these cannot run on `device`, or None: the sends and receives they are made of
    run on the CPU engine only in this version (p2p.record refuses others)."""
    if device != "cpu":
        return f"sends and receives run on the CPU engine (device='cpu') in this version, not {device!r}"
    return None


def power_of_two_refusal(nranks: int) -> str | None:
    """Why hypercube cannot run on `nranks` ranks, or None."""
    if nranks & (nranks - 1):
        return f"hypercube exchanges with rank ^ 2^k, so it needs a power-of-two number of ranks, not {nranks}"
    return None


def hypercube(comm, sendbuf, recvbuf, *, stream=None, algorithm=None) -> None:
    """nccl-tests' hypercube_perf: recvbuf (nranks blocks of sendbuf's count) gets every
    rank's sendbuf in rank order, by log2(nranks) exchanges with rank ^ 2^k."""
    _algorithm(comm, "hypercube", algorithm)
    r, n = comm.rank, comm.nranks
    refusal = power_of_two_refusal(n)
    if refusal:
        raise ValueError(f"rank {r}: {refusal}")
    if groups.grouping():
        raise ValueError(
            f"rank {r}: hypercube's steps send what the step before received; it cannot run inside a group"
        )
    s, out = _flat(comm, sendbuf, "sendbuf"), _flat(comm, recvbuf, "recvbuf")
    _same_dtype(comm, s, out)
    c = s.size
    if out.size != n * c:
        raise ValueError(
            f"rank {r}: hypercube needs recvbuf of nranks * sendcount = {n} * {c} = {n * c} elements, got {out.size}"
        )
    _copy(out[r * c : (r + 1) * c], s)
    mask = 1
    while mask < n:
        mine = r & ~(mask - 1)  # the first of the `mask` blocks this rank holds
        theirs = mine ^ mask
        with comm.group():
            comm.send(out[mine * c : (mine + mask) * c], r ^ mask, stream=stream)
            comm.recv(out[theirs * c : (theirs + mask) * c], r ^ mask, stream=stream)
        mask <<= 1


def pair_count(src: int, dst: int, count: int) -> int:
    """Elements rank `src` sends rank `dst` in the alltoallv layout (the module docstring)."""
    return (count - 1 - src - dst) % count if count else 0


@functools.lru_cache(maxsize=64)
def alltoallv_layout(rank: int, nranks: int, count: int) -> tuple[tuple[int, ...], ...]:
    """(sendcounts, sdispls, recvcounts, rdispls) of `rank` in the alltoallv layout of
    check and bench: blocks of `count` elements, pair counts from pair_count."""
    displs = tuple(j * count for j in range(nranks))
    sends = tuple(pair_count(rank, j, count) for j in range(nranks))
    recvs = tuple(pair_count(i, rank, count) for i in range(nranks))
    return sends, displs, recvs, displs


# The catalogue's calls (catalogue.Collective.compose): f(comm, sendbuf, recvbuf, root,
# **kwargs), one call with nccl-tests' arguments on `comm`, through its method of that
# name where it has one (a Communicator's gather, a baseline's), else composed here.
def _method(comm, name: str, composed):
    method = getattr(comm, name, None)
    return method if method is not None else functools.partial(composed, comm)


def call_gather(comm, sendbuf, recvbuf, root: int, **kwargs) -> None:
    _method(comm, "gather", gather)(sendbuf, recvbuf, root, **kwargs)


def call_scatter(comm, sendbuf, recvbuf, root: int, **kwargs) -> None:
    _method(comm, "scatter", scatter)(sendbuf, recvbuf, root, **kwargs)


def call_alltoallv(comm, sendbuf, recvbuf, root: int, **kwargs) -> None:
    """alltoallv in the layout of check and bench, on buffers of nranks blocks each."""
    sends, sd, recvs, rd = alltoallv_layout(comm.rank, comm.nranks, sendbuf.size // comm.nranks)
    _method(comm, "alltoallv", alltoallv)(sendbuf, sends, sd, recvbuf, recvs, rd, **kwargs)


def call_sendrecv(comm, sendbuf, recvbuf, root: int, **kwargs) -> None:
    method = getattr(comm, "sendrecv", None)  # a baseline's; else composed (no partial: a hot path)
    if method is None:
        sendrecv(comm, sendbuf, recvbuf, **kwargs)
    else:
        method(sendbuf, recvbuf, **kwargs)


def call_hypercube(comm, sendbuf, recvbuf, root: int, **kwargs) -> None:
    _method(comm, "hypercube", hypercube)(sendbuf, recvbuf, **kwargs)
