"""pipeplan's runtime: what a cluster node needs to train a generated package (torch only).

It never imports ``partitioner``: a node runs packages with torch and this package alone. Its
sub-packages, lowest first (each imports only those before it: ``tests/test_import_graph.py``):
``files``, ``faults``, ``packages``, ``observing``, ``executing``, ``settings``, ``datasets``,
``building``, ``checkpoints``, ``job``, ``exporting``; ``schedule``, ``precision`` and ``errors`` sit
on top, as the planner imports them.

A package generated before the runtime had sub-packages carries a copy of the stage kit that
imports the modules by their flat names (``runtime.weights``, ``runtime.userfile``, ...). Each such
name in :data:`MOVED` still imports: a finder on ``sys.meta_path`` answers it with the module that
holds that code now (one module under two names), so those packages verify and run unchanged.
"""

from __future__ import annotations

import importlib
import sys
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

__all__ = ["MOVED"]

MOVED = {
    "blame": "faults.failed_rank",
    "checkin": "faults.startup_checkin",
    "checkpoint": "checkpoints.step_folders",
    "checkpoint_read": "checkpoints.read_tensors",
    "checkpoint_v1": "checkpoints.convert_v1",
    "comm": "executing.comm",
    "config": "packages.job_config",
    "data": "datasets.minibatches",
    "deferred_init": "building.deferred_init",
    "evaluate": "executing.evaluate",
    "export": "exporting.model_weights",
    "fidelity": "observing.fidelity",
    "filedata": "datasets.user_data",
    "flops": "observing.flops",
    "formats": "files.formats",
    "fqns": "packages.tensor_names",
    "header": "job.run_header",
    "heap": "observing.resident_memory",
    "hf": "building.hugging_face",
    "imagefolder": "datasets.imagefolder",
    "launch": "job.launch",
    "lazy": "building.meta_params",
    "lifeline": "faults.die_with_launcher",
    "liveness": "faults.liveness",
    "lookahead": "executing.lookahead",
    "loss_scale": "executing.loss_scale",
    "memory": "observing.peak_memory",
    "metrics": "observing.metrics",
    "newest": "files.find_newest",
    "optim": "executing.optimizer",
    "options": "settings.run_options",
    "package": "packages.load",
    "preflight": "job.preflight",
    "probe": "job.link_probe",
    "rank_checkpoints": "checkpoints.rank_side",
    "recompute": "executing.recompute",
    "resume": "checkpoints.resume_settings",
    "run_checks": "job.run_checks",
    "run_config": "settings.run_toml",
    "runlock": "job.run_lock",
    "runs": "job.run_folders",
    "schema": "files.schema",
    "split_backward": "executing.split_backward",
    "stage": "executing.stage",
    "stagekit": "building.stage_init",
    "step_log": "job.step_log",
    "text": "datasets.text_windows",
    "torch_plan": "exporting.torch_plan",
    "train_state": "checkpoints.train_state",
    "userfile": "files.user_code",
    "weights": "building.weight_files",
    "worker": "job.worker",
}
"""Old flat module name (``runtime.<old>``) -> the module, under ``runtime``, that holds its code now."""


class _MovedFinder:
    """Answers ``runtime.<old>`` with the module :data:`MOVED` names, imported under its own name."""

    @staticmethod
    def find_spec(fullname: str, path: Any = None, target: Any = None) -> ModuleSpec | None:
        prefix, _, old = fullname.partition(".")
        if prefix != "runtime" or old not in MOVED:
            return None
        return ModuleSpec(fullname, _MovedFinder)  # type: ignore[arg-type]

    @staticmethod
    def create_module(spec: ModuleSpec) -> ModuleType:
        return importlib.import_module(f"runtime.{MOVED[spec.name.partition('.')[2]]}")

    @staticmethod
    def exec_module(module: ModuleType) -> None:
        """Nothing to run: the module was imported, under its own name, by :meth:`create_module`."""


if _MovedFinder not in sys.meta_path:  # first: an old name is never a file of its own any more
    sys.meta_path.insert(0, _MovedFinder)
