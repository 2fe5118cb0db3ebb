import asyncio
import contextlib
import contextvars
import copy
import enum
import os
import pickle
import random
import re
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import wsarena
from wsarena import Config, _config, config, configure, format_size, get_config, parse_size
from wsarena._report_cli import render_table
from wsarena._sizes import cap_for, exact_cap, format_percent, format_seconds

from .interrupts import interrupt_at_check


@pytest.fixture(autouse=True)
def _default_cache_dir(monkeypatch):
    """These tests compare the settings with Config()'s defaults, cache_dir included: the tests' WSARENA_CACHE_DIR=off
    (conftest) is left out here. The user cache folder is still a temporary one (XDG_CACHE_HOME, conftest)."""
    monkeypatch.delenv("WSARENA_CACHE_DIR")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("512", 512),
        (512, 512),
        ("64KiB", 64 * 1024),
        ("256MiB", 256 * 2**20),
        ("1.5GiB", 3 * 2**29),
        ("2GB", 2 * 10**9),
        ("1kB", 1000),
        ("3 MB", 3 * 10**6),
        ("7B", 7),
        ("1TiB", 2**40),
        ("0.5KiB", 512),
        (".5KiB", 512),  # no whole part: none, not one
        (".25 MiB", 2**18),
        # more digits than Decimal's default 28 of precision, which rounded them
        ("123456789012345678901234567891", 123456789012345678901234567891),
        pytest.param("9" * 400, 10**400 - 1, id="400-nines"),
        ("1.00000000000000000000000000000000000000KiB", 1024),
    ],
)
def test_parse_size_accepts(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    "text", ["", "-1", "1.5", "1.0000000000000000000000000001KiB", "1.5.3GiB", "12 parsecs", "MiB", "1e3", "0x10",
             "inf", "nan", "1 GiB B", "\u0661\u0662", "\uff11MiB", "1.\u0665KiB"]  # Arabic-Indic and fullwidth digits
)
def test_parse_size_rejects_with_value_error(text):
    with pytest.raises(ValueError, match="size|unit|bytes"):
        parse_size(text)


def test_a_size_past_the_largest_number_is_a_value_error():
    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(0)  # no limit on int()'s digits: the number reaches the Decimal
    try:
        with pytest.raises(ValueError, match="1000001 digits is too large"):  # was decimal.Overflow
            parse_size("9" * 1_000_001)
    finally:
        sys.set_int_max_str_digits(limit)


def test_a_size_with_more_digits_than_int_takes_is_a_value_error():
    """Past the digits Python's int() takes from a string (sys.get_int_max_str_digits(), 4300 by default), a size is
    refused as int() refuses it: converting one of a million digits took seconds. Its fraction does not count."""
    limit = sys.get_int_max_str_digits()
    assert parse_size("9" * limit + ".0KiB") == (10**limit - 1) * 1024
    assert parse_size("1." + "0" * (limit + 1)) == 1
    with pytest.raises(ValueError, match=f"{limit + 1} digits is too large"):
        parse_size("9" * (limit + 1))
    with pytest.raises(ValueError, match="999999 digits is too large"):
        parse_size("1" + "0" * 999_998 + "MiB")


def _run_python(code):
    """Run ``code`` in a fresh interpreter without the WSARENA_ variables: its output, or a failed test where it hung
    or crashed."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WSARENA_")}
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                           cwd=Path(__file__).resolve().parent.parent, timeout=60, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail("the program hung for 60 s")
    assert r.returncode == 0, f"exit status {r.returncode}: {r.stderr[-2000:]}"
    return r.stdout.strip()


# A finalizer that parses a size and makes garbage again, which the collector, run at every allocation, finalizes in
# the middle of the program's own parse of a size.
_PARSED_IN_A_PARSE = """
import gc
import wsarena

parsed = []


class ParsesASize:
    def __del__(self):
        parsed.append(wsarena.parse_size("2MiB"))
        again = ParsesASize()
        again.cycle = again


first = ParsesASize()
first.cycle = first
del first
gc.set_threshold(1)
sizes = [wsarena.parse_size(f"{i}.5KiB") for i in range(200)]
gc.set_threshold(700)
print(sizes == [i * 1024 + 512 for i in range(200)], len(parsed) > 0, set(parsed))
"""


def test_a_size_parsed_in_a_finalizer_during_a_parse_does_not_crash_the_interpreter():
    """parse_size() computed in a decimal.localcontext(), which sets a context variable; the collector, run as that
    allocates, ran a finalizer that parsed a size too, and CPython 3.11 freed the context's table under the first set
    (decimal's current context across Python callbacks, python/cpython#148382): a segmentation fault, where a
    finalizer configures a cap while the program does."""
    assert _run_python(_PARSED_IN_A_PARSE) == "True True {2097152}"


@pytest.mark.parametrize("value", [1.5, 2.0, None, True, [1], b"1"])
def test_parse_size_rejects_other_types(value):
    with pytest.raises(TypeError):
        parse_size(value)


def test_parse_size_rejects_negative_int():
    with pytest.raises(ValueError, match="negative"):
        parse_size(-5)


@pytest.mark.parametrize(
    ("n", "text"),
    [(0, "0 B"), (512, "512 B"), (1 << 20, "1 MiB"), (3 << 29, "1.5 GiB"), (1536, "1.5 KiB"), (2**40 * 3, "3 TiB"),
     (1023, "1023 B"), (2**20 - 1, "1 MiB"), (2**30 - 1, "1 GiB"), (2**40 - 1, "1 TiB"), (2**20 - 512, "1023.5 KiB"),
     (-(2**20 - 1), "-1 MiB"), (2**50, "1024 TiB")],
)
def test_format_size(n, text):
    assert format_size(n) == text


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(2.5, "2.500 s"), (1.0, "1.000 s"), (0.999, "999.00 ms"), (1e-3, "1.00 ms"), (9.99e-4, "999.0 us"),
     (3.2e-6, "3.2 us"), (0.0, "0.0 us"), (0.999996, "1.000 s"), (0.999994, "999.99 ms"), (9.9996e-4, "1.00 ms"),
     (9.9994e-4, "999.9 us")],
)
def test_format_seconds(seconds, text):
    """The times that wsarena tune's table and its plot print, from one function: each unit from its own 1 up, as
    the value is rounded (a step of 0.999996 s read "1000.00 ms" in a column where the next read "1.000 s")."""
    assert format_seconds(seconds) == text


@pytest.mark.parametrize(("fraction", "text"), [(0.02, "2%"), (0.025, "2.5%"), (0.0, "0%"), (5.0, "500%")])
def test_format_percent(fraction, text):
    assert format_percent(fraction) == text


def test_format_size_takes_any_integer_type_as_parse_size_does():
    # a byte count summed by NumPy (np.int64) was a TypeError; a bool or a float is still none
    assert format_size(np.int64(3 << 29)) == format_size(np.uint64(3 << 29)) == "1.5 GiB"
    assert format_size(np.int8(-3)) == "-3 B"
    for value in (True, np.bool_(True), 1.0, "1"):
        with pytest.raises(TypeError, match="format_size takes an int"):
            format_size(value)


def test_format_size_is_exact_past_a_floats_range():
    assert format_size(2**1100) == f"{2**1060} TiB"  # a float quotient overflows here
    assert format_size(-(2**1100 + 2**38)) == f"-{2**1060}.25 TiB"
    assert format_size(2**1100 + 5 * 2**37) == f"{2**1060}.62 TiB"  # .625 rounds half to even, as '%.2f' does


def test_format_size_is_exact_past_the_digits_str_takes():
    # str() of an int refuses past sys.get_int_max_str_digits() (4300): a lease of 2**15000 bytes raised that
    # ValueError from its message, not the arena's out-of-memory error
    n = 2**15000 + 2**39
    text = format_size(n)
    whole = n // 2**40
    assert 10**4503 <= whole < 10**4504 and text.endswith(".5 TiB") and len(text) == 4504 + len(".5 TiB")
    assert text.startswith(f"{whole // 10**4400}") and text[:-6].endswith(f"{whole % 10**4000:04000d}")
    arena = wsarena.get_arena("cpu")
    with pytest.raises(wsarena.ArenaOutOfMemoryError, match="could not grow"):
        arena.reserve(2**15000)


def _format_size_with_decimal(nbytes):
    """format_size as it was written with decimal.Decimal (before it computed in ints): the reference."""
    from decimal import Decimal

    sign = "-" if nbytes < 0 else ""
    n = abs(nbytes)
    if n < 2**10:
        return f"{sign}{n} B"
    for unit, scale in (("KiB", 2**10), ("MiB", 2**20), ("GiB", 2**30), ("TiB", 2**40)):
        hundredths, rest = divmod(n * 100, scale)
        if 2 * rest > scale or (2 * rest == scale and hundredths % 2):
            hundredths += 1
        if hundredths < 1024 * 100:
            break
    whole, frac = divmod(hundredths, 100)
    return f"{sign}{Decimal(whole)}{f'.{frac:02d}'.rstrip('0').rstrip('.')} {unit}"


def test_format_size_writes_what_it_wrote_with_decimal():
    """Sizes around each unit's edges and each rounding's half (where half to even decides), a few bytes either
    side, random ones, and ones past the digits str() takes (4300), negative ones too."""
    sizes = {0, 1, 1023, 1024, 10**4400, 2**15000 + 2**39, 10**9000 - 1, 10**9000 + 2**40 * 5 // 1000}
    for scale in (2**10, 2**20, 2**30, 2**40):
        for hundredths in (1, 5, 50, 99, 100, 101, 125, 150, 999, 102_350, 102_399, 102_400, 102_450, 10**9 + 7):
            exact, half = hundredths * scale // 100, (2 * hundredths + 1) * scale // 200  # x.yz and x.yz5
            sizes.update(n + d for n in (exact, half) for d in range(-3, 4))
    rng = random.Random(20261127)
    sizes.update(rng.getrandbits(rng.randint(1, 120)) for _ in range(5000))
    sizes.update(rng.getrandbits(rng.randint(14_300, 30_000)) for _ in range(20))
    for n in sorted(sizes):
        assert format_size(n) == _format_size_with_decimal(n), n
        if n:
            assert format_size(-n) == _format_size_with_decimal(-n), n


def test_a_cap_a_message_names_is_a_size_the_settings_take_back():
    """exact_cap(n) reads back as n, and cap_for(n) as at least n and less than an eighth of format_size's unit more,
    in at most three decimals: format_size's "3.91 KiB" for 4000 bytes is no whole number of bytes, and its "4 KiB"
    for 4097 less than 4097."""
    rng = random.Random(20261127)
    sizes = {0, 1, 1023, 1024, 1025, 4000, 4097, 43200, (1 << 20) - 1, 1 << 20, 2**64 - 1}
    sizes.update(rng.getrandbits(rng.randint(1, 70)) for _ in range(3000))
    sizes.update(rng.getrandbits(rng.randint(1, 50)) << 7 for _ in range(1000))
    units = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
    for n in sorted(sizes):
        assert parse_size(exact_cap(n)) == n, n
        shown = cap_for(n)
        assert n <= parse_size(shown) < n + max(units[format_size(n).rpartition(" ")[2]] // 8, 1), n
        assert len(shown.partition(".")[2].partition(" ")[0]) <= 3, n
    assert (cap_for(4000), cap_for(4097), cap_for(43200), exact_cap(4000)) == ("4 KiB", "4.125 KiB", "42.25 KiB",
                                                                                "4000 B")


def test_format_size_leaves_the_threads_decimal_context_unset():
    """Decimal() sets the thread's decimal context on first use, a context variable: format_size did, where
    parse_size computes in ints so that a finalizer's parse, run while a context variable is being set, cannot crash
    CPython 3.11 (python/cpython#148382)."""
    def set_variables(n):
        format_size(n)
        return [var.name for var in contextvars.copy_context()]

    for n in (1, 3 << 29, 2**15000 + 2**39):
        assert contextvars.Context().run(set_variables, n) == []


def test_a_number_repr_refuses_is_described_under_any_digit_limit():
    limit = sys.get_int_max_str_digits()
    sys.set_int_max_str_digits(640)  # the least Python takes: repr() refuses an int of 641 digits
    try:
        with pytest.raises(ValueError, match=r"cannot be negative: a negative integer of 2326 bits"):
            parse_size(-(10**700))
    finally:
        sys.set_int_max_str_digits(limit)


def test_format_parse_round_trip():
    for n in (0, 1, 1023, 1024, 1 << 20, 5 << 30):
        assert parse_size(format_size(n).replace(" ", "")) == n


def test_defaults():
    c = get_config()
    assert c == Config(cap_workspace=None, algo_search="heuristic", backend="auto", debug=False, allocator="auto")
    assert (c.cudnn_api, c.plan_cache_size) == ("graph", 1024)
    assert c.search_cache_max_size == 64 << 20


def test_environment_is_read(monkeypatch):
    monkeypatch.setenv("WSARENA_CAP_WORKSPACE", "64MiB")
    monkeypatch.setenv("WSARENA_ALGO_SEARCH", "exhaustive")
    monkeypatch.setenv("WSARENA_BACKEND", "cpu")
    monkeypatch.setenv("WSARENA_DEBUG", "1")
    monkeypatch.setenv("WSARENA_ALLOCATOR", " Torch ")
    monkeypatch.setenv("WSARENA_CUDNN_API", " Legacy ")
    monkeypatch.setenv("WSARENA_PLAN_CACHE_SIZE", "64")
    monkeypatch.setenv("WSARENA_SEARCH_CACHE_MAX_SIZE", "1.5GiB")
    monkeypatch.setenv("WSARENA_CACHE_DIR", " /srv/wsarena-Cache ")
    wsarena._config._reset()
    assert get_config() == Config(
        cap_workspace=64 << 20, algo_search="exhaustive", backend="cpu", debug=True, allocator="torch",
        cudnn_api="legacy", plan_cache_size=64, search_cache_max_size=3 << 29, cache_dir=Path("/srv/wsarena-Cache"),
    )
    monkeypatch.setenv("WSARENA_SEARCH_CACHE_MAX_SIZE", " None ")
    wsarena._config._reset()
    assert get_config().search_cache_max_size is None


def test_the_environment_is_read_at_the_first_use_of_the_settings_not_at_import():
    """As the README says: a variable set after ``import wsarena`` counts; one changed after the first use does not."""
    code = ("import os, wsarena; os.environ['WSARENA_CAP_WORKSPACE'] = '1MiB'; first = wsarena.get_config(); "
            "os.environ['WSARENA_CAP_WORKSPACE'] = '2MiB'; "
            "print(first.cap_workspace, wsarena.get_config().cap_workspace)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("WSARENA_")}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       cwd=Path(__file__).resolve().parent.parent, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(1 << 20)] * 2


@pytest.mark.parametrize(
    ("value", "debug"),
    [("1", True), ("true", True), ("yes", True), ("on", True), (" On ", True), ("TRUE", True),
     ("0", False), ("false", False), ("no", False), ("off", False), ("OFF", False)],
)
def test_debug_variable_takes_the_usual_words_for_on_and_off(monkeypatch, value, debug):
    monkeypatch.setenv("WSARENA_DEBUG", value)
    wsarena._config._reset()
    assert get_config().debug is debug


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_environment_variable_means_the_default(monkeypatch, value):
    for var in ("WSARENA_CAP_WORKSPACE", "WSARENA_ALGO_SEARCH", "WSARENA_BACKEND", "WSARENA_DEBUG",
                "WSARENA_ALLOCATOR", "WSARENA_CUDNN_API", "WSARENA_PLAN_CACHE_SIZE", "WSARENA_SEARCH_CACHE_MAX_SIZE",
                "WSARENA_CACHE_DIR"):
        monkeypatch.setenv(var, value)
    wsarena._config._reset()
    assert get_config() == Config()


@pytest.mark.parametrize(
    ("var", "value"),
    [
        ("WSARENA_CAP_WORKSPACE", "lots"), ("WSARENA_ALGO_SEARCH", "fast"), ("WSARENA_BACKEND", "tpu"),
        ("WSARENA_DEBUG", "maybe"), ("WSARENA_ALLOCATOR", "rmm"), ("WSARENA_CUDNN_API", "v8"),
        ("WSARENA_PLAN_CACHE_SIZE", "0"), ("WSARENA_PLAN_CACHE_SIZE", "many"),
        ("WSARENA_SEARCH_CACHE_MAX_SIZE", "lots"), ("WSARENA_SEARCH_CACHE_MAX_SIZE", "64 MiB of it"),
        ("WSARENA_SEARCH_CACHE_MAX_SIZE", "-1MiB"), ("WSARENA_SEARCH_CACHE_MAX_SIZE", "0"),
        ("WSARENA_SEARCH_CACHE_MAX_SIZE", "1.5B"),
    ],
)
def test_bad_environment_names_the_variable(monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    wsarena._config._reset()
    with pytest.raises(ValueError, match=var):
        get_config()


BAD_ENV = {  # setting: (its variable, an invalid value, a valid value given explicitly)
    "cap_workspace": ("WSARENA_CAP_WORKSPACE", "garbage", 1 << 20),
    "algo_search": ("WSARENA_ALGO_SEARCH", "fast", "exhaustive"),
    "backend": ("WSARENA_BACKEND", "gpu", "cpu"),
    "debug": ("WSARENA_DEBUG", "maybe", True),
    "allocator": ("WSARENA_ALLOCATOR", "malloc", "torch"),
    "cudnn_api": ("WSARENA_CUDNN_API", "v7", "legacy"),
    "plan_cache_size": ("WSARENA_PLAN_CACHE_SIZE", "-1", 8),
    "search_cache_max_size": ("WSARENA_SEARCH_CACHE_MAX_SIZE", "big", 1 << 20),
}


@pytest.mark.parametrize(
    ("changes", "error"),
    [({"cudnn_api": "v8"}, ValueError), ({"plan_cache_size": 0}, ValueError), ({"plan_cache_size": "8"}, TypeError),
     ({"plan_cache_size": True}, TypeError), ({"plan_cache_size": 8.0}, TypeError),
     ({"plan_cache_size": np.bool_(True)}, TypeError)],
)
def test_bad_graph_api_settings_are_refused_and_change_nothing(changes, error):
    with pytest.raises(error, match=next(iter(changes))):
        configure(**changes)
    assert get_config() == Config()


@pytest.mark.parametrize(("size", "said"), [(sys.maxsize + 1, str(sys.maxsize + 1)),
                                          (10**5000, "an integer of 16610 bits")], ids=["maxsize+1", "10**5000"])
def test_a_plan_cache_size_above_sys_maxsize_is_refused(monkeypatch, size, said):
    """No cache holds more entries than sys.maxsize; a larger size was taken, and one of more than 4300 digits made
    repr() of the settings fail, and `wsarena info` with it. sys.maxsize itself is taken."""
    bound = f"plan_cache_size must be at most sys.maxsize = {sys.maxsize}, the most entries a cache holds"
    with pytest.raises(ValueError, match=f"^{bound}, not {said}$"):
        configure(plan_cache_size=size)
    assert get_config() == Config()
    assert "plan_cache_size=9223372036854775807" in repr(configure(plan_cache_size=sys.maxsize))
    monkeypatch.setenv("WSARENA_PLAN_CACHE_SIZE", str(sys.maxsize + 1))
    _config._reset()
    with pytest.raises(ValueError, match=f"WSARENA_PLAN_CACHE_SIZE='{sys.maxsize + 1}': {bound}"):
        get_config()


def test_plan_cache_size_takes_any_integer_type_as_an_int():
    assert type(configure(plan_cache_size=np.int64(8)).plan_cache_size) is int  # was a TypeError
    assert get_config().plan_cache_size == 8


def test_a_choice_given_as_a_str_enum_is_held_as_its_str():
    # a (str, Enum) member or another str subclass equals its value, but the report's table wrote "backend B.CPU"
    class Backend(str, enum.Enum):
        CPU = "cpu"

    class Search(str, enum.Enum):
        EXHAUSTIVE = "exhaustive"

    c = configure(backend=Backend.CPU, algo_search=Search.EXHAUSTIVE, cudnn_api=np.str_("legacy"),
                  cache_dir="off")
    assert (type(c.backend), type(c.algo_search), type(c.cudnn_api)) == (str, str, str)
    assert f"{c.backend} {c.algo_search} {c.cudnn_api}" == "cpu exhaustive legacy"
    assert "Backend" not in repr(c) and "np.str_" not in repr(c)
    layers = wsarena.load_model([{"name": "c", "input_shape": [1, 2, 4, 4], "weight_shape": [2, 2, 3, 3]}])
    header = render_table(wsarena.plan(layers)).splitlines()[1]
    assert "backend cpu " in header and "search exhaustive" in header, header


@pytest.mark.parametrize(
    ("value", "error", "says"),
    [(0, ValueError, "at least 1 byte"), (-1, ValueError, "negative"), ("lots", ValueError, "not a size"),
     (1.5, TypeError, "must be an int"), (True, TypeError, "must be an int")],
)
def test_a_bad_search_cache_size_is_refused_and_changes_nothing(value, error, says):
    with pytest.raises(error, match=f"search_cache_max_size.*{says}"):
        configure(search_cache_max_size=value)
    with pytest.raises(error, match=f"search_cache_max_size.*{says}"), config(search_cache_max_size=value):
        pass
    assert get_config() == Config()
    assert configure(search_cache_max_size="256MiB").search_cache_max_size == 256 << 20
    assert configure(search_cache_max_size=None).search_cache_max_size is None


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_size_string_means_the_settings_default(value):
    # as an empty variable does, and an empty cache_dir: it gave no limit on the search cache, not its 64 MiB
    configure(cap_workspace="1MiB", search_cache_max_size="1MiB")
    assert configure(search_cache_max_size=value).search_cache_max_size == 64 << 20
    with config(search_cache_max_size="1MiB"), config(search_cache_max_size=value) as c:
        assert c.search_cache_max_size == get_config().search_cache_max_size == 64 << 20
    assert configure(cap_workspace=value).cap_workspace is None
    assert get_config() == Config()


@pytest.mark.parametrize("key", list(BAD_ENV))
def test_an_explicit_setting_replaces_an_invalid_environment_variable(monkeypatch, key):
    var, bad, good = BAD_ENV[key]
    monkeypatch.setenv(var, bad)
    wsarena._config._reset()
    with config(**{key: good}) as c:
        assert getattr(c, key) == good and getattr(get_config(), key) == good
    with pytest.raises(ValueError, match=var):  # outside the block the variable is used again
        get_config()
    assert getattr(configure(**{key: good}), key) == good
    assert getattr(get_config(), key) == good  # configure() repaired the process-wide settings


@pytest.mark.parametrize("key", list(BAD_ENV))
def test_an_invalid_environment_variable_still_counts_for_the_settings_not_given(monkeypatch, key):
    var, bad, _ = BAD_ENV[key]
    other, (_, _, value) = next((k, v) for k, v in BAD_ENV.items() if k != key)
    monkeypatch.setenv(var, bad)
    wsarena._config._reset()
    with pytest.raises(ValueError, match=f"environment variable {var}={bad!r}"):
        configure(**{other: value})
    with pytest.raises(ValueError, match=var), config(**{other: value}):
        pass
    with pytest.raises(ValueError, match=var):  # the failed configure() changed nothing
        get_config()


def test_a_free_reads_one_setting_and_no_invalid_variable_of_another_is_its_error(monkeypatch):
    """setting() (what frees and finalizers read) gives the value in force here, as get_config() does, but raises for
    no invalid variable: another setting's is not read, and its own setting's gives the default."""
    monkeypatch.setenv("WSARENA_CAP_WORKSPACE", "junk")
    monkeypatch.setenv("WSARENA_DEBUG", "maybe")
    wsarena._config._reset()
    assert _config.setting("debug") is False and _config.setting("cap_workspace") is None
    assert _config.setting("algo_search") == "heuristic"
    with config(debug=True, cap_workspace="1MiB"):
        assert _config.setting("debug") is True and _config.setting("cap_workspace") == 1 << 20
    with pytest.raises(ValueError, match="WSARENA_CAP_WORKSPACE"):
        configure(debug=True)
    monkeypatch.setenv("WSARENA_DEBUG", "1")
    wsarena._config._reset()
    assert _config.setting("debug") is True
    configure(debug=False, cap_workspace=None)
    assert _config.setting("debug") is False and get_config().debug is False


# A program whose object's finalizer uses wsarena's settings, and whose first read of the settings (or first
# configure()) runs the collector, which finalizes that object. The collector may run at any allocation of the read,
# which reads the environment under the settings' lock: here it runs as the read begins, where the test can tell.
_FINALIZED_IN_THE_FIRST_READ = """
import gc
import wsarena
from wsarena import _config

from_env = _config._from_env


def collecting():
    gc.collect()
    return from_env()


_config._from_env = collecting
seen = []


class UsesTheSettings:
    def __del__(self):
        seen.append({inner})


garbage = UsesTheSettings()
garbage.cycle = garbage
del garbage
{outer}
print(seen, wsarena.get_config().cap_workspace, wsarena.get_config().debug)
"""


@pytest.mark.parametrize(
    ("inner", "outer", "expected"),
    [
        ("wsarena.get_config().debug", "wsarena.get_config()", "[False] None False"),
        ("wsarena.get_config().debug", "wsarena.configure(cap_workspace='1MiB')", "[False] 1048576 False"),
        ("wsarena.configure(debug=True).debug", "wsarena.configure(cap_workspace='1MiB')", "[True] 1048576 True"),
        ("wsarena.configure(debug=True).debug", "wsarena.get_config()", "[True] None True"),
        ("wsarena.configure(debug=True).debug", "_config.setting('debug')", "[True] None True"),
        ("wsarena.configure(debug=True).debug", "wsarena.config(cap_workspace=0).__enter__()", "[True] 0 True"),
    ],
)
def test_a_finalizer_that_uses_the_settings_during_their_first_read_neither_waits_nor_is_lost(inner, outer, expected):
    """The collector may run a finalizer of the program's in the first read of the settings, under their lock, in the
    same thread: one that reads the settings takes the lock again. Once a plain lock, the thread waited for itself
    for good. A configure() there counts too: the configure() it ran in makes its settings again over it, and the
    read it ran in (get_config(), a free's setting(), a config() block's start) keeps it, where the read stored the
    environment's settings over it."""
    code = _FINALIZED_IN_THE_FIRST_READ.format(inner=inner, outer=outer)
    env = {k: v for k, v in os.environ.items() if not k.startswith("WSARENA_")}
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                           cwd=Path(__file__).resolve().parent.parent, timeout=30, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail("the program hung for 30 s: its finalizer waited for the settings' lock its own thread held")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == expected


# A finalizer that configures and makes garbage again, finalized at every collection, which runs at every allocation:
# in the middle of the program's configure(), each time it made its settings again over the finalizer's.
_CONFIGURED_IN_EACH_COLLECTION = """
import gc
import wsarena

wsarena.get_config()
seen = []
stop = False


class Configures:
    def __del__(self):
        if stop:
            return
        seen.append(len(seen) + 1)
        wsarena.configure({setting}={value})
        again = Configures()
        again.cycle = again


first = Configures()
first.cycle = first
del first
gc.set_threshold(1)
before = len(seen)
got = wsarena.configure(cap_workspace="1MiB", debug=True)
during = len(seen) - before
stop = True
gc.set_threshold(700)
now = wsarena.get_config()
origins = sorted((key, source) for key, (_, source, _) in wsarena._config.in_force().items() if source != "default")
print(during > 10, got == now, now.cap_workspace, now.debug, getattr(now, "{setting}") == {last}, origins)
"""


@pytest.mark.parametrize(("setting", "value", "last"), [
    ("plan_cache_size", "len(seen)", "seen[-1]"),
    ("search_cache_max_size", 'f"{len(seen)}MiB"', "seen[-1] << 20"),  # parsed in the finalizer, in the program's
])
def test_a_finalizer_that_configures_at_every_collection_lets_configure_return_and_is_kept(setting, value, last):
    """configure() made its settings again, under its lock, until no finalizer had changed them meanwhile: under
    gc.set_threshold(1), with a finalizer that configures and makes garbage each time, it never returned. Now a
    configure() made inside it applies its changes over the finalizer's: both kept, the program's last."""
    code = _CONFIGURED_IN_EACH_COLLECTION.format(setting=setting, value=value, last=last)
    origins = sorted((key, "configure") for key in ("cap_workspace", "debug", setting))
    assert _run_python(code) == f"True True 1048576 True True {origins}"


def test_a_configure_inside_another_applies_under_it():
    """As a finalizer or a signal handler runs one: the outer call's changes apply over the inner one's, which keeps
    those the outer does not make."""
    inner = []

    def configures_inside(base, changes):
        if not inner:
            inner.append(None)
            inner[0] = configure(cap_workspace="2MiB", algo_search="exhaustive")
        return real_replace(base, changes)

    real_replace = _config._replace
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_config, "_replace", configures_inside)
        outer = configure(cap_workspace="1MiB", backend="cpu")
    assert (inner[0].cap_workspace, inner[0].algo_search, inner[0].backend) == (2 << 20, "exhaustive", "auto")
    assert outer == get_config()
    assert (outer.cap_workspace, outer.algo_search, outer.backend) == (1 << 20, "exhaustive", "cpu")
    assert {key: _config.origin(key) for key in ("cap_workspace", "algo_search", "backend")} == dict.fromkeys(
        ("cap_workspace", "algo_search", "backend"), "configure")
    configure(cap_workspace=None, algo_search="heuristic", backend="auto")


def test_a_configure_inside_another_as_it_stores_its_settings_is_kept():
    """The last allocation before the store may run the collector: a configure() that a finalizer made there was
    lost, the outer call storing the settings it had made before."""
    get_config()  # the environment read
    made = []

    def configures_inside(settings, origins):
        if not made:
            made.append(None)
            made[0] = configure(algo_search="exhaustive")
        return real_carrying(settings, origins)

    real_carrying = _config._carrying
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_config, "_carrying", configures_inside)
        outer = configure(cap_workspace="1MiB")
    assert made[0] == outer == get_config()
    assert (outer.cap_workspace, outer.algo_search) == (1 << 20, "exhaustive")


def test_configure_and_bad_values_change_nothing():
    configure(cap_workspace="1MiB")
    assert get_config().cap_workspace == 1 << 20
    before = get_config()
    with pytest.raises(ValueError):
        configure(cap_workspace="1MiB", algo_search="fastest")
    with pytest.raises(TypeError, match="capacity"):
        configure(capacity=3)
    with pytest.raises(ValueError):
        configure(backend="tpu")
    assert get_config() == before
    configure(cap_workspace=None)
    assert get_config().cap_workspace is None


def test_config_block_overrides_and_restores():
    configure(cap_workspace="8MiB")
    with config(cap_workspace=0) as c:
        assert c.cap_workspace == 0
        assert get_config().cap_workspace == 0
        with config(algo_search="exhaustive"):
            assert get_config() == Config(cap_workspace=0, algo_search="exhaustive")
        assert get_config().algo_search == "heuristic"
    assert get_config().cap_workspace == 8 << 20


def test_config_block_restores_after_error():
    with pytest.raises(RuntimeError), config(cap_workspace=0):
        raise RuntimeError
    assert get_config().cap_workspace is None


def test_config_block_is_local_to_its_thread():
    seen = []
    inside = threading.Event()
    done = threading.Event()

    def other():
        inside.wait()
        seen.append(get_config().cap_workspace)
        done.set()

    t = threading.Thread(target=other)
    t.start()
    with config(cap_workspace=0):
        inside.set()
        done.wait()
    t.join()
    assert seen == [None]


def test_one_config_object_is_reusable_but_not_inside_a_block_of_its_own():
    # as torch.no_grad() objects are: a block kept in a variable and entered again raised AttributeError
    small = config(cap_workspace="1MiB")
    for _ in range(2):
        with small as c:
            assert c.cap_workspace == get_config().cap_workspace == 1 << 20
        assert get_config().cap_workspace is None
    with config(algo_search="exhaustive"), small:  # the changes apply where the block begins, as before
        assert get_config() == Config(cap_workspace=1 << 20, algo_search="exhaustive")
        with config(cap_workspace=0), pytest.raises(RuntimeError, match="make a new config"), small:
            pass
        assert get_config() == Config(cap_workspace=1 << 20, algo_search="exhaustive")
        with config(cap_workspace=0), config(**small.changes):  # a new one nests
            assert get_config() == Config(cap_workspace=1 << 20, algo_search="exhaustive")
        assert get_config().cap_workspace == 1 << 20
    assert get_config() == Config()
    with pytest.raises(ValueError, match="cap_workspace"), config(cap_workspace="lots"):
        pass  # checked where the block begins
    assert get_config() == Config()


def test_a_config_decorator_serves_several_threads_at_once():
    @config(cap_workspace=0)
    def call(seen: list, started: threading.Barrier, hold: threading.Barrier) -> None:
        started.wait()  # every thread inside the one object's block at once
        seen.append(get_config().cap_workspace)
        hold.wait()

    seen: list = []
    errors: list = []
    started, hold = threading.Barrier(4), threading.Barrier(4)

    def worker() -> None:
        try:
            call(seen, started, hold)  # each thread's block ends with the token it began with
            seen.append(get_config().cap_workspace)
        except BaseException as exc:  # noqa: BLE001 - a thread's error, reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and sorted(seen, key=str) == [0] * 4 + [None] * 4 and get_config().cap_workspace is None


def test_one_config_object_serves_several_asyncio_tasks_at_once():
    # each task runs in a context of its own: a block's end resets the token its own task made there, where tokens
    # kept per thread gave one task another's, and contextvars raised ValueError ("created in a different Context")
    small = config(cap_workspace=0)

    async def task(delay: float) -> list:
        with small:
            await asyncio.sleep(delay)  # the other task begins its block meanwhile, and ends it first or last
            inside = get_config().cap_workspace
        return [inside, get_config().cap_workspace]

    async def main() -> list:
        return await asyncio.gather(task(0.02), task(0.01), task(0.03))

    assert asyncio.run(main()) == [[0, None]] * 3
    assert get_config().cap_workspace is None


def test_a_config_decorator_serves_a_recursive_function():
    @config(cap_workspace=0)
    def depth(n: int) -> list:
        return [get_config().cap_workspace, *(depth(n - 1) if n else [])]

    assert depth(3) == [0] * 4 and get_config().cap_workspace is None


def test_a_config_decorator_applies_to_the_body_of_a_coroutine():
    # a coroutine function's call only makes the coroutine: a block around the call ended before its body ran
    @config(cap_workspace=0)
    async def body() -> int | None:
        await asyncio.sleep(0)
        return get_config().cap_workspace

    async def main() -> list:
        return [*await asyncio.gather(body(), body()), get_config().cap_workspace]

    assert asyncio.run(main()) == [0, 0, None]
    assert body.__name__ == "body"


def test_a_config_decorator_refuses_a_generator_function():
    # its call only makes the generator, whose body would run outside the block: refused, not ignored
    with pytest.raises(TypeError, match="generator"):
        @config(cap_workspace=0)
        def numbers():
            yield get_config().cap_workspace
    with pytest.raises(TypeError, match="generator"):
        @config(cap_workspace=0)
        async def later():
            yield get_config().cap_workspace


def test_a_block_shows_its_changes():
    assert repr(config(cap_workspace="64MiB", algo_search="exhaustive")) == (
        "wsarena.config(cap_workspace='64MiB', algo_search='exhaustive')")
    assert repr(config()) == "wsarena.config()"


def test_a_block_left_open_by_a_suspended_generator_ends_later():
    # a generator suspended in one object's block while its caller's block of another ends: each ends its own
    outer, inner = config(algo_search="exhaustive"), config(cap_workspace=0)

    def steps():
        with inner:
            yield
        yield

    def run() -> None:
        with outer:
            it = steps()
            next(it)
        next(it)  # the inner block ends here, with no error
        assert list(it) == []

    contextvars.copy_context().run(run)  # a context of its own, as the generator's caller may have
    assert get_config() == Config()


def test_blocks_ended_out_of_order_leave_the_open_blocks_in_force_and_nothing_of_the_ended_ones():
    # A block ended while one begun inside it is still open (a generator suspended in it, an ExitStack unwound out
    # of order): the open one's changes stay in force, the ended one's go. Before, the open one, ending last, put
    # back the ended one's settings, which stayed in force for good; and a caller's block was dropped in its own body
    # when a generator's block begun before it ended there.
    outer, inner = config(algo_search="exhaustive"), config(cap_workspace=0)

    def steps():
        with inner:
            yield
        yield

    def run() -> list:
        with outer:
            it = steps()
            next(it)
        seen = [get_config()]
        next(it)
        return [*seen, get_config()]

    assert contextvars.copy_context().run(run) == [Config(cap_workspace=0), Config()]
    first, second = config(cap_workspace=1), config(cap_workspace=2, algo_search="exhaustive")

    def unwind() -> list:
        first.__enter__()
        second.__enter__()
        first.__exit__(None, None, None)
        seen = [get_config()]
        second.__exit__(None, None, None)
        return [*seen, get_config()]

    assert contextvars.copy_context().run(unwind) == [Config(cap_workspace=2, algo_search="exhaustive"), Config()]

    def callers_block() -> list:
        it = steps()
        next(it)  # the generator's block, begun before the caller's
        with config(algo_search="exhaustive"):
            seen = [get_config()]
            next(it)  # the generator's block ends inside the caller's: the caller's stays
            seen.append(get_config())
        return [*seen, get_config()]

    assert contextvars.copy_context().run(callers_block) == [
        Config(cap_workspace=0, algo_search="exhaustive"), Config(algo_search="exhaustive"), Config()]
    three = [config(cap_workspace=1), config(algo_search="exhaustive"), config(cap_workspace=3)]

    def middle_first() -> list:
        for block in three:
            block.__enter__()
        three[1].__exit__(None, None, None)  # the innermost keeps its own changes, over the outermost's: no search
        seen = [get_config()]
        three[0].__exit__(None, None, None)
        seen.append(get_config())
        three[2].__exit__(None, None, None)
        return [*seen, get_config()]

    assert contextvars.copy_context().run(middle_first) == [Config(cap_workspace=3), Config(cap_workspace=3), Config()]
    assert get_config() == Config()


def test_a_using_scope_and_a_block_ended_out_of_order_leave_the_open_one_in_force_and_nothing_of_the_ended_one():
    # A using() scope (a backward pass's, a recompute's) ended by resetting the token it began with, which put back
    # what was in force where it began: a config() block begun before it and ended first came back into force for
    # good; and a block begun inside it lost its changes as the scope ended first, and put back the scope's settings
    # as it ended itself.
    scope, block = _config.using(Config(algo_search="exhaustive")), config(cap_workspace=0)

    def block_first() -> list:
        block.__enter__()
        scope.__enter__()
        block.__exit__(None, None, None)  # the scope begun inside it stays open
        seen = [get_config()]
        scope.__exit__(None, None, None)
        return [*seen, get_config(), _config.overridden()]

    assert contextvars.copy_context().run(block_first) == [Config(algo_search="exhaustive"), Config(), None]

    def scope_first() -> list:
        scope.__enter__()
        block.__enter__()
        scope.__exit__(None, None, None)  # the block begun inside it stays open, over what was in force before it
        seen = [get_config()]
        block.__exit__(None, None, None)
        return [*seen, get_config(), _config.overridden()]

    assert contextvars.copy_context().run(scope_first) == [Config(cap_workspace=0), Config(), None]


def test_settings_passed_back_in_a_using_scope_keep_where_each_comes_from(monkeypatch):
    """A scope of what get_config() gave (an op's, as it chooses its algorithm; a backward pass's) showed where the
    process-wide settings come from as they are now: a value of the environment's said "configure" once a configure()
    had set it since, and a configure()'s value "default" once the settings were read again."""
    monkeypatch.setenv("WSARENA_CAP_WORKSPACE", "1MiB")
    _config._reset()
    read = get_config()
    configure(cap_workspace="2MiB", algo_search="exhaustive")
    configured = get_config()
    _config._reset()  # as a fork's child, or a test, reads the environment again
    monkeypatch.setenv("WSARENA_ALGO_SEARCH", "heuristic")
    for settings, cap, search in ((read, ("1 MiB", "environment"), ("heuristic", "default")),
                                  (configured, ("2 MiB", "configure"), ("exhaustive", "configure"))):
        with _config.using(settings):
            shown = _config.in_force()
            assert (format_size(shown["cap_workspace"][0]), shown["cap_workspace"][1]) == cap
            assert shown["algo_search"][:2] == search
            assert (_config.origin("cap_workspace"), _config.origin("algo_search")) == (cap[1], search[1])
    with config(backend="cpu") as block, _config.using(block):  # a block's settings kept theirs already
        assert [_config.origin(key) for key in ("backend", "cap_workspace", "algo_search")] == [
            "config", "environment", "environment"]


def test_one_object_entered_by_a_caller_and_the_generator_it_drives_is_refused():
    # The caller's block and the generator's of one object, ended out of order: the caller's end ended the
    # generator's block, so that the generator went on in its own block under its outer block's cap of 5, as the caller
    # did after its block.
    small, outer = config(cap_workspace=0), config(cap_workspace=5)

    def steps(block: config):
        with outer, block:
            yield
            yield get_config().cap_workspace

    def caller(block: config) -> list:
        it = steps(block)
        with small:
            next(it)  # the generator's blocks begin inside the caller's
        return [get_config().cap_workspace, next(it), *it, get_config()]

    assert contextvars.copy_context().run(caller, config(cap_workspace=0)) == [0, 0, Config()]
    with pytest.raises(RuntimeError, match=r"config\(cap_workspace=0\) is entered inside a block of its own"):
        contextvars.copy_context().run(caller, small)

    async def task() -> None:
        with small:
            pass

    async def main() -> None:
        with small:
            await asyncio.create_task(task())  # its context holds the block it was created in

    with pytest.raises(RuntimeError, match="a task was created in"):
        asyncio.run(main())
    assert get_config() == Config()


def test_a_block_ended_in_another_thread_or_context_says_so():
    # an async generator left by a break in its block is closed by the event loop, in a context of its own: that
    # was contextvars' own ValueError about a token, another thread's a RuntimeError
    small = config(cap_workspace=0)

    async def numbers():
        with small:
            yield 1
            yield 2

    async def left() -> int | None:
        async for _ in numbers():
            break
        await asyncio.sleep(0.01)  # the loop closes the generator
        return get_config().cap_workspace

    async def closed() -> int | None:
        async with contextlib.aclosing(numbers()) as closing:
            async for _ in closing:
                break
        return get_config().cap_workspace

    errors: list = []
    loop = asyncio.new_event_loop()
    loop.set_exception_handler(lambda _, context: errors.append(context.get("exception")))
    try:  # as the README says: the generator's block stays in force, unless aclosing() closes it
        assert contextvars.copy_context().run(loop.run_until_complete, left()) == 0
        assert contextvars.copy_context().run(loop.run_until_complete, closed()) is None
    finally:
        loop.close()
    assert [type(e) for e in errors] == [RuntimeError] and "config() block ends" in str(errors[0])

    def end() -> None:
        try:
            small.__exit__(None, None, None)
        except RuntimeError as exc:
            errors.append(exc)

    small.__enter__()
    outside = threading.Thread(target=end)
    outside.start()
    outside.join()
    contextvars.copy_context().run(end)
    small.__exit__(None, None, None)
    assert [type(e) for e in errors] == [RuntimeError] * 3 and get_config() == Config()


def test_an_interrupt_in_a_blocks_beginning_or_end_leaves_all_of_it_or_none():
    # Ctrl-C at every place CPython may deliver it in __enter__ and __exit__. __enter__ wrote the settings, then the
    # block that ends them: an interrupt as the first write returned left the settings in force for good, as a with
    # statement ends no block whose __enter__ raised.
    small, inner = config(cap_workspace=0), config(algo_search="exhaustive")

    def begin(block, settings: Config) -> int:
        n = 1
        while interrupt_at_check(n, block.__enter__):
            assert get_config() == Config() and _config.overridden() is None  # none of it
            n += 1
        assert get_config() == settings  # the run with no interrupt left: all of it
        block.__exit__(None, None, None)
        return n

    assert contextvars.copy_context().run(begin, small, Config(cap_workspace=0)) > 3
    scope = _config.using(Config(algo_search="exhaustive"))  # a backward pass's, the settings of its forward
    assert contextvars.copy_context().run(begin, scope, scope.settings) > 1

    def ended(n: int, nested: bool) -> bool:
        small.__enter__()
        if nested:
            inner.__enter__()  # begun inside the block, and still open as it ends
        fired = interrupt_at_check(n, small.__exit__, None, None, None)
        if get_config() in (Config(cap_workspace=0), Config(cap_workspace=0, algo_search="exhaustive")):
            small.__exit__(None, None, None)  # none of it: ended now
        assert get_config() == (Config(algo_search="exhaustive") if nested else Config())
        if nested:
            inner.__exit__(None, None, None)
        assert get_config() == Config() and _config.overridden() is None
        return fired

    def end(nested: bool) -> int:
        n = 1
        while contextvars.copy_context().run(ended, n, nested):
            n += 1
        return n

    assert end(nested=False) > 1 and end(nested=True) > 3


def test_a_config_object_copies_and_pickles_inside_its_block():
    small = config(cap_workspace="1MiB")
    with small:
        for other in (copy.copy(small), copy.deepcopy(small), pickle.loads(pickle.dumps(small))):
            with other as c:
                assert c.cap_workspace == 1 << 20
            assert get_config().cap_workspace == 1 << 20  # the copy's end left the original's block in force
    assert get_config().cap_workspace is None


def test_config_is_frozen():
    with pytest.raises(AttributeError):
        get_config().cap_workspace = 1


# ------------------------------------------------------------------------------------ the search cache's folder


def test_the_cache_dir_default_is_the_user_cache_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    wsarena._config._reset()
    assert get_config().cache_dir == tmp_path / "xdg" / "wsarena"
    monkeypatch.setattr(wsarena._config, "platformdirs", None)  # what an install without it has: the XDG rule
    assert Config().cache_dir == tmp_path / "xdg" / "wsarena"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert Config().cache_dir == Path.home() / ".cache" / "wsarena"


def _no_home(monkeypatch):
    """What a process has whose user id has no account and HOME is unset (a container run under an arbitrary user
    id): neither os.path.expanduser nor platformdirs can find a home folder."""
    import pwd

    def no_account(uid):
        raise KeyError(f"getpwuid(): uid not found: {uid}")

    monkeypatch.delenv("HOME", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(pwd, "getpwuid", no_account)


@pytest.mark.parametrize("platformdirs", ["installed", "missing", "older"])
def test_without_a_home_folder_the_cache_is_off_and_the_rest_works(monkeypatch, tmp_path, capsys, platformdirs):
    """platformdirs and Path.home() raise RuntimeError there: every get_config(), and so every convolution, heuristic
    ones too, failed with it. An older platformdirs gave "~/.cache/wsarena" unexpanded, and the searches saved their
    entries under a folder named "~" in the working directory."""
    from wsarena.cli import main

    from .reference import ref_conv_forward

    _no_home(monkeypatch)
    monkeypatch.delenv("WSARENA_CACHE_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    if platformdirs == "missing":
        monkeypatch.setattr(wsarena._config, "platformdirs", None)
    elif platformdirs == "older":
        monkeypatch.setattr(wsarena._config.platformdirs, "user_cache_dir",
                            lambda *args, **kwargs: os.path.join(os.path.expanduser("~/.cache"), "wsarena"))
    _config._reset()
    assert get_config().cache_dir is None and Config().cache_dir is None
    x = np.random.default_rng(0).standard_normal((2, 3, 7, 7), dtype="float32")
    w = np.random.default_rng(1).standard_normal((4, 3, 3, 3), dtype="float32")
    expected = ref_conv_forward(x.astype("float64"), w.astype("float64"), padding=1)
    for search in ("heuristic", "exhaustive"):
        with config(algo_search=search):
            np.testing.assert_allclose(wsarena.conv_forward(x, w, padding=1), expected, rtol=1e-4, atol=1e-4)
    assert list(tmp_path.iterdir()) == []  # nothing saved, no "~" folder here
    assert main(["cache", "info"]) == 0
    assert capsys.readouterr().out == ("the search cache is off (no home folder for the user cache folder: set HOME, "
                                       "XDG_CACHE_HOME or WSARENA_CACHE_DIR)\n")


def test_a_cache_dir_under_a_home_folder_that_cannot_be_found_is_refused(monkeypatch, tmp_path):
    # "~" left as it is made a folder named "~" in the working directory (and `rm -r ~` to remove it removes another)
    _no_home(monkeypatch)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="cache_dir '~/cache': no home folder is known for '~'"):
        configure(cache_dir="~/cache")
    monkeypatch.setenv("WSARENA_CACHE_DIR", "~/cache")
    _config._reset()
    with pytest.raises(ValueError, match="WSARENA_CACHE_DIR='~/cache'"):
        get_config()
    assert list(tmp_path.iterdir()) == []


def _refused_everywhere(monkeypatch, tmp_path, capsys, value, why, hint):
    """``cache_dir=value`` is refused saying ``why`` by configure(), as WSARENA_CACHE_DIR (naming the variable), and
    by ``wsarena cache info`` (exit 2, one line giving ``hint``), with nothing made in the working directory."""
    from wsarena.cli import main

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=re.escape(f"cache_dir {value!r} {why}")):
        configure(cache_dir=value)
    monkeypatch.setenv("WSARENA_CACHE_DIR", value)
    _config._reset()
    with pytest.raises(ValueError, match=re.escape(f"WSARENA_CACHE_DIR={value!r}: cache_dir {value!r} {why}")):
        get_config()
    assert main(["cache", "info"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and hint in err, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("quoted", ['"/data/cache"', "'/data/cache'", '"off"', '""'])
def test_a_cache_dir_in_quotes_is_refused(monkeypatch, tmp_path, capsys, quoted):
    """docker's --env-file keeps a value's quotes: WSARENA_CACHE_DIR="/data/cache" was taken as a folder named with
    them, relative, so under the working directory ('"' and below it 'data', 'cache"'), silently. A folder so named
    is still had as ./NAME, or as a Path."""
    _refused_everywhere(monkeypatch, tmp_path, capsys, quoted, "is in quotes",
                        "give the folder without them, or as ./NAME")
    with config(cache_dir="./" + quoted):
        assert get_config().cache_dir == tmp_path / quoted
    with config(cache_dir=Path(quoted)):
        assert get_config().cache_dir == tmp_path / quoted
    with config(cache_dir='/data/"cache"'):  # quotes inside a name are the name's
        assert get_config().cache_dir == Path('/data/"cache"')


@pytest.mark.parametrize(("stray", "why"), [
    ("'/data/cache", "begins with a quote"), ('"/data/cache', "begins with a quote"), ('"', "begins with a quote"),
    ('/data/cache"', "ends with a quote that closes none"), ("/data/cache'", "ends with a quote that closes none"),
])
def test_a_cache_dir_with_one_quote_of_a_pair_is_refused(monkeypatch, tmp_path, capsys, stray, why):
    """A value pasted with one of its quotes, the other lost, was taken as a folder named with it: '/data/cache a
    folder "'" under the working directory, /data/cache" a folder 'cache"' in /data. A quote inside a name, or a pair
    that ends it, is the name's; a folder whose name begins or ends with a quote is had as ./NAME/ or NAME/."""
    _refused_everywhere(monkeypatch, tmp_path, capsys, stray, f"{why}, which would be part of the folder's",
                        "give the folder without it, or as ")
    monkeypatch.delenv("WSARENA_CACHE_DIR")
    _config._reset()
    escaped = "./" + stray + "/" if why.startswith("begins") else stray + "/"
    with config(cache_dir=escaped):
        assert get_config().cache_dir == Path(os.path.abspath(stray))
    with config(cache_dir=Path(stray)):
        assert get_config().cache_dir == Path(os.path.abspath(stray))


@pytest.mark.parametrize("name", ['/data/a"b', "/data/it's", '/data/"cache"', "./'cache'", "/data/it's/'cache'",
                                  "/data/it's/cache'"])
def test_a_cache_dir_with_quotes_inside_its_name_is_taken_as_it_is(monkeypatch, tmp_path, name):
    """A quote in a name is a character of it, and so is one at its end that closes another."""
    monkeypatch.chdir(tmp_path)
    with config(cache_dir=name):
        assert get_config().cache_dir == Path(os.path.abspath(name))
    monkeypatch.setenv("WSARENA_CACHE_DIR", name)
    _config._reset()
    assert get_config().cache_dir == Path(os.path.abspath(name))


def test_a_long_cache_dir_is_shortened_in_its_refusal(monkeypatch, capsys):
    """A WSARENA_CACHE_DIR of 10 kB under a user with no home folder was quoted whole twice (a 20 kB line), and
    one holding a NUL whole, as the search cache's errors and warnings no longer quote it."""
    from wsarena.cli import main

    long = "~nosuchuser" + "/d" * 5000
    monkeypatch.setenv("WSARENA_CACHE_DIR", long)
    _config._reset()
    assert main(["cache", "info"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and len(err) < 600, err[:700]
    assert "cache_dir '~nosuchuser/d/d/" in err, err[:700]
    assert "d/d': no home folder is known for '~nosuchuser' (./~nosuchuser/d/d/" in err, err[:700]
    with pytest.raises(ValueError) as caught:
        configure(cache_dir="/d" * 5000 + "\0")
    assert len(str(caught.value)) < 250 and str(caught.value).endswith("\\x00' holds a NUL character"), caught.value


def test_without_platformdirs_a_relative_xdg_cache_home_is_ignored(monkeypatch, tmp_path):
    # as platformdirs and the XDG rule do: a relative one would be a folder under the working directory
    monkeypatch.setattr(wsarena._config, "platformdirs", None)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")
    assert Config().cache_dir == tmp_path / ".cache" / "wsarena"


@pytest.mark.parametrize(
    ("value", "expected"),
    [("off", None), (" OFF ", None), ("none", None), ("None", None), (None, None), ("./none", Path.cwd() / "none"),
     ("~/wsarena-cache", Path.home() / "wsarena-cache"), ("/srv/cache", Path("/srv/cache")),
     (Path("/srv/cache"), Path("/srv/cache")), ("relative/cache", Path.cwd() / "relative" / "cache")],
)
def test_cache_dir_by_configure_config_and_the_environment(monkeypatch, value, expected):
    assert configure(cache_dir=value).cache_dir == expected
    wsarena._config._reset()
    with config(cache_dir=value) as c:
        assert c.cache_dir == expected == wsarena.searchcache.cache_dir()
    if isinstance(value, str):
        monkeypatch.setenv("WSARENA_CACHE_DIR", value)
        wsarena._config._reset()
        assert get_config().cache_dir == expected == wsarena.searchcache.cache_dir()


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("WSARENA_CACHE_DIR", str(tmp_path / "env"))
    wsarena._config._reset()
    assert wsarena.searchcache.cache_dir() == tmp_path / "env"
    configure(cache_dir=tmp_path / "configured")
    assert wsarena.searchcache.cache_dir() == tmp_path / "configured"
    with config(cache_dir="off"):
        assert wsarena.searchcache.cache_dir() is None
    assert wsarena.searchcache.cache_dir() == tmp_path / "configured"
    configure(cache_dir="")  # an empty one is the default, as an empty variable is
    assert get_config().cache_dir == Config().cache_dir


def test_a_relative_cache_dir_does_not_move_with_the_working_directory(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    configure(cache_dir="cache")
    monkeypatch.chdir(tmp_path.parent)
    assert wsarena.searchcache.cache_dir() == tmp_path / "cache"


@pytest.mark.parametrize(("value", "error"), [(3, TypeError), (b"wsarena-cache", TypeError), ("a\0b", ValueError),
                                            ("~wsarena-no-such-user/cache", ValueError)])
def test_a_bad_cache_dir_is_refused_and_changes_nothing(value, error):
    with pytest.raises(error, match="cache_dir"):
        configure(cache_dir=value)
    assert get_config() == Config()


@pytest.mark.parametrize("key", ["cap_workspace", "search_cache_max_size"])
@pytest.mark.parametrize("value", ["9" * 4000, 10**400, 2**64], ids=["4000-nines", "10**400", "2**64"])
def test_a_size_setting_past_64_bits_is_refused_naming_it(key, value):
    # no memory or disk holds it; such a number was taken, and showing the settings (the report's table, cache info's
    # JSON) then failed on it: an OverflowError, or the int's 4300-digit limit for str()
    with pytest.raises(ValueError, match=f"{key}.*more than 2\\*\\*64 - 1 bytes"):
        configure(**{key: value})
    assert get_config() == Config()
    assert getattr(configure(**{key: 2**64 - 1}), key) == 2**64 - 1


def test_a_size_variable_past_64_bits_is_the_error_naming_it(monkeypatch):
    monkeypatch.setenv("WSARENA_SEARCH_CACHE_MAX_SIZE", "9" * 4000)
    wsarena._config._reset()
    with pytest.raises(ValueError, match="WSARENA_SEARCH_CACHE_MAX_SIZE"):
        get_config()


@pytest.mark.parametrize("var", ["WSARENA_CAP_WORKSPACE", "WSARENA_PLAN_CACHE_SIZE", "WSARENA_DEBUG", "WSARENA_BACKEND",
                                 "WSARENA_ALGO_SEARCH", "WSARENA_CUDNN_API", "WSARENA_CUDNN_HEURISTIC",
                                 "WSARENA_ALLOCATOR"])
def test_a_long_bad_variable_is_quoted_in_part(monkeypatch, var):
    # the message names the variable and quotes the value's ends, not all of a megabyte of it
    monkeypatch.setenv(var, "ab" + "x" * 1_000_000 + "yz")
    wsarena._config._reset()
    with pytest.raises(ValueError, match=f"{var}='abx+\\.\\.\\.x+yz'") as raised:
        get_config()
    assert len(str(raised.value)) < 400


@pytest.mark.parametrize("value", ["x" * 100_000, -(10**5000), [1] * 100_000], ids=["str", "int", "list"])
def test_a_long_bad_size_is_quoted_in_part(value):
    with pytest.raises((TypeError, ValueError), match="cap_workspace=") as raised:
        configure(cap_workspace=value)
    assert len(str(raised.value)) < 400  # a huge negative int's repr() raised a ValueError of its own
    with pytest.raises((TypeError, ValueError)) as raised:
        parse_size(value)
    assert len(str(raised.value)) < 400


@pytest.mark.parametrize(("setting", "value"), [
    ("backend", "x" * 100_000), ("algo_search", "x" * 100_000), ("plan_cache_size", "x" * 100_000),
    ("plan_cache_size", -(10**5000)), ("debug", "x" * 100_000), ("cache_dir", [1] * 100_000),
], ids=["backend", "algo_search", "plan_cache_size", "plan_cache_size-int", "debug", "cache_dir"])
def test_a_long_bad_setting_is_quoted_in_part(setting, value):
    """A choice, the plan cache's size and the debug flag were quoted whole (repr()): a 100 kB line, or repr()'s own
    ValueError for an int of 5000 digits."""
    with pytest.raises((TypeError, ValueError), match=f"^{setting} must be ") as raised:
        configure(**{setting: value})
    assert len(str(raised.value)) < 400


def test_a_plan_cache_size_too_long_to_write_out_is_said_to_be_negative():
    """Quoted as how many bits it has, "must be >= 1, not an integer of 16610 bits" read as a number too large."""
    with pytest.raises(ValueError, match="^plan_cache_size must be >= 1, not a negative integer of 16610 bits$"):
        configure(plan_cache_size=-(10**5000))


@pytest.mark.parametrize("value", ["\u0661\u0662", "\uff11\uff12", "1_0"])
def test_the_plan_cache_variable_takes_ascii_digits(monkeypatch, value):
    # as sizes and the command's integers take them: int() took 1_0 and any script's digits
    monkeypatch.setenv("WSARENA_PLAN_CACHE_SIZE", value)
    wsarena._config._reset()
    with pytest.raises(ValueError, match="WSARENA_PLAN_CACHE_SIZE.*positive integer"):
        get_config()
