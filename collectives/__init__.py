"""Policy: the Communicator, the collective catalogue, typed options, the launch
record, topology, the tuner and verification (commref.collectives)."""
