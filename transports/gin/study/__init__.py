"""The ordering study: which put/signal protocols are safe on which GIN transport
models, next to the model it explores (semantics.py).

- protocols: the transport models (columns), message shapes, sender programs and
  receiver checks (rows);
- explorer: the exhaustive search (with its reductions) and the matrix of verdicts;
- stress: the same programs run on the real GIN proxy, corruptions counted;
- report: `commref study` (add_arguments, run) and its tables, traces and JSON.
"""
