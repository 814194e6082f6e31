"""Moving a request's bytes between paged caches and staging: :func:`pack` and :func:`unpack`.

* :mod:`.validate`: every argument checked before anything is launched or written (typed
  :class:`~kvtriton.errors.LaunchError`s, no device synchronisation).
* :mod:`.launch`: dispatch (Triton kernels on CUDA or under the interpreter, the torch reference
  on the CPU), the segment table, one launch per request; :func:`launch_config_for`.
* :mod:`.heuristics`: the launch geometry (word width, vector length, tile shape), pure.
* :mod:`.reference`: the torch pack/unpack, the kernels' oracle and the CPU execution path.

The kernels themselves live in ``kvtriton.kernels`` (moving words only, no policy).
"""

from .heuristics import LaunchConfig
from .launch import launch_config_for, pack, unpack
from .reference import pack_reference, unpack_reference

__all__ = ["LaunchConfig", "launch_config_for", "pack", "pack_reference", "unpack", "unpack_reference"]
