"""Model specs: the zoo's architectures, user factories and files, inputs, targets, loss, errors."""

from __future__ import annotations

import re
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from partitioner.errors import ModelSpecError
from partitioner.models.specs import load_model, model_name, next_token_targets
from partitioner.models.zoo import ZOO

torch.set_num_threads(1)

# torchvision's published counts (and OpenAI's GPT-2 with the LM head tied to the embedding).
PARAMS = {
    "alexnet": 61_100_840,
    "vgg16": 138_357_544,
    "vgg19": 143_667_240,
    "resnet18": 11_689_512,
    "resnet50": 25_557_032,
    "resnet101": 44_549_160,
    "gpt2": 124_439_808,
    "gpt2-medium": 354_823_168,
}


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_parameter_counts_match_the_reference(name: str) -> None:
    with torch.device("meta"):
        module = ZOO[name].factory()
    assert sum(p.numel() for p in module.parameters()) == PARAMS[name]


def test_gpt2_matches_transformers_count() -> None:
    transformers = pytest.importorskip("transformers")
    with torch.device("meta"):
        for config, ours in [({}, "gpt2"), ({"n_layer": 24, "n_embd": 1024, "n_head": 16}, "gpt2-medium")]:
            hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(**config))
            assert hf.num_parameters() == PARAMS[ours]


def test_gpt2_lm_head_is_tied() -> None:
    module = load_model("tiny-gpt").module
    assert module.lm_head.weight is module.wte.weight


def test_build_is_reproducible_and_meta_allocates_nothing() -> None:
    bundle = load_model("tiny-cnn", batch_size=2)
    a, b, c = bundle.build(seed=0), bundle.build(seed=0), bundle.build(seed=1)
    assert all(torch.equal(pa, pb) for pa, pb in zip(a.parameters(), b.parameters(), strict=True))
    assert not torch.equal(a.stem.weight, c.stem.weight)
    assert torch.equal(next(bundle.module.parameters()), next(a.parameters()))
    assert all(p.device.type == "meta" for p in bundle.build(device="meta").parameters())


def test_a_bundle_built_on_meta_has_shapes_and_real_inputs() -> None:
    """Code generation needs the structure, not the weights: nothing drawn, inputs as on CPU."""
    meta, cpu = load_model("tiny-cnn", batch_size=2, device="meta"), load_model("tiny-cnn", batch_size=2)
    assert all(p.is_meta for p in meta.module.parameters())
    shapes = {n: p.shape for n, p in cpu.module.named_parameters()}
    assert {n: p.shape for n, p in meta.module.named_parameters()} == shapes
    torch.testing.assert_close(meta.inputs, cpu.inputs, rtol=0, atol=0)


def test_inputs_targets_and_loss_of_an_image_model() -> None:
    bundle = load_model("tiny-cnn", batch_size=3, input_shape=(3, 8, 8))
    assert bundle.inputs[0].shape == (3, 3, 8, 8)
    assert bundle.targets.shape == (3,) and bundle.targets.dtype == torch.int64
    assert torch.equal(bundle.make_inputs(3)[0], bundle.inputs[0])
    assert bundle.make_inputs(5)[0].shape[0] == 5
    loss = bundle.loss_fn(bundle.module(*bundle.inputs), bundle.targets)
    assert loss.dim() == 0 and loss.item() > 0


def test_token_model_targets_are_the_next_tokens() -> None:
    bundle = load_model("tiny-gpt", batch_size=2, input_shape=(10,))
    (tokens,) = bundle.inputs
    assert tokens.dtype == torch.int64 and tokens.shape == (2, 10)
    assert torch.equal(bundle.targets[:, :-1], tokens[:, 1:])
    assert (bundle.targets[:, -1] == -100).all()
    assert torch.equal(next_token_targets(tokens), bundle.targets)


def _write(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "mymodel.py"
    path.write_text(textwrap.dedent(body))
    return path


def test_file_factory_with_example_inputs_targets_and_loss(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
        import torch
        def make():
            return torch.nn.Sequential(torch.nn.Linear(4, 3))
        def example_inputs(batch_size):
            return torch.ones(batch_size, 4)
        def example_targets(batch_size):
            return torch.zeros(batch_size, 3)
        def loss_fn(output, target):
            return ((output - target) ** 2).mean()
        """,
    )
    bundle = load_model(f"{path}:make", batch_size=5)
    assert bundle.inputs[0].shape == (5, 4) and bundle.targets.shape == (5, 3)
    assert bundle.loss_fn.__name__ == "loss_fn"
    assert re.fullmatch(r"mymodel-make-[0-9a-f]{6}", model_name(f"{path}:make"))
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "mymodel.py").write_text(path.read_text())
    named = {model_name(f"{p}:{f}") for p in (path, tmp_path / "other" / "mymodel.py") for f in ("make", "b")}
    assert len(named) == 4  # a file's name comes from the file, not only its stem and the factory
    assert model_name("hf:configs/llama3-70b.json") == "hf-llama3-70b"
    assert model_name("hf:checkpoints/tiny/config.json") == "hf-tiny"
    assert model_name("hf:llama") == "hf-llama"


def test_factory_returning_module_and_integer_inputs(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
        import torch
        def make():
            model = torch.nn.Sequential(torch.nn.Embedding(50, 8), torch.nn.Linear(8, 50))
            return model, torch.randint(0, 50, (2, 6))
        """,
    )
    bundle = load_model(f"{path}:make", batch_size=4)
    assert bundle.inputs[0].shape == (4, 6) and bundle.inputs[0].dtype == torch.int64
    # token ids in, logits per position out: default targets are the next tokens
    assert torch.equal(bundle.targets[:, :-1], bundle.inputs[0][:, 1:])
    longer = load_model(f"{path}:make", batch_size=2, input_shape=(9,))
    assert longer.inputs[0].shape == (2, 9) and int(longer.inputs[0].max()) < 50


def test_package_module_factory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "userpkg").mkdir()
    (tmp_path / "userpkg" / "__init__.py").write_text("")
    (tmp_path / "userpkg" / "nets.py").write_text(
        "import torch\ndef mlp():\n    return torch.nn.Sequential(torch.nn.Linear(6, 2))\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    bundle = load_model("userpkg.nets:mlp", batch_size=2, input_shape=(6,))
    assert bundle.module(*bundle.inputs).shape == (2, 2)
    assert bundle.targets.shape == (2,)
    sys.modules.pop("userpkg.nets", None)


@pytest.mark.parametrize(
    ("spec", "shape", "message"),
    [
        ("vgg17", None, "unknown model 'vgg17' (did you mean"),
        ("nosuchpkg.mod:fn", None, "cannot import nosuchpkg.mod"),
        ("missing.py:fn", None, "does not exist"),
        ("tiny-gpt", (3, 4), "sequence length"),
        ("tiny-mlp", (0,), "positive integers"),
    ],
)
def test_bad_specs_name_the_problem(spec: str, shape: tuple[int, ...] | None, message: str) -> None:
    with pytest.raises(ModelSpecError, match=message.replace("(", r"\(")):
        load_model(spec, input_shape=shape)


def test_unknown_model_lists_builtins_and_forms() -> None:
    with pytest.raises(ModelSpecError) as err:
        load_model("nonsense")
    assert "vgg16" in str(err.value) and "file.py:factory" in str(err.value)


def test_factory_errors(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        """
        import torch
        def broken():
            raise RuntimeError("out of cheese")
        def not_a_module():
            return 42
        def no_inputs():
            return torch.nn.Linear(2, 2)
        """,
    )
    with pytest.raises(ModelSpecError, match="raised RuntimeError: out of cheese"):
        load_model(f"{path}:broken")
    with pytest.raises(ModelSpecError, match="returned int"):
        load_model(f"{path}:not_a_module")
    with pytest.raises(ModelSpecError, match="--input-shape"):
        load_model(f"{path}:no_inputs")
    with pytest.raises(ModelSpecError, match="no callable 'absent'"):
        load_model(f"{path}:absent")
    with pytest.raises(ModelSpecError, match="batch size must be positive"):
        load_model("tiny-mlp", batch_size=0)


def test_torchvision_spec() -> None:
    try:
        import torchvision  # noqa: F401
    except Exception:
        with pytest.raises(ModelSpecError, match="needs torchvision"):
            load_model("torchvision:resnet18")
        pytest.skip("torchvision cannot be imported here")
    bundle = load_model("torchvision:resnet18", input_shape=(3, 32, 32))
    assert sum(p.numel() for p in bundle.module.parameters()) == PARAMS["resnet18"]


def test_model_file_with_dict_inputs_importing_a_file_beside_it(tmp_path: Path) -> None:
    """A model file may import modules from its own folder and give its inputs as a dict of keywords."""
    (tmp_path / "beside_block.py").write_text("from torch import nn\n\nclass Block(nn.Linear):\n    pass\n")
    (tmp_path / "kw_model.py").write_text(
        "import torch\nfrom torch import nn\nfrom beside_block import Block\n\n"
        "class Net(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.a = Block(4, 3)\n\n"
        "    def forward(self, x, scale):\n        return self.a(x) * scale\n\n"
        "def make():\n    return Net()\n\n"
        "def example_inputs(b):\n    return {'x': torch.randn(b, 4), 'scale': torch.ones(b, 1)}\n"
    )
    bundle = load_model(f"{tmp_path / 'kw_model.py'}:make", batch_size=3)
    assert bundle.input_names == ("x", "scale")
    out = bundle.call(bundle.module, bundle.inputs)
    assert out.shape == (3, 3) and bundle.targets.shape == (3,)
    assert int(bundle.targets.max()) < 3
