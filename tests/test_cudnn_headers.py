"""Parity of the cuDNN bindings with the shipped headers: enums and perf structs (needs a C compiler, no GPU)."""

from __future__ import annotations

import ctypes
import importlib.util
import sys
from enum import IntEnum
from pathlib import Path

import cudnn_headers
import pytest

from wsarena import cudnn

from .cudnn_probe import probe

pytestmark = pytest.mark.skipif(probe.compiler() is None, reason="no C compiler (cc/gcc/clang or $CC) found")

STRUCTS = {
    "cudnnConvolutionFwdAlgoPerf_t": cudnn.ConvolutionFwdAlgoPerfStruct,
    "cudnnConvolutionBwdDataAlgoPerf_t": cudnn.ConvolutionBwdDataAlgoPerfStruct,
    "cudnnConvolutionBwdFilterAlgoPerf_t": cudnn.ConvolutionBwdFilterAlgoPerfStruct,
}


# the members that count the others (the last of their enum): an older cuDNN's headers may count fewer
_COUNTS = {"COUNT", "COUNTS", "TYPE_COUNT", "MODES_COUNT"}


def _agrees(older: bool, member: str, ours: int, theirs: int | None) -> bool:
    """Whether a header's value of an enumerator is ``ours``: a count in older headers may be lower."""
    if older and member in _COUNTS and theirs is not None:
        return theirs <= ours
    return theirs == ours


def _headers_older_than_enums() -> bool:
    """True on a machine with an older cuDNN than _enums.py came from (a lent GPU's own): enumerators added since
    would not compile against its headers, so only those its headers declare are compiled and checked."""
    installed = cudnn_headers.header_version()
    return (installed.major, installed.minor, installed.patch) < tuple(map(int, cudnn.HEADER_VERSION.split(".")))


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    if _headers_older_than_enums():  # what these headers declare of the enums wsarena mirrors
        declared = probe.parsed()["enums"]
        names = [name for typedef in cudnn.C_NAMES for name, _ in declared.get(typedef, [])]
    else:
        names = [name for table in cudnn.C_NAMES.values() for name in table]
    return probe.run_probe(probe.probe_source(names), tmp_path_factory.mktemp("cudnn_probe"))


def test_header_directory_prefers_cudnn_path(monkeypatch, tmp_path):
    monkeypatch.delenv("CUDNN_PATH", raising=False)
    found = cudnn_headers.header_directory()  # cuda.pathfinder's (the wheel's, here)
    assert (found / "cudnn_graph.h").is_file()
    (tmp_path / "own" / "include").mkdir(parents=True)
    (tmp_path / "own" / "include" / "cudnn_graph.h").symlink_to(found / "cudnn_graph.h")
    monkeypatch.setenv("CUDNN_PATH", str(tmp_path / "own"))
    assert cudnn_headers.header_directory() == tmp_path / "own" / "include"
    monkeypatch.setenv("CUDNN_PATH", str(tmp_path / "empty"))
    assert cudnn_headers.header_directory() == found


def _generator():
    path = Path(__file__).resolve().parents[1] / "tools" / "gen_cudnn_enums.py"
    spec = importlib.util.spec_from_file_location("_gen_cudnn_enums_under_test", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_every_declared_enumerator_has_the_compiled_value(compiled):
    older = _headers_older_than_enums()
    checked = 0
    for typedef, names in cudnn.C_NAMES.items():
        enum = cudnn.C_TYPEDEFS[typedef]
        for c_name, member in names.items():
            if older and c_name not in compiled["enums"]:
                continue  # added in a later cuDNN than this machine's
            assert _agrees(older, member, enum[member], compiled["enums"][c_name]), (
                f"{typedef}: {c_name} {compiled['enums'][c_name]} vs {enum.__name__}.{member} {int(enum[member])}"
            )
            checked += 1
    total = sum(len(n) for n in cudnn.C_NAMES.values())
    assert checked > 100 and (older or checked == total)


def _generated_from_these_headers() -> bool:
    return cudnn.HEADER_VERSION == str(cudnn_headers.header_version())


@pytest.mark.parametrize("typedef", sorted(cudnn.C_NAMES))
def test_no_header_enumerator_is_missing(typedef):
    header = probe.parsed()["enums"][typedef]
    enum = cudnn.C_TYPEDEFS[typedef]
    values = dict(header)
    older = _headers_older_than_enums()
    # Any cuDNN 9 keeps the values of the enumerators wsarena binds (a newer one may add others).
    for c_name, member in cudnn.C_NAMES[typedef].items():
        if older and c_name not in values:
            continue  # added in a later cuDNN than this machine's (9.19 has no CUDNN_DATA_BYTE_BOOLEAN)
        assert _agrees(older, member, enum[member], values.get(c_name)), (
            f"{c_name}: {values.get(c_name)} in the headers, {int(enum[member])} here"
        )
    if _generated_from_these_headers():  # the headers the enums came from: nothing left out either
        assert list(cudnn.C_NAMES[typedef]) == [name for name, _ in header]
        # Every distinct header value is a canonical member, and nothing else is.
        assert {m.value for m in enum} == {value for _, value in header}


def test_parser_values_agree_with_the_compiler(compiled):
    """The generator reads values with its own evaluator; the compiler is the referee."""
    for typedef in cudnn.C_NAMES:
        for name, value in probe.parsed()["enums"][typedef]:
            assert compiled["enums"][name] == value, name


def test_class_names_follow_the_typedefs():
    for typedef, enum in cudnn.C_TYPEDEFS.items():
        assert issubclass(enum, IntEnum)
        assert enum.__name__ == typedef.removeprefix("cudnn").removesuffix("_t")
        assert getattr(cudnn, enum.__name__) is enum


def test_member_names_drop_the_common_prefix():
    assert cudnn.ConvolutionFwdAlgo.IMPLICIT_GEMM == 0
    assert cudnn.Status.BAD_PARAM == 2000
    assert cudnn.DataType.FLOAT == 0
    assert cudnn.TensorFormat.NHWC == 1
    assert cudnn.ConvolutionMode.CROSS_CORRELATION == 1
    assert cudnn.MathType.TENSOR_OP_MATH == 1
    assert cudnn.Determinism.DETERMINISTIC == 1
    # A member that would start with a digit keeps the last shared word.
    assert cudnn.ConvolutionBwdFilterAlgo.ALGO_0 == 0 and cudnn.ConvolutionBwdFilterAlgo.FFT == 2
    assert cudnn.ConvolutionBwdDataAlgo.ALGO_1 == 1
    # Deprecated header aliases stay aliases.
    assert cudnn.Status.ALLOC_FAILED is cudnn.Status.INTERNAL_ERROR_HOST_ALLOCATION_FAILED


def test_algorithm_counts_match_the_notes():
    assert cudnn.ConvolutionFwdAlgo.COUNT == 8
    assert cudnn.ConvolutionBwdDataAlgo.COUNT == 6
    assert cudnn.ConvolutionBwdFilterAlgo.COUNT == 7


def test_generated_file_is_up_to_date():
    version = str(cudnn_headers.header_version())
    if not _generated_from_these_headers():
        pytest.skip(
            f"the installed headers are cuDNN {version}; _enums.py was generated from {cudnn.HEADER_VERSION} "
            "(test_no_header_enumerator_is_missing checks that they agree)"
        )
    gen = _generator()
    enums = probe.parsed()["enums"]
    expected = gen.render(enums, version, cudnn_headers.CUDNN_HEADERS)
    current = (Path(cudnn.__file__).parent / "_enums.py").read_text()
    assert current == expected, "wsarena/cudnn/_enums.py is stale: run python tools/gen_cudnn_enums.py"
    assert cudnn.HEADER_VERSION == version
    expected = gen.render_status_errors(enums["cudnnStatus_t"], version, cudnn_headers.CUDNN_HEADERS)
    current = (Path(cudnn.__file__).parent / "_status_errors.py").read_text()
    assert current == expected, "wsarena/cudnn/_status_errors.py is stale: run python tools/gen_cudnn_enums.py"


def test_generator_member_name_rule():
    gen = _generator()
    assert gen.member_names(["CUDNN_A_X", "CUDNN_A_Y_Z"]) == {"CUDNN_A_X": "X", "CUDNN_A_Y_Z": "Y_Z"}
    assert gen.member_names(["P_ALGO_0", "P_ALGO_FFT"]) == {"P_ALGO_0": "ALGO_0", "P_ALGO_FFT": "FFT"}
    assert gen.class_name("cudnnMathType_t") == "MathType"


def test_c_types_have_the_sizes_ctypes_assumes(compiled):
    assert compiled["types"]["int"] == ctypes.sizeof(ctypes.c_int)
    assert compiled["types"]["enum"] == ctypes.sizeof(ctypes.c_int)  # enums are passed as c_int
    assert compiled["types"]["size_t"] == ctypes.sizeof(ctypes.c_size_t)
    assert compiled["types"]["pointer"] == ctypes.sizeof(ctypes.c_void_p)


@pytest.mark.parametrize("c_struct", sorted(STRUCTS))
def test_perf_struct_layout(compiled, c_struct):
    ours = STRUCTS[c_struct]
    size, align = compiled["structs"][c_struct]
    assert ctypes.sizeof(ours) == size == 48
    assert ctypes.alignment(ours) == align
    assert [name for name, _ in ours._fields_] == list(probe.PERF_FIELDS)
    for field in probe.PERF_FIELDS:
        offset, field_size = compiled["fields"][(c_struct, field)]
        assert getattr(ours, field).offset == offset, field
        assert getattr(ours, field).size == field_size, field
    assert len(ours().reserved) == 3


@pytest.mark.parametrize("c_struct", sorted(STRUCTS))
def test_perf_struct_fields_match_the_declaration(c_struct):
    """Field names and C types as the header declares them (the compiler checked the layout)."""
    c_ast = probe.c_ast()

    decl = probe.parsed()["typedefs"][c_struct].type
    assert isinstance(decl, c_ast.Struct)
    c_fields = []
    for item in decl.decls:
        node = item.type
        length = None
        if isinstance(node, c_ast.ArrayDecl):
            length = int(node.dim.value)
            node = node.type
        c_fields.append((item.name, " ".join(node.type.names), length))
    ours = STRUCTS[c_struct]
    expected_ctypes = {"float": ctypes.c_float, "size_t": ctypes.c_size_t, "int": ctypes.c_int}
    for (name, c_type, length), (our_name, our_type) in zip(c_fields, ours._fields_, strict=True):
        assert name == our_name
        if length is not None:
            assert our_type._length_ == length and our_type._type_ is ctypes.c_int
        elif c_type.startswith("cudnn"):
            assert our_type is ctypes.c_int  # an enum
        else:
            assert our_type is expected_ctypes[c_type]


def test_algo_perf_from_struct():
    raw = cudnn.ConvolutionBwdFilterAlgoPerfStruct(
        algo=2, status=0, time=1.5, memory=1 << 20, determinism=1, mathType=1
    )
    perf = cudnn.AlgoPerf.from_struct(raw)
    assert perf == cudnn.AlgoPerf(
        algo=cudnn.ConvolutionBwdFilterAlgo.FFT,
        status=cudnn.Status.SUCCESS,
        time_ms=1.5,
        memory=1 << 20,
        determinism=cudnn.Determinism.DETERMINISTIC,
        math_type=cudnn.MathType.TENSOR_OP_MATH,
    )
    assert perf.ok
    with pytest.raises(AttributeError):
        perf.memory = 0  # frozen
    unknown = cudnn.AlgoPerf.from_struct(cudnn.ConvolutionFwdAlgoPerfStruct(algo=99, status=3000))
    assert unknown.algo == 99 and not unknown.ok
