"""Serving: an engine that batches requests continuously over a paged KV cache.

:class:`Engine` takes requests from any thread (:meth:`Engine.add_request`), runs them together
in one loop and reports each token as a :class:`TokenEvent`; :mod:`attnkit.serving.paged` holds
the block pool and the paged attention. Only torch is needed here.
"""

from attnkit.serving.engine import Engine, EngineStats, TokenEvent
from attnkit.serving.sampling import SamplingParams

__all__ = ["Engine", "EngineStats", "SamplingParams", "TokenEvent"]
