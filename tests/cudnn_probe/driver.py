"""Let cuDNN's backend API finalize descriptors on a machine without the NVIDIA driver (no ``libcuda.so.1``).

cuDNN loads its engine sub-libraries on the first ``cudnnBackendFinalize`` of the process, one of them links
``libcuda.so.1`` (from cuDNN 9.27 on), and a failure is final for the process: without the driver library every
finalize returns ``SUBLIBRARY_LOADING_FAILED`` (1008). :func:`load_stand_in` compiles ``libcuda_stub.c`` (the six
driver functions that sub-library imports, each failing as a driver without a device does) and loads it before
anything else, so that the test process can build descriptors, operation graphs and execution plans against device
properties. A machine with the driver (the lent GPU's) keeps its own: the stand-in is loaded only where none loads.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import tempfile
from pathlib import Path

import cudnn_headers

SOURCE = Path(__file__).with_name("libcuda_stub.c")
_loaded: list[ctypes.CDLL] = []  # never unloaded: cuDNN keeps pointers into it


def driver_library_loaded() -> bool:
    """Whether a ``libcuda.so.1`` (the driver's or the stand-in) is loaded in this process."""
    try:
        ctypes.CDLL("libcuda.so.1", mode=os.RTLD_NOLOAD)
    except OSError:
        return False
    return True


def load_stand_in() -> str | None:
    """Make ``libcuda.so.1`` loadable in this process; ``None`` on success, else why it could not be.

    ``WSARENA_TEST_DRIVER_STAND_IN=0`` leaves it out: the process then behaves as a machine without the driver.
    """
    if os.environ.get("WSARENA_TEST_DRIVER_STAND_IN") == "0":
        return "WSARENA_TEST_DRIVER_STAND_IN=0: the stand-in for libcuda.so.1 is left out"
    if driver_library_loaded():
        return None
    if real_driver_library():
        return None
    compiler = cudnn_headers.c_compiler()
    if compiler is None:
        return "no libcuda.so.1 and no C compiler to build its test stand-in"
    folder = Path(tempfile.mkdtemp(prefix="wsarena-libcuda-"))
    target = folder / "libcuda.so.1"
    build = subprocess.run(
        [compiler, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(target), str(SOURCE)],
        capture_output=True, text=True, check=False,
    )
    if build.returncode != 0:
        return f"the libcuda.so.1 stand-in does not build: {build.stderr.strip()[:500]}"
    # RTLD_GLOBAL under its soname: the loader then satisfies cuDNN's NEEDED libcuda.so.1 with it.
    _loaded.append(ctypes.CDLL(str(target), mode=ctypes.RTLD_GLOBAL))
    return None


def finalize_unavailable_reason() -> str | None:
    """``None`` when cuDNN's backend API can finalize descriptors in this process, else why not (for skips)."""
    from wsarena import cudnn

    try:
        cudnn.bind_all()
        t = cudnn.BackendDescriptor(cudnn.BackendDescriptorType.TENSOR_DESCRIPTOR)
    except Exception as exc:  # noqa: BLE001 - no libcudnn: the reason is the skip's
        return f"libcudnn is not usable: {exc}"
    A, T = cudnn.BackendAttributeName, cudnn.BackendAttributeType
    with t:
        t.set(A.TENSOR_DATA_TYPE, T.DATA_TYPE, cudnn.DataType.FLOAT).set(A.TENSOR_DIMENSIONS, T.INT64, [1, 1, 1, 1])
        t.set(A.TENSOR_STRIDES, T.INT64, [1, 1, 1, 1]).set(A.TENSOR_UNIQUE_ID, T.INT64, 1)
        t.set(A.TENSOR_BYTE_ALIGNMENT, T.INT64, 4)
        try:
            t.finalize()
        except cudnn.CudnnError as exc:
            return f"cuDNN cannot finalize backend descriptors here: {exc}"
    return None


def engines_link_the_driver() -> bool:
    """Whether the loaded cuDNN's engine libraries link ``libcuda.so.1``, as from 9.27 on: an older cuDNN loads
    them, and plans against device properties, without it."""
    from wsarena.cudnn import load_library

    return load_library().version >= 92700


def real_driver_library() -> bool:
    """Whether this machine has the NVIDIA driver's own ``libcuda.so.1`` (not the stand-in)."""
    if _loaded:
        return False
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True
