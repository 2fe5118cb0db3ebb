import subprocess
import sys

import pytest

import wsarena


def test_all_is_sorted_and_every_name_resolves():
    assert wsarena.__all__ == sorted(wsarena.__all__)
    for name in wsarena.__all__:
        assert getattr(wsarena, name) is not None, name
    assert set(dir(wsarena)) >= set(wsarena.__all__)
    assert set(wsarena._LAZY) <= set(wsarena.__all__)  # every name served on first use is public
    public = {name for name in vars(wsarena) if not name.startswith("_")} - {"annotations", "importlib", "Any"}
    modules = {name for name in public if type(getattr(wsarena, name)).__name__ == "module"}
    assert public - modules <= set(wsarena.__all__)  # nothing defined here is left out


def test_every_error_and_warning_is_in_the_hierarchy_and_exported():
    """wsarena.errors' docstring draws the hierarchy: each class it exports has a line there, and is public."""
    import re

    from wsarena import errors

    drawn = set(re.findall(r"^[ │├└─]*(\w+)(?: \(\w+\))?(?: {2,}|$)", errors.__doc__, re.MULTILINE))
    assert set(errors.__all__) <= drawn, set(errors.__all__) - drawn
    assert set(errors.__all__) <= set(wsarena.__all__)


def test_the_errors_tree_draws_each_class_under_its_nearest_drawn_base():
    """Each class in wsarena.errors' tree is drawn under the nearest of the drawn classes that it subclasses (none at
    the left edge), and the built-in named beside it in brackets is one of its bases: a class moved under another
    (ReleasedAtExitError under ArenaClosedError) and its drawing change together."""
    import builtins
    import importlib
    import re

    from wsarena import errors

    def resolve(name):
        if "." not in name:
            return getattr(errors, name)
        module, _, attribute = name.rpartition(".")
        return getattr(importlib.import_module(module), attribute)

    drawn = []  # (depth, class, the built-in in brackets or None)
    for line in errors.__doc__.split("::\n", 1)[1].splitlines():
        # a class at the left edge (column 4), or after a branch; a description's continuation is neither
        found = re.match(r"^ {4}((?:[│ ] {3})*)(?:[├└]── )?([A-Za-z_][\w.]*)(?: \((\w+)\))?(?: {2,}|$)", line)
        if found and ("── " in line or not found[1]):
            depth = len(found[1]) // 4 + ("── " in line)
            drawn.append((depth, resolve(found[2]), found[3]))
    classes = [cls for _, cls, _ in drawn]
    assert {cls.__name__ for cls in classes} >= set(errors.__all__)
    parents = []
    for depth, cls, builtin in drawn:
        del parents[depth:]
        ancestors = [other for other in classes if other is not cls and issubclass(cls, other)]
        nearest = [a for a in ancestors if all(issubclass(a, other) for other in ancestors)]
        assert (parents[-1] if parents else None) is (nearest[0] if nearest else None), cls
        assert builtin is None or issubclass(cls, getattr(builtins, builtin)), (cls, builtin)
        parents.append(cls)


def test_the_contract_names_exist():
    for name in ("configure", "config", "get_config", "parse_size", "format_size", "conv_forward",
                 "conv_backward_data", "conv_backward_filter", "get_arena", "load_model", "plan", "cudnn"):
        assert name in wsarena.__all__, name
    assert callable(wsarena.cudnn.bind_all)


def test_import_is_light():
    """`import wsarena` loads neither libcudnn nor CuPy nor any array library but NumPy (the CPU path's, imported
    with the package so that a fork never cuts its import in half), so it works anywhere; nor does a NumPy
    convolution import PyTorch or JAX."""
    code = (
        "import sys, wsarena\n"
        "maps = open('/proc/self/maps').read()\n"
        "print('libcudnn' in maps, 'cupy' in sys.modules, 'torch' in sys.modules, 'jax' in sys.modules)\n"
        "import numpy as np\n"
        "wsarena.conv_forward(np.ones((1, 1, 4, 4)), np.ones((1, 1, 3, 3)))\n"
        "print('torch' in sys.modules, 'jax' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False"] * 6


def test_the_models_module_is_reached_from_the_package_as_the_docs_write_it():
    """README and docs/models.md write ``wsarena.models.zoo_names()``, ``wsarena.models.layers_to_json`` and
    ``wsarena.models.ModelError`` after a plain ``import wsarena``; in a new process, where nothing else has imported
    the submodule yet."""
    code = (
        "import wsarena\n"
        "print(','.join(wsarena.models.zoo_names()), wsarena.models.ModelError.__name__,\n"
        "      callable(wsarena.models.layers_to_json))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    from wsarena.models import zoo_names

    assert out.split() == [",".join(zoo_names()), "ModelError", "True"]


@pytest.mark.parametrize("version, refused", [("2.6.0+cpu", True), ("2.7.0a0+git1234", False), ("2.13.0", False)])
def test_wsarena_torch_refuses_a_pytorch_older_than_the_one_it_needs(version, refused):
    """wsarena.torch needs PyTorch 2.7 (``torch.library.custom_op`` of ``list[int]`` parameters, ``register_vmap``,
    ``torch.compiler.is_exporting``): an older one is an ImportError naming both versions at import, not an error
    from inside the import (2.6 raised a ValueError: its custom_op takes no ``list[int]``). A new process in which
    ``torch.__version__`` reads as ``version``."""
    pytest.importorskip("torch")
    code = (
        "import torch\n"
        "from torch.torch_version import TorchVersion\n"
        f"torch.__version__ = TorchVersion({version!r})\n"
        "try:\n"
        "    import wsarena.torch\n"
        "except ImportError as exc:\n"
        "    print('refused:', exc)\n"
        "else:\n"
        "    print('imported')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    if refused:
        assert out.startswith("refused: wsarena.torch needs PyTorch 2.7 or newer") and version in out
    else:
        assert out.strip() == "imported"
