"""What the fuzz tests tried: per area, the inputs tried, those refused, and those refused as documented.

The counts are kept per process. With ``WSARENA_FUZZ_TALLY=FILE`` set, each fuzz module appends its counts to
``FILE`` as one JSON line when it finishes, so a run can report its figures (the tests never print them).
"""

import collections
import json
import os

import pytest

COUNTS: collections.Counter = collections.Counter()


def record(area, error, documented):
    """Count one input of ``area``: accepted (``error`` is ``None``), or refused with ``error``, as documented or
    not."""
    COUNTS[(area, "tried")] += 1
    if error is not None:
        COUNTS[(area, "refused")] += 1
        COUNTS[(area, "refused as documented")] += bool(documented)


@pytest.fixture(scope="module", autouse=True)
def write_tally():
    """Module fixture: append this module's counts to ``$WSARENA_FUZZ_TALLY``, when set."""
    before = collections.Counter(COUNTS)
    yield
    target = os.environ.get("WSARENA_FUZZ_TALLY")
    if target:
        mine = COUNTS - before
        areas = sorted({area for area, _ in mine})
        keys = ("tried", "refused", "refused as documented")
        with open(target, "a", encoding="utf-8") as f:
            f.writelines(json.dumps({"area": area, **{k: mine[(area, k)] for k in keys}}) + "\n" for area in areas)
