"""GIN: proxy-driven put/signal between ranks (NCCL's GPU-Initiated Networking model).

- semantics: the one definition of what a transport and a backend allow to land next
  (used by the runtime wire and by the ordering explorer);
- backends: capability reports and selection;
- proxy: the per-rank progress thread that drains the device queue over a wire.
"""
