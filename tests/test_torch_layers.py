"""wsarena.torch.layers: a PyTorch model's convolutions as the layers wsarena plans, checked two ways: a ResNet-50
written as torchvision writes it gives the zoo's ``resnet50`` layer for layer, and each layer's convolution, run
through wsarena's ops on the input PyTorch padded as the layer says, gives what the module computed."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import random
import threading
import types
import warnings

import numpy as np
import pytest

import wsarena
from wsarena.models import ModelError, layers_to_json

torch = pytest.importorskip("torch")  # before wsarena.torch and the helpers, which import it
F = torch.nn.functional
nn = torch.nn
wt = pytest.importorskip("wsarena.torch")

from .cli_helpers import run_main
from .forking import fork
from .torch_models import small_resnet


class Bottleneck(nn.Module):  # torchvision's ResNet v1.5 block: the stride on the 3x3
    def __init__(self, cin: int, width: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, width * 4, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(width * 4)
        self.relu = nn.ReLU()
        self.downsample = None
        if stride != 1 or cin != width * 4:
            self.downsample = nn.Sequential(nn.Conv2d(cin, width * 4, 1, stride=stride, bias=False),
                                            nn.BatchNorm2d(width * 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        identity = x if self.downsample is None else self.downsample(x)
        return self.relu(out + identity)


class ResNet50(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 64, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU()
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        cin, stages = 64, []
        for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
            stage = []
            for i in range(blocks):
                stage.append(Bottleneck(cin, width, stride if i == 0 else 1))
                cin = width * 4
            stages.append(nn.Sequential(*stage))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.fc = nn.Linear(2048, 1000)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def test_a_resnet50_on_the_meta_device_gives_the_zoos_layers():
    model = ResNet50().to("meta")  # nothing is computed: a model of any size is read in a moment
    found = wt.layers(model, torch.empty(8, 3, 224, 224, device="meta"))
    assert found == wsarena.load_model("resnet50")


def test_a_copy_moved_to_the_meta_device_gives_the_models_layers_and_leaves_the_model_as_it_was():
    """README's recipe for reading a model without computing: ``copy.deepcopy(model).to("meta")`` and a meta input
    give the layers the model gives on its own device with an input there (a converted model too), and the model
    keeps its weights. A meta input alone gives them too, as it does to PyTorch's own model (its convolution takes a
    meta input with weights elsewhere); once, the converted model's bias, added out of place, refused it."""
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 4, 2, stride=2))
    wt.convert(model)
    weight = model[0].weight.detach().clone()
    found = wt.layers(copy.deepcopy(model).to("meta"), torch.empty(1, 3, 16, 16, device="meta"))
    assert found == wt.layers(model, torch.zeros(1, 3, 16, 16))  # computed: no uninitialized input
    assert [layer.name for layer in found] == ["0", "2"]
    assert model[0].weight.device.type == "cpu" and torch.equal(model[0].weight, weight)
    assert wt.layers(model, torch.empty(1, 3, 16, 16, device="meta")) == found
    assert model[0].weight.device.type == "cpu" and torch.equal(model[0].weight, weight)


@pytest.mark.parametrize("converted", [True, False], ids=["converted", "pytorch"])
def test_a_model_built_on_the_meta_device_gives_with_a_real_input_the_layers_of_the_model_materialised(converted):
    """A model never materialised (built under ``torch.device("meta")``, as a large one is to save memory) is planned
    with a real input: layers() moves the input to the meta device, and gives the layers the same model gives on
    the CPU. Without that, a converted model's convolution refused its meta weight beside the real input, and
    PyTorch's own gave a CPU result its BatchNorm's meta statistics refused. The model, called itself, still
    refuses the mix."""
    prepare = wt.convert if converted else (lambda model: model)
    with torch.device("meta"):
        meta = prepare(small_resnet())
    x = torch.randn(2, 3, 16, 16)
    found = wt.layers(meta, x)
    assert found == wt.layers(prepare(small_resnet()), x)
    assert len(found) == 9 and found[0].input_shape == (1, 3, 16, 16)
    assert x.device.type == "cpu" and all(p.is_meta for p in meta.parameters())
    assert wt.layers(meta, x.to("meta")) == found
    with pytest.raises(TypeError if converted else RuntimeError, match="meta"):
        meta(x)


class Stepped(nn.Module):
    """A forward that reads the values of tensors it is given: a step count's ``.item()``, a flag in an ``if``, the
    widths of a 1-D tensor's ``tolist()``; and a 1-D shift that meets the model's tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 4, 3, padding=1)
        self.block = nn.Conv2d(4, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.heads = nn.ModuleList(nn.Conv2d(4, 2, k) for k in (1, 2, 3))

    def forward(self, x: torch.Tensor, steps: torch.Tensor, shift: torch.Tensor, *,
                kernels: torch.Tensor, norm: torch.Tensor) -> list[torch.Tensor]:
        x = self.stem(x) + shift.view(1, -1, 1, 1)
        for _ in range(steps.item()):
            x = self.block(x)
        if norm:
            x = self.bn(x)
        return [self.heads[k - 1](x) for k in kernels.tolist()]


@pytest.mark.parametrize("converted", [True, False], ids=["converted", "pytorch"])
def test_a_model_on_the_meta_device_reads_the_values_of_small_tensors_it_is_given(converted):
    """The input's tensors move to the meta device where they meet the model's, not before: a forward that reads
    the value of a tensor it is given (``.item()``, an ``if``, ``tolist()``) gives, on a model built on the meta
    device, the layers the same model gives on the CPU. Moving every tensor of the input first made each such read
    a RuntimeError (a meta tensor holds no value)."""
    prepare = wt.convert if converted else (lambda model: model)
    with torch.device("meta"):
        meta = prepare(Stepped())
    x, steps, shift, kernels = torch.randn(2, 3, 8, 8), torch.tensor(2), torch.randn(4), torch.tensor([3, 1])
    found = wt.layers(meta, x, steps, shift, kernels=kernels, norm=torch.tensor(True))
    assert found == wt.layers(prepare(Stepped()), x, steps, shift, kernels=kernels, norm=torch.tensor(True))
    assert [layer.name for layer in found] == ["stem", "block", "block#2", "heads.2", "heads.0"]
    assert [layer.weight_shape for layer in found][-2:] == [(2, 4, 3, 3), (2, 4, 1, 1)]
    assert all(t.device.type == "cpu" for t in (x, steps, shift, kernels)) and all(p.is_meta for p in meta.parameters())
    other = (x, torch.tensor(0), shift)
    fewer = wt.layers(meta, *other, kernels=torch.tensor([2]), norm=torch.tensor(False))
    assert fewer == wt.layers(prepare(Stepped()), *other, kernels=torch.tensor([2]), norm=torch.tensor(False))
    assert [layer.name for layer in fewer] == ["stem", "heads.1"]


def test_a_forward_that_writes_into_its_input_on_a_meta_model_writes_into_the_callers_tensor():
    """The input's tensors are not copied: a forward that scales its input in place before it meets the model scales
    the caller's tensor, as the model on the CPU does (the README says to pass a copy to keep it)."""

    class Scaling(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv(x.div_(255))

    with torch.device("meta"):
        meta = wt.convert(Scaling())
    x = torch.full((1, 3, 5, 5), 255.0)
    assert [layer.input_shape for layer in wt.layers(meta, x)] == [(1, 3, 5, 5)]
    assert torch.equal(x, torch.ones(1, 3, 5, 5))


class Selecting(nn.Module):
    """A forward whose operations read the values of tensors it is given beside its own activations: a boolean mask
    keeping some of the batch, ``repeat_interleave``'s repeats along the width, and a number of groups given as a
    tensor, that reshapes the result."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.grouped = nn.Conv3d(2, 4, (1, 3, 3))
        self.head = nn.Conv2d(8, 2, 1)

    def forward(self, x: torch.Tensor, keep: torch.Tensor, repeats: torch.Tensor,
                groups: torch.Tensor) -> torch.Tensor:
        y = torch.repeat_interleave(self.stem(x)[keep], repeats, dim=3)
        z = self.grouped(y.view(y.shape[0], -1, groups, *y.shape[2:]))
        return self.head(y) + z.sum()


@pytest.mark.parametrize("converted", [True, False], ids=["converted", "pytorch"])
def test_a_model_on_the_meta_device_reads_the_values_of_tensors_it_is_given_beside_its_own(converted):
    """An operation given a real tensor beside the model's meta ones, whose values it reads (a boolean mask, the
    repeats of ``repeat_interleave``, a size as a tensor), runs on that tensor as it is, which PyTorch's meta kernels
    take: the layers are those the model gives on the CPU, as long as the shapes they read into. Moved to the meta
    device too, each such operation failed (a meta tensor holds no values)."""
    prepare = wt.convert if converted else (lambda model: model)
    with torch.device("meta"):
        meta = prepare(Selecting())
    x, keep, groups = torch.randn(3, 3, 6, 5), torch.tensor([True, False, True]), torch.tensor(4)
    for repeats in (torch.tensor([1, 2, 1, 3, 1]), torch.tensor([2, 2, 2, 2, 2])):
        found = wt.layers(meta, x, keep, repeats, groups)
        assert found == wt.layers(prepare(Selecting()), x, keep, repeats, groups)
        widths = int(repeats.sum())
        assert [layer.input_shape for layer in found] == [(1, 3, 6, 5), (1, 2, 4, 6, widths), (1, 8, 6, widths)]
    assert all(p.is_meta for p in meta.parameters())


def test_an_operation_that_fails_on_the_meta_device_and_beside_it_says_so():
    """An operation that fails with the tensors of its input moved to the meta device and as they were (masked_select
    has no meta kernel) raises the error of the first, as PyTorch raises it, with a note saying the model's tensors
    were meta and the others were moved there: the error may name as meta a tensor the forward was given real."""

    class Masked(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 1)

        def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
            return self.conv(x).masked_select(keep)

    with torch.device("meta"):
        meta = Masked()
    with pytest.raises(NotImplementedError, match="masked_select") as raised:
        wt.layers(meta, torch.randn(1, 3, 2, 2), torch.ones(1, 4, 2, 2, dtype=torch.bool))
    assert [note for note in raised.value.__notes__ if "wsarena.torch.layers: masked_select was given the model's meta "
            "tensors beside others" in note]


def _padded(module: nn.Module, x: torch.Tensor, layer: wsarena.ConvLayer) -> torch.Tensor:
    """``x`` padded as the layer says PyTorch pads it: by the module's own mode over its whole padding where that
    mode is not zeros, else with zeros at the end up to the layer's input size."""
    x = x if x.dim() == len(layer.input_shape) else x.unsqueeze(0)
    if module.padding_mode != "zeros":
        return F.pad(x, module._reversed_padding_repeated_twice, mode=module.padding_mode)
    extra = [want - have for want, have in zip(layer.input_shape[2:], x.shape[2:])]
    return F.pad(x, [p for e in reversed(extra) for p in (0, e)])


def _set(module: nn.Module, **settings: object) -> nn.Module:
    """``module`` with ``settings`` set as attributes, as a model's surgery sets them (ints PyTorch takes too)."""
    for name, value in settings.items():
        setattr(module, name, value)
    return module


MODULES = {
    "1d-strided": (nn.Conv1d(3, 4, 5, stride=2, padding=1, bias=False), (2, 3, 17)),
    "2d-grouped-dilated": (nn.Conv2d(4, 6, 3, padding=2, dilation=2, groups=2, bias=False), (2, 4, 9, 10)),
    "2d-same-even": (nn.Conv2d(3, 4, (4, 3), padding="same", bias=False), (2, 3, 9, 8)),
    "2d-same-dilated-even": (nn.Conv2d(3, 4, 2, padding="same", dilation=3, bias=False), (1, 3, 7, 7)),
    "2d-valid": (nn.Conv2d(3, 4, 3, padding="valid", bias=False), (1, 3, 7, 6)),
    "2d-reflect": (nn.Conv2d(3, 4, 3, padding=(1, 2), padding_mode="reflect", bias=False), (2, 3, 8, 9)),
    "2d-circular-same-even": (nn.Conv2d(3, 4, 4, padding="same", padding_mode="circular", bias=False),
                              (1, 3, 8, 8)),
    "2d-replicate-unbatched": (nn.Conv2d(3, 4, 3, padding=1, padding_mode="replicate", bias=False), (3, 6, 7)),
    "3d": (nn.Conv3d(2, 3, (3, 1, 2), stride=(1, 2, 1), padding=(1, 0, 1), bias=False), (1, 2, 5, 6, 4)),
    # a stride turned into a dilation after construction, as a dilated ResNet's surgery does, with ints
    "2d-int-padding-dilation-set": (_set(nn.Conv2d(3, 4, 3, bias=False), padding=2, dilation=2), (1, 3, 9, 8)),
    "2d-same-int-dilation-set": (_set(nn.Conv2d(3, 4, 4, padding="same", bias=False), dilation=2), (1, 3, 9, 8)),
    # a padding mode other than zeros pads by the padding the module was made with: PyTorch reads none set later
    # (here, one the stride would give the same output size with)
    "2d-reflect-padding-set": (_set(nn.Conv2d(3, 4, 3, stride=3, padding=1, padding_mode="reflect", bias=False),
                                    padding=(2, 2)), (1, 3, 7, 7)),
    "2d-circular-same-dilation-set": (
        _set(nn.Conv2d(3, 4, 4, padding="same", padding_mode="circular", bias=False), dilation=2), (1, 3, 8, 8)),
}


@pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel lengths")  # PyTorch's, of its copy
@pytest.mark.parametrize("case", list(MODULES))
def test_each_layer_computes_what_the_module_computed(case):
    """The layer's convolution, on the input PyTorch padded as the layer says, through wsarena's ops against the
    module's own result, in float64 (within 1e-10)."""
    module, shape = MODULES[case]
    module = module.double()
    x = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    (layer,) = wt.layers(module, x)
    assert layer.name == type(module).__name__ and not layer.transposed
    want = module(x)
    xp = _padded(module, x, layer)
    assert tuple(xp.shape[1:]) == layer.input_shape[1:]
    got = wsarena.conv_forward(xp.numpy(), module.weight.detach().numpy(), stride=layer.stride,
                               padding=layer.padding, dilation=layer.dilation, groups=layer.groups)
    np.testing.assert_allclose(got, want.detach().reshape(got.shape).numpy(), rtol=0, atol=1e-10)


TRANSPOSED = {
    "2d-output-padding": (nn.ConvTranspose2d(4, 6, 3, stride=2, padding=1, output_padding=1, groups=2, bias=False),
                          (2, 4, 5, 6), None),
    "1d-output-size": (nn.ConvTranspose1d(3, 2, 4, stride=3, padding=1, dilation=2, bias=False), (1, 3, 7), [23]),
    "3d-unbatched": (nn.ConvTranspose3d(2, 3, 2, stride=2, bias=False), (2, 3, 4, 2), None),
}


@pytest.mark.parametrize("case", list(TRANSPOSED))
def test_a_transposed_layer_is_the_backward_data_pass_the_module_computed(case):
    module, shape, size = TRANSPOSED[case]
    module = module.double()
    x = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    args = () if size is None else (size,)
    (layer,) = wt.layers(module, x, *args)
    want = module(x, *args)
    assert layer.transposed and layer.input_shape[1:] == tuple(want.shape[-len(layer.input_shape) + 1:])
    batched = x if x.dim() == len(layer.input_shape) else x.unsqueeze(0)
    got = wsarena.conv_backward_data(batched.numpy(), module.weight.detach().numpy(),
                                     (batched.shape[0], *layer.input_shape[1:]), stride=layer.stride,
                                     padding=layer.padding, dilation=layer.dilation, groups=layer.groups)
    np.testing.assert_allclose(got, want.detach().reshape(got.shape).numpy(), rtol=0, atol=1e-10)


@pytest.mark.parametrize("cls", [nn.Conv2d, nn.Conv3d, nn.ConvTranspose2d, nn.ConvTranspose3d])
def test_one_value_in_a_sequence_is_that_value_in_every_dimension_as_pytorch_runs_it(cls):
    """``nn.Conv2d(..., padding=(2,))``, or ``conv.padding = (2,)`` set after construction, runs as padding 2 in
    every dimension (ATen's expand_param_if_needed): its layer is that of the explicit ``(2, 2)``, on the meta device
    and converted too. A sequence of another length is PyTorch's error, raised as the model raises it."""
    nd = int(cls.__name__[-2])
    explicit = {"stride": 2, "padding": 2, "dilation": 2}
    if cls in (nn.ConvTranspose2d, nn.ConvTranspose3d):
        explicit["output_padding"] = 1
    x = torch.randn(1, 3, *(9,) * nd)
    (want,) = wt.layers(cls(3, 4, 3, **{k: (v,) * nd for k, v in explicit.items()}), x)
    assert (want.stride, want.padding, want.dilation) == ((2,) * nd,) * 3
    assert wt.layers(cls(3, 4, 3, **{k: [v] for k, v in explicit.items()}), x) == [want]
    later = _set(cls(3, 4, 3), **{k: (v,) for k, v in explicit.items()})  # a transposed one takes tuples only
    assert wt.layers(later, x) == [want]
    assert wt.layers(copy.deepcopy(later).to("meta"), x.to("meta")) == [want]
    assert wt.layers(wt.convert(later), x) == [want]
    with pytest.raises(RuntimeError, match="expected padding to be a single integer value or a list of"):
        wt.layers(_set(cls(3, 4, 3), padding=(2,) * (nd + 1)), x)


class Shared(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.LazyConv2d(4, 3, padding=1)  # its weight is made by the first call
        self.body = nn.Conv2d(4, 4, 3, padding=1)
        self.alias = self.body  # one module under two names: the first is its name
        self.head = nn.Conv2d(4, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.body(input=self.body(self.stem(x)))  # called twice, at one size (once by keyword)
        x = F.conv2d(x, self.head.weight)  # a function call: not a module's, not seen
        return self.alias(F.max_pool2d(self.body(torch.cat([x, x], 1)), 2))  # twice more, at other sizes


def test_modules_are_named_by_their_path_and_each_call_listed():
    found = wt.layers(Shared(), torch.randn(1, 3, 8, 8))
    assert [(layer.name, layer.input_shape) for layer in found] == [
        ("stem", (1, 3, 8, 8)), ("body", (1, 4, 8, 8)), ("body#2", (1, 4, 8, 8)), ("body#3", (1, 4, 8, 8)),
        ("body#4", (1, 4, 4, 4)),
    ]
    assert found[0].weight_shape == (4, 3, 3, 3)


def test_a_compiled_model_gives_its_modules_layers_without_compiling():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 1))
    compiled = torch.compile(model)
    found = wt.layers(compiled, torch.randn(1, 3, 8, 8))
    assert [layer.name for layer in found] == ["0", "2"] == [k.split(".")[0] for k in model.state_dict()][::2]
    assert found == wt.layers(model, torch.randn(1, 3, 8, 8))


def test_a_model_compiled_in_place_or_holding_a_compiled_module_runs_uncompiled():
    """Module.compile() compiles the model in place (no wrapper to unwrap), and a compiled submodule is a wrapper
    inside the model: their layers too come from an uncompiled run, which the backend given to torch.compile never
    sees. The submodule's layers keep its wrapper's "_orig_mod." in their names, as the state_dict names them."""
    compiled = []

    def backend(graph, example_inputs):
        compiled.append(graph)
        return graph.forward

    x = torch.randn(1, 3, 8, 8)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 1))
    expected = wt.layers(model, x)
    model.compile(backend=backend)
    assert wt.layers(model, x) == expected and compiled == []
    holder = nn.Sequential(torch.compile(nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 1)),
                                         backend=backend))
    found = wt.layers(holder, x)
    assert [layer.name for layer in found] == ["0._orig_mod.0", "0._orig_mod.2"] and compiled == []
    assert [k.rsplit(".", 1)[0] for k in holder.state_dict()][::2] == ["0._orig_mod.0", "0._orig_mod.2"]
    holder(x)  # outside layers(), compiled as asked
    assert len(compiled) == 1


class _Overlaps(nn.Module):
    """A model whose run says it began (``began``), then waits, at most 5 s, for ``go``, then runs ``conv``."""

    def __init__(self, conv: nn.Module, began: threading.Event, go: threading.Event) -> None:
        super().__init__()
        self.conv = conv
        self.began, self.go = began, go

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.began.set()
        self.go.wait(5)
        return self.conv(x)


def test_overlapping_calls_in_two_threads_leave_torch_compile_as_it_was():
    """torch.compile's stance is the process's: two layers() calls in two threads, the first ending while the second
    runs, each restoring the stance it found, would leave "force_eager" set for good (and the second's compiled
    submodule, run once the first ended, compiled). Neither run compiles; a function compiled afterwards is."""
    graphs = []

    def backend(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    x = torch.randn(1, 3, 8, 8)
    a_began, b_began, a_ended = threading.Event(), threading.Event(), threading.Event()
    found: dict[str, list] = {}
    first = _Overlaps(nn.Conv2d(3, 2, 3), a_began, b_began)
    second = _Overlaps(torch.compile(nn.Conv2d(3, 2, 3), backend=backend), b_began, a_ended)
    a = threading.Thread(target=lambda: found.setdefault("a", wt.layers(first, x)))
    b = threading.Thread(target=lambda: found.setdefault("b", wt.layers(second, x)))
    a.start()
    assert a_began.wait(5)
    b.start()  # a ends once b's run began, then b once a ended
    a.join()
    a_ended.set()
    b.join()
    try:
        assert [[layer.name for layer in found[k]] for k in "ab"] == [["conv"], ["conv._orig_mod"]]
        assert graphs == []
        torch.compile(lambda t: t.sin() + 1, backend=backend)(x)
        assert len(graphs) == 1
    finally:
        torch.compiler.set_stance("default")  # the tests after this one compile as asked, whatever it found


def _compiles() -> int:
    """How many graphs a function compiled now makes on a tiny tensor: 1, or 0 under "force_eager". (Elementwise on
    two numbers: no OpenMP region, which a forked child of a process that ran convolutions may wait on for ever.)"""
    graphs = []

    def backend(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    code = (lambda t: t * 2 - 1).__code__.replace()  # a code object of its own: torch.compile's limit of
    torch.compile(types.FunctionType(code, globals()), backend=backend)(torch.ones(2))  # recompiles is per code object
    return len(graphs)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork here")
def test_a_child_forked_while_another_thread_runs_layers_compiles_as_asked():
    """The thread inside layers() at os.fork() does not exist in the child, where its call never ends: the child
    would run uncompiled for ever. It finds torch.compile's stance as that call found it."""
    began, forked = threading.Event(), threading.Event()
    model = _Overlaps(nn.Conv2d(3, 2, 3), began, forked)
    thread = threading.Thread(target=wt.layers, args=(model, torch.randn(1, 3, 8, 8)))
    thread.start()
    try:
        assert began.wait(5)
        wait = fork(_compiles)
    finally:
        forked.set()
        thread.join()
    assert wait() == 1
    assert _compiles() == 1  # and the parent, once the call ended


class _Forks(nn.Module):
    """A model whose run forks (in ``box["wait"]``, what :func:`fork` returns) once its convolution ran."""

    def __init__(self, box: dict) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 2, 3)
        self.box = box

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        self.box["wait"] = fork(_compiles)
        return y


@pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork here")
def test_a_child_forked_by_the_model_itself_runs_uncompiled_until_its_call_ends():
    """The thread that forks goes on in the child, inside its layers() call: there "force_eager" holds until that
    call ends, as in the parent."""
    box: dict = {}
    assert [layer.name for layer in wt.layers(_Forks(box), torch.randn(1, 3, 8, 8))] == ["conv"]
    assert box["wait"]() == 0
    assert _compiles() == 1


class _InterruptedLock:
    """A lock whose first release is followed by a KeyboardInterrupt, as a Ctrl-C just after it raises one."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.interrupt = True

    def __enter__(self) -> None:
        self.lock.acquire()

    def __exit__(self, *exc: object) -> None:
        self.lock.release()
        if self.interrupt:
            self.interrupt = False
            raise KeyboardInterrupt


class _InterruptedStack(contextlib.ExitStack):
    """An ExitStack whose first context entered is followed by a KeyboardInterrupt: the stance set, not yet
    counted."""

    interrupt = True

    def enter_context(self, cm):
        entered = super().enter_context(cm)
        if self.interrupt:
            self.interrupt = False
            raise KeyboardInterrupt
        return entered


def _refused_once(monkeypatch):
    """torch.compiler.set_stance refuses its first call (raises), then works."""
    set_stance = torch.compiler.set_stance
    calls = []

    def refusing(*args, **kwargs):
        calls.append(args)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return set_stance(*args, **kwargs)

    monkeypatch.setattr(torch.compiler, "set_stance", refusing)


@pytest.mark.parametrize("where", ["as the lock is let go", "once the stance is set", "as the stance is set"])
def test_a_ctrl_c_as_layers_sets_the_stance_leaves_torch_compile_as_it_was(monkeypatch, where):
    """A Ctrl-C between the stance set and the count of calls under way, or after them before the run that ends
    them, would leave "force_eager", or the count and with it "force_eager", for the rest of the process; one as
    torch sets the stance would leave a count of nothing to end."""
    from wsarena.torch import _layers

    monkeypatch.setattr(_layers, "_eager_calls", type(_layers._eager_calls)())  # this test's own count
    if where == "as the lock is let go":
        monkeypatch.setattr(_layers, "_eager_lock", _InterruptedLock())
    elif where == "once the stance is set":
        monkeypatch.setattr(_layers, "_eager_stance", _InterruptedStack())
    else:
        _refused_once(monkeypatch)
    try:
        with pytest.raises(KeyboardInterrupt):
            wt.layers(nn.Conv2d(3, 2, 3), torch.randn(1, 3, 8, 8))
        assert _compiles() == 1
        found = wt.layers(nn.Sequential(nn.Conv2d(3, 2, 3)), torch.randn(1, 3, 8, 8))  # a run after it
        assert [layer.name for layer in found] == ["0"]
        assert _compiles() == 1
    finally:
        torch.compiler.set_stance("default")  # the tests after this one compile as asked, whatever it found


def test_a_converted_model_gives_the_same_layers_and_hooks_are_removed():
    model = ResNet50()
    x = torch.randn(1, 3, 64, 64)
    before = wt.layers(model.eval(), x)
    converted = wt.convert(model)
    assert wt.layers(converted, x) == before
    assert all(not m._forward_hooks for m in converted.modules())


def test_the_run_leaves_running_statistics_and_the_random_stream_as_they_were():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Dropout(0.5), nn.Conv2d(4, 2, 1)).train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(2, 3, 8, 8) * 10 + 3  # statistics far from the initial ones
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    found = wt.layers(model, x)
    assert torch.equal(torch.rand(3), expected)  # the dropout drew from a generator of its own
    assert [layer.name for layer in found] == ["0", "3"] and model.training
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # num_batches_tracked and the running stats


class LayerDrop(nn.Module):  # a train-mode layer drop drawn from Python's generator (older Hugging Face encoders')
    def __init__(self) -> None:                                                      # and a jitter from NumPy's
        super().__init__()
        self.convs = nn.ModuleList(nn.Conv1d(4, 4, 3, padding=1) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for conv in self.convs:
            if not self.training or random.uniform(0, 1) >= 0.1:
                x = conv(x) * float(np.random.uniform(0.9, 1.1))
        return x


def test_the_run_leaves_pythons_and_numpys_random_streams_as_they_were():
    model = LayerDrop().train()
    random.seed(3)
    np.random.seed(3)
    expected = random.random(), np.random.random()
    random.seed(3)
    np.random.seed(3)
    assert len(wt.layers(model, torch.randn(1, 4, 16))) == 3  # none dropped by seed 3
    assert (random.random(), np.random.random()) == expected


def test_numpys_random_stream_is_restored_without_a_warning_where_its_global_generator_is_not_mt19937():
    """NumPy's global generator may be another bit generator (np.random.set_bit_generator): its state is saved as
    it is, not as MT19937's legacy tuple, which NumPy gives for others only with a RuntimeWarning."""
    model = LayerDrop().train()
    found = np.random.get_bit_generator()
    try:
        np.random.set_bit_generator(np.random.PCG64(3))
        expected = np.random.random()
        np.random.set_bit_generator(np.random.PCG64(3))
        random.seed(3)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            assert len(wt.layers(model, torch.randn(1, 4, 16))) == 3  # none dropped by seed 3
        assert np.random.random() == expected
    finally:
        np.random.set_bit_generator(found)


def test_a_model_that_raises_leaves_no_hook_and_bad_models_are_typed_errors():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Linear(5, 5))  # the linear layer's sizes do not fit
    with pytest.raises(RuntimeError):
        wt.layers(model, torch.randn(1, 3, 6, 6))
    assert all(not m._forward_hooks for m in model.modules())
    with pytest.raises(ModelError, match="Sequential ran no nn.Conv"):
        wt.layers(nn.Sequential(nn.Linear(3, 3)), torch.randn(2, 3))
    with pytest.raises(TypeError, match="torch.nn.Module"):
        wt.layers(F.conv2d, torch.randn(1, 3, 6, 6))


class Guided(nn.Module):  # a forward with a keyword argument named as layers()' own first parameter
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.guide = nn.Conv2d(3, 4, 1)

    def forward(self, x: torch.Tensor, model: str = "plain") -> torch.Tensor:
        return self.conv(x) if model == "plain" else self.guide(x)


def test_a_keyword_argument_named_model_goes_to_the_models_forward():
    found = wt.layers(Guided(), torch.randn(1, 3, 6, 6), model="guided")
    assert [(layer.name, layer.weight_shape) for layer in found] == [("guide", (4, 3, 1, 1))]
    assert [layer.name for layer in wt.layers(Guided(), x=torch.randn(1, 3, 6, 6))] == ["conv"]


def test_the_layers_plan_tune_and_reach_the_command_through_json(tmp_path, capsys):
    found = wt.layers(Shared(), torch.randn(1, 3, 8, 8))
    p = wsarena.plan(found, batch=4, backend="cpu")
    assert [layer.name for layer in p.layers] == [layer.name for layer in found] and p.arena_bytes > 0
    t = wsarena.tune(found, batch=4, backend="cpu")
    assert t.curve[-1].arena_bytes == wsarena.plan(found, batch=4, backend="cpu", cap_workspace=None,
                                                   search="exhaustive").arena_bytes
    path = tmp_path / "model.json"
    path.write_text(json.dumps(layers_to_json(found)))
    code, out, err = run_main(capsys, "report", str(path), "--backend", "cpu", "--batch", "4", "--format", "json")
    assert code == 0, err
    assert json.loads(out)["arena_bytes"] == p.arena_bytes


def test_lazy_modules_are_read_and_their_buffers_left_as_first_initialized():
    # LazyBatchNorm's buffers are uninitialized until the run: they cannot be copied before it, only once made
    bn = nn.LazyBatchNorm2d()
    model = nn.Sequential(nn.LazyConv2d(4, 3), bn, bn, nn.LazyConv2d(2, 1)).train()  # the norm called twice
    found = wt.layers(model, torch.randn(2, 3, 8, 8) * 10 + 3)
    assert [(layer.name, layer.input_shape, layer.weight_shape) for layer in found] == [
        ("0", (1, 3, 8, 8), (4, 3, 3, 3)), ("3", (1, 4, 6, 6), (2, 4, 1, 1))]
    assert torch.equal(bn.running_mean, torch.zeros(4)) and torch.equal(bn.running_var, torch.ones(4))
    assert int(bn.num_batches_tracked) == 0  # as initialized: the example input's statistics left out


class SameConv2d(nn.Conv2d):  # timm's Conv2dSame: TensorFlow's "SAME" padding, made in forward, padding kept 0
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pads = [max((-(-n // s) - 1) * s + k - n, 0) for n, k, s in zip(x.shape[-2:], self.kernel_size, self.stride)]
        x = F.pad(x, [pads[1] // 2, pads[1] - pads[1] // 2, pads[0] // 2, pads[0] - pads[0] // 2])
        return F.conv2d(x, self.weight, self.bias, self.stride, 0, self.dilation, self.groups)


class Cropped(nn.ConvTranspose2d):  # a transposed one whose output is cut: its layer, read from it, is too small
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)[..., 1:, 1:]


class Keyword(nn.Conv2d):  # a subclass whose forward names its input otherwise
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)


def test_a_subclass_convolving_otherwise_is_a_model_error_and_its_input_is_found_by_any_name():
    # the layer's settings give a 4x4 output where the module made 5x5: a plan of that layer would be wrong
    with pytest.raises(ModelError, match=r"0 \(SameConv2d\).*\(5, 5\).*\(4, 4\)"):
        wt.layers(nn.Sequential(SameConv2d(3, 4, 3, stride=2)), torch.randn(1, 3, 9, 9))
    model = nn.Sequential(nn.Conv2d(3, 4, 3), Cropped(4, 3, 3, stride=2))
    with pytest.raises(ModelError, match=r"1 \(Cropped\) made \(7, 7\) where its settings give \(6, 6\)"):
        wt.layers(model, torch.randn(1, 3, 9, 9))
    conv = Keyword(3, 4, 3)
    (layer,) = wt.layers(conv, x=torch.randn(2, 3, 6, 6))
    assert layer.input_shape == (1, 3, 6, 6) and tuple(layer.geometry().output_shape) == (1, 4, 4, 4)


class Masked(nn.Conv2d):  # NVIDIA's partial convolution (return_mask=True): the result and the updated mask
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[override]
        mask = F.conv2d(torch.ones_like(x[:, :1]), torch.ones(1, 1, *self.kernel_size), padding=self.padding)
        return super().forward(x), mask.clamp(0, 1)


def test_a_subclass_returning_no_tensor_is_a_model_error_naming_it():
    with pytest.raises(ModelError, match=r"^1 \(Masked\) returned a tuple, not a tensor: .*ONNX"):
        wt.layers(nn.Sequential(nn.Conv2d(3, 3, 1), Masked(3, 4, 3, padding=1)), torch.randn(1, 3, 8, 8))


class Counted(nn.Module):  # a forward that replaces its buffer rather than updating it in place
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.register_buffer("calls", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = self.calls + 1
        return self.conv(x)


def test_a_replaced_buffer_and_an_inference_mode_model_are_left_as_they_were():
    model = Counted()
    before = model.calls
    assert [layer.name for layer in wt.layers(model, torch.randn(1, 3, 4, 4))] == ["conv"]
    assert model.calls is before and float(model.calls) == 0  # the model's own tensor, as it was
    with torch.inference_mode():  # as a model loaded for serving: its buffers are inference tensors
        served = nn.Sequential(nn.Conv2d(3, 4, 1), nn.BatchNorm2d(4)).eval()
    (layer,) = wt.layers(served, torch.randn(1, 3, 4, 4))  # copying them back raised outside inference mode
    assert layer.weight_shape == (4, 3, 1, 1) and float(served[1].running_var.sum()) == 4


class Gridded(nn.Module):  # a buffer expanded over a dimension: its elements share memory, as expand() makes them
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.register_buffer("grid", torch.linspace(-1, 1, 4).expand(2, 4), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv(x) + self.grid[0]


def test_a_buffer_expanded_over_a_dimension_is_left_as_it_was():
    """Such a buffer takes no write in place (PyTorch refuses one to elements that share memory), so the run cannot
    have changed it; copying it back raised once the model had run."""
    model = Gridded()
    grid = model.grid
    assert [layer.name for layer in wt.layers(model, torch.randn(1, 3, 4, 4))] == ["conv"]
    assert model.grid is grid and torch.equal(grid, torch.linspace(-1, 1, 4).expand(2, 4))


def test_a_users_forward_hook_that_changes_the_result_does_not_change_the_layer():
    conv = nn.Conv2d(3, 4, 3)
    conv.register_forward_hook(lambda module, args, out: out[..., 1:, 1:])  # the layer is the convolution's
    (layer,) = wt.layers(nn.Sequential(conv), torch.randn(1, 3, 8, 8))
    assert layer.input_shape == (1, 3, 8, 8) and len(conv._forward_hooks) == 1
