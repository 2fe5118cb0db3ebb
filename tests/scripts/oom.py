"""A convolution under an address-space limit (``resource.setrlimit(RLIMIT_AS)``) that leaves EXTRA_MIB MiB.

    python tests/scripts/oom.py EXTRA_MIB [CAP]

The layer is NHWC with large images, where the fastest algorithm is ``implicit_gemm``: no workspace, but NumPy
temporaries as large as the output (6 MiB), which a tight limit does not leave. The call either falls back (then
this prints the result's largest error against the float64 reference and the workspace the arena holds, as one
JSON object) or raises NoAlgorithmFitsError, which is left to end the process (exit status 1). CAP, a workspace
cap (``0``: only the zero-workspace algorithm may run), leaves it nothing to fall back to.
"""

from __future__ import annotations

import json
import resource
import sys

import numpy as np

import wsarena
from wsarena.arena import get_arena

rng = np.random.default_rng(0)
x = rng.standard_normal((8, 56, 56, 64)).astype(np.float32)
w = rng.standard_normal((64, 3, 3, 64)).astype(np.float32) / 24
out = np.zeros((8, 56, 56, 64), np.float32)  # allocated before the limit: only the convolution's memory is short
if len(sys.argv) > 2:
    wsarena.configure(cap_workspace=int(sys.argv[2]))
wsarena.conv_forward(x[:1], w, padding=1, layout="NHWC")  # imports, BLAS threads, the algorithm cache: all made
sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent))
from reference import ref_conv_forward


def vm_size() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize")


resource.setrlimit(resource.RLIMIT_AS, (vm_size() + (int(sys.argv[1]) << 20), resource.RLIM_INFINITY))
wsarena.conv_forward(x, w, padding=1, layout="NHWC", out=out)
resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
expected = ref_conv_forward(x, w, padding=1, layout="NHWC")
error = float(np.abs(out - expected).max() / np.abs(expected).max())
print(json.dumps({"relative_error": error, "workspace_bytes": get_arena("cpu").stats().capacity_bytes}))
