"""attnkit's kernels: the machine probe, the dispatch policy, and the C kernels it builds.

* :mod:`attnkit.kernels.probe`: what this machine can do, probed once.
* :mod:`attnkit.kernels.policy`: every choice between kernels, by rule or by a cached
  measurement (``attnkit kernels`` shows them).
"""
