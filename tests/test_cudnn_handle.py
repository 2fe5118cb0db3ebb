"""cuDNN handles on a machine without a usable GPU: a clear, typed error (GPU behaviour: test_cudnn_gpu.py)."""

from __future__ import annotations

import pytest

import wsarena.cudnn as cudnn
from wsarena._gpu import gpu_unusable_reason
from wsarena.cudnn import handle as handle_mod
from wsarena.errors import BackendUnavailableError

_info = cudnn.library_info()


@pytest.mark.skipif(gpu_unusable_reason() is None, reason="a GPU is usable here; see test_cudnn_gpu.py")
@pytest.mark.skipif(not _info["found"], reason=f"libcudnn not loadable: {_info['error']}")
def test_get_handle_without_gpu_says_there_is_no_usable_gpu():
    with pytest.raises(cudnn.CudnnGpuUnavailableError) as info:
        cudnn.get_handle(0)
    err = info.value
    assert isinstance(err, BackendUnavailableError) and isinstance(err, cudnn.CudnnError)
    text = str(err)
    assert "no usable GPU" in text and gpu_unusable_reason() in text
    assert "cudnnCreate" in text and "CUDNN_STATUS_NOT_INITIALIZED" in text
    assert err.status is cudnn.Status.NOT_INITIALIZED and err.func_name == "cudnnCreate"
    # Nothing half-built is kept: asking again fails the same way.
    with pytest.raises(cudnn.CudnnGpuUnavailableError):
        cudnn.get_handle(0)
    assert not list(handle_mod._live)


def test_close_all_handles_with_none_open_is_harmless():
    cudnn.close_all_handles()
