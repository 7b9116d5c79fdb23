"""GIN: proxy-driven put/signal between ranks (NCCL's GPU-Initiated Networking model).

- semantics: the one definition of what a transport and a backend allow to land next
  (used by the runtime scheduler and by the ordering study);
- backends: capability reports and selection; options and plan: GIN options and the
  planning of a communicator's GIN peers, backend, wire and network; engines: which
  engine carries a plan (native, the Python proxy, on GPUs the copy-engine proxy), started;
- the proxy (proxy.GinProxy, one progress thread per rank) and its parts: queue (the
  descriptor queue, read and written; descriptors decoded in one place), scheduler
  (what lands when, by semantics), wires (shm and mpi behind one interface), observer
  (hooks for tools), atomics (host atomics from a small C++ shim, host_atomics.cpp);
- study: the ordering study (explorer, protocols, stress, report: `commref study`;
  cells: what the runtime asks it).
"""
