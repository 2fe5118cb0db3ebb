"""A child forked while other threads are inside wsarena has usable arenas (what multiprocessing's fork start
method and many data loaders do). Each scenario forks in a child process of its own (``tests/scripts/fork.py``),
and a child still running after 10 s counts as a hang."""

import pytest

from .reliability import figures, run_script


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
