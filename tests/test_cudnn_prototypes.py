"""Every entry of the prototype table against the declaration parsed from the headers (no GPU needed)."""

from __future__ import annotations

import ctypes
import threading

import cudnn_headers
import pytest

from wsarena import cudnn
from wsarena.cudnn import _prototypes

from .cudnn_probe import probe

pytestmark = pytest.mark.skipif(probe.compiler() is None, reason="no C compiler (cc/gcc/clang or $CC) found")

REQUIRED = {
    "cudnnGetVersion", "cudnnGetCudartVersion", "cudnnGetErrorString", "cudnnGetLastErrorString", "cudnnGetProperty",
    "cudnnCreate", "cudnnDestroy", "cudnnSetStream", "cudnnGetStream",
    "cudnnCreateTensorDescriptor", "cudnnSetTensorNdDescriptor", "cudnnGetTensorNdDescriptor",
    "cudnnDestroyTensorDescriptor", "cudnnGetTensorSizeInBytes",
    "cudnnCreateFilterDescriptor", "cudnnSetFilterNdDescriptor", "cudnnGetFilterNdDescriptor",
    "cudnnDestroyFilterDescriptor",
    "cudnnCreateConvolutionDescriptor", "cudnnSetConvolutionNdDescriptor", "cudnnGetConvolutionNdDescriptor",
    "cudnnSetConvolutionGroupCount", "cudnnGetConvolutionGroupCount", "cudnnSetConvolutionMathType",
    "cudnnGetConvolutionMathType", "cudnnDestroyConvolutionDescriptor", "cudnnGetConvolutionNdForwardOutputDim",
    *(
        f"{prefix}{p}{suffix}"
        for p in ("Forward", "BackwardData", "BackwardFilter")
        for prefix, suffix in (
            ("cudnnGetConvolution", "WorkspaceSize"),
            ("cudnnGetConvolution", "Algorithm_v7"),
            ("cudnnGetConvolution", "AlgorithmMaxCount"),
            ("cudnnFindConvolution", "AlgorithmEx"),
        )
    ),
    "cudnnConvolutionForward", "cudnnConvolutionBackwardData", "cudnnConvolutionBackwardFilter",
    "cudnnBackendCreateDescriptor", "cudnnBackendDestroyDescriptor", "cudnnBackendFinalize",
    "cudnnBackendSetAttribute", "cudnnBackendGetAttribute", "cudnnBackendExecute",
    "cudnnGetExecutionPlanWorkspaceSize",
}

# typedef'd structs passed by pointer -> the ctypes Structure that mirrors them
STRUCTS = {
    "cudnnConvolutionFwdAlgoPerf_t": cudnn.ConvolutionFwdAlgoPerfStruct,
    "cudnnConvolutionBwdDataAlgoPerf_t": cudnn.ConvolutionBwdDataAlgoPerfStruct,
    "cudnnConvolutionBwdFilterAlgoPerf_t": cudnn.ConvolutionBwdFilterAlgoPerfStruct,
}
SCALARS = {
    ("int",): ctypes.c_int,
    ("size_t",): ctypes.c_size_t,
    ("float",): ctypes.c_float,
    ("double",): ctypes.c_double,
    ("int64_t",): ctypes.c_int64,
    ("int32_t",): ctypes.c_int32,
    ("unsigned",): ctypes.c_uint,
}


def expected_ctype(node, typedefs):
    """The ctypes type a C type must be declared as (module docstring of wsarena.cudnn._prototypes)."""
    c_ast = probe.c_ast()

    if isinstance(node, (c_ast.PtrDecl, c_ast.ArrayDecl)):  # arrays in parameters decay to pointers
        inner = node.type
        if isinstance(inner, c_ast.TypeDecl) and isinstance(inner.type, c_ast.IdentifierType):
            names = tuple(inner.type.names)
            if names == ("void",):
                return ctypes.c_void_p
            if names == ("char",):
                return ctypes.c_char_p
        return ctypes.POINTER(expected_ctype(inner, typedefs))
    assert isinstance(node, c_ast.TypeDecl), node
    base = node.type
    if isinstance(base, c_ast.Enum):
        return ctypes.c_int
    assert isinstance(base, c_ast.IdentifierType), base
    names = tuple(base.names)
    if names == ("void",):
        return None
    if names in SCALARS:  # before typedef resolution, so size_t stays size_t
        return SCALARS[names]
    (name,) = names
    if name in STRUCTS:
        return STRUCTS[name]
    target = typedefs[name]
    if isinstance(target, c_ast.PtrDecl):  # cudnnHandle_t, cudnn*Descriptor_t, cudaStream_t: opaque pointers
        return ctypes.c_void_p
    return expected_ctype(target, typedefs)


def test_table_covers_every_function_wsarena_needs():
    assert REQUIRED <= set(cudnn.PROTOTYPES)


@pytest.mark.parametrize("name", sorted(cudnn.PROTOTYPES))
def test_prototype_matches_header(name):
    c_ast = probe.c_ast()

    parsed = probe.parsed()
    if name in _prototypes.OPTIONAL and name not in parsed["functions"]:
        version = cudnn_headers.header_version()
        assert version.version < _prototypes.OPTIONAL[name], f"{name} is missing from the cuDNN {version} headers"
        pytest.skip(f"{name} is new in a later cuDNN than these headers ({version})")
    assert name in parsed["functions"], f"{name} is not declared in {', '.join(cudnn_headers.CUDNN_HEADERS)}"
    decl = parsed["functions"][name]
    restype, argtypes = cudnn.PROTOTYPES[name]
    assert restype is expected_ctype(decl.type, parsed["typedefs"]), "restype"
    params = list(decl.args.params) if decl.args else []
    if len(params) == 1 and isinstance(params[0], c_ast.Typename) and expected_ctype(
        params[0].type, parsed["typedefs"]
    ) is None:
        params = []  # f(void)
    assert len(argtypes) == len(params), f"{name}: {len(argtypes)} argtypes for {len(params)} parameters"
    for i, (ours, param) in enumerate(zip(argtypes, params)):
        want = expected_ctype(param.type, parsed["typedefs"])
        assert ours is want, f"{name} argument {i} ({param.name}): {ours} declared, header says {want}"


def test_bind_all_declares_every_function():
    lib = cudnn.bind_all()
    assert isinstance(lib, ctypes.CDLL)
    for name, (restype, argtypes) in cudnn.PROTOTYPES.items():
        if name in _prototypes.OPTIONAL and not _prototypes.available(name):
            assert cudnn.load_library().version < _prototypes.OPTIONAL[name], name
            continue
        fn = getattr(lib, name)
        assert fn.restype is restype and list(fn.argtypes) == list(argtypes), name
        assert _prototypes.function(name) is fn
    assert lib.cudnnGetVersion() // 10000 == 9


def test_a_finalizer_may_bind_a_function_while_its_thread_is_binding_another():
    # A garbage collection inside _declare (which allocates) can run a descriptor's finalizer on the same
    # thread, and that finalizer binds its Destroy function through the same lock.
    cudnn.bind_all()
    name = "cudnnDestroyTensorDescriptor"
    bound = _prototypes._bound.pop(name)
    done = threading.Event()

    def bind_inside_the_lock():
        with _prototypes._lock:
            _prototypes.function(name)
        done.set()

    try:
        threading.Thread(target=bind_inside_the_lock, daemon=True).start()
        assert done.wait(10), "binding re-entered the prototype lock and deadlocked"
    finally:
        _prototypes._bound.setdefault(name, bound)


def test_bind_all_leaves_out_an_optional_function_the_library_lacks(monkeypatch):
    """A cuDNN older than an optional function (the lent GPU's 9.19 has no cudnnGetExecutionPlanWorkspaceSize)
    still binds; the function alone fails, as CudnnSymbolError, when asked for."""
    cudnn.bind_all()
    real = _prototypes._declare
    missing = {"cudnnGetExecutionPlanWorkspaceSize", "cudnnBackendExecute"}

    def declare(lib, path, version, name):
        if name in missing:
            raise cudnn.CudnnSymbolError(f"{path} does not export {name}")
        return real(lib, path, version, name)

    monkeypatch.setattr(_prototypes, "_declare", declare)
    monkeypatch.setattr(_prototypes, "_bound", {})
    monkeypatch.setattr(_prototypes, "OPTIONAL", {"cudnnGetExecutionPlanWorkspaceSize": 92300})
    with pytest.raises(cudnn.CudnnSymbolError, match="cudnnBackendExecute") as info:
        cudnn.bind_all()  # a required function missing is still an error, naming only it
    assert "cudnnGetExecutionPlanWorkspaceSize" not in str(info.value)
    missing.discard("cudnnBackendExecute")
    assert isinstance(cudnn.bind_all(), ctypes.CDLL)
    assert not _prototypes.available("cudnnGetExecutionPlanWorkspaceSize")
    with pytest.raises(cudnn.CudnnSymbolError, match="cudnnGetExecutionPlanWorkspaceSize"):
        _prototypes.function("cudnnGetExecutionPlanWorkspaceSize")


def test_unknown_name_is_a_key_error():
    with pytest.raises(KeyError, match="cudnnNoSuchThing"):
        _prototypes.function("cudnnNoSuchThing")


def test_library_property_mirrors_the_stub():
    enums = probe.parsed()["enums"]["libraryPropertyType"]
    assert [(m.name, m.value) for m in cudnn.LibraryProperty] == enums
