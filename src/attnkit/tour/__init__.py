"""``attnkit tour``: every claim of the blog (and five on today's variants), measured on attnkit's
own modules.

* :mod:`attnkit.tour.claims`: one check per claim; each measures and returns a
  :class:`ClaimResult` (verdict, numbers, what its picture needs);
* :mod:`attnkit.tour.figures`: one drawing per claim, from its result (matplotlib);
* :mod:`attnkit.tour.report`: :func:`run_tour` runs them in the blog's order and writes
  ``report.html``, ``claims.json``, the figures and the trained model's explorer.

Needs matplotlib (the ``viz`` extra) for the figures and tqdm (``lab``) for the training.
"""

from attnkit.tour import claims
from attnkit.tour.claims import *  # noqa: F403  (the checks, named once in claims.__all__)
from attnkit.tour.figures import draw
from attnkit.tour.report import run_tour

__all__ = ["draw", "run_tour"]
__all__ += claims.__all__
