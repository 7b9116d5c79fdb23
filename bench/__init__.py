"""nccl-tests-compatible benchmarks of commref's collectives.

`commref bench <collective> -b 8 -e 64M -f 2 ...` runs :func:`commref.bench.harness.main`.
Layout (nccl-tests' split): one harness owns the size sweep, the timing, the check
and the output (harness.py, the run on each rank; its flags in arguments.py with the
value types of flags.py, the series measured side by side in series.py, the timed and
checked calls in measure.py, the table and JSON document in output.py); each
collective is a small plugin (plugins.py); baselines measured in the same run
(baselines.py: MPI on CPU, NCCL on GPU); the memory-bandwidth bound column (bound.py);
plots (plot.py). Beside the sweep, the bench programs
(programs.py: ep, gin_rate, soak, engine), each run by `commref bench NAME`.

Bandwidths are nccl-tests': algbw = bytes / time with nccl-tests' byte count per
collective, busbw = algbw * the collective's bus factor (plugins.py, from the catalogue).
"""
