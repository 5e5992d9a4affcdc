"""Every bad input a careful user tried (issue 12) exits 2 with one ``error:`` line saying what is wrong.

One row per input: a function that writes what the input needs into a temporary folder and returns the
command line. All rows run in this process (CliRunner); ``run`` rows fail in the launcher's checks
before any rank starts, so none of them starts a process.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import pytest
from click.testing import CliRunner

from cli import main
from cli_render.progress import PhaseLog
from tests.data import PIPEDREAM_PROFILES
from tests.runtime.generated import generate
from tests.runtime.packages import write_package

Row = Callable[[Path], list[str]]

PROGRESS = PhaseLog.PATTERN  # progress lines a command printed before its error


def _node(node_id: str, op: str, inputs: list[str], **fields: object) -> dict[str, object]:
    doc: dict[str, object] = {"id": node_id, "name": node_id, "op": op, "target": "Linear", "inputs": inputs}
    doc.update({"forward_ms": 1.0, "backward_ms": 2.0, "output_bytes": 64, "param_bytes": 4096})
    doc.update(fields)
    return doc


# Every linear layer of _profile's splits two ways, so a layout's checks past the degree are reached.
_SPLIT: dict[str, dict[str, object]] = {
    n: {"tp_param_bytes": 4096, "tp_comm_bytes": 64, "tp_max": 2} for n in ("fc1", "fc2", "fc3")
}


def _profile(
    tmp: Path, batch_size: object = 8, top: dict[str, object] | None = None, **changes: dict[str, object]
) -> list[str]:
    """A valid three-layer profile.json with ``changes`` applied to the nodes they name (``top``: to
    the document's own fields)."""
    nodes = [
        _node("x", "input", [], forward_ms=0.0, backward_ms=0.0),
        _node("fc1", "call_module", ["x"]),
        _node("fc2", "call_module", ["fc1"]),
        _node("fc3", "call_module", ["fc2"]),
        _node("out", "output", ["fc3"], forward_ms=0.0, backward_ms=0.0),
    ]
    for node in nodes:
        for key, value in changes.get(str(node["id"]), {}).items():
            if value is _DROP:
                del node[key]
            else:
                node[key] = value
    doc = {"schema": "pipeplan.profile/1", "model": "tiny", "tracer": "pipedream", "batch_size": batch_size}
    doc["nodes"] = nodes
    doc.update(top or {})
    path = tmp / "profile.json"
    path.write_text(json.dumps(doc))
    return ["partition", "--profile", str(path), "--gpus", "2", "-o", str(tmp / "models")]


_DROP = object()


def _graph_txt(tmp: Path, old: str, new: str) -> list[str]:
    text = (PIPEDREAM_PROFILES / "alexnet" / "graph.txt").read_text()
    assert old in text
    path = tmp / "graph.txt"
    path.write_text(text.replace(old, new, 1))
    return ["partition", "--profile", str(path), "--gpus", "2", "-o", str(tmp / "models")]


def _model_file(tmp: Path, body: str) -> list[str]:
    path = tmp / "net.py"
    path.write_text("import torch\nfrom torch import nn\n\n" + body)
    return ["profile", f"{path}:make", "-o", str(tmp / "p.json"), "--repeats", "1"]


_RAISES = """
class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        raise RuntimeError("forward is broken")


def make():
    return Net(), (torch.randn(2, 4),)
"""

_INT64 = """
def make():
    return nn.Sequential(nn.Linear(4, 2)), (torch.ones(2, 4, dtype=torch.int64),)
"""


def _package(tmp: Path) -> Path:
    return write_package(tmp / "pkg", "chain", replicas=(1, 1), microbatches=2, batch_size=4)


def _run(tmp: Path, *args: str) -> list[str]:
    return ["run", str(_package(tmp)), "--steps", "1", "--timeout", "5", *args]


def _broken_stage(tmp: Path, text: str | None) -> list[str]:
    pkg = _package(tmp)
    if text is None:
        (pkg / "stage1.py").unlink()
    else:
        (pkg / "stage1.py").write_text(text)
    return ["run", str(pkg), "--steps", "1"]


def _unwritable(tmp: Path) -> Path:
    """A folder nobody can create, even root: its parent is a file."""
    (tmp / "afile").write_text("")
    return tmp / "afile"


def _data(tmp: Path, body: str) -> list[str]:
    path = tmp / "data.py"
    path.write_text("import torch\nfrom torch.utils.data import TensorDataset\n\n" + body)
    return _run(tmp, "--data", f"{path}:make")


def _images(tmp: Path, classes: tuple[str, ...] = (), *args: str) -> list[str]:
    """An image folder with these (empty) class folders."""
    for name in classes:
        (tmp / "images" / name).mkdir(parents=True)
    (tmp / "images").mkdir(exist_ok=True)
    return _run(tmp, "--data", f"imagefolder:{tmp / 'images'}", *args)


def _text(tmp: Path, size: int, *args: str) -> list[str]:
    (tmp / "t.txt").write_bytes(b"abcdefgh" * (size // 8))
    return _run(tmp, "--data", f"text:{tmp / 't.txt'}", *args)


def _tiny_gpt(tmp: Path, data: str, *args: str) -> list[str]:
    """A generated tiny-gpt package (vocabulary 97, sequences of 8) and a text of lowercase letters."""
    pkg = generate(tmp / "gpt", "tiny-gpt", (1, 1), batch_size=4, input_shape=(8,))
    (tmp / "t.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 20)
    (tmp / "images" / "cat").mkdir(parents=True)
    (tmp / "images" / "cat" / "a.png").write_bytes(b"")
    spec = data.replace("TEXT", str(tmp / "t.txt")).replace("IMAGES", str(tmp / "images"))
    return ["run", str(pkg), "--steps", "1", "--data", spec, *args]


def _inconsistent_plan(tmp: Path) -> list[str]:
    pkg = _package(tmp)
    plan = json.loads((pkg / "plan.json").read_text())
    plan["stages"][1]["ranks"] = [1, 2]
    plan["stages"][1]["replicas"] = 2
    (pkg / "plan.json").write_text(json.dumps(plan))
    return ["run", str(pkg), "--steps", "1"]


def _other_models_metrics(tmp: Path) -> list[str]:
    return _metrics(tmp, [0.01, 0.01], model="gpt2")


def _plan_field(tmp: Path, key: str, value: object) -> list[str]:
    pkg = _package(tmp)
    plan = json.loads((pkg / "plan.json").read_text())
    plan[key] = value
    (pkg / "plan.json").write_text(json.dumps(plan))
    return ["run", str(pkg), "--steps", "1"]


def _metrics(tmp: Path, times: list[object], **fields: object) -> list[str]:
    """calibrate a 2-stage package (planned from a profile of model test:chain) with metrics.json
    stage ``times`` and other ``fields``."""
    ours = write_package(tmp / "ours", "chain", replicas=(1, 1))
    nodes = [_node("x", "input", []), _node("n0", "call_module", ["x"]), _node("n1", "call_module", ["n0"])]
    profile = {"schema": "pipeplan.profile/1", "model": "test:chain", "batch_size": 8, "nodes": nodes}
    (tmp / "profile.json").write_text(json.dumps(profile))
    plan = json.loads((ours / "plan.json").read_text())
    plan["profile"] = str(tmp / "profile.json")
    (ours / "plan.json").write_text(json.dumps(plan))
    stages = [{"stage": k, "compute_s_per_minibatch": t} for k, t in enumerate(times)]
    metrics = {"schema": "pipeplan.metrics/1", "batch_size": 8, "stages": stages, **fields}
    (tmp / "metrics.json").write_text(json.dumps(metrics))
    return ["calibrate", str(ours), "--metrics", str(tmp / "metrics.json")]


def _too_many_replicas(tmp: Path) -> list[str]:
    return [*_profile(tmp)[:-4], "--gpus", "100000", "-o", str(tmp / "models")]


def _binary_profile(tmp: Path) -> list[str]:
    (tmp / "blob.bin").write_bytes(bytes(range(256)) * 4)
    return ["partition", "--profile", str(tmp / "blob.bin"), "--gpus", "2"]


ROWS: dict[str, tuple[Row, str]] = {
    # -- input files read by partition
    "graph.txt metric abc": (
        lambda t: _graph_txt(t, "forward_compute_time=0.539", "forward_compute_time=abc"),
        "forward_compute_time",
    ),
    "graph.txt metric [1000;x]": (
        lambda t: _graph_txt(t, "activation_size=44302336.000", "activation_size=[1000;x]"),
        "activation_size",
    ),
    "graph.txt negative time": (
        lambda t: _graph_txt(t, "backward_compute_time=0.188", "backward_compute_time=-1"),
        "backward_ms",
    ),
    "binary --profile": (_binary_profile, "blob.bin"),
    "profile input names unknown node": (lambda t: _profile(t, fc2={"inputs": ["ghost"]}), "ghost"),
    "profile cycle": (lambda t: _profile(t, fc1={"inputs": ["x", "fc3"]}), "cycle"),
    "profile negative time": (lambda t: _profile(t, fc2={"forward_ms": -3.0}), "forward_ms"),
    "profile NaN time": (lambda t: _profile(t, fc2={"backward_ms": float("nan")}), "backward_ms"),
    "profile forward_ms missing": (lambda t: _profile(t, fc1={"forward_ms": _DROP}), "forward_ms"),
    "profile batch size 0": (lambda t: _profile(t, batch_size=0), "batch_size"),
    "profile batch size text": (lambda t: _profile(t, batch_size="eight"), "batch_size"),
    "profile negative bytes": (lambda t: _profile(t, fc1={"output_bytes": -5}), "output_bytes"),
    "profile duplicate id": (lambda t: _profile(t, fc2={"id": "fc1"}), "fc1"),
    # -- partition options
    "--gpus 100000 at batch 8": (_too_many_replicas, "batch"),
    "--gpus 0": (lambda t: [*_profile(t)[:-4], "--gpus", "0"], "--gpus"),
    "--memory 1KiB": (lambda t: [*_profile(t), "--memory", "1KiB"], "KiB"),
    "--memory abc": (lambda t: [*_profile(t), "--memory", "abc"], "memory"),
    "--microbatches 0": (
        lambda t: [*_profile(t), "--schedule", "1f1b", "--microbatches", "0"],
        "microbatches",
    ),
    "--schedule bogus (click)": (lambda t: [*_profile(t), "--schedule", "bogus"], "--schedule"),
    "--recompute bogus (click)": (lambda t: [*_profile(t), "--recompute", "some"], "--recompute"),
    "--recompute auto, --memory too small even so": (
        lambda t: [*_profile(t), "--recompute", "auto", "--memory", "8300B"],  # each layer fits alone
        "recomputing",
    ),
    "a layer that fits no device": (
        lambda t: [*_profile(t), "--memory", "1KiB"],
        "layer fc1 needs 8.00 KiB for its 4.00 KiB of float32 weights",
    ),
    "unknown option (click)": (lambda t: [*_profile(t), "--gpuz", "2"], "--gpuz"),
    # -- profile
    "forward raises while profiling": (lambda t: _model_file(t, _RAISES), "forward is broken"),
    "int64 inputs into a Linear": (lambda t: _model_file(t, _INT64), "Long"),
    "--batch-size 0 (profile)": (lambda t: ["profile", "tiny-mlp", "--batch-size", "0"], "batch-size"),
    # -- verify
    "verify --batch-size -1": (lambda t: ["verify", str(_package(t)), "--batch-size", "-1"], "--batch-size"),
    "verify --batch-size 0": (lambda t: ["verify", str(_package(t)), "--batch-size", "0"], "--batch-size"),
    # -- run (all refused before any rank starts)
    "run: stage file deleted": (lambda t: _broken_stage(t, None), "stage1"),
    "run: stage file syntax error": (lambda t: _broken_stage(t, "def broken(:\n"), "stage1.py"),
    "run: unwritable --checkpoint-dir": (
        lambda t: _run(t, "--checkpoint-every", "1", "--checkpoint-dir", str(_unwritable(t) / "ck")),
        "checkpoint-dir",
    ),
    "run: unwritable --trace": (lambda t: _run(t, "--trace", str(_unwritable(t) / "trace.json")), "--trace"),
    "run: --data wrong shape": (
        lambda t: _data(
            t, "def make():\n    return TensorDataset(torch.randn(16, 5), torch.randint(0, 3, (16,)))\n"
        ),
        "shape",
    ),
    "run: --data raises": (lambda t: _data(t, "def make():\n    raise OSError('disk gone')\n"), "disk gone"),
    "run: --data too small": (
        lambda t: _data(
            t, "def make():\n    return TensorDataset(torch.randn(2, 6), torch.randint(0, 3, (2,)))\n"
        ),
        "batch",
    ),
    "run: plan.json disagrees with mp_conf.json": (_inconsistent_plan, "mp_conf.json"),
    "run: imagefolder missing": (lambda t: _run(t, "--data", f"imagefolder:{t / 'nope'}"), "no such folder"),
    "run: imagefolder empty": (lambda t: _images(t), "no class folders"),
    "run: imagefolder class without images": (lambda t: _images(t, ("cat", "dog")), "holds no image"),
    "run: imagefolder for a token model": (lambda t: _tiny_gpt(t, "imagefolder:IMAGES"), "not an image"),
    "run: text missing": (lambda t: _run(t, "--data", "text:nope.txt", "--seq-len", "4"), "no such file"),
    "run: text without --seq-len": (lambda t: _text(t, 64), "--seq-len"),
    "run: --seq-len 0 (click)": (lambda t: _text(t, 64, "--seq-len", "0"), "--seq-len"),
    "run: --seq-len -3 (click)": (lambda t: _text(t, 64, "--seq-len", "-3"), "--seq-len"),
    "run: text shorter than a minibatch": (lambda t: _text(t, 64, "--seq-len", "16"), "minibatch"),
    "run: token ids beyond the vocabulary": (
        lambda t: _tiny_gpt(t, "text:TEXT", "--seq-len", "8"),
        "vocabulary of 97",
    ),
    "run: --tokenizer folder missing": (
        lambda t: _text(t, 640, "--seq-len", "4", "--tokenizer", str(t / "tok")),
        "--tokenizer",
    ),
    "run: --seq-len without text data": (lambda t: _run(t, "--seq-len", "8"), "--seq-len"),
    "run: --tokenizer without text data": (lambda t: _run(t, "--tokenizer", str(t)), "--tokenizer"),
    "run: --data-workers -1 (click)": (lambda t: _run(t, "--data-workers", "-1"), "--data-workers"),
    "run: --data-workers for synthetic data": (lambda t: _run(t, "--data-workers", "3"), "--data-workers"),
    "run: --eval-every without --eval-data": (lambda t: _run(t, "--eval-every", "2"), "--eval-data"),
    "run: --eval-data missing": (
        lambda t: _run(t, "--eval-data", "text:nope.txt", "--seq-len", "4"),
        "--eval-data",
    ),
    "run: --eval-data of another shape": (
        lambda t: _run(
            t,
            "--eval-data",
            _data(t, "def make():\n    return TensorDataset(torch.randn(8, 5), torch.randn(8, 3))\n")[-1],
        ),
        "--eval-data",
    ),
    "run: --lr nan": (lambda t: _run(t, "--lr", "nan"), "--lr"),
    "run: --lr inf": (lambda t: _run(t, "--lr", "inf"), "--lr"),
    "run: --momentum nan": (lambda t: _run(t, "--momentum", "nan"), "--momentum"),
    "run: --steps 0 (click)": (lambda t: _run(t, "--steps", "0"), "--steps"),
    "run: --steps and --epochs": (lambda t: _run(t, "--epochs", "2"), "--epochs"),
    # -- calibrate
    "calibrate with another model's metrics": (_other_models_metrics, "metrics"),
    # -- issue 21: silently accepted, tracebacks and unclear messages
    "--microbatches 3 at batch 8": (
        lambda t: [*_profile(t), "--schedule", "1f1b", "--microbatches", "3"],
        "microbatches",
    ),
    "--microbatches 16 at batch 8": (
        lambda t: [*_profile(t), "--schedule", "1f1b", "--microbatches", "16"],
        "microbatches",
    ),
    "--gpus 1000000000": (lambda t: [*_profile(t)[:-4], "--gpus", "1000000000"], "devices"),
    "profile node without inputs": (lambda t: _profile(t, fc2={"inputs": _DROP}), "inputs is missing"),
    "profile inputs a string": (lambda t: _profile(t, fc2={"inputs": "fc1"}), "inputs"),
    "profile tied garbage": (lambda t: _profile(t, top={"tied": "fc1.weight"}), "tied"),
    "profile tied groups of numbers": (lambda t: _profile(t, top={"tied": [[1, 2]]}), "tied"),
    "profile param_names a string": (lambda t: _profile(t, fc1={"param_names": "weight"}), "param_names"),
    "profile nodes a dict": (lambda t: _profile(t, top={"nodes": {"x": {}}}), "nodes"),
    "profile infinite output_bytes": (
        lambda t: _profile(t, fc1={"output_bytes": float("inf")}),
        "output_bytes",
    ),
    "graph.txt infinite activation": (
        lambda t: _graph_txt(t, "activation_size=44302336.000", "activation_size=inf"),
        "activation_size",
    ),
    "run: --timeout nan": (lambda t: _run(t, "--timeout", "nan"), "--timeout"),
    "run: --schedule interleaved on a 1f1b package": (
        lambda t: _run(t, "--schedule", "interleaved"),
        "interleaved",
    ),
    "run: plan.json with 0 microbatches": (lambda t: _plan_field(t, "microbatches", 0), "microbatches"),
    "run: plan.json schedule unknown": (lambda t: _plan_field(t, "schedule", "fast"), "schedule"),
    "run: plan.json stages a dict": (lambda t: _plan_field(t, "stages", {"0": 1}), "stages"),
    "calibrate: NaN stage time": (lambda t: _metrics(t, [float("nan"), 0.1]), "compute_s_per_minibatch"),
    "calibrate: negative stage time": (lambda t: _metrics(t, [-1.0, 0.1]), "compute_s_per_minibatch"),
    "calibrate: zero stage time": (lambda t: _metrics(t, [0.0, 0.1]), "compute_s_per_minibatch"),
    "calibrate: stage time null": (lambda t: _metrics(t, [None, 0.1]), "compute_s_per_minibatch"),
    "calibrate: a stage not measured": (lambda t: _metrics(t, [0.1]), "no time for stage 1"),
    "calibrate: stage time a string": (lambda t: _metrics(t, ["fast", 0.1]), "compute_s_per_minibatch"),
    "calibrate: batch size a list": (lambda t: _metrics(t, [0.1, 0.1], batch_size=[8]), "batch_size"),
    "profile hf:llama:nosuchtask": (lambda t: ["profile", "hf:llama:nosuchtask"], "no task 'nosuchtask'"),
    "--shard with no copies to shard over": (
        lambda t: [*_profile(t, **_SPLIT), "--schedule", "1f1b", "--tensor-parallel", "2", "--shard", "full"],
        "data-parallel copies",
    ),
}
if not __import__("torch").cuda.is_available():
    ROWS["run: --backend nccl without a GPU"] = (lambda t: _run(t, "--backend", "nccl"), "nccl")


@pytest.mark.parametrize("name", list(ROWS))
def test_bad_input_is_one_error_line_and_exit_2(name: str, tmp_path: Path) -> None:
    make, needle = ROWS[name]
    args = make(tmp_path)
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        result = CliRunner().invoke(main, args)
    finally:
        os.chdir(cwd)
    lines = [line for line in result.output.splitlines() if line.strip() and not re.match(PROGRESS, line)]
    assert result.exit_code == 2, f"{name}: exit {result.exit_code}\n{result.output}{result.exception!r}"
    assert len(lines) == 1 and lines[0].startswith("error: "), f"{name}:\n{result.output}"
    assert needle.lower() in lines[0].lower(), f"{name}: {lines[0]!r} does not mention {needle!r}"


def test_rows_cover_the_issue() -> None:
    """The table tries at least the inputs issue 12 lists (33 distinct ones, some split in several)."""
    assert len(ROWS) >= 33
