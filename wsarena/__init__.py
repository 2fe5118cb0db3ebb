"""wsarena: one shared, capped cuDNN convolution workspace per device.

Every convolution call leases its scratch memory from one arena per device. Per stream the arena holds a
single buffer sized to the largest workspace any call on that stream needs, so memory is the *maximum* over
layers and passes, not their sum; calls on different streams get disjoint sub-arenas.
"""

from __future__ import annotations

import importlib
from typing import Any

from . import errors
from ._config import Config, config, configure, get_config
from ._sizes import format_size, parse_size
from .errors import (
    AlignmentWorkspaceError,
    ArenaClosedError,
    ArenaOutOfMemoryError,
    BackendUnavailableError,
    CaptureError,
    CaptureFallbackWarning,
    CudaError,
    CudnnApiFallbackWarning,
    MemoryFallbackWarning,
    NoAlgorithmFitsError,
    ProviderError,
    ReleasedAtExitError,
    SearchCacheWarning,
    SearchFallbackWarning,
    UnsupportedConvolutionError,
    WorkspaceCapError,
    WorkspaceCapWarning,
    WorkspaceMemoryError,
    WsarenaError,
)

__version__ = "0.1.0"

# The ops and their CPU path (arena, backend, algorithms, search cache) are imported here, not on first use: a
# thread importing a module holds that module's import lock, and a child forked meanwhile (multiprocessing's fork
# start method, while other threads run their first convolution) would find the lock held for ever and the
# module half made. NumPy comes with them; CuPy, PyTorch, JAX and libcudnn are still loaded only when used.
from .arena import Arena, get_arena
from .ops import conv_backward_data, conv_backward_filter, conv_forward

# Names served from submodules on first use, so that `import wsarena` stays light and never loads libcudnn.
_LAZY = {
    "ConvLayer": "wsarena.models",
    "load_model": "wsarena.models",
    "Plan": "wsarena.planner",
    "plan": "wsarena.planner",
    "Tuning": "wsarena.tuning",
    "tune": "wsarena.tuning",
    "cudnn": "wsarena.cudnn",
    "models": "wsarena.models",
    "capture": "wsarena.cudagraph",
    "CapturedGraph": "wsarena.cudagraph",
}

__all__ = [
    "AlignmentWorkspaceError",
    "Arena",
    "ArenaClosedError",
    "ArenaOutOfMemoryError",
    "BackendUnavailableError",
    "CaptureError",
    "CaptureFallbackWarning",
    "CapturedGraph",
    "Config",
    "ConvLayer",
    "CudaError",
    "CudnnApiFallbackWarning",
    "MemoryFallbackWarning",
    "NoAlgorithmFitsError",
    "Plan",
    "ProviderError",
    "ReleasedAtExitError",
    "SearchCacheWarning",
    "SearchFallbackWarning",
    "Tuning",
    "UnsupportedConvolutionError",
    "WorkspaceCapError",
    "WorkspaceCapWarning",
    "WorkspaceMemoryError",
    "WsarenaError",
    "__version__",
    "capture",
    "config",
    "configure",
    "conv_backward_data",
    "conv_backward_filter",
    "conv_forward",
    "cudnn",
    "errors",
    "format_size",
    "get_arena",
    "get_config",
    "load_model",
    "models",
    "parse_size",
    "plan",
    "tune",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'wsarena' has no attribute {name!r}")
    mod = importlib.import_module(module)
    value = mod if name in ("cudnn", "models") else getattr(mod, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
