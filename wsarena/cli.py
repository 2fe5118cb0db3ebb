"""The ``wsarena`` command: ``wsarena report MODEL``, ``wsarena tune MODEL``, ``wsarena cache`` and ``wsarena info``.

Exit codes: 0 success; 2 bad usage or bad input (one line on stderr); 3 the environment cannot do it (for
example ``--backend cudnn`` with no usable GPU, or output that cannot be written, the ``--plot`` file included);
130 interrupted (``wsarena: interrupted``); 141 the reader of the output went away (nothing printed).
Warnings are one line each on stderr, ``wsarena: warning: ...``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from ._cli_args import OutputError, UsageError, input_shapes, parser, unplanned_batches
from ._config import _FROM_CONFIG, Config, _given, config
from ._report_cli import render_table, write_csv
from ._sizes import os_error_text, short_path, short_repr, write_text
from ._tune_cli import cache_output, tune_output, uncached_apply
from .errors import BackendUnavailableError

__all__ = ["main"]

EXIT_OK, EXIT_USAGE, EXIT_ENVIRONMENT, EXIT_INTERRUPTED = 0, 2, 3, 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a writer whose reader closed the pipe


def main(argv: Sequence[str] | None = None) -> int:
    global _interrupted
    _interrupted = False
    _bars.clear()  # a bar that a second Ctrl-C left there in an earlier call (_progress_bar), wiped by then
    try:
        with _one_line_warnings(), _kept_interrupts():
            return _main(argv)
    except KeyboardInterrupt:
        # A Ctrl-C where _main() no longer catches it, which gave a traceback: a second one (a key pressed twice, or
        # held down) as or after the first one's line; or the first, as the command was done, or ending (an error's
        # line, --help's exit), or as these blocks began
        _say_interrupted()
        return EXIT_INTERRUPTED


_interrupted = False  # "wsarena: interrupted" was said (_say_interrupted)


def _say_interrupted() -> None:
    """Say ``wsarena: interrupted``, once: a second Ctrl-C that lands as the line is said or after it is the same
    interruption. It is marked said before it is written, so that it is never said twice: a second Ctrl-C between
    the mark and the write loses it instead, a window of one statement."""
    global _interrupted
    if not _interrupted:
        for bar in _bars:  # one whose wipe a second Ctrl-C cut short (_progress_bar): the line would follow it
            bar.clear()
        _interrupted = True
        _say("wsarena: interrupted")


_lost: list[type[BaseException]] = []  # the interrupts a finalizer raised while the command ran (below)


@contextlib.contextmanager
def _kept_interrupts() -> Iterator[None]:
    """A Ctrl-C that lands in a finalizer or another weakref callback, which the collector runs anywhere (planning
    destroys cuDNN descriptors all the time), raises ``KeyboardInterrupt`` there, and Python only reports it
    ("Exception ignored in ..."): the command went on and exited 0. Such an interrupt is kept instead, and raised
    after the next layer planned (:func:`_progress`) or when planning is over (:func:`_raise_kept`)."""
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        if unraisable.exc_type is not None and issubclass(unraisable.exc_type, KeyboardInterrupt):
            _lost.append(unraisable.exc_type)
        else:
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous
        _lost.clear()


def _say(line: str) -> None:
    """Write ``line`` to stderr, or nothing where the command started with its stderr closed (``2>&-``): Python gives
    no stream for it then, and print() would write the line to stdout, into the output (a JSON object, --apply's
    line). Where stderr cannot be written (its reader gone, or a caller of :func:`main` closed ``sys.stderr``: a
    ValueError), the command's exit code still says what happened. What stderr's encoding cannot show is escaped
    (:func:`write_text`), not the line lost."""
    if sys.stderr is not None:
        with contextlib.suppress(OSError, ValueError):
            write_text(sys.stderr, f"{line}\n")


def _raise_kept() -> None:
    """Raise the interrupt a finalizer raised, if one did (:func:`_kept_interrupts`)."""
    if _lost:
        _lost.clear()
        raise KeyboardInterrupt


def _progress(bar: Any) -> Callable[[int, int, str], None]:
    """What the planner calls after each layer: the progress bar, if any, once an interrupt kept is raised."""
    def progress(done: int, total: int, name: str) -> None:
        _raise_kept()
        if bar is not None:
            bar(done, total, name)

    return progress


@contextlib.contextmanager
def _one_line_warnings() -> Iterator[None]:
    """Show each warning as one line on stderr, ``wsarena: warning: ...``, instead of Python's file, line number
    and source line."""
    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None,
             line: str | None = None) -> None:
        for bar in _bars:  # the bar has no newline: the warning would print onto its end; it is drawn again next
            bar.clear()
        _say(f"wsarena: warning: {' '.join(str(message).splitlines())}")

    with warnings.catch_warnings():
        warnings.showwarning = show
        yield


def _main(argv: Sequence[str] | None) -> int:
    try:
        args = parser().parse_args(argv)
        if args.command == "info":
            return _info(args)
        if args.command == "tune":
            return _tune(args)
        if args.command == "cache":
            return _cache(args)
        return _report(args)
    except BrokenPipeError:  # the reader went away (`wsarena report ... | head`): stop quietly, as SIGPIPE would
        _drop_stdout()
        return EXIT_BROKEN_PIPE
    except OutputError as exc:
        _drop_stdout()
        _say(f"wsarena: error: {exc}")
        return EXIT_ENVIRONMENT
    except UsageError as exc:
        _say(f"wsarena: error: {exc}")
        return EXIT_USAGE
    except (BackendUnavailableError, MemoryError) as exc:
        # Python's own MemoryError, where an allocation fails (a model too large to read), carries no message
        _say(f"wsarena: error: {str(exc) or 'out of memory'}")
        return EXIT_ENVIRONMENT
    except (ValueError, TypeError, OSError) as exc:
        _say(f"wsarena: error: {exc}")
        return EXIT_USAGE
    except Exception as exc:  # noqa: BLE001 - a cuDNN or CUDA failure: one line, as for any other error
        _say(f"wsarena: error: {type(exc).__name__}: {exc}")
        return EXIT_ENVIRONMENT
    except KeyboardInterrupt:
        _say_interrupted()
        return EXIT_INTERRUPTED


def _drop_stdout() -> None:
    """Point stdout at the null device, so that the flush at exit cannot fail again on what is still buffered."""
    if sys.stdout is None:  # closed from the start: nothing to flush
        return
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError):  # not a file (a caller's buffer): nothing buffered for the exit to flush
        return
    os.dup2(os.open(os.devnull, os.O_WRONLY), fd)


def _check_plot(args: argparse.Namespace, inputs: dict[str, str | None]) -> None:
    """With ``--plot``, fail now if matplotlib is missing or the file cannot be written there (a folder, a folder
    missing), not after a search that may have taken minutes; or if the plot would replace one of the command's
    ``inputs`` (what each is: a file, or ``None`` when not given), as a compiler refuses an output that is its
    input."""
    path = args.plot
    if path is not None:
        for what, given in inputs.items():
            with contextlib.suppress(OSError):  # either missing: nothing to lose
                if given is not None and os.path.samefile(path, given):
                    raise _refused(args, f"--plot {short_path(path)} is the {what}; the plot would replace it")
        from .plot import _pyplot, check_writable

        _pyplot()
        with _plot_file(path):
            check_writable(path)


@contextlib.contextmanager
def _plot_file(path: str) -> Iterator[None]:
    """Around writing the ``--plot`` file: a failure to write it (a folder, a full disk) is :class:`OutputError`."""
    try:
        yield
    except OSError as exc:
        raise OutputError(f"cannot write the plot to {short_path(path)}: {exc.strerror or exc}") from None


@contextlib.contextmanager
def _output() -> Iterator[None]:
    """Around writing to stdout: flush at the end, so that a failure shows here and not at exit, and turn a
    failure other than a closed pipe (text stdout's encoding cannot show included) into :class:`OutputError`."""
    # the command started with its stdout closed (`>&-`): Python gives no stream for it; or a caller of main()
    # closed sys.stdout, whose writes raise ValueError
    if sys.stdout is None or getattr(sys.stdout, "closed", False):
        raise OutputError("cannot write the output: stdout is closed")
    try:
        yield
        sys.stdout.flush()
    except BrokenPipeError:
        raise
    except OSError as exc:
        raise OutputError(f"cannot write the output: {exc.strerror or exc}") from None
    except UnicodeEncodeError as exc:  # a name the locale's encoding has no character for: not bad input
        shown = exc.object[exc.start:exc.end]
        surrogates = [c for c in shown if "\ud800" <= c <= "\udfff"]
        # U+DC80 to U+DCFF, as a byte that decoded to no character reads: the only surrogates surrogateescape writes
        if surrogates and all("\udc80" <= c <= "\udcff" for c in surrogates):
            hint = "a lone surrogate, which no encoding shows; PYTHONIOENCODING=utf-8:surrogateescape writes a byte"
        elif surrogates:  # of no byte (JSON's "\ud800" or "\udfff"), which surrogateescape refuses too
            hint = "a lone surrogate, which no encoding shows; PYTHONIOENCODING=utf-8:backslashreplace escapes it"
        else:
            hint = "use a UTF-8 locale or set PYTHONIOENCODING=utf-8"
        # a code page's codec (cp437, cp1252) names itself "charmap" in its errors: the stream's name says which
        encoding = getattr(sys.stdout, "encoding", None) if exc.encoding == "charmap" else exc.encoding
        if not isinstance(encoding, str):  # a caller's stdout that names none
            encoding = exc.encoding
        why = f"its encoding, {encoding}, cannot show {short_repr(shown)} ({hint})"
        raise OutputError(f"cannot write the output: {why}") from None


_bars: list[Any] = []  # the progress bar being drawn, which a warning wipes first


@contextlib.contextmanager
def _progress_bar() -> Iterator[Any]:
    """The progress bar on stderr (when it is a terminal), wiped if the work stops midway, so that the error or
    ``wsarena: interrupted`` that follows starts a line of its own, and before each warning."""
    from .planner import text_progress

    bar = text_progress()
    _bars.append(bar)
    try:
        yield bar
    finally:
        # wiped before it is let go: a second Ctrl-C that lands in the wipe leaves it among the bars, which
        # _say_interrupted() wipes before its line, where the line was said onto the end of the bar
        bar.clear()
        _bars.remove(bar)


def _refused(args: argparse.Namespace, text: str) -> UsageError:
    """The error of flags the command refuses together, or of a flag's value it refuses once the model is read:
    ``text`` with the help that lists the flags, as argparse's error of a flag ends (``see 'wsarena report
    --help'``)."""
    return UsageError(f"{text} (see 'wsarena {args.command} --help')")


def _model_file(model: str) -> str | None:
    """The file ``model`` names, ``None`` for a zoo name: the loader reads the zoo model then, whatever file of that
    name the working directory holds (an earlier ``--plot resnet50``)."""
    from .models._zoo import zoo_model

    return None if zoo_model(model) is not None else model


def _load(args: argparse.Namespace) -> Any:
    from .models import check_model_named, load_model

    # --input-shape's own errors (an input given twice) first, as they were before --input-shape joined the refusal
    try:
        shapes = input_shapes(args.input_shape)
    except UsageError as exc:
        raise _refused(args, str(exc)) from None
    # The ONNX loader's flags, refused for another model, where --skip-unknown and --asymmetric-pads were taken and
    # did nothing (a zoo model or a layer list has every shape known and its pads symmetric), and --input-shape was
    # refused by load_model() in its words (input_shapes); with the help that lists them, as a flag's error is
    onnx_only = [flag for flag, given in (("--skip-unknown", args.skip_unknown),
                                          ("--asymmetric-pads", args.asymmetric_pads is not None),
                                          ("--input-shape", args.input_shape is not None)) if given]
    if onnx_only and os.path.splitext(args.model)[1].lower() != ".onnx":
        check_model_named(args.model)  # a name's typo first ("did you mean 'resnet50'?"), the user's real problem
        flags = " and ".join([", ".join(onnx_only[:-1]), onnx_only[-1]] if len(onnx_only) > 1 else onnx_only)
        raise _refused(args, f"{flags} {'applies' if len(onnx_only) == 1 else 'apply'} to .onnx models only, not "
                             f"{short_path(args.model)}")
    layers = load_model(
        args.model, skip_unknown=args.skip_unknown, asymmetric_pads=args.asymmetric_pads or "widen",
        input_shapes=shapes,
    )
    if layers:  # none left (--skip-unknown leaving out every conv) is plan()'s to say
        from .planner import check_streams_bound

        # plan()'s check, whose bound (the model's layers) it is, said of the flag as --batch's is, with the help
        # that says the bound: the error named plan()'s streams=, and --streams 1000000000 read as a Python call's
        try:
            check_streams_bound(args.streams, len(layers), prefix="argument --streams: ")
        except ValueError as exc:
            raise _refused(args, str(exc)) from None
    for message in unplanned_batches(args.input_shape, args.batch):
        warnings.warn(message, stacklevel=2)
    return layers


def _report(args: argparse.Namespace) -> int:
    from .planner import plan

    if args.max_slowdown is not None:
        if args.cap_workspace is not _FROM_CONFIG:
            raise _refused(args, "give --cap-workspace or --max-slowdown, not both: --max-slowdown picks the cap")
        if args.search == "heuristic":
            raise _refused(args, "--max-slowdown times every algorithm: it needs --search exhaustive (or no --search)")
    if args.device_properties is not None:  # it plans cuDNN's heuristic choices through the graph API
        if args.backend not in (None, "cudnn"):
            raise _refused(args, f"--device-properties plans for a cuDNN GPU: leave out --backend {args.backend}")
        if args.search == "exhaustive" or args.max_slowdown is not None:
            raise _refused(args, "--device-properties plans without the GPU, which cannot time algorithms: leave out "
                           + ("--search exhaustive" if args.max_slowdown is None else "--max-slowdown"))
        if args.cudnn_api == "legacy":
            raise _refused(args, "--device-properties plans through cuDNN's graph API: leave out --cudnn-api legacy")
    _check_plot(args, {"model file": _model_file(args.model), "--device-properties file": args.device_properties})
    layers = _load(args)
    # --max-slowdown decides the search and the cap, --device-properties the backend, the search and the API, as
    # plan() does: their variables do not matter
    chosen, offline = args.max_slowdown is not None, args.device_properties is not None
    given = _given(algo_search="exhaustive" if chosen else "heuristic" if offline else args.search,
                   backend="cudnn" if offline else args.backend, cap_workspace=None if chosen else args.cap_workspace,
                   cudnn_api="graph" if offline else args.cudnn_api, cudnn_heuristic=args.cudnn_heuristic)
    with config(**given) as cfg, _progress_bar() as bar:  # flags override the environment, which then matters
        exhaustive = cfg.algo_search == "exhaustive"  # only for the rest
        p = plan(
            layers,
            batch=args.batch,
            dtype=args.dtype,
            layout=args.layout,
            passes=args.passes,
            streams=args.streams,
            model=args.model,
            progress=_progress(bar if exhaustive else None),
            max_slowdown=args.max_slowdown,
            device_properties=None if args.device_properties is None else Path(args.device_properties),
        )
        _raise_kept()
    if args.plot is not None:
        from .plot import plot_plan

        with _plot_file(args.plot):
            plot_plan(p, args.plot)
    with _output():
        if args.format == "json":
            json.dump(p.to_dict(), sys.stdout, indent=2)
            sys.stdout.write("\n")
        elif args.format == "csv":
            write_csv(p, sys.stdout)
        else:
            sys.stdout.write(render_table(p))
    return EXIT_OK


def _tune(args: argparse.Namespace) -> int:
    from .tuning import tune

    if args.apply and args.format is not None:
        raise _refused(args, "--apply prints one line, WSARENA_CAP_WORKSPACE=... WSARENA_ALGO_SEARCH=exhaustive; "
                             "leave out --format")
    _check_plot(args, {"model file": _model_file(args.model)})
    layers = _load(args)
    # tune decides the search and the cap (exhaustive, none): their variables do not matter, nor does the
    # backend's when --backend is given
    given = _given(algo_search="exhaustive", backend=args.backend, cap_workspace=None, cudnn_api=args.cudnn_api,
                   cudnn_heuristic=args.cudnn_heuristic)
    with config(**given), _progress_bar() as bar:
        t = tune(layers, batch=args.batch, dtype=args.dtype, layout=args.layout, passes=args.passes,
                 streams=args.streams, backend=args.backend, max_slowdown=args.max_slowdown, model=args.model,
                 progress=_progress(bar))
        _raise_kept()
    if args.plot is not None:
        from .plot import plot_curve

        with _plot_file(args.plot):
            plot_curve(t, args.plot)
    if args.apply and (uncached := uncached_apply()) is not None:
        warnings.warn(uncached, stacklevel=1)
    with _output():
        sys.stdout.write(tune_output(t, "apply" if args.apply else args.format or "table"))
    return EXIT_OK


# What `wsarena cache` reads: an invalid variable of any other setting does not stop it. `clear` needs no limit.
_CACHE_SETTINGS = {"info": ("cache_dir", "search_cache_max_size"), "clear": ("cache_dir",)}


def _cache(args: argparse.Namespace) -> int:
    defaults, read = Config(), _CACHE_SETTINGS[args.action]
    unread = {f.name: getattr(defaults, f.name) for f in dataclasses.fields(Config) if f.name not in read}
    try:
        with config(**unread):
            text = cache_output(args.action, args.format)
    except OSError as exc:  # the folder, not the command, is at fault: a file in its place, or no permission
        _say(f"wsarena: error: cannot {'read' if args.action == 'info' else 'clear'} the search cache: "
             f"{os_error_text(exc)}")
        return EXIT_ENVIRONMENT
    with _output():
        sys.stdout.write(text)
    return EXIT_OK


def _info(args: argparse.Namespace) -> int:
    from .info import collect_info, render_info

    data = collect_info()
    with _output():
        if args.format == "json":
            json.dump(data, sys.stdout, indent=2)
            sys.stdout.write("\n")
        else:
            write_text(sys.stdout, render_info(data))  # read, not parsed: shown on any terminal, escaped
    return EXIT_OK
