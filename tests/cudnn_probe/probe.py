"""Parse the shipped cuDNN headers once per test session, and build and run C probes against them.

A probe is a C program that includes the cuDNN headers (with the CUDA stub headers of
``tools/cudnn_headers.py``) and prints what the compiler knows: enumerator values, ``sizeof`` and ``offsetof``.
It links nothing from cuDNN, so it runs on any machine with a C compiler.
"""

from __future__ import annotations

import functools
import subprocess
from pathlib import Path
from typing import Any

import cudnn_headers
import pytest

# The perf structures and their fields, in header order.
PERF_STRUCTS = (
    "cudnnConvolutionFwdAlgoPerf_t",
    "cudnnConvolutionBwdDataAlgoPerf_t",
    "cudnnConvolutionBwdFilterAlgoPerf_t",
)
PERF_FIELDS = ("algo", "status", "time", "memory", "determinism", "mathType", "reserved")


def compiler() -> str | None:
    return cudnn_headers.c_compiler()


def c_ast() -> Any:
    """pycparser's ``c_ast`` module; skips the calling test where pycparser is missing (see :func:`parsed`)."""
    return pytest.importorskip("pycparser.c_ast", reason="pycparser is not installed (pip install -e '.[test]')")


@functools.cache
def parsed() -> dict[str, Any]:
    """The parsed headers: ``ast``, ``enums``, ``functions`` and ``typedefs`` (computed once).

    Skips the calling test where pycparser is missing: the test extras install it (CI always has it), a lent
    GPU machine may not."""
    c_ast()
    ast = cudnn_headers.parse_headers()
    return {
        "ast": ast,
        "enums": cudnn_headers.enumerations(ast),
        "functions": cudnn_headers.function_declarations(ast),
        "typedefs": cudnn_headers.typedefs(ast),
    }


def probe_source(enumerators: list[str]) -> str:
    """C source printing ``E <name> <value>`` per enumerator and ``S``/``F`` lines for the perf structs."""
    lines = [
        "#include <stddef.h>",
        "#include <stdio.h>",
        '#include "cudnn_graph.h"',
        '#include "cudnn_ops.h"',
        '#include "cudnn_cnn.h"',
        "int main(void) {",
        '    printf("T int %zu\\n", sizeof(int));',
        '    printf("T size_t %zu\\n", sizeof(size_t));',
        '    printf("T enum %zu\\n", sizeof(cudnnStatus_t));',
        '    printf("T pointer %zu\\n", sizeof(cudnnHandle_t));',
    ]
    lines += [f'    printf("E {name} %lld\\n", (long long){name});' for name in enumerators]
    for struct in PERF_STRUCTS:
        lines.append(f'    printf("S {struct} %zu %zu\\n", sizeof({struct}), _Alignof({struct}));')
        for field in PERF_FIELDS:
            lines.append(
                f'    printf("F {struct} {field} %zu %zu\\n", offsetof({struct}, {field}), '
                f"sizeof((({struct} *)0)->{field}));"
            )
    lines += ["    return 0;", "}", ""]
    return "\n".join(lines)


def run_probe(source: str, workdir: Path) -> dict[str, Any]:
    """Compile and run ``source``; return ``{"types": {...}, "enums": {...}, "structs": {...}, "fields": {...}}``."""
    stub = cudnn_headers.write_stubs(workdir / "stub")
    src = workdir / "probe.c"
    exe = workdir / "probe"
    src.write_text(source)
    build = subprocess.run(
        [compiler(), "-std=c11", "-I", str(stub), "-I", str(cudnn_headers.header_directory()),
         str(src), "-o", str(exe)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert build.returncode == 0, f"probe does not compile:\n{build.stderr[-4000:]}"
    out = subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout
    result: dict[str, Any] = {"types": {}, "enums": {}, "structs": {}, "fields": {}}
    for line in out.splitlines():
        kind, *rest = line.split()
        if kind == "T":
            result["types"][rest[0]] = int(rest[1])
        elif kind == "E":
            result["enums"][rest[0]] = int(rest[1])
        elif kind == "S":
            result["structs"][rest[0]] = (int(rest[1]), int(rest[2]))
        elif kind == "F":
            result["fields"][(rest[0], rest[1])] = (int(rest[2]), int(rest[3]))
    return result
