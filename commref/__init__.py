"""commref: collective-communication kernels in the style of NCCL's Device API.

The public face: ``Communicator`` (nccl4py-shaped collectives over LSA peer memory and
GIN), the worlds that bootstrap ranks (``MPIWorld``, one rank per process;
``ThreadWorld``, ranks as threads of one process), groups of calls (``group``,
``group_start``, ``group_end``: NCCL's ncclGroupStart/End), users' own kernels on a device
communicator (``DeviceComm``, ``Kernel``: include/commref/device.h; ``DeviceRequirements``,
``DeviceProperties``), and the error types. The
``commref`` command (check, bench, study) is ``commref.cli``.
"""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version
from pathlib import Path as _Path

# In a source tree the layer folders (collectives/, device_kernels/, transports/, bench/)
# lie beside this package rather than in it (pyproject's package-dir maps them at
# install): let commref.<layer> find them there too, so a checkout runs without an
# install (PYTHONPATH=<checkout>, as tests/gpu/gpu_check.sh does). An installed copy
# has them inside and no such sibling.
_TREE = _Path(__file__).resolve().parent.parent
if (_TREE / "collectives" / "catalogue.py").is_file() and str(_TREE) not in __path__:
    __path__.append(str(_TREE))

from commref.collectives.communicator import Communicator
from commref.collectives.device_api import CompileError, DeviceComm, DeviceProperties, DeviceRequirements, Kernel
from commref.collectives.groups import group, group_end, group_start
from commref.collectives.rma import RegisteredWindow, WaitSignalDesc
from commref.collectives.setup import SPLIT_NOCOLOR
from commref.transports.errors import CapabilityError, CommAborted, CommMismatch, CommrefError, CommTimeout
from commref.transports.mpi_world import MPIWorld
from commref.transports.thread_world import ThreadWorld
from commref.transports.world import World

try:
    __version__ = _version("commref")
except PackageNotFoundError:  # a source tree that was not installed
    __version__ = "0+unknown"

__all__ = [
    "Communicator",
    "RegisteredWindow",
    "WaitSignalDesc",
    "SPLIT_NOCOLOR",
    "group",
    "group_start",
    "group_end",
    "DeviceComm",
    "DeviceRequirements",
    "DeviceProperties",
    "Kernel",
    "CompileError",
    "MPIWorld",
    "ThreadWorld",
    "World",
    "CommrefError",
    "CommTimeout",
    "CommAborted",
    "CommMismatch",
    "CapabilityError",
    "__version__",
]
