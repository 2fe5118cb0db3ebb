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
    ArenaOutOfMemoryError,
    BackendUnavailableError,
    CaptureError,
    CudnnApiFallbackWarning,
    NoAlgorithmFitsError,
    SearchCacheWarning,
    UnsupportedConvolutionError,
    WorkspaceCapError,
    WorkspaceCapWarning,
    WorkspaceMemoryError,
    WsarenaError,
)

__version__ = "0.1.0"

# Names served from submodules on first use, so that `import wsarena` stays light and never loads libcudnn.
_LAZY = {
    "Arena": "wsarena.arena",
    "get_arena": "wsarena.arena",
    "conv_forward": "wsarena.ops",
    "conv_backward_data": "wsarena.ops",
    "conv_backward_filter": "wsarena.ops",
    "ConvLayer": "wsarena.models",
    "load_model": "wsarena.models",
    "Plan": "wsarena.planner",
    "plan": "wsarena.planner",
    "Tuning": "wsarena.tuning",
    "tune": "wsarena.tuning",
    "cudnn": "wsarena.cudnn",
    "capture": "wsarena.cudagraph",
    "CapturedGraph": "wsarena.cudagraph",
}

__all__ = [
    "Arena",
    "ArenaOutOfMemoryError",
    "BackendUnavailableError",
    "CaptureError",
    "CapturedGraph",
    "Config",
    "ConvLayer",
    "CudnnApiFallbackWarning",
    "NoAlgorithmFitsError",
    "Plan",
    "SearchCacheWarning",
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
    "parse_size",
    "plan",
    "tune",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'wsarena' has no attribute {name!r}")
    mod = importlib.import_module(module)
    value = mod if name == "cudnn" else getattr(mod, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
