"""The device API from Python: what users' kernels run on, and what is built on it.

- device_comm: the device communicator (``DeviceComm``, NCCL's ncclDevComm) and
  ``Kernel``, a kernel written against include/commref/device.h, compiled and launched
  with the same source on a GPU and on the CPU engine;
- ep_buffer: expert parallelism's ``Buffer`` (MoE dispatch and combine in DeepEP's two
  modes) on a DeviceComm and the kernels of device_kernels/kernels/device_api/ep.cu;
  its public name is ``commref.ep``;
- ep_check: exact checks of the Buffer's results, as DeepEP's tests make them.

The device communicator's names are re-exported here (``from
commref.collectives.device_api import DeviceComm, Kernel``).
"""

from .device_comm import CompileError, DeviceComm, Kernel, KernelError, UsesDeviceComm

__all__ = ["DeviceComm", "Kernel", "UsesDeviceComm", "CompileError", "KernelError"]
