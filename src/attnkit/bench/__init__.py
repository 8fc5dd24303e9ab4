"""Measurement harness: attnkit timed side by side against what a user would pick instead.

The one home of attnkit's benchmarks and the top layer of the package (it may import any part
of attnkit; only the ``attnkit bench`` command imports it). Every module that measures writes
JSON with the machine it ran on (:mod:`attnkit.bench.results`); the results pages are generated
from that JSON (:mod:`attnkit.bench.pages`).

* :mod:`attnkit.bench.suite`: block-sparse attention against torch SDPA and the textbook math
  (``attnkit bench``);
* :mod:`attnkit.bench.vs`: one table of attnkit against its alternatives (``attnkit bench --vs``);
* :mod:`attnkit.bench.attention` and :mod:`attnkit.bench.memory`: the core attention's speed and
  the cost model's memory predictions;
* :mod:`attnkit.bench.structured`, :mod:`attnkit.bench.softcap` and :mod:`attnkit.bench.ring`:
  structured, soft-capped and ring attention;
* :mod:`attnkit.bench.decoding`: cached decoding against transformers, the read-bandwidth bound,
  batched decoding, time to first token and the single-row weight layouts;
* :mod:`attnkit.bench.quantization`: weight-only int8/int4 speed, quality, loading memory and
  kernels, measured once;
* :mod:`attnkit.bench.sentence` and :mod:`attnkit.bench.llamacpp`: sentence-transformers and
  llama.cpp as peers;
* :mod:`attnkit.bench.flex`: torch's FlexAttention, the one wrapper every table uses;
* :mod:`attnkit.bench.peers`: optional libraries, imported only where a row needs them, quietly.

Each measuring module runs as ``python -m attnkit.bench.<name> --help``.
"""
