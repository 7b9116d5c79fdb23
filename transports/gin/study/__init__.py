"""The ordering study: which put/signal protocols are safe on which GIN transport
models, next to the model it explores (semantics.py).

- signaling: the put/signal protocols (rows: a sender program and a receiver check
  each), the transport models (columns) and the message shapes;
- explorer: the exhaustive search (with its reductions) and the matrix of verdicts;
- stress: the same programs run on the real GIN proxy, corruptions counted;
- report: `commref study` (add_arguments, run) and its tables, traces and JSON.
- cells: what the runtime asks the study (which cell models a wire, its verdict).
"""
