"""A child forked while other threads are inside wsarena has usable arenas (what multiprocessing's fork start
method and many data loaders do). Each scenario forks in a child process of its own (``tests/scripts/fork.py``),
and a child still running after 10 s counts as a hang."""

import subprocess
import sys

import pytest

from .reliability import ROOT, child_env, figures, run_script


@pytest.mark.parametrize(
    ("scenario", "forks"),
    [
        ("busy", 40),  # four threads inside convolutions on lanes of their own and their default lanes
        ("held", 20),  # one thread inside a lease, another inside the growth of a lane
        ("device", 5),  # a device arena: the parent's memory is never freed in the child, leases say why not
    ],
)
def test_a_child_forked_while_threads_use_the_arena_runs_on_the_same_lanes(scenario, forks):
    found = figures(run_script("fork.py", scenario, forks, timeout=120))
    assert found == {"scenario": scenario, "forks": forks, "hangs": 0, "failed": 0}


def test_a_child_forked_while_threads_make_their_first_convolution_does_not_hang():
    """A module imported on first use is imported under its module lock; a child forked meanwhile finds the lock
    held by a thread it does not have, and waits for ever. So the CPU path is imported with ``import wsarena``.
    Each process has one first call: two processes, 30 forks each, 1 ms apart from the threads' start."""
    for _ in range(2):
        found = figures(run_script("fork.py", "first", 30, timeout=120))
        assert found == {"scenario": "first", "forks": 30, "hangs": 0, "failed": 0}


_FIRST_CALLS = """
import sys
import numpy as np
import wsarena

before = set(sys.modules)
x, w = np.ones((2, 3, 8, 8), np.float32), np.ones((4, 3, 3, 3), np.float32)
y = wsarena.conv_forward(x, w, padding=1)
wsarena.conv_backward_data(y, w, x.shape, padding=1)
wsarena.conv_backward_filter(x, y, w.shape, padding=1)
with wsarena.config(algo_search="exhaustive", debug=True, cap_workspace="1MiB"):
    wsarena.conv_forward(x.astype(np.float64), w.astype(np.float64), padding=2, stream="lane")
    wsarena.conv_backward_filter(x, y, w.shape, padding=1, layout="NCHW", stream="lane")
print(sorted(set(sys.modules) - before))
"""


def test_the_first_convolutions_on_the_cpu_import_nothing(tmp_path):
    """What the fork test above finds by chance, found for certain: no module is imported on the ops' CPU path
    after ``import wsarena`` (every pass, the heuristic and the exhaustive search with its cache, debug mode)."""
    out = subprocess.run([sys.executable, "-c", _FIRST_CALLS], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env=child_env(WSARENA_CACHE_DIR=str(tmp_path)), check=True).stdout
    assert out.strip() == "[]"
