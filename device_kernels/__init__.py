"""Device side: one CUDA C++ source for GPU and CPU, the CPU execution engine, the ABI
shared with Python, and the loader (commref.device_kernels)."""
