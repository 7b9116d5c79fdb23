"""Device side (commref.device_kernels): one CUDA C++ source for GPU and CPU, the CPU
execution engine, the ABI shared with Python, and the builds that load the kernels:
build (what both share), cpu_loader, gpu_loader, and loader (the command that builds
them into the cache ahead of use)."""
