"""The lab: train a small attnkit transformer on a built-in task and write a report.

``attnkit lab`` (see :mod:`attnkit.commands.lab`) is the command-line front end. The pieces:

* :mod:`attnkit.lab.tasks`: tasks generated on the fly (reverse, copy, sort, recall);
* :mod:`attnkit.lab.train`: :class:`LabConfig` and the deterministic training loop;
* :mod:`attnkit.lab.distributed`: data-parallel training under ``torchrun``;
* :mod:`attnkit.lab.checkpoint`: atomic safetensors checkpoints;
* :mod:`attnkit.lab.report`: figures and the self-contained ``report.html``;
* :mod:`attnkit.lab.runner`: one whole run, as the command does it.

Needs the ``lab`` extra (matplotlib, numpy, safetensors, tqdm) for the report and checkpoints.
"""

from attnkit.lab.runner import run_lab
from attnkit.lab.tasks import TASKS, Task, get_task
from attnkit.lab.train import LabConfig, TrainResult, build_model, evaluate, load_trained, train

__all__ = [
    "TASKS",
    "LabConfig",
    "Task",
    "TrainResult",
    "build_model",
    "evaluate",
    "get_task",
    "load_trained",
    "run_lab",
    "train",
]
