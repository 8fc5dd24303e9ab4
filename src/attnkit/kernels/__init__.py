"""attnkit's kernels: the machine probe, the C kernels it builds, and the dispatch policy.

* :mod:`attnkit.kernels.probe`: what this machine can do, probed once.
* :mod:`attnkit.kernels.build`: building, caching and loading the C kernels and the C++ ops.
* :mod:`attnkit.kernels.binding`: the C functions' ``ctypes`` signatures.
* :mod:`attnkit.kernels.attention`, :mod:`attnkit.kernels.linear`, :mod:`attnkit.kernels.rows`:
  one module per kernel family; :mod:`attnkit.kernels.tiles`: the flash loop's keyword options.
* :mod:`attnkit.kernels.ops`: every ``torch.library`` op, in one place.
* :mod:`attnkit.kernels.policy`: every choice between kernels, by rule or by a cached
  measurement (``attnkit kernels`` shows them), answered with the records of
  :mod:`attnkit.kernels.plans`; :mod:`attnkit.kernels.tuning`: how a choice is decided, measured
  and cached; :mod:`attnkit.kernels.timing`: the candidates it times.
"""

from attnkit.kernels import ops as ops  # (registers the ops: compiled graphs call them)
