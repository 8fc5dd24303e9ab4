"""Measurement harness: attnkit timed side by side against what a user would pick instead.

The top layer of the package (it may import any part of attnkit; only the ``attnkit bench``
command imports it):

* :mod:`attnkit.bench.suite`: block-sparse attention against torch SDPA and the textbook math
  (``attnkit bench``);
* :mod:`attnkit.bench.vs`: one table of attnkit against its alternatives (``attnkit bench --vs``);
* :mod:`attnkit.bench.decoding`: cached decoding against transformers, the read-bandwidth bound
  and the single-row weight-layout kernels;
* :mod:`attnkit.bench.flex`: torch's FlexAttention with the mask rules of
  :class:`attnkit.masks.Structure`.

Measured results live in ``benchmarks/RESULTS.md``.
"""
