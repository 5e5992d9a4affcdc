"""Hand-written packages in the generated-package format (brief, interface 5) for runtime tests.

They depend on nothing but torch, so the runtime is tested without the profiler or code generator.
Six shapes: ``chain`` (an MLP cut into N stages), ``skip`` (a tensor that skips a stage, and a
stage with two outputs), ``skip4`` (four stages; stage 0 sends two tensors of one shape, one to
stage 1 and one, skipping, to stage 3: on two ranks under interleaved both go from rank 0 to rank
1), ``skiphome`` (the same, but the skip goes to stage 2: under interleaved on two ranks, rank 0 to
itself), ``tied`` (one weight used by the first and the last stage), ``int`` (an integer tensor crosses
stages, without a gradient) and ``modules`` (PipeDream's own layout: four modules on two stages,
``module_to_stage_map`` [0, 0, 1, 1, 1], a tensor from the first module read by the last).
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Sequence
from pathlib import Path

from partitioner.plan import Cluster, Plan, Prediction, SolverInfo, Stage, Tie, mp_conf, plan_to_json
from runtime.schedule import layout_of

__all__ = ["write_package"]

IN_DIM, HIDDEN, OUT_DIM = 6, 8, 3

_INIT = '''
"""Hand-written test package: {arch}."""
import torch
from torch import nn

{imports}

STAGES = [{classes}]
IN_NAMES = {ins!r}
OUT_NAMES = {outs!r}


def arch():
    return "{arch}"


class Full(nn.Module):
    def __init__(self):
        super().__init__()
        self.stages = nn.ModuleList([S() for S in STAGES])
{tie}
    def forward(self, input0):
        env = {{"input0": input0}}
        for module, ins, outs in zip(self.stages, IN_NAMES, OUT_NAMES):
            out = module(*[env[n] for n in ins])
            env.update(zip(outs, (out,) if len(outs) == 1 else out))
        return env[OUT_NAMES[-1][0]]


def full_model(seed=0):
    torch.manual_seed(seed)
    return Full()


{stage_fn}def model(criterion):
    made = [(S(), list(i), list(o)) for S, i, o in zip(STAGES, IN_NAMES, OUT_NAMES)]
    return made + [(criterion, [OUT_NAMES[-1][0]], ["loss"])]


def criterion():
    return nn.MSELoss()


def example_inputs(batch_size):
    return {{"input0": torch.randn(batch_size, {in_dim})}}


def example_targets(batch_size):
    return torch.randn(batch_size, {out_dim})
'''

_STAGE_FN = """def stage(k, seed=0, device="cpu"):
    return full_model(seed).stages[k].to(device)


def fqn_prefix(k):
    return f"stages.{k}."


"""

_LINEAR = """
import torch
from torch import nn


class Stage{k}(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear({din}, {dout})

    def forward(self, x):
        return {body}
"""

_SKIP = {
    0: """
import torch
from torch import nn


class Stage0(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear({i}, {h})
        self.side = nn.Linear({i}, {o})

    def forward(self, x):
        return torch.tanh(self.fc(x)), self.side(x)
""",
    2: """
import torch
from torch import nn


class Stage2(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear({h}, {o})

    def forward(self, x, skip):
        return self.fc(x) + skip
""",
}

_SKIP4 = {
    0: """
import torch
from torch import nn


class Stage0(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear({i}, {h})
        self.side = nn.Linear({i}, {h})

    def forward(self, x):
        return torch.tanh(self.fc(x)), torch.tanh(self.side(x))
""",
    3: """
import torch
from torch import nn


class Stage3(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear({h}, {o})

    def forward(self, x, skip):
        return self.fc(x + skip)
""",
}

_SKIP_HOME = """
import torch
from torch import nn


class Stage2(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear({h}, {h})

    def forward(self, x, skip):
        return torch.tanh(self.fc(x) + skip)
"""

_INT = {
    0: """
import torch
from torch import nn


class Stage0(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear({i}, {h})

    def forward(self, x):
        return torch.tanh(self.fc(x)), (x[:, 0] > 0).long()
""",
    1: """
import torch
from torch import nn


class Stage1(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear({h}, {o})
        self.table = nn.Parameter(torch.randn(2, {o}))

    def forward(self, x, idx):
        return self.fc(x) + self.table[idx]
""",
}

_BUFFER = {
    0: """
import torch
from torch import nn


class Stage0(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear({i}, {h})
        self.register_buffer("scale", torch.linspace(0.5, 1.5, {h}))

    def forward(self, x):
        return torch.tanh(self.fc(x)), self.scale.expand(x.shape[0], -1) * 1.0
""",
    1: """
import torch
from torch import nn


class Stage1(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear({h}, {o})

    def forward(self, x, scale):
        return self.fc(x * scale.clamp_(min=0.0))  # (in place: allowed on a tensor autograd does not track)
""",
}

_TIED_LAST = """
import torch
from torch import nn


class Stage{k}(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn({h}, {i}) * 0.3)
        self.fc = nn.Linear({i}, {o})

    def forward(self, x):
        return self.fc(torch.nn.functional.linear(x, self.w.t()))
"""


_MODULES_LAST = """
import torch
from torch import nn


class Stage3(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear({h}, {o})

    def forward(self, x, skip):
        return self.fc(x + skip)
"""


def _stage_sources(kind: str, stages: int) -> tuple[list[str], list[list[str]], list[list[str]]]:
    if kind == "modules":  # four modules, two per stage (module_to_stage_map [0, 0, 1, 1, 1])
        body = "torch.tanh(self.fc(x))"
        sources = [
            _LINEAR.format(k=k, din=IN_DIM if k == 0 else HIDDEN, dout=HIDDEN, body=body) for k in range(3)
        ]
        sources.append(_MODULES_LAST.format(h=HIDDEN, o=OUT_DIM))
        return (
            sources,
            [["input0"], ["out0"], ["out1"], ["out2", "out0"]],
            [["out0"], ["out1"], ["out2"], ["out3"]],
        )
    if kind == "skip4":  # stage 0 sends two tensors of one shape: to stage 1 and, skipping, to stage 3
        mids = [_LINEAR.format(k=k, din=HIDDEN, dout=HIDDEN, body="torch.tanh(self.fc(x))") for k in (1, 2)]
        sources = [_SKIP4[0].format(i=IN_DIM, h=HIDDEN), *mids, _SKIP4[3].format(h=HIDDEN, o=OUT_DIM)]
        ins = [["input0"], ["out0"], ["out1"], ["out2", "skip0"]]
        return sources, ins, [["out0", "skip0"], ["out1"], ["out2"], ["out3"]]
    if kind == "skiphome":  # the skip goes to stage 2: under interleaved on 2 ranks, rank 0 to itself
        mid = _LINEAR.format(k=1, din=HIDDEN, dout=HIDDEN, body="torch.tanh(self.fc(x))")
        last = _LINEAR.format(k=3, din=HIDDEN, dout=OUT_DIM, body="self.fc(x)")
        sources = [_SKIP4[0].format(i=IN_DIM, h=HIDDEN), mid, _SKIP_HOME.format(h=HIDDEN), last]
        ins = [["input0"], ["out0"], ["out1", "skip0"], ["out2"]]
        return sources, ins, [["out0", "skip0"], ["out1"], ["out2"], ["out3"]]
    if kind == "buffer":  # stage 0 also sends a float made from a buffer alone: it needs no gradient
        sources = [_BUFFER[k].format(i=IN_DIM, h=HIDDEN, o=OUT_DIM) for k in range(2)]
        return sources, [["input0"], ["out0", "scale0"]], [["out0", "scale0"], ["out1"]]
    if kind == "int":
        sources = [_INT[k].format(i=IN_DIM, h=HIDDEN, o=OUT_DIM) for k in range(2)]
        return sources, [["input0"], ["out0", "idx0"]], [["out0", "idx0"], ["out1"]]
    if kind == "skip":
        mid = _LINEAR.format(k=1, din=HIDDEN, dout=HIDDEN, body="torch.tanh(self.fc(x))")
        sources = [_SKIP[0], mid, _SKIP[2]]
        sources = [s.format(i=IN_DIM, h=HIDDEN, o=OUT_DIM) for s in sources]
        return sources, [["input0"], ["out0"], ["out1", "skip0"]], [["out0", "skip0"], ["out1"], ["out2"]]
    dims = [IN_DIM] + [HIDDEN] * (stages - 1) + [OUT_DIM if kind == "chain" else HIDDEN]
    sources = []
    for k in range(stages):
        body = "self.fc(x)" if k == stages - 1 else "torch.tanh(self.fc(x))"
        sources.append(_LINEAR.format(k=k, din=dims[k], dout=dims[k + 1], body=body))
    if kind == "tied":
        sources[-1] = _TIED_LAST.format(k=stages - 1, h=HIDDEN, i=IN_DIM, o=OUT_DIM)
    ins = [["input0"]] + [[f"out{k}"] for k in range(stages - 1)]
    return sources, ins, [[f"out{k}"] for k in range(stages)]


def write_package(
    folder: Path,
    kind: str = "chain",
    replicas: Sequence[int] = (1, 1),
    schedule: str = "1f1b",
    microbatches: int = 4,
    batch_size: int = 8,
    predicted_s: float = 0.01,
    virtual: int = 1,
    v_shape: bool = False,
) -> Path:
    """Write a complete package (``__init__.py``, ``stageK.py``, mp_conf.json, plan.json) to ``folder``.
    ``virtual`` > 1: the stages (one replica each) lie on ``len(replicas) // virtual`` ranks as
    ``interleaved`` lays them, stage ``k`` on rank ``k mod ranks``; with ``v_shape`` (``virtual``
    2) as ``zbv`` lays them, rank ``r`` holding stages ``r`` and ``2 ranks - 1 - r``."""
    stages = len(replicas)
    sources, ins, outs = _stage_sources(kind, stages)
    folder.mkdir(parents=True, exist_ok=True)
    for k, source in enumerate(sources):
        (folder / f"stage{k}.py").write_text(textwrap.dedent(source).lstrip())
    tie = f"        self.stages[{stages - 1}].w = self.stages[0].fc.weight\n" if kind == "tied" else ""
    init = _INIT.format(
        arch=kind,
        imports="\n".join(f"from .stage{k} import Stage{k}" for k in range(len(sources))),
        classes=", ".join(f"Stage{k}" for k in range(len(sources))),
        ins=ins,
        outs=outs,
        tie=tie,
        in_dim=IN_DIM,
        out_dim=OUT_DIM,
        stage_fn=_STAGE_FN,
    ).lstrip()
    if kind == "modules":  # as in PipeDream's packages: no stage(k); the runtime chains model()'s entries
        init = init.replace(_STAGE_FN, "")
    (folder / "__init__.py").write_text(init)
    first, plan_stages = 0, []
    for k, r in enumerate(replicas):
        plan_stages.append(Stage(k, (f"n{k}",), r, tuple(range(first, first + r))))
        first += r
    if virtual > 1:
        first = stages // virtual
        homes = layout_of("zbv" if v_shape else "interleaved", first, virtual)
        plan_stages = [Stage(k, (f"n{k}",), 1, homes[k]) for k in range(stages)]
    ties = (Tie("stages.0.fc.weight", ((0, "fc.weight"), (stages - 1, "w"))),) if kind == "tied" else ()
    plan = Plan(
        gpus=first,
        cluster=Cluster.flat(first),
        schedule=schedule,
        microbatches=microbatches,
        stages=tuple(plan_stages),
        predicted=Prediction(predicted_s),
        solver=SolverInfo("hand-written", 0.0, True),
        batch_size=batch_size,
        model=f"test:{kind}",
        ties=ties,
        extra={"inputs": [{"name": "input0", "shape": [batch_size, IN_DIM], "dtype": "float32"}]},
    )
    (folder / "plan.json").write_text(json.dumps(plan_to_json(plan), indent=1))
    conf = mp_conf(plan.stages)
    if kind == "modules":
        conf["module_to_stage_map"] = [0, 0, 1, 1, 1]
    (folder / "mp_conf.json").write_text(json.dumps(conf, indent=1))
    return folder
