"""Process-wide settings: the workspace cap, the algorithm search, the backend, the cuDNN API path, debug checks, and
the search cache's folder and size.

Precedence, lowest first: built-in defaults, environment variables (read once, on first use; an empty one
means the default), :func:`configure`, and the innermost :func:`config` block of the current thread or task.
An invalid environment variable makes reading the settings an error, unless that setting is given
explicitly: a value from :func:`configure` or :func:`config` (or from the planner's arguments and the command's
flags, which apply as a :func:`config` block) replaces it, and a :func:`configure` call that sets it repairs the
process-wide settings.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import difflib
import functools
import inspect
import os
import sys
import threading
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

try:  # imported with wsarena, not on first use (see wsarena/__init__.py)
    import platformdirs
except ImportError:  # an install made without dependencies
    platformdirs = None  # type: ignore[assignment]

from . import _forksafe
from ._sizes import as_int, ascii_int, is_choice, parse_size, short_path, short_repr

__all__ = [
    "ALGO_SEARCHES", "ALLOCATORS", "BACKENDS", "CUDNN_APIS", "CUDNN_HEURISTICS", "Config", "config", "configure",
    "get_config",
]

ALGO_SEARCHES = ("heuristic", "exhaustive")
BACKENDS = ("auto", "cudnn", "cpu")
ALLOCATORS = ("auto", "cupy", "torch")
CUDNN_APIS = ("legacy", "graph")
CUDNN_HEURISTICS = ("instant", "b")  # cuDNN's CUDNN_HEUR_MODE_INSTANT and CUDNN_HEUR_MODE_B
_CHOICES = {"algo_search": ALGO_SEARCHES, "backend": BACKENDS, "allocator": ALLOCATORS, "cudnn_api": CUDNN_APIS,
            "cudnn_heuristic": CUDNN_HEURISTICS}
# The cuDNN API path by default: the graph API, whose cached call costs less host time than the legacy one in every
# layer and pass measured, with the same arena and the same GPU time (an H200, 2026-11-26: bench/RESULTS.md).
DEFAULT_CUDNN_API = "graph"

_ENV = {
    "cap_workspace": "WSARENA_CAP_WORKSPACE",
    "algo_search": "WSARENA_ALGO_SEARCH",
    "backend": "WSARENA_BACKEND",
    "cudnn_api": "WSARENA_CUDNN_API",
    "cudnn_heuristic": "WSARENA_CUDNN_HEURISTIC",
    "plan_cache_size": "WSARENA_PLAN_CACHE_SIZE",
    "debug": "WSARENA_DEBUG",
    "allocator": "WSARENA_ALLOCATOR",
    "search_cache_max_size": "WSARENA_SEARCH_CACHE_MAX_SIZE",
    "cache_dir": "WSARENA_CACHE_DIR",
}
# Every environment variable the package reads is a setting's, named above: wsarena info names the others.
_PREFIX = "WSARENA_"
# Settings given in bytes: an int or a size string ("256MiB"), or None ("none").
_SIZES = ("cap_workspace", "search_cache_max_size")
_SIZE_MAX = 2**64 - 1
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def default_cache_dir() -> Path | None:
    """The user's cache folder for wsarena: ``platformdirs.user_cache_dir("wsarena")``, which on Linux is
    ``$XDG_CACHE_HOME/wsarena`` or ``~/.cache/wsarena``; ``None`` (no cache) where the home folder cannot be found
    (``HOME`` unset and no account for the process's user id, as in a container run under an arbitrary one)."""
    try:
        if platformdirs is None:  # an install made without dependencies: the XDG rule, which platformdirs follows
            xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
            folder = Path(xdg if os.path.isabs(xdg) else Path.home() / ".cache") / "wsarena"
        else:
            folder = Path(platformdirs.user_cache_dir("wsarena", appauthor=False))
    except RuntimeError:  # Path.home() and platformdirs: the home folder cannot be found
        return None
    # An older platformdirs leaves "~/.cache/wsarena" as it is where "~" has no home (and takes a relative
    # XDG_CACHE_HOME as it is): made absolute, that would be a folder named "~" in the working directory.
    return folder if folder.is_absolute() else None


def _cache_path(value: Any) -> Path | None:
    """A ``cache_dir`` value as the setting holds it: an absolute folder (``~`` expanded, ``ValueError`` where it
    cannot be; an empty string is the user's cache folder), or ``None`` for ``None``, ``"off"`` and ``"none"`` (any
    case; a folder of that name is ``"./none"``), as the other settings' ``none`` means none. A string in quotes is
    refused (``ValueError``): they would be part of the folder's name; a folder so named is ``./"name"``. So is one
    that begins with a quote (``'/data/cache``; ``./'name``) or ends with the only one of its kind
    (``/data/cache"``; ``name"/``), one quote of a pair pasted with the value."""
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() in ("off", "none"):
        return None
    if isinstance(value, str) and not value.strip():
        return default_cache_dir()
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"cache_dir must be a folder (a str or a path), 'off', 'none' or None, not {short_repr(value)}")
    text = os.fspath(value)
    if not isinstance(text, str):
        raise TypeError(f"cache_dir must be a folder (a str or a path), 'off', 'none' or None, not {short_repr(value)}")
    if "\0" in text:
        raise ValueError(f"cache_dir {short_path(text)} holds a NUL character")
    # a string in quotes, as docker's --env-file leaves VAR="/data/cache" (a Path says what it names)
    if isinstance(value, str) and len(text) > 1 and text[0] == text[-1] and text[0] in "\"'":
        raise ValueError(f"cache_dir {short_path(text)} is in quotes, which would be part of the folder's name (under "
                         "the working directory): give the folder without them, or as ./NAME for a folder so named")
    # One quote of a pair pasted with the value, the other lost ('/data/cache or /data/cache"): a name that begins
    # with a quote is a folder under the working directory, and a quote at the end, the only one of its kind, closes
    # none. Quotes inside a name, or a pair that ends it (/data/"cache", ./"/data/cache"), are the name's.
    if isinstance(value, str) and text[0] in "\"'":
        raise ValueError(f"cache_dir {short_path(text)} begins with a quote, which would be part of the folder's name "
                         "(under the working directory): give the folder without it, or as ./NAME for a folder so "
                         "named")
    if isinstance(value, str) and text[-1] in "\"'" and text.count(text[-1]) == 1:
        raise ValueError(f"cache_dir {short_path(text)} ends with a quote that closes none, which would be part of the "
                         "folder's name: give the folder without it, or as NAME/ for a folder so named")
    expanded = os.path.expanduser(text)
    if expanded.startswith("~"):  # left as it is, "~" would be a folder of that name in the working directory
        user = short_repr(text.split("/", 1)[0])
        raise ValueError(f"cache_dir {short_path(text)}: no home folder is known for {user} "
                         f"(./{short_path(text, quoted=False)} is a folder of that name in the working directory)")
    # absolute now, so that a later os.chdir() does not move the cache
    return Path(os.path.abspath(expanded))


@dataclasses.dataclass(frozen=True)
class Config:
    """The settings in force. Build changes with :func:`configure` or :func:`config`, not by hand.

    Attributes
    ----------
    cap_workspace : int or None
        Largest workspace, in bytes, that any single convolution call may use; ``None`` for no cap.
    algo_search : str
        ``"heuristic"`` (cuDNN's ranked guesses, no timing) or ``"exhaustive"`` (time the candidates).
    backend : str
        ``"auto"`` (the ops: cuDNN for CuPy arrays and other device memory, the CPU for NumPy arrays and other host
        memory; the planner: cuDNN where a GPU is usable), ``"cudnn"`` or ``"cpu"``.
    cudnn_api : str
        How the cudnn backend calls cuDNN: ``"graph"``, the default (the backend API: execution plans built once
        and cached), or ``"legacy"`` (``cudnnConvolutionForward`` and its kin).
    cudnn_heuristic : str
        Which of cuDNN's heuristics ranks the graph API's engine configurations: ``"instant"`` (its mode
        INSTANT, a quick guess) or ``"b"`` (mode B, a slower, more accurate model that falls back to INSTANT
        where it has none). Either way the fallback list follows them.
    plan_cache_size : int
        How many execution plans (and as many operation graphs) the graph API path keeps, for all threads and
        devices together, least recently used evicted first: 1 to ``sys.maxsize``.
    debug : bool
        Poison released workspace bytes and check that live leases on different streams never overlap.
    allocator : str
        Where a device arena made from now on takes its memory: ``"cupy"`` (CuPy's current allocator), ``"torch"``
        (PyTorch's caching allocator), or ``"auto"`` (PyTorch's when PyTorch tensors are the operands of the call
        that makes the arena, else CuPy's).
    search_cache_max_size : int or None
        Largest total size, in bytes, of the persistent search cache's entries (:mod:`wsarena.searchcache`); the
        least recently used go first when a write takes it over. ``None`` for no limit.
    cache_dir : Path or None
        The persistent search cache's folder; ``None`` when the cache is off. Given as a str or a path (``~``
        expanded, made absolute when set), ``"off"`` (or ``"none"``) or ``None``; default the user's cache folder
        (:func:`default_cache_dir`), or no cache where the home folder cannot be found.
    """

    cap_workspace: int | None = None
    algo_search: str = "heuristic"
    backend: str = "auto"
    cudnn_api: str = DEFAULT_CUDNN_API
    cudnn_heuristic: str = "instant"
    plan_cache_size: int = 1024
    debug: bool = False
    allocator: str = "auto"
    search_cache_max_size: int | None = 64 << 20
    cache_dir: Path | None = dataclasses.field(default_factory=default_cache_dir)

    def __post_init__(self) -> None:
        object.__setattr__(self, "cache_dir", _cache_path(self.cache_dir))
        for key in _SIZES:
            if getattr(self, key) is not None:
                object.__setattr__(self, key, _named_size(key, getattr(self, key)))
        if self.search_cache_max_size == 0:
            # ccache reads a zero limit as no limit; refuse it rather than guess which is meant
            raise ValueError("search_cache_max_size must be at least 1 byte (none for no limit; "
                             "WSARENA_CACHE_DIR=off turns the cache off)")
        for key, choices in _CHOICES.items():
            value = getattr(self, key)
            if not is_choice(value, choices):
                raise ValueError(f"{key} must be one of {choices}, not {short_repr(value)}")
            # the choice's own str: a str subclass equal to it (a (str, Enum) member) is shown by its own name
            object.__setattr__(self, key, choices[choices.index(value)])
        size = as_int(self.plan_cache_size)  # any integer type (numpy.int64), as sizes take; not a bool, nor a float
        if size is None:
            raise TypeError(f"plan_cache_size must be an int, not {short_repr(self.plan_cache_size)}")
        object.__setattr__(self, "plan_cache_size", size)
        if self.plan_cache_size < 1:
            raise ValueError(f"plan_cache_size must be >= 1, not {short_repr(self.plan_cache_size)}")
        # No cache holds more entries than a len() counts, and a larger number broke what writes the settings out:
        # repr(Config) and `wsarena info` failed on one of more than 4300 digits (int's str() limit)
        if self.plan_cache_size > sys.maxsize:
            raise ValueError(f"plan_cache_size must be at most sys.maxsize = {sys.maxsize}, the most entries a cache "
                             f"holds, not {short_repr(self.plan_cache_size)}")
        if not isinstance(self.debug, bool):
            raise TypeError(f"debug must be True or False, not {short_repr(self.debug)}")


def _parse_cap(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, str) and value.strip().lower() in ("", "none"):
        return None
    return parse_size(value)


def _named_size(key: str, value: Any) -> int | None:
    """:func:`_parse_cap`, with the setting's name in the error; at most ``2**64 - 1`` bytes, which no memory or disk
    passes (a larger number could not even be shown: a float overflows, and str() stops at 4300 digits). An empty
    string is the setting's default, as an empty variable is."""
    if isinstance(value, str) and not value.strip():
        return getattr(Config, key)  # the class attribute: the field's default
    try:
        n = _parse_cap(value)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{key}={short_repr(value)}: {exc}") from None
    if n is not None and n > _SIZE_MAX:
        raise ValueError(f"{key}={short_repr(value)}: more than 2**64 - 1 bytes (none for no limit)")
    return n


# The process-wide settings, the error of each invalid environment variable that nothing has replaced yet, and where
# each setting's value comes from ("environment" or "configure"; a setting not named: "default"). The environment
# is read once: a variable changed later is not what the settings hold (origin() tells it).
_State = tuple[Config, dict[str, str], dict[str, str]]


def _env_value(key: str, raw: str) -> Any:
    if key in _SIZES:
        return _parse_cap(raw)
    if key == "plan_cache_size":
        try:
            return ascii_int(raw)
        except ValueError:
            raise ValueError(f"expected a positive integer, not {short_repr(raw)}") from None
        except OverflowError as exc:
            raise ValueError(str(exc)) from None
    if key == "debug":
        low = raw.strip().lower()
        if low not in _TRUE | _FALSE:
            raise ValueError(f"expected 1, true, yes or on, or 0, false, no or off, not {short_repr(raw)}")
        return low in _TRUE
    if key == "cache_dir":
        return raw.strip()  # a path keeps its case
    return raw.strip().lower()


def _from_env() -> _State:
    """The settings the environment gives, and the error of each invalid variable (its setting keeps the default
    until something replaces it); as the third member, the names of those it set, each from "environment"."""
    values: dict[str, Any] = {}
    errors: dict[str, str] = {}
    for key, var in _ENV.items():
        raw = os.environ.get(var)
        if raw is None or not raw.strip():  # set but empty, as `VAR= cmd` leaves it: the default
            continue
        try:
            value = _env_value(key, raw)
            Config(**{key: value})
        except (TypeError, ValueError) as exc:
            errors[key] = f"environment variable {var}={short_repr(raw)}: {exc}"
        else:
            values[key] = value
    origins = dict.fromkeys(values, "environment")
    return _carrying(Config(**values), origins), errors, origins


# Guards _state; readers take the reference without it (assignment is atomic). Reentrant: the first read reads the
# environment under it, and configure() makes its settings under it, where the collector may run a finalizer (a
# collected arena's, which reads the debug setting; any of the program's) or a signal handler may run, in this thread,
# that reads or changes the settings: it takes the lock again, where a plain lock would wait for itself for good. A
# configure() run there is kept: the first read stores the environment's settings only where none were stored meanwhile.
_lock = _forksafe.rlock()
_state: _State | None = None


class _UnderWay(threading.local):
    """The changes of the configure() calls under way in this thread, outermost first, each checked: one run inside
    another (a finalizer, a signal handler) stores its settings with those of the calls it runs in over them, so that
    none is made again, which a finalizer making garbage and configuring at every collection would make forever. Of
    this thread: a forked child has none of another thread's, whose configure() the fork cut short."""

    def __init__(self) -> None:
        self.changes: list[dict[str, Any]] = []


_under_way = _UnderWay()


# A block in force, a config() block or a using() scope: [the settings in force in it (None: the process-wide ones),
# its config or using object, the block it began in, the token of the write that began it (a block ends with the token
# made in its own context, which contextvars needs)]. A list, which costs less to make than an object.
_Block = list[Any]
# The innermost block in force in this thread or task; outside any, _OUTSIDE. The blocks and their settings in one
# context variable, so that a block begins with one write: an interrupt leaves no settings in force without the block
# that ends them, nor a block that never was.
_OUTSIDE: _Block = [None, None, None, None]
_top: contextvars.ContextVar[_Block] = contextvars.ContextVar("wsarena_config", default=_OUTSIDE)


# An argument that names a setting and was not given: the configured value applies (None is a value: no cap).
_FROM_CONFIG: Any = object()


def _given(
    *, algo_search: Any = None, backend: Any = None, cap_workspace: Any = _FROM_CONFIG, cudnn_api: Any = None,
    cudnn_heuristic: Any = None,
) -> dict[str, Any]:
    """The :func:`config` changes of the arguments that were given (the planner's and the command's flags)."""
    given = (("algo_search", algo_search), ("backend", backend), ("cudnn_api", cudnn_api),
             ("cudnn_heuristic", cudnn_heuristic))
    changes = {key: value for key, value in given if value is not None}
    if cap_workspace is not _FROM_CONFIG:
        changes["cap_workspace"] = cap_workspace
    return changes


def _replace(base: Config, changes: dict[str, Any]) -> Config:
    unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(Config)})
    if unknown:
        raise TypeError(f"unknown setting(s) {', '.join(map(repr, unknown))}; known: {', '.join(_ENV)}")
    changes = {key: _named_size(key, value) if key in _SIZES else value for key, value in changes.items()}
    return dataclasses.replace(base, **changes)


def _check_env(errors: dict[str, str], given: Iterable[str] = ()) -> None:
    """Raise the error of the first invalid environment variable whose setting is not in ``given``."""
    for key, message in errors.items():
        if key not in given:
            raise ValueError(message)


def _base_state() -> _State:
    global _state
    state = _state
    if state is None:
        with _lock:
            if _state is None:
                read = _from_env()
                if _state is None:  # else this thread stored them meanwhile (a finalizer's configure()): kept
                    _state = read
            state = _state
    return state


def get_config() -> Config:
    """Return the settings in force for the calling thread or task (a frozen :class:`Config`)."""
    settings = _top.get()[0]
    if settings is not None:
        return settings
    base, errors, _ = _base_state()
    if errors:
        _check_env(errors)
    return base


def configure(**changes: Any) -> Config:
    """Change the process-wide settings and return the new :class:`Config`.

    Keywords: ``cap_workspace`` (bytes, a size string such as ``"256MiB"``, or ``None``), ``algo_search``,
    ``backend``, ``cudnn_api``, ``cudnn_heuristic``, ``plan_cache_size``, ``debug``, ``allocator``,
    ``search_cache_max_size`` (bytes, a size string or ``None``), ``cache_dir`` (a folder, ``"off"``, ``"none"`` or
    ``None``).
    Invalid values raise and change nothing; so does an invalid environment variable for a setting that
    ``changes`` leaves to it. A call made inside this one, in the same thread (by a finalizer the collector runs
    here, or a signal handler), is kept, and this one's changes apply over it.
    """
    global _state
    with _lock:
        pending = _under_way.changes
        state = _base_state()
        new = _replace(state[0], changes)
        _check_env(state[1], changes)
        # checked, and as the settings hold them (a size parsed): a configure() run inside this one applies them
        ours = {key: getattr(new, key) for key in changes}
        try:
            pending.append(ours)
            if _state is not state or len(pending) > 1:
                # Run inside another configure(), or one ran inside this one meanwhile (in this thread, under the
                # lock: a finalizer the collector ran, a signal handler): made over the settings stored now, with the
                # changes of the configure() calls under way here applied over them, outermost last.
                state = _base_state()
                new = state[0]
                for made in reversed(pending):
                    new = _replace(new, made)
            origins = {**state[2], **dict.fromkeys([key for made in pending for key in made], "configure")}
            stored: _State = (_carrying(new, origins), {}, origins)
            # Nothing is allocated from this test to the store, where the collector could run a finalizer
            if _state is state:  # else one run meanwhile stored its settings with these changes over them
                _state = stored
        finally:
            if pending and pending[-1] is ours:
                pending.pop()
        return _base_state()[0]


_ELSEWHERE = ("a config() block ends where it did not begin (another thread or task, or an async generator that the "
              "event loop closes: contextlib.aclosing() closes it where it runs)")


def _end(owner: Any, *exc: object) -> None:
    """End the block of ``owner`` in force here (the ``__exit__`` of :func:`config` and :class:`using`). Then in force:
    the blocks still open, each over those begun before it, over what was in force before this one. Ended in order,
    that is what was in force before it; ended before a block begun inside it (a generator suspended in one, whose
    caller's block ends, or the other way round), the blocks still open keep their own changes, and none of this one's.
    An interrupt as a write returns ends it all the same."""
    top = block = _top.get()
    while block is not None and block[1] is not owner:
        block = block[2]
    if block is None:
        raise RuntimeError(_ELSEWHERE)
    rest = block[2]
    if block is not top:  # blocks begun inside this one and not ended yet (a generator suspended in one): kept
        inner = []
        while top is not block:
            inner.append(top)
            top = top[2]
        for _, kept, _, token in reversed(inner):
            rest = [kept._settings_over(rest[0]), kept, rest, token]
    try:
        _top.reset(block[3])  # raises where the block began in another context, which holds a copy of it
        if _top.get() is not rest:  # a block ended out of order made the token's value stale
            _top.set(rest)
    except (ValueError, RuntimeError):
        raise RuntimeError(_ELSEWHERE) from None
    except BaseException:  # an interrupt as a write returned: the reset was made, and the rest is
        _top.set(rest)
        raise


class config(contextlib.ContextDecorator):  # lower case: used as a function
    """Override settings for the body of a ``with`` block, in this thread or task only; ``as`` gives the
    :class:`Config` in force in it. The changes apply to the settings in force where the block begins (an enclosing
    block's), and are checked there. Reusable, also by several threads or asyncio tasks at once, but not inside a
    block of its own that has not ended (a ``RuntimeError``: nest a new ``config()``), and usable as a decorator (each
    call a block of its own; of a coroutine function, around its body)."""

    __slots__ = ("changes",)

    def __init__(self, **changes: Any) -> None:
        self.changes = changes

    def __repr__(self) -> str:
        return f"wsarena.config({', '.join(f'{k}={v!r}' for k, v in self.changes.items())})"

    def __enter__(self) -> Config:
        outer = _top.get()
        held = outer
        while held is not None:
            if held[1] is self:
                # Two blocks of one object in one context (a caller's and a generator's it drives) could not be told
                # apart as they end, if they end out of order.
                raise RuntimeError(f"{self!r} is entered inside a block of its own that has not ended (in this thread "
                                   "or task, or the block a task was created in): make a new config() for each block")
            held = held[2]
        new = _over(outer[0], self.changes, check_env=True)
        block: _Block = [new, self, outer, None]
        try:
            block[3] = _top.set(block)
        except BaseException:  # an interrupt as the write returned: undone, as no with statement ends this block
            _top.set(outer)
            raise
        return new

    __exit__ = _end

    def _settings_over(self, settings: Config | None) -> Config:
        """This block's settings, begun where ``settings`` are in force."""
        return _over(settings, self.changes)

    def __call__(self, func: Any) -> Any:
        if inspect.isgeneratorfunction(func) or inspect.isasyncgenfunction(func):
            raise TypeError(f"config() cannot decorate the generator function {func.__qualname__}: its body runs "
                            "outside the call; use a with block inside it")
        # Each call in a block of a new object, as torch.no_grad()'s: the blocks of a recursive function's calls, or of
        # several threads' or tasks' at once, are each of their own.
        if inspect.iscoroutinefunction(func):

            @functools.wraps(func)
            async def body(*args: Any, **kwargs: Any) -> Any:
                with config(**self.changes):
                    return await func(*args, **kwargs)

            return body

        @functools.wraps(func)
        def call(*args: Any, **kwargs: Any) -> Any:
            with config(**self.changes):
                return func(*args, **kwargs)

        return call


def overridden() -> Config | None:
    """The settings of the innermost :func:`config` block (or :class:`using` scope) in force here, or ``None`` for the
    process-wide ones."""
    return _top.get()[0]


class using:  # lower case: used like config()
    """``settings`` in force for the body of a ``with`` block, in this thread or task only, as an enclosing
    :func:`config` block's would be (``None``: the process-wide settings, as outside any block): the block a
    piece of work was started in, where the work goes on elsewhere (a backward pass on PyTorch's autograd thread).
    Reusable, and re-entrant (PyTorch's checkpoint enters a recompute context once per recompute; unlike a config()
    object, one scope is not refused inside itself: its entries end innermost first)."""

    __slots__ = ("settings",)

    def __init__(self, settings: Config | None) -> None:
        self.settings = settings

    def __enter__(self) -> Config | None:
        outer = _top.get()
        block: _Block = [self.settings, self, outer, None]
        try:
            block[3] = _top.set(block)
        except BaseException:  # an interrupt as the write returned: undone, as no with statement ends this block
            _top.set(outer)
            raise
        return self.settings

    __exit__ = _end  # as a config() block's: one begun before it and ended first does not come back

    def _settings_over(self, settings: Config | None) -> Config | None:
        """The settings in force in this scope, wherever it begins."""
        return self.settings


def _over(settings: Config | None, changes: dict[str, Any], *, check_env: bool = False) -> Config:
    """``changes`` applied over ``settings`` (``None``: the process-wide ones); ``check_env``: refuse an invalid
    variable of a setting ``changes`` leaves as it is (where a block begins; a setting in ``changes`` needs no valid
    environment). The settings carry where each value comes from (:func:`origin`): those ``changes`` names from
    "config", the rest as in force where the block began, which a later :func:`configure` does not change."""
    if settings is not None:
        new = _replace(settings, changes)
        origins = _origins(settings)
    else:
        # the settings and their origins of one state: a configure() of another thread meanwhile changes neither
        base, errors, origins = _base_state()
        new = _replace(base, changes)
        if check_env:
            _check_env(errors, changes)
    return _carrying(new, {**origins, **dict.fromkeys(changes, "config")})


def _carrying(settings: Config, origins: dict[str, str]) -> Config:
    """``settings``, made here, carrying where each of their values comes from: not a field of Config (neither
    compared nor shown), it travels with them wherever they go, into a :class:`using` scope (a backward pass's, an op's
    that chose under what get_config() gave) too, where a later :func:`configure` does not change it."""
    object.__setattr__(settings, "_origins", origins)
    return settings


def _origins(settings: Config | None) -> dict[str, str]:
    """Where each value of ``settings`` comes from; for settings made by hand (``Config(...)``), which carry none,
    the process-wide settings' origins."""
    found: dict[str, str] | None = None if settings is None else settings.__dict__.get("_origins")
    return found if found is not None else _base_state()[2]


def setting(key: str) -> Any:
    """The value in force here of the setting ``key``, for a path that must not raise (freeing memory, a finalizer):
    where :func:`get_config` raises for an invalid environment variable of any setting that nothing replaced, this
    raises for none; a setting whose variable is invalid has its default, as the settings hold it meanwhile."""
    settings = _top.get()[0]
    if settings is None:
        settings = _base_state()[0]
    return getattr(settings, key)


def origin(key: str) -> str:
    """Where the value in force here of the setting ``key`` comes from: ``"config"`` (a :func:`config` block),
    ``"configure"`` (:func:`configure`), ``"environment"`` (its variable, as read) or ``"default"``."""
    return _origins(overridden()).get(key, "default")


def in_force() -> dict[str, tuple[Any, str, str | None]]:
    """Each setting in force here, as ``wsarena info`` shows it: ``(value, source, error)``, ``source`` as
    :func:`origin` names it. ``error`` is that of an invalid environment variable nothing has replaced, which reading
    the settings raises (its ``value`` then the default, its ``source`` ``"environment"``); ``None`` for the rest.
    Never raises."""
    settings = overridden()
    if settings is None:
        settings, errors, origins = _base_state()  # one state: a configure() of another thread changes neither
    else:  # a block's settings: an invalid variable was refused where it began, or replaced
        errors, origins = {}, _origins(settings)
    return {
        f.name: (getattr(settings, f.name), "environment" if f.name in errors else origins.get(f.name, "default"),
                 errors.get(f.name))
        for f in dataclasses.fields(Config)
    }


def unknown_variables(environ: Mapping[str, str] | None = None) -> dict[str, str | None]:
    """The variables of ``environ`` (default ``os.environ``, as it is now) whose name begins with ``WSARENA_``, in any
    case, and that no setting reads, sorted, each with the setting's variable whose name is closest to it (difflib,
    on the part after the prefix) or that it alone abbreviates (:func:`_abbreviates`), or ``None`` where none is
    close, or where it abbreviates several: a misspelled one is otherwise ignored silently."""
    environ = os.environ if environ is None else environ
    known = {var[len(_PREFIX):]: var for var in _ENV.values()}
    found: dict[str, str | None] = {}
    for name in sorted(environ):
        if name[:len(_PREFIX)].upper() != _PREFIX or name in _ENV.values():
            continue
        short = name[len(_PREFIX):].upper()
        close = difflib.get_close_matches(short, known, n=1)
        abbreviates = _abbreviates(short, known)
        # Of two words or more, an abbreviation follows a name's words, as a misspelling of another name hardly does
        # (CUDNN_H, which difflib finds closer to CUDNN_API); one word may be another name's, misspelt or whole, as
        # difflib finds it (SEARCH, of ALGO_SEARCH: `wsarena report --search`). A short form of several names is
        # none's: difflib's pick would be a guess (CUDNN: CUDNN_API, of CUDNN_API and CUDNN_HEURISTIC).
        if len(abbreviates) > 1:
            close = []
        elif abbreviates and (not close or len(_words(short)) > 1):
            close = abbreviates
        found[name] = known[close[0]] if close else None
    return found


def _words(name: str) -> list[str]:
    """The words of a variable's name, between its ``_``."""
    return [word for word in name.split("_") if word]


def _abbreviates(short: str, names: Iterable[str]) -> list[str]:
    """The names of ``names`` that ``short`` abbreviates, word by word: each of its words begins the name's word in
    the same place, as ``CAP`` does ``CAP_WORKSPACE`` and ``SEARCH_C_MAX`` ``SEARCH_CACHE_MAX_SIZE`` (difflib finds
    neither: it asks for more than half of the name); none for a ``short`` of fewer than three letters."""
    words = _words(short)
    if sum(map(len, words)) < 3:
        return []
    return [name for name in names if len(words) <= len(_words(name))
            and all(full.startswith(word) for word, full in zip(words, _words(name)))]


def _reset() -> None:
    """Forget every change and re-read the environment on next use (for tests)."""
    global _state
    with _lock:
        _state = None
