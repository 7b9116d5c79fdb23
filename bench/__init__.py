"""nccl-tests-compatible benchmarks of commref's collectives.

`commref bench <collective> -b 8 -e 64M -f 2 ...` runs :func:`commref.bench.harness.main`.
Layout (nccl-tests' split): one harness owns the size sweep, the timing, the check
and the output (harness.py); each collective is a small plugin (plugins/); baselines
measured in the same run (baselines.py: MPI on CPU, NCCL on GPU); the memory-bandwidth
bound column (bound.py); plots (plot.py).

Bandwidths are nccl-tests': algbw = bytes / time with nccl-tests' byte count per
collective, busbw = algbw * the collective's bus factor (plugins/base.py).
"""
