"""How much workspace a network needs: shared (what wsarena holds) versus unshared (a workspace per layer and pass).

:func:`plan` asks the same backend and the same algorithm choice that the ops use, so in a real run the largest
lease on each stream is that stream's entry of ``stream_bytes`` (``arena_bytes`` over all streams: the arena's
``high_water_bytes`` for one stream). The arena itself ends up holding slightly more: each sub-arena rounds its
size up with :func:`wsarena.arena._stats.aligned_size`, so its ``capacity_bytes`` is the plan's ``held_bytes``, which is
also what ``arena.reserve_for(plan)`` reserves. (An exhaustive search can leave a sub-arena larger still: it times
the candidates in one workspace as large as the largest of them.)

Streams. ``streams=K`` models K concurrent streams each able to run any layer (an inference server with K
requests in flight): each stream's sub-arena holds the largest workspace of the whole network, so the arena is
K times that. ``streams=[s0, s1, ...]`` assigns layer ``i`` to stream ``s_i`` (an Inception module's branches,
say): each stream holds the largest workspace of its own layers, and the arena is their sum; the plan's streams are
those listed, in the order of their indices (``streams=[0, 2, 0]`` plans two streams, as ``[0, 1, 0]`` does: an
index is a label, any int >= 0, and one left out is no stream). Either way the streams are those one run of the model
spreads its layers over, as the unshared figure is one run's workspaces: a run cannot keep more streams busy than it
has layers, so ``streams`` above the number of layers is refused (rather than clamped, which would report a run other
than the one asked for); a list, one entry per layer, names no more streams than that.

Layers left out. A layer list from ``load_model(..., skip_unknown=True)`` carries the convolutions it left out
(``skipped``); the plan keeps them (:attr:`Plan.skipped`), and its totals say that they leave those layers out.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import stat
import sys
import unicodedata
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ._config import _FROM_CONFIG, ALGO_SEARCHES, Config, _given, config
from ._files import NotRegularFile, TooLarge, read_regular_file, unexpanded_home
from ._geometry import ConvGeometry, dtype_name
from ._pass import PASSES
from ._sizes import (
    TEXT_OR_BYTES,
    as_int,
    checked_ordered,
    escaped,
    format_size,
    is_choice,
    positive_batch,
    refused_in,
    short_path,
    short_repr,
)
from .algos import is_cached, is_cut_short, select
from .backends import Candidate, device_properties_backend, get_backend, resolve_backend_name
from .errors import BackendUnavailableError
from .models._layer import ConvLayer

__all__ = ["LayerPlan", "Plan", "plan"]

# what a model's layers are loaded from, for the errors of layers that are no list of them
_LOADS = "wsarena.load_model() reads a zoo name, a path to a .onnx or .json file or a list of JSON layer dicts"
_PROPERTIES_MAX_BYTES = 64 << 10  # device properties: a GPU's take about 1 KiB


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """One layer's geometry, stream and, per pass, the chosen algorithm and its workspace."""

    name: str
    geometry: ConvGeometry
    stream: int
    choices: dict[str, Candidate]
    transposed: bool = False

    @property
    def largest_bytes(self) -> int:
        return max((c.workspace_bytes for c in self.choices.values()), default=0)

    def to_dict(self) -> dict[str, Any]:
        g = self.geometry
        entry: dict[str, Any] = {
            "name": self.name,
            "input_shape": list(g.input_shape),
            "weight_shape": list(g.weight_shape),
            "stride": list(g.stride),
            "padding": list(g.padding),
            "dilation": list(g.dilation),
            "groups": g.groups,
        }
        if self.transposed:
            entry["transposed"] = True
        for pass_, cand in self.choices.items():
            entry[pass_] = {"algo": cand.algo, "workspace_bytes": cand.workspace_bytes}
        return entry


@dataclasses.dataclass(frozen=True)
class Plan:
    """The outcome of :func:`plan`. ``to_dict()`` is the JSON object ``wsarena report --format json`` prints."""

    model: str
    backend: str
    device: str
    batch: int
    dtype: str
    layout: str
    cap_workspace: int | None
    search: str
    passes: tuple[str, ...]
    layers: tuple[LayerPlan, ...]
    # per stream: the largest workspace chosen for a layer it runs; for streams=[...], the indices it lists, in order
    stream_bytes: tuple[int, ...]
    max_slowdown: float | None = None  # set when the cap was chosen by plan(max_slowdown=...)
    skipped: tuple[tuple[str, str], ...] = ()  # (name, why) of each conv the model's loader left out

    @property
    def streams(self) -> int:
        return len(self.stream_bytes)

    @property
    def arena_bytes(self) -> int:
        """What wsarena holds: per stream the largest chosen workspace, summed over streams (before the arena's
        rounding, which :attr:`held_bytes` includes)."""
        return sum(self.stream_bytes)

    @property
    def held_bytes(self) -> int:
        """What the arena's buffers come to once it rounds each up (:func:`wsarena.arena._stats.aligned_size`)."""
        from .arena._stats import aligned_size

        return sum(aligned_size(b) for b in self.stream_bytes)

    @property
    def unshared_bytes(self) -> int:
        """One workspace per layer and pass, as Caffe's cuDNN layer keeps: the sum of every chosen workspace."""
        return sum(c.workspace_bytes for layer in self.layers for c in layer.choices.values())

    @property
    def saved_bytes(self) -> int:
        return self.unshared_bytes - self.arena_bytes

    def to_dict(self) -> dict[str, Any]:
        from . import __version__

        return {
            "wsarena_version": __version__,
            "model": self.model,
            "backend": self.backend,
            "device": self.device,
            "batch": self.batch,
            "dtype": self.dtype,
            "layout": self.layout,
            "cap_workspace_bytes": self.cap_workspace,
            "streams": self.streams,
            "search": self.search,
            "layers": [layer.to_dict() for layer in self.layers],
            "stream_bytes": list(self.stream_bytes),
            "arena_bytes": self.arena_bytes,
            "arena_held_bytes": self.held_bytes,
            "unshared_bytes": self.unshared_bytes,
            "saved_bytes": self.saved_bytes,
            # the figures above leave these layers out (load_model(..., skip_unknown=True), --skip-unknown)
            "skipped_layers": [{"name": name, "reason": why} for name, why in self.skipped],
            **({} if self.max_slowdown is None else {"max_slowdown": self.max_slowdown}),
        }


def checked_layers(layers: Any) -> list[ConvLayer]:
    """``layers`` as a new list, when it is a non-empty iterable of :class:`~wsarena.models.ConvLayer`.

    Raises ``TypeError`` or ``ValueError`` naming ``layers`` (and the entry) otherwise."""
    if isinstance(layers, (str, os.PathLike)):  # a model's source: no layers to iterate
        raise TypeError(f"layers must be a list of ConvLayer, not {short_repr(layers)}: load it with "
                        "wsarena.load_model()")
    if isinstance(layers, TEXT_OR_BYTES):  # binary data (a model file's bytes?), which load_model() refuses too
        raise TypeError(f"layers must be a list of ConvLayer, not {short_repr(layers)}, binary data: {_LOADS}")
    if not isinstance(layers, Iterable):  # said as binary data and a bad entry are: what load_model() reads
        raise TypeError(f"layers must be a list of ConvLayer, not {short_repr(layers)}: {_LOADS}")
    items = list(layers)
    if not items:
        raise ValueError("layers is empty: a plan needs at least one convolution")
    for i, layer in enumerate(items):
        if not isinstance(layer, ConvLayer):
            raise TypeError(
                f"layers[{i}] must be a ConvLayer, not {type(layer).__name__} {short_repr(layer)}: {_LOADS}"
            )
    return items


def skipped_layers(layers: Any) -> tuple[tuple[str, str], ...]:
    """The ``(name, why)`` of the convolutions a loader left out of ``layers`` (see the module docstring)."""
    return tuple(getattr(layers, "skipped", ()))


def _integer(value: Any) -> Any:
    """``value`` as an ``int`` where it is an integer of any kind (NumPy's too, as the ops take them), else as it is,
    for the check that names it: a bool (NumPy's has no ``__index__``), a float, a sequence."""
    n = as_int(value)
    return value if n is None else n


def check_streams_bound(streams: int, n_layers: int, *, prefix: str = "streams=") -> None:
    """``ValueError`` where ``streams``, a count of streams each of which may run any layer, is more than the
    ``n_layers`` of the model: its bound, which only the model read tells. ``prefix`` begins the message, naming the
    count: plan()'s argument, or the command's flag (``"argument --streams: "``), which says it in these words."""
    if streams > n_layers:
        raise ValueError(
            f"{prefix}{short_repr(streams)} is more than the model's {n_layers} layer(s): one run of the model cannot "
            "keep more streams busy than it has layers"
        )


def _streams(streams: int | Sequence[int], n_layers: int) -> tuple[bool, list[int]]:
    """(shared, assignment): whether every stream may run any layer, and each layer's stream index."""
    streams = _integer(streams)
    if isinstance(streams, int) and not isinstance(streams, bool):
        if streams < 1:
            raise ValueError(f"streams must be >= 1, not {short_repr(streams)}")
        check_streams_bound(streams, n_layers)
        return True, [0] * n_layers
    indices = checked_ordered("streams", streams, "an int or a sequence of stream indices",
                              "and it collapses repeated indices, where streams lists each layer's stream in turn")
    assignment = [_integer(s) for s in indices]
    if len(assignment) != n_layers:
        raise ValueError(f"streams assigns {len(assignment)} layers; the model has {n_layers}")
    for i, s in enumerate(assignment):
        if isinstance(s, bool) or not isinstance(s, int):
            raise TypeError(f"streams[{i}] must be an int, a stream index, not {short_repr(s)}")
        if s < 0:
            raise ValueError(f"streams[{i}] must be a stream index >= 0, not {short_repr(s)}")
    # An index is a label (a stream's handle, 2**46, will do): the plan has the streams the list names, one entry per
    # layer, so never more streams than layers, whatever the largest index.
    return False, assignment


def plan(
    layers: Iterable[Any],
    *,
    batch: int = 1,
    dtype: Any = "float32",
    layout: str = "NCHW",
    cap_workspace: Any = _FROM_CONFIG,
    passes: Sequence[str] = PASSES,
    streams: int | Sequence[int] = 1,
    backend: str | None = None,
    search: str | None = None,
    model: str | os.PathLike[str] = "",
    progress: Callable[[int, int, str], None] | None = None,
    max_slowdown: float | None = None,
    device_properties: str | os.PathLike[str] | None = None,
) -> Plan:
    """Choose every layer's algorithms as the ops would, and add up the workspace.

    Parameters
    ----------
    layers : iterable of :class:`~wsarena.models.ConvLayer`
        From :func:`wsarena.load_model`; at least one. Convolutions the loader left out (``skip_unknown``) are
        listed in :attr:`Plan.skipped` and in ``to_dict()["skipped_layers"]``.
    batch, dtype, layout
        The run being planned (layers are stored at batch 1, NCHW); ``batch`` is 1 to 2**31 - 1, the largest
        dimension a cuDNN descriptor holds. ``dtype`` is a name (``"float32"``) or a NumPy or PyTorch dtype
        (``np.float32``, ``torch.float16``); the plan holds its name.
    cap_workspace : int, str or None
        The cap on one call's workspace; ``None`` for none. Default: the configured cap.
    passes : sequence of ``"fwd"``, ``"bwd_data"``, ``"bwd_filter"``
        Distinct names, in the order the plan lists them (its report, CSV columns and plot): a list, a tuple, a
        generator; not a set, whose order changes from run to run (``TypeError``).
    streams : int or sequence of int
        See the module docstring; an int is at most the number of layers, an index any int >= 0. A sequence is each
        layer's stream in turn (a list, a tuple, an array); not a set, which collapses repeated indices, or a mapping
        (``TypeError``).
    backend, search : str, optional
        Default: the configured ones. ``auto`` picks cuDNN when a GPU is usable.
    progress : callable, optional
        Called as ``progress(done, total, layer_name)`` after each layer.
    max_slowdown : float, optional
        Choose the cap instead of taking one: the smallest cap whose step is at most this fraction slower than
        with no cap (0.02 for 2 %), from one exhaustive search (:func:`wsarena.tune`), and the plan under it from
        the same measurements. Excludes ``cap_workspace``; the search is exhaustive.
    model : str or path, optional
        The model's name in the report (``to_dict()["model"]``); a path by its text.
    device_properties : str or path, optional
        A GPU's properties as cuDNN serialises them to JSON (``bench/gpu_check.py`` captures them): the JSON text
        (a str that starts with ``{``, after any byte order mark) or a regular file or a pipe holding it (another
        str, or a path; UTF-8, a byte order mark first or not). Plans for that GPU through cuDNN's graph API, on
        this machine, with no GPU (``backend`` must then be ``cudnn`` or left out, and ``search`` heuristic;
        docs/deviceless.md).
    """
    skipped = skipped_layers(layers)
    layers = checked_layers(layers)
    if search is not None and not is_choice(search, ALGO_SEARCHES):
        raise ValueError(f"search must be one of {ALGO_SEARCHES}, not {short_repr(search)}")
    source = None  # the file device_properties came from, which its errors name
    if device_properties is not None:
        if backend is not None and not is_choice(backend, ("cudnn",)):
            raise ValueError("device_properties plans for a cuDNN GPU: backend must be 'cudnn', not "
                             f"{short_repr(backend)}")
        if search == "exhaustive" or max_slowdown is not None:
            raise ValueError("device_properties plans without the GPU: it cannot time algorithms (search heuristic)")
        backend, search = "cudnn", "heuristic"
        from .cudnn._deviceprops import without_bom  # the cuDNN layer plans for them: loaded here, not with wsarena

        text = os.fspath(device_properties) if isinstance(device_properties, (str, os.PathLike)) else None
        if not isinstance(text, str):  # a dict of them, or bytes: os.fspath's own error named nothing
            raise TypeError("device_properties must be the JSON text or a file holding it (a str or a path), not "
                            f"{short_repr(device_properties)}")
        # a path is a file, whatever its name ({gpu}.json); a str is the JSON text where it starts as one (after a
        # byte order mark, as a file that has one reads with the utf-8 codec)
        file = isinstance(device_properties, os.PathLike) or not without_bom(text).lstrip().startswith("{")
        source = text if file else None
        if not file:
            _refuse_large(len(text.encode("utf-8", "surrogatepass")), "given as text")
        device_properties = without_bom(_read_properties(text) if file else text)
    if max_slowdown is not None:
        if cap_workspace is not _FROM_CONFIG:
            raise ValueError("give cap_workspace or max_slowdown, not both: max_slowdown chooses the cap")
        if search not in (None, "exhaustive"):
            raise ValueError(f"max_slowdown needs search='exhaustive' (it times every algorithm), not {search!r}")
        from .tuning import tune

        p = tune(layers, batch=batch, dtype=dtype, layout=layout, passes=passes, streams=streams, backend=backend,
                 max_slowdown=max_slowdown, model=model, progress=progress).plan()
        return dataclasses.replace(p, skipped=skipped) if skipped else p
    # The arguments apply as a config() block: the exhaustive search's leases then see the plan's cap, and an
    # invalid environment variable matters only for a setting left to it (device_properties decides the API too).
    api = "graph" if device_properties is not None else None
    with config(**_given(algo_search=search, backend=backend, cap_workspace=cap_workspace, cudnn_api=api)) as cfg:
        p = _plan(layers, cfg, batch=batch, dtype=dtype, layout=layout, passes=passes, streams=streams,
                  model=model, progress=progress, device_properties=device_properties, properties_source=source)
    return dataclasses.replace(p, skipped=skipped) if skipped else p


def _read_properties(path: str) -> str:
    """The text of the device properties file ``path``, which must be a regular file or a pipe (``--device-properties
    <(ssh gpu cat props.json)``; ``/dev/zero`` has no end), no larger than :func:`_refuse_large` allows: a regular
    file larger is refused unread, a pipe once it gives a byte more. A pipe is not waited on until a writer comes: one
    that none has open reads as empty, which is refused."""
    try:
        data, st = read_regular_file(path, limit=_PROPERTIES_MAX_BYTES, pipes=True)
    except TooLarge:
        raise _too_large(short_path(path)) from None
    except NotRegularFile as exc:
        raise ValueError(f"cannot read the device properties {short_path(path)}: it is {exc.kind}, not a regular "
                         "file or a pipe") from None
    except (OSError, ValueError) as exc:  # as load_model() names a model file it cannot read; ValueError: a NUL
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise ValueError(f"cannot read the device properties {short_path(path)}: {why}{unexpanded_home(path, exc)}"
                         ) from None
    if not data.strip():  # said here, not by cuDNN (not JSON), which may not even load on this machine
        why = ": the pipe gave nothing (no writer had it open, or its writer wrote nothing)" \
            if stat.S_ISFIFO(st.st_mode) else ""
        raise ValueError(f"device properties {short_path(path)} are empty{why}")
    try:
        return data.decode("utf-8")  # a byte order mark first is kept, for without_bom() to drop
    except UnicodeDecodeError as exc:
        raise ValueError(f"device properties {short_path(path)} are not a JSON text file (not UTF-8: {exc})") from None


def _refuse_large(size: int, what: str) -> None:
    """Refuse device properties far larger than any GPU's: cuDNN copies the text over and over while it plans
    (properties padded to 50 MiB held 3 GiB while one layer was planned)."""
    if size > _PROPERTIES_MAX_BYTES:
        raise _too_large(what)


def _too_large(what: str) -> ValueError:
    """The error of device properties ``what`` larger than :data:`_PROPERTIES_MAX_BYTES`."""
    return ValueError(f"device properties {what} are larger than {format_size(_PROPERTIES_MAX_BYTES)}: a GPU's take "
                      "about 1 KiB (bench/gpu_check.py captures them)")


def _plan(layers: list[Any], cfg: Config, *, batch: int, dtype: str, layout: str, passes: Sequence[str],
          streams: int | Sequence[int], model: Any, progress: Callable[[int, int, str], None] | None,
          device_properties: str | None = None, properties_source: str | None = None) -> Plan:
    batch, streams = positive_batch(batch), _integer(streams)
    dtype = dtype_name(dtype)
    cap, search, requested = cfg.cap_workspace, cfg.algo_search, cfg.backend
    # the plan keeps the passes in the order given: its report, CSV columns and plot too
    checked_ordered("passes", passes, "a sequence of pass names such as ('fwd',)",
                    "and the plan lists the passes in the order given")
    if progress is not None and not callable(progress):  # else a TypeError of its own after the first layer's search
        raise TypeError(f"progress must be callable, as progress(done, total, layer_name), not {short_repr(progress)}")
    # the report's "model": text, as to_dict() promises JSON (a path, as load_model takes one, by its name), else a
    # json.dumps() of the plan's dict failed, far from the call
    named = os.fspath(model) if isinstance(model, os.PathLike) else model
    if not isinstance(named, str):
        raise TypeError(f"model must be a str, the model's name in the report, or a path, not {short_repr(model)}")
    model = str.__str__(named)  # the plain text, where a str subclass (numpy.str_) was given, as passes are kept
    passes = tuple(passes)
    # names alone compared (an array's == answers an array), and kept as the plain names (a str subclass's)
    if not passes or not all(is_choice(p, PASSES) for p in passes) or len(set(passes)) != len(passes):
        raise ValueError(f"passes must be distinct names from {', '.join(PASSES)}, not {short_repr(passes)}")
    passes = tuple(PASSES[PASSES.index(p)] for p in passes)
    shared, assignment = _streams(streams, len(layers))
    if device_properties is not None:
        name, impl = "cudnn", device_properties_backend(device_properties, properties_source)
    else:
        name = resolve_backend_name(requested)
        impl = get_backend(name)
    try:
        impl.check_dtype(dtype)
    except TypeError as exc:
        if requested == "auto":  # the dtype is fine; this machine just has no GPU for it
            raise BackendUnavailableError(f"{exc}; plan {dtype} with the cudnn backend on a GPU") from None
        raise ValueError(str(exc)) from None
    geometries = [layer.geometry(batch=batch, dtype=dtype, layout=layout) for layer in layers]

    planned = []
    # The calls whose ranking is not kept for good, chosen once per plan: the backend ranked them without some
    # candidates for want of memory, their search could time nothing (the heuristic order), or their ranking serves
    # only operands alike those its search timed on. Each layer that repeats the call would rank it again, search
    # again, or make operands to ask whether they are alike, which a plan's own random ones, made alike for each layer,
    # cannot tell of any real call. (One memory cut short is probed by each, with a lease, which is cheap, and searched
    # again where what it lacked can be had by then.)
    once: dict[tuple[str, ConvGeometry], Candidate] = {}
    for i, (layer, geom) in enumerate(zip(layers, geometries)):
        choices = {}
        for pass_ in passes:
            if (pass_, geom) in once:
                choices[pass_] = once[(pass_, geom)]
                continue
            # Random operands only where the search really times (a shape seen before is cached).
            operands = functools.partial(_operands, impl, pass_, geom)
            ranked = select(impl, pass_, geom, cap=cap, search=search, operands=operands, warn=False)
            choices[pass_] = ranked[0]
            if not (is_cached(impl, pass_, geom, cap=cap, search=search, ranking=ranked)
                    or is_cut_short(impl, pass_, geom, cap=cap, search=search, ranking=ranked)):
                once[(pass_, geom)] = ranked[0]
        planned.append(
            LayerPlan(layer.name, geom, assignment[i], choices, transposed=bool(getattr(layer, "transposed", False)))
        )
        if progress is not None:
            progress(i + 1, len(layers), layer.name)

    return Plan(
        model=model,
        backend=name,
        device=impl.device_label(),
        batch=batch,
        dtype=dtype,
        layout=geometries[0].layout,  # the plain name, as the geometries hold it, where a str subclass was given
        cap_workspace=cap,
        search=search,
        passes=passes,
        layers=tuple(planned),
        stream_bytes=_stream_bytes(planned, streams, shared, assignment),
    )


def _stream_bytes(planned: Sequence[LayerPlan], streams: Any, shared: bool, assignment: list[int]) -> tuple[int, ...]:
    """Per stream, the largest workspace chosen for a layer it runs (see the module docstring): for an assignment,
    the streams it lists, in the order of their indices (:func:`_stream_slots`)."""
    if shared:
        largest = max((lp.largest_bytes for lp in planned), default=0)
        return (largest,) * int(streams)
    slots = _stream_slots(assignment)
    per_stream = [0] * len(slots)
    for lp in planned:
        slot = slots[lp.stream]
        per_stream[slot] = max(per_stream[slot], lp.largest_bytes)
    return tuple(per_stream)


def _stream_slots(assignment: Iterable[int]) -> dict[int, int]:
    """Each stream index an assignment lists -> its entry in :attr:`Plan.stream_bytes`: the streams it lists in the
    order of their indices; one it skips runs no layer and has none."""
    return {s: slot for slot, s in enumerate(sorted(set(assignment)))}


def _operands(backend: Any, pass_: str, geom: ConvGeometry) -> tuple[Any, Any, Any]:
    """Random operands of the pass, for timing algorithms in an exhaustive search."""
    a, b, out = (backend.random(shape, geom.dtype) for shape in geom.operand_shapes(pass_))
    return a, b, out


class ProgressBar:
    """A progress bar drawn in place on a terminal: call it as ``progress(done, total, layer_name)``. It wipes
    itself when the last layer is done; :meth:`clear` wipes it sooner, when the work stops midway (an error,
    Ctrl-C), so that what is printed next starts a line of its own."""

    __slots__ = ("drawn", "encoding", "out", "shown")

    def __init__(self, out: Any) -> None:
        self.out = out  # None: not a terminal, nothing is drawn
        self.shown = False  # a bar is on the line now
        self.drawn = 0  # the columns the line drawn last takes, which clear() wipes
        self.encoding: str | None = None  # the codec a write refused a name in, for a stream that names none

    _WIDTH = 30

    def _columns(self) -> int:
        """The characters a line may take: one less than the terminal's width, so that the cursor never reaches its
        last column; a line as wide as the terminal or wider wraps there, and each ``"\\r"`` then returns to the
        start of its last row only, leaving a row of bar behind for each layer (the bar's 78 to 85 characters on an
        80-column terminal, or a narrower one); none on a terminal of one column. A width unknown (a stream with no
        descriptor, or a terminal that says 0, as one whose size was never set does) is taken as 80 columns, as
        :func:`shutil.get_terminal_size` takes it, where the whole line was drawn."""
        try:
            width = os.get_terminal_size(self.out.fileno()).columns
        except (AttributeError, OSError, ValueError):  # no descriptor (a caller's stream), or no size known
            width = 0
        return max((width or 80) - 1, 0)

    def _line(self, done: int, total: int, name: str, encoding: str | None) -> tuple[str, int]:
        """The bar's line, and the columns it takes: the name escaped where ``encoding`` cannot show it (as the
        command's lines are), then cut to its 40 columns and padded to them, so that the columns of every line
        line up and clear() wipes what was drawn."""
        filled = self._WIDTH * done // max(total, 1)
        shown = name if name.isprintable() else repr(name)[1:-1]  # a newline would break the bar
        shown, width = _cut(escaped(shown, encoding), 40)
        return _cut(f"[{'#' * filled}{'.' * (self._WIDTH - filled)}] {done}/{total} {shown}{' ' * (40 - width)}",
                    self._columns())

    def __call__(self, done: int, total: int, name: str) -> None:
        if self.out is None:
            return
        try:
            # What the terminal's encoding cannot show (on an ASCII or cp437 stream) is escaped, as the command's
            # lines are, where its UnicodeEncodeError, a ValueError, was taken for a closed terminal and the bar
            # stopped; escaped before it is cut to its 40 columns, which clear() then wipes
            line, cells = self._line(done, total, name, self.encoding or getattr(self.out, "encoding", None))
            # marked drawn before the write: a Ctrl-C that lands as it returns, the line out, still has clear() wipe
            # it, so that "wsarena: interrupted" starts a line of its own (a wipe of what was not drawn yet is blanks)
            self.shown, self.drawn = True, cells
            try:
                self.out.write(f"\r{line}")
            except UnicodeEncodeError as exc:
                # A stream that names no encoding (a caller's): the codec its refusal names escapes the name, this
                # one's and the next ones', before it is cut and padded, where write_text() escaped the line once
                # padded by the name's unescaped width (an escape, \xfc, takes four columns where the character took
                # one). A text stream encodes the whole text before it writes any of it, so the refused write left
                # nothing behind. (ASCII for a code page's "charmap": refused_in().)
                self.encoding = refused_in(exc)
                line, cells = self._line(done, total, name, self.encoding)
                self.drawn = cells
                self.out.write(f"\r{line}")
            if done == total:
                self.clear()
            else:
                self.out.flush()
        except (OSError, ValueError):  # a terminal gone (closed, hung up): the work goes on, undrawn
            self.out, self.shown = None, False

    def clear(self) -> None:
        """Wipe the bar if one is drawn (nothing otherwise)."""
        if not self.shown:
            return
        if self.out is not None:
            try:
                self.out.write("\r" + " " * min(self.drawn, self._columns()) + "\r")
                self.out.flush()
            except (OSError, ValueError):  # a terminal gone (closed, hung up): nothing left to wipe
                pass
        # marked wiped after the wipe: a Ctrl-C that lands in it leaves the bar shown, for the next clear() (the
        # CLI's, before "wsarena: interrupted") to wipe (blanks over blanks where the first wipe was out)
        self.shown = False


def _cut(text: str, columns: int) -> tuple[str, int]:
    """The start of ``text`` that takes at most ``columns`` columns of a terminal, and how many it takes: a wide
    character (Chinese, Japanese, Korean, most emoji) takes two, a combining one none, where a line cut by its
    characters wrapped (40 wide ones take 80 columns)."""
    taken = 0
    for i, c in enumerate(text):
        width = 2 if unicodedata.east_asian_width(c) in "WF" else 0 if unicodedata.combining(c) else 1
        if taken + width > columns:
            return text[:i], taken
        taken += width
    return text, taken


def text_progress(stream: Any = None) -> ProgressBar:
    """A progress bar on ``stream`` (default stderr), drawn in place; nothing when it is not a terminal."""
    out = sys.stderr if stream is None else stream
    try:
        terminal = getattr(out, "isatty", lambda: False)()
    except (OSError, ValueError):  # a stream closed (a caller's sys.stderr.close()): nowhere to draw
        terminal = False
    return ProgressBar(out if terminal else None)
