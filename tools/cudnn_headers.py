"""Read the cuDNN C headers shipped in the ``nvidia-cudnn`` wheel: enumerations, typedefs and prototypes.

A development tool, not part of the installed package: ``tools/gen_cudnn_enums.py`` (which writes
:mod:`wsarena.cudnn._enums`) and the parity tests that compare the bindings with the headers import it as
``cudnn_headers`` (pytest puts ``tools/`` on ``sys.path``). It needs a C compiler and pycparser, which only
development and test installs have.

The headers include ``cuda_runtime_api.h`` and ``library_types.h`` from the CUDA toolkit, which no wheel ships.
They use exactly three names from them, so :data:`STUB_HEADERS` replaces both with the matching typedefs; the
preprocessed output is then the same as with the real CUDA headers.

This module imports only the standard library at import time (pycparser on first parse) and nothing from
wsarena, so the generator runs even while ``_enums.py`` is missing or stale.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "CUDNN_HEADERS",
    "STUB_HEADERS",
    "HeaderInfo",
    "c_compiler",
    "enumerations",
    "function_declarations",
    "header_directory",
    "header_version",
    "parse_headers",
    "preprocess",
    "typedefs",
    "write_stubs",
]

# The headers that declare the legacy convolution API, in include order.
CUDNN_HEADERS = ("cudnn_graph.h", "cudnn_ops.h", "cudnn_cnn.h")

# Stand-ins for the two CUDA toolkit headers that cudnn_graph.h includes (see the module docstring).
STUB_HEADERS = {
    "cuda_runtime_api.h": (
        "/* Stub: the only CUDA runtime names the cuDNN headers use. */\n"
        "#ifndef WSARENA_STUB_CUDA_RUNTIME_API_H\n"
        "#define WSARENA_STUB_CUDA_RUNTIME_API_H\n"
        "typedef struct CUstream_st *cudaStream_t;\n"
        "typedef struct CUgraph_st *cudaGraph_t;\n"
        "#endif\n"
    ),
    "library_types.h": (
        "/* Stub: libraryPropertyType as CUDA's library_types.h defines it. */\n"
        "#ifndef WSARENA_STUB_LIBRARY_TYPES_H\n"
        "#define WSARENA_STUB_LIBRARY_TYPES_H\n"
        "typedef enum libraryPropertyType_t { MAJOR_VERSION, MINOR_VERSION, PATCH_LEVEL } libraryPropertyType;\n"
        "#endif\n"
    ),
}


def header_directory() -> Path:
    """Folder holding ``cudnn_graph.h``: ``$CUDNN_PATH/include``, else the one cuda.pathfinder finds.

    The order is the loader's (:mod:`wsarena.cudnn._library`): ``$CUDNN_PATH`` first, then
    ``cuda.pathfinder.find_nvidia_header_directory("cudnn")`` (the wheel's ``nvidia/cudnn/include``, conda, ...).

    Raises
    ------
    FileNotFoundError
        Listing every place looked at.
    """
    tried: list[str] = []
    root = os.environ.get("CUDNN_PATH")
    if root:
        folder = Path(root) / "include"
        if (folder / "cudnn_graph.h").is_file():
            return folder
        tried.append(f"{folder}: no cudnn_graph.h")
    else:
        tried.append("$CUDNN_PATH/include: CUDNN_PATH is not set")
    place = "cuda.pathfinder.find_nvidia_header_directory('cudnn')"
    try:
        from cuda.pathfinder import find_nvidia_header_directory

        found = find_nvidia_header_directory("cudnn")
    except Exception as exc:  # noqa: BLE001 - any failure is reported with the other places
        tried.append(f"{place}: {type(exc).__name__}: {exc}")
    else:
        if found and (Path(found) / "cudnn_graph.h").is_file():
            return Path(found)
        tried.append(f"{place}: {found} has no cudnn_graph.h" if found else f"{place}: nothing found")
    raise FileNotFoundError("cuDNN headers not found; tried: " + "; ".join(tried))


@dataclass(frozen=True)
class HeaderInfo:
    """Version of a cuDNN header folder, from ``cudnn_version.h``."""

    major: int
    minor: int
    patch: int

    @property
    def version(self) -> int:
        """The number ``cudnnGetVersion()`` returns for the same release (cuDNN 9 scheme)."""
        return self.major * 10000 + self.minor * 100 + self.patch

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}.{self.patch}"


def header_version(include_dir: Path | None = None) -> HeaderInfo:
    """Read ``CUDNN_MAJOR``, ``CUDNN_MINOR`` and ``CUDNN_PATCHLEVEL`` from ``cudnn_version.h``."""
    text = ((include_dir or header_directory()) / "cudnn_version.h").read_text()
    values = {}
    for key in ("MAJOR", "MINOR", "PATCHLEVEL"):
        match = re.search(rf"^#define\s+CUDNN_{key}\s+(\d+)", text, re.MULTILINE)
        if match is None:
            raise ValueError(f"cudnn_version.h defines no CUDNN_{key}")
        values[key] = int(match.group(1))
    return HeaderInfo(values["MAJOR"], values["MINOR"], values["PATCHLEVEL"])


def c_compiler() -> str | None:
    """The C compiler to use: ``$CC`` if set, else ``cc``, ``gcc`` or ``clang`` from ``PATH``; ``None`` if none."""
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name:
            path = shutil.which(name)
            if path:
                return path
    return None


def write_stubs(directory: Path) -> Path:
    """Write :data:`STUB_HEADERS` into ``directory`` and return it (for ``-I``)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in STUB_HEADERS.items():
        (directory / name).write_text(text)
    return directory


def preprocess(
    headers: tuple[str, ...] = CUDNN_HEADERS, *, include_dir: Path | None = None, compiler: str | None = None
) -> str:
    """Run the C preprocessor over ``headers`` (with the CUDA stubs) and return text pycparser can parse.

    ``<stddef.h>`` comes first for ``size_t``; ``__attribute__`` is defined away because pycparser does not
    read GNU attributes (the headers only use it for deprecation warnings, and only when asked to).
    """
    include_dir = include_dir or header_directory()
    compiler = compiler or c_compiler()
    if compiler is None:
        raise FileNotFoundError("no C compiler found (set CC or install cc/gcc/clang)")
    with tempfile.TemporaryDirectory(prefix="wsarena-cudnn-") as tmp:
        stub_dir = write_stubs(Path(tmp) / "stub")
        source = Path(tmp) / "cudnn_all.c"
        source.write_text("#include <stddef.h>\n" + "".join(f'#include "{h}"\n' for h in headers))
        result = subprocess.run(
            [compiler, "-E", "-P", "-std=c99", "-D__attribute__(x)=", "-I", str(stub_dir), "-I", str(include_dir),
             str(source)],
            capture_output=True,
            text=True,
            check=False,
        )
    if result.returncode != 0:
        raise RuntimeError(f"{compiler} -E failed ({result.returncode}): {result.stderr.strip()[:2000]}")
    return result.stdout


def parse_headers(
    headers: tuple[str, ...] = CUDNN_HEADERS, *, include_dir: Path | None = None, compiler: str | None = None
) -> Any:
    """Preprocess and parse ``headers``; return pycparser's ``FileAST``."""
    from pycparser import c_parser

    text = preprocess(headers, include_dir=include_dir, compiler=compiler)
    return c_parser.CParser().parse(text, "cudnn_all.c")


def _int_literal(text: str) -> int:
    text = text.rstrip("uUlL")
    if text[:2].lower() == "0x":
        return int(text, 16)
    if len(text) > 1 and text.startswith("0"):
        return int(text, 8)  # C octal
    return int(text)


def _evaluate(node: Any, known: dict[str, int]) -> int:
    """Value of an enumerator's constant expression (literals, earlier enumerators, arithmetic, shifts)."""
    from pycparser import c_ast

    if isinstance(node, c_ast.Constant):
        return _int_literal(node.value)
    if isinstance(node, c_ast.ID):
        return known[node.name]
    if isinstance(node, c_ast.UnaryOp):
        value = _evaluate(node.expr, known)
        return {"-": -value, "+": value, "~": ~value}[node.op]
    if isinstance(node, c_ast.BinaryOp):
        left, right = _evaluate(node.left, known), _evaluate(node.right, known)
        ops = {
            "+": lambda a, b: a + b,
            "-": lambda a, b: a - b,
            "*": lambda a, b: a * b,
            "<<": lambda a, b: a << b,
            ">>": lambda a, b: a >> b,
            "|": lambda a, b: a | b,
            "&": lambda a, b: a & b,
        }
        return ops[node.op](left, right)
    if isinstance(node, c_ast.Cast):
        return _evaluate(node.expr, known)
    raise ValueError(f"cannot evaluate enumerator expression {type(node).__name__}")


def enumerations(ast: Any) -> dict[str, list[tuple[str, int]]]:
    """Every ``typedef enum {...} name;`` in ``ast``: typedef name -> [(enumerator, value), ...] in header order."""
    from pycparser import c_ast

    out: dict[str, list[tuple[str, int]]] = {}
    known: dict[str, int] = {}
    for ext in ast.ext:
        node = getattr(ext, "type", None)
        if not isinstance(ext, c_ast.Typedef) or not isinstance(node, c_ast.TypeDecl):
            continue
        enum = node.type
        if not isinstance(enum, c_ast.Enum) or enum.values is None:
            continue
        members = []
        value = -1
        for item in enum.values.enumerators:
            value = value + 1 if item.value is None else _evaluate(item.value, known)
            known[item.name] = value
            members.append((item.name, value))
        out[ext.name] = members
    return out


def typedefs(ast: Any) -> dict[str, Any]:
    """Every typedef in ``ast``: name -> its pycparser type node."""
    from pycparser import c_ast

    return {ext.name: ext.type for ext in ast.ext if isinstance(ext, c_ast.Typedef)}


def function_declarations(ast: Any) -> dict[str, Any]:
    """Every function prototype in ``ast``: name -> pycparser ``FuncDecl``."""
    from pycparser import c_ast

    return {
        ext.name: ext.type
        for ext in ast.ext
        if isinstance(ext, c_ast.Decl) and isinstance(ext.type, c_ast.FuncDecl)
    }
