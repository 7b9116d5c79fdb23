"""The device API from Python: what users' kernels run on, and what is built on it.

- device_comm: the device communicator (``DeviceComm``, NCCL's ncclDevComm) and
  ``Kernel``, a kernel written against include/commref/device.h, compiled and launched
  with the same source on a GPU and on the CPU engine;
- ep_buffer: expert parallelism's ``Buffer`` (MoE dispatch and combine in DeepEP's two
  modes) on a DeviceComm and the kernels of device_kernels/kernels/device_api/ep.cu;
  its public name is ``commref.ep``;
- ep_check: exact checks of the Buffer's results, as DeepEP's tests make them;
- requirements: what a device communicator is asked for (``DeviceRequirements``) and
  what it has (``DeviceProperties``, ``DeviceComm.properties()``);
- conformance: the device API's promises as litmus tests and their outcome classes per
  wire (tests/test_device_conformance.py, the table of docs/device-api.md).

The device communicator's names are re-exported here (``from
commref.collectives.device_api import DeviceComm, Kernel``).
"""

from .device_comm import CompileError, DeviceComm, Kernel, KernelError, UsesDeviceComm
from .requirements import DeviceProperties, DeviceRequirements

__all__ = [
    "DeviceComm",
    "DeviceProperties",
    "DeviceRequirements",
    "Kernel",
    "UsesDeviceComm",
    "CompileError",
    "KernelError",
]
