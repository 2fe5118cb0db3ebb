"""The ``wsarena`` command's arguments: the parser of ``report``, ``tune``, ``cache`` and ``info``, the checks of
their values, and :class:`UsageError`, what :mod:`wsarena.cli` makes an exit 2 of."""

from __future__ import annotations

import argparse
import ast
import itertools
import re
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from . import __version__
from ._config import _FROM_CONFIG, _SIZE_MAX, CUDNN_HEURISTICS, _parse_cap
from ._geometry import DTYPES
from ._pass import PASSES
from ._report_cli import shape_text
from ._sizes import ascii_int as _int
from ._sizes import positive_batch, short_repr, write_text
from ._tune_cli import max_slowdown_arg

__all__: list[str] = []  # wsarena.cli's own


class UsageError(Exception):
    """Bad usage or bad input: exit 2 with one line."""


class _CommandError(UsageError):
    """The error of a command's parser (``report``'s, ``tune``'s): the top parser says it after the arguments before
    the command that it does not take, if any (:meth:`_Parser.parse_args`)."""


class OutputError(Exception):
    """Writing the output failed (a full disk, a closed terminal): the environment, exit 3 with one line."""


_AMBIGUOUS = re.compile(r"(ambiguous option: )(.*)( could match -[^ ]*(?:, -[^ ]*)*)", re.DOTALL)
_AFTER_COMMAND = "_wsarena_after_command"  # a command's leftovers, on its namespace (_Parser.parse_known_args)
_IGNORED = re.compile(r"(argument [^ ]+: ignored explicit argument )('.*'|\".*\")", re.DOTALL)


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._commands: Any = None  # the subcommands, on the top parser (add_subparsers)
        self._given: list[str] = []  # the arguments parse_args() was given, for a command's invalid choice to read
        # What starts as a negative number (-2%, -2e-2, -inf, -nan) is a value, for its flag's check to say what is
        # wrong with it, not an unknown option that leaves the flag "expected one argument": argparse before Python
        # 3.14 takes only a plain number (-2, -0.5) so; 3.14's own matcher takes what starts with a digit. No flag
        # of wsarena's starts with a digit, "inf" or "nan".
        self._negative_number_matcher = re.compile(r"-(\.?[0-9]|inf|nan)", re.IGNORECASE)

    def add_subparsers(self, **kwargs: Any) -> Any:
        self._commands = super().add_subparsers(**kwargs)
        return self._commands

    def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
        parsed, extras = super().parse_known_args(args, namespace)
        if self._commands is None:
            # a command's parser: its leftovers, which argparse adds to the top parser's (those before the command)
            # in one list, kept apart for parse_args() to say which help lists the options of each position
            setattr(parsed, _AFTER_COMMAND, list(extras))
        return parsed, extras

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        # A flag's choice in any case (--backend CPU, --layout nhwc), as the variables take theirs (WSARENA_BACKEND=
        # CPU), where argparse refused it; --help still lists the choices as they are
        if kwargs.get("choices") is not None and "type" not in kwargs and args and args[0].startswith("-"):
            kwargs["type"] = _any_case(tuple(kwargs["choices"]))
        return super().add_argument(*args, **kwargs)

    def error(self, message: str) -> NoReturn:  # one line, not usage + error
        # argparse's messages that quote an argument whole, the argument shortened: a 100 kB --cud=... gave a 100 kB
        # "ambiguous option" line, a 100 kB --apply=... a 100 kB "ignored explicit argument" (quoted with repr)
        if match := _AMBIGUOUS.fullmatch(message):
            message = f"{match[1]}{short_repr(match[2])[1:-1]}{match[3]}"
        elif match := _IGNORED.fullmatch(message):
            message = f"{match[1]}{short_repr(ast.literal_eval(match[2]))}"
        # a command's parser's error is said after the arguments before the command, if any (parse_args)
        raise (UsageError if self._commands is not None else _CommandError)(f"{message} (see '{self.prog} --help')")

    def _print_message(self, message: str, file: Any = None) -> None:
        # --help and --version: written and flushed here, so that a write that fails ends them as it ends the other
        # commands' output, where argparse dropped the text and exited 0: a reader gone (`| head -0`) as
        # BrokenPipeError, exit 141, another failure (a full disk) as OutputError, exit 3. A closed stdout is output
        # that cannot be written too, as the commands' (exit 3), where argparse wrote the text to stderr instead
        # (`>&-`: Python's sys.stdout is None, which argparse is given) or nothing (a caller of main() closed it).
        # What the stream's encoding cannot show is escaped, not the whole text lost (write_text)
        if not message:
            return
        if file is sys.stdout and (file is None or getattr(file, "closed", False)):
            raise OutputError("cannot write the output: stdout is closed")
        stream = file or sys.stderr
        try:
            write_text(stream, message)
            stream.flush()
        except (AttributeError, ValueError):
            pass
        except BrokenPipeError:
            raise
        except OSError as exc:
            raise OutputError(f"cannot write the output: {exc.strerror or exc}") from None

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        # argparse's own check, but the value quoted shortened: a 100 kB --dtype gave a 100 kB line
        if action.choices is not None and value not in action.choices:
            choices = ", ".join(map(repr, action.choices))
            # the command's: where it is the value of an option of the command's given before it (--batch 4 report),
            # said to go after it, as one with its value joined is (--batch=4 report)
            hint = self._value_taken_for_the_command(value) if action is self._commands else ""
            raise argparse.ArgumentError(action, f"invalid choice: {short_repr(value)} (choose from {choices}){hint}")

    def parse_args(self, args: Any = None, namespace: Any = None) -> Any:
        """As argparse's, but arguments left over are named shortened, with the help that lists the options of
        their position: the subcommand's for those after it, which argparse leaves to the top parser ("unrecognized
        arguments: ... (see 'wsarena --help')"), the top parser's for those before it; and no command given is said
        with the commands, after any arguments left over."""
        self._given = list(sys.argv[1:] if args is None else args)
        self._refuse_ending_before_the_command()
        try:
            parsed, extras = self.parse_known_args(self._given, namespace)
        except _CommandError as exc:
            # The command's error (its model missing, a value refused) was all that was said, where the arguments
            # before the command, none of them taken there (--bogus report), were never named: argparse says its
            # leftovers only once the command's parser is done
            before = list(itertools.takewhile(lambda arg: arg.startswith("-") and arg != "-", self._given))
            if not before or len(before) == len(self._given) or self._given[len(before)] not in self._commands.choices:
                raise
            raise self._before_error(before, self._given[len(before)], str(exc)) from None
        after = vars(parsed).pop(_AFTER_COMMAND, [])
        if getattr(parsed, "command", ...) is None:  # the top parser, whose command is optional so that this says
            # what was wrong: argparse's "the following arguments are required: command" was all that `wsarena -v`
            # or `wsarena --bogus` gave, the option given not named, nor the commands
            commands = list(next(a for a in self._actions if a.dest == "command").choices or ())
            expected = f"a command is required: {', '.join(commands[:-1])} or {commands[-1]} (see '{self.prog} --help')"
            if extras:
                raise UsageError(f"unrecognized arguments: {short_repr(' '.join(extras))[1:-1]}; {expected}")
            raise UsageError(expected)
        # What is left before the command is none of the top parser's options (--help, --version), which its help
        # lists, where the command's help was named, whose options are not taken there
        before, command = extras[:len(extras) - len(after)], getattr(parsed, "command", None)
        prog = self.prog if command is None else f"{self.prog} {command}"
        others = self._taken_by_others(command, after)
        after_said = f"{short_repr(' '.join(after))[1:-1]} (see '{prog} --help'){others}" if after else None
        if before:
            raise self._before_error(before, command, after_said)
        if after_said is not None:
            raise UsageError(f"unrecognized arguments: {after_said}")
        return parsed

    def _before_error(self, before: list[str], command: str | None, after: str | None) -> UsageError:
        """The error of the arguments ``before`` the command, which the top parser does not take, and of what is
        wrong ``after`` it, if anything (arguments left over, or the command's own error): each with the help that
        lists the options of its position."""
        rest = f", and after it: {after}" if after is not None else ""
        said = f"{short_repr(' '.join(before))[1:-1]} (see '{self.prog} --help')"
        return UsageError(f"unrecognized arguments before the command: {said}{rest}{self._go_after(command, before)}")

    def _taken_by_others(self, command: str | None, after: list[str]) -> str:
        """What to add to the error of arguments left ``after`` the command that are options of other commands' (tune's
        --apply given to report, report's --search to tune), or their abbreviations: which command takes each, where
        "unrecognized arguments" read as an option no command has."""
        if self._commands is None or command is None:
            return ""
        owners: dict[str, list[str]] = {}  # each option left over, full name, -> the other commands that take it
        for arg in after:
            if arg.startswith("-") and arg != "-":
                for other in self._commands.choices:
                    option = self._command_option(other, arg) if other != command else None
                    # each command once, where the option is given twice, or by its name and an abbreviation
                    if option is not None and other not in owners.setdefault(option, []):
                        owners[option].append(other)
        by_commands: dict[tuple[str, ...], list[str]] = {}
        for option, others in owners.items():
            by_commands.setdefault(tuple(others), []).append(option)
        return "".join(f"; {' and '.join(others)} take{'s' if len(others) == 1 else ''} {' and '.join(options)}"
                       for others, options in by_commands.items())

    def _refuse_ending_before_the_command(self) -> None:
        """Refuse a ``--`` before the command, which ends the options of none: argparse took it for the command
        (invalid choice: '--'), where a newer argparse (3.13's) drops it and takes the options after the command as
        options all the same, so that it is refused alike on each Python. After the command it ends the command's
        options (``wsarena report -- -model.onnx``)."""
        for at, arg in enumerate(self._given):
            if self._own_option(arg):  # --help or --version, which argparse answers first (wsarena --help --)
                return
            if arg == "--":
                named = self._given[at + 1] if at + 1 < len(self._given) else None
                if named in ("report", "tune") or self._commands is None or named not in self._commands.choices:
                    command = named if named in ("report", "tune") else "report"
                    raise UsageError(f"'--' goes after the command, where it ends the command's options: wsarena "
                                     f"{command} -- MODEL (see '{self.prog} --help')")
                # cache and info take no model, which a '--' would let begin with a dash: none is needed
                raise UsageError(f"'--' goes after the command, where it ends the command's options; {named} takes "
                                 f"no model: leave the '--' out (see '{self.prog} {named} --help')")
            if not arg.startswith("-") or arg == "-":  # the command, or a word taken for it
                return

    def _own_option(self, arg: str) -> bool:
        """Whether ``arg`` is one of this parser's own options, or an abbreviation of one (``--vers``)."""
        flag = arg.partition("=")[0]
        return flag in self._option_string_actions or (
            self.allow_abbrev and flag.startswith("--") and len(flag) > 2
            and any(option.startswith(flag) for option in self._option_string_actions))

    def _go_after(self, command: str | None, before: list[str]) -> str:
        """What to add to the error of arguments ``before`` the command that are options of ``command``'s (--batch=4
        report), or their abbreviations (--bat=4), which the command takes after it: that they go there."""
        theirs = list(dict.fromkeys(filter(None, (self._command_option(command, arg) for arg in before))))
        # the command named, not "it": after an invalid choice, "it" read as the value taken for the command
        return f"; {command}'s own options ({', '.join(theirs)}) go after {command!r}" if theirs else ""

    def _value_taken_for_the_command(self, value: str) -> str:
        """:meth:`_go_after` of the arguments before the first command given after ``value``, the invalid command,
        where an option of that command's is given just before ``value``: ``--batch 4 report`` has 4 taken for the
        command, --batch being none of the top parser's options. A word that follows no such option (``reprot vgg16
        --format json --plot info``) is a command mistyped, and the command a later word names (a file's, there) is
        not the one meant: nothing is added."""
        if value not in self._given:
            return ""
        at = self._given.index(value)
        end = next((i for i, arg in enumerate(self._given[at + 1:], at + 1) if arg in self._commands.choices), None)
        if end is None or at == 0 or self._command_option(self._given[end], self._given[at - 1]) is None:
            return ""
        return self._go_after(self._given[end], self._given[:end])

    def _command_option(self, command: str | None, arg: str) -> str | None:
        """The option of ``command``'s that ``arg`` (``--batch=4``, ``--bat``) names, as the command's parser reads
        it after the command (an abbreviation that only one of its long options starts with), else ``None``."""
        if self._commands is None or command is None:
            return None
        known = self._commands.choices[command]
        flag = arg.partition("=")[0]
        if flag in known._option_string_actions:
            return flag
        if not (known.allow_abbrev and flag.startswith("--") and len(flag) > 2):
            return None
        matches = [option for option in known._option_string_actions if option.startswith(flag)]
        return matches[0] if len(matches) == 1 else None


def _any_case(choices: tuple[str, ...]) -> Callable[[str], str]:
    """The ``type`` of a flag of ``choices`` that takes each in any case: the choice ``text`` is, in its own case, or
    ``text`` as given, for the choices' check to quote."""
    by_case = {choice.lower(): choice for choice in choices}

    def choice(text: str) -> str:
        return by_case.get(text.lower(), text)

    return choice


def _size(text: str) -> int | None:
    # An empty variable means the default; an empty flag (--cap-workspace "$CAP", CAP unset) means nothing, and
    # read as "none" it would drop the variable's cap unseen
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a size or none, not {short_repr(text)}")
    try:
        n = _parse_cap(text)  # what WSARENA_CAP_WORKSPACE and configure() take, "none" included
    except (TypeError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if n is not None and n > _SIZE_MAX:  # as configure() refuses it
        raise argparse.ArgumentTypeError(f"more than 2**64 - 1 bytes (none for no limit): {short_repr(text)}")
    return n


_PASS = _any_case(PASSES)  # each pass in any case, as a flag's choice is (FWD,Bwd_Data)


def _passes(text: str) -> tuple[str, ...]:
    # the message without the flag, which argparse names before it ("argument --passes: --passes takes ...")
    names = tuple(_PASS(p.strip()) for p in text.split(",") if p.strip())
    bad = [p for p in names if p not in PASSES]
    if bad or not names or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"expected distinct names from {','.join(PASSES)}, not {short_repr(text)}")
    return names


def _positive(text: str) -> int:
    try:
        value = _int(text)
    except ValueError:
        # "+4" is an integer, which was said not to be one: written without a sign, as a size is
        unsigned = text.strip().removeprefix("+")
        if unsigned != text.strip() and re.fullmatch(r"[0-9]+", unsigned):
            if not unsigned.strip("0"):  # "write 0" would name a count refused in turn
                raise argparse.ArgumentTypeError(f"must be >= 1, not {short_repr(text)}") from None
            raise argparse.ArgumentTypeError(f"a count is written without a sign: {short_repr(text)} "
                                             f"(write {short_repr(unsigned)[1:-1]})") from None
        raise argparse.ArgumentTypeError(f"not an integer: {short_repr(text)}") from None
    except OverflowError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, not {short_repr(value)}")
    return value


def _batch(text: str) -> int:
    # A batch above what the geometry takes was refused as a layer's input_shape, the flag not named: plan()'s
    # check, whose bound it is, said of the flag, which argparse names before the message
    value = _positive(text)
    try:
        return positive_batch(value, prefix="")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _file_name(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError(f"expected a file name, not {short_repr(text)}")
    return text


def _plot_file_name(text: str) -> str:
    # "-" is stdout for many a command, but stdout takes this one's output (the table, the JSON), and a PNG there
    # is binary on a terminal: it was written to a file named "-", which read as nothing written
    if text.strip() == "-":
        raise argparse.ArgumentTypeError(f"expected a file name, not {short_repr(text)}: the PNG is not written to "
                                         "stdout, which takes the output (./- names a file '-')")
    return _file_name(text)


def _input_shape(text: str) -> tuple[str | None, tuple[int, ...]]:
    """``[NAME=]D0,D1,...`` (``x`` separates dims too: ``1x3x800x800``) -> (name or None, dims)."""
    name, equals, dims = text.rpartition("=")
    try:
        shape = tuple(_int(d) for d in dims.replace("x", ",").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected [NAME=]D0,D1,... with integer dims, not {short_repr(text)}"
        ) from None
    except OverflowError as exc:
        raise argparse.ArgumentTypeError(f"{exc}: {short_repr(text)}") from None
    if equals and not name.strip():
        raise argparse.ArgumentTypeError(
            f"no input name before '=' in {short_repr(text)}: write NAME=DIMS, or DIMS alone"
        )
    return name.strip() or None, shape


def input_shapes(given: list[tuple[str | None, tuple[int, ...]]] | None) -> Any:
    """What ``load_model(input_shapes=...)`` takes: one shape, or ``{name: shape}``."""
    if not given:
        return None
    if len(given) == 1 and given[0][0] is None:
        return given[0][1]
    if any(name is None for name, _ in given):
        raise UsageError("with several --input-shape options, name each input: --input-shape NAME=DIMS")
    shapes: dict[str, tuple[int, ...]] = {}
    for name, shape in given:
        assert name is not None  # checked just above
        if name in shapes:
            twice = f"{_dims(shapes[name])} and {_dims(shape)}"
            raise UsageError(f"--input-shape given twice for input {short_repr(name)}: {twice}")
        shapes[name] = shape
    return shapes


def _dims(shape: tuple[int, ...]) -> str:
    """``1x3x224x224``, its middle cut to ``...`` where it is long, as :func:`short_repr` cuts a value."""
    return short_repr(shape_text(shape))[1:-1]


def unplanned_batches(given: list[tuple[str | None, tuple[int, ...]]] | None, batch: int) -> list[str]:
    """What to warn of the ``--input-shape`` options whose batch (the first of three or more dims, as the loader
    reads it) is neither 1 nor ``batch``: the loader plans every layer at batch 1 and the planner at ``--batch``,
    so ``--input-shape 8,3,224,224`` alone plans batch 1."""
    return [
        f"--input-shape {'' if name is None else f'{short_repr(name)[1:-1]}='}{_dims(shape)} has batch "
        f"{short_repr(shape[0])}: the plan is for --batch {batch} (the batch comes from --batch)"
        for name, shape in given or ()
        if len(shape) >= 3 and shape[0] not in (1, batch)
    ]


def _model_flags(parser: argparse.ArgumentParser) -> None:
    """The flags ``report`` and ``tune`` share: the model, how to read it, and the run to plan."""
    parser.add_argument("model", help="zoo name (resnet50, vgg16, ...), a .onnx file or a .json layer list")
    parser.add_argument("--batch", type=_batch, default=1, help="batch size (default 1)")
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="default float32")
    parser.add_argument("--layout", choices=("NCHW", "NHWC"), default="NCHW", help="default NCHW")
    parser.add_argument("--passes", type=_passes, default=PASSES,
                        help=f"comma-separated, of {','.join(PASSES)} (default: all three)")
    parser.add_argument("--streams", type=_positive, default=1,
                        help="concurrent streams, each may run any layer; at most the model's layers (default 1)")
    parser.add_argument(
        "--backend", choices=("auto", "cudnn", "cpu"), default=None, help="default: WSARENA_BACKEND or auto"
    )
    parser.add_argument("--cudnn-api", choices=("graph", "legacy"), help="default: WSARENA_CUDNN_API or graph")
    parser.add_argument("--cudnn-heuristic", choices=CUDNN_HEURISTICS,
                        help="cuDNN's heuristic that ranks the graph API's engines (default: WSARENA_CUDNN_HEURISTIC "
                             "or instant)")
    parser.add_argument("--skip-unknown", action="store_true",
                        help="leave out, with a warning, the ONNX convs that cannot be planned (a shape unknown, "
                             "an empty conv, operands of a type the operator refuses, asymmetric pads under "
                             "--asymmetric-pads error)")
    parser.add_argument(
        "--asymmetric-pads", choices=("widen", "error"), default=None,  # None: not given (widen), for cli._load
        help="ONNX convs with asymmetric pads: model them as onnxruntime's CUDA provider runs them (widen, the "
        "default) or treat them as unknown (error)",
    )
    parser.add_argument(
        "--input-shape", type=_input_shape, action="append", metavar="[NAME=]DIMS",
        help="fix an ONNX input's shape (1,3,800,800 or images=1x3x800x800); repeat the flag, one NAME=DIMS each, "
        "for several inputs",
    )


def parser() -> _Parser:
    """The parser of the ``wsarena`` command and its subcommands."""
    command = _Parser(prog="wsarena", description="Shared, capped cuDNN convolution workspace.")
    command.add_argument("--version", action="version", version=f"wsarena {__version__}")
    sub = command.add_subparsers(dest="command", parser_class=_Parser)  # required: parse_args()

    report = sub.add_parser(
        "report", help="workspace each layer needs, shared vs unshared",
        description="The algorithm and workspace each convolution layer takes per pass, and the arena wsarena holds "
        "(per stream, the largest workspace) against one workspace per layer and pass.",
    )
    _model_flags(report)
    report.add_argument(
        "--cap-workspace", type=_size, default=_FROM_CONFIG, metavar="SIZE",
        help="cap on one call's workspace, e.g. 256MiB or none (default: WSARENA_CAP_WORKSPACE, else none)",
    )
    report.add_argument(
        "--search", choices=("heuristic", "exhaustive"), default=None, help="default: WSARENA_ALGO_SEARCH or heuristic"
    )
    report.add_argument(
        "--max-slowdown", type=max_slowdown_arg, default=None, metavar="PCT",
        help="pick the cap instead: the smallest whose step is at most this much slower than uncapped (2%%, or "
        "0.02: without %%, a fraction below 1); times every algorithm",
    )
    report.add_argument("--device-properties", type=_file_name, metavar="FILE", help="plan for the GPU whose "
                        "cuDNN device properties (JSON) FILE holds, without one (cuDNN 9.8+, its graph API)")
    report.add_argument("--format", choices=("table", "json", "csv"), default="table", help="default table")
    report.add_argument(
        "--plot", type=_plot_file_name, metavar="FILE.png",
        help="draw per-layer workspace and the arena (needs wsarena[plot])",
    )

    tune = sub.add_parser(
        "tune", help="step time against the workspace cap, and the cap to pick",
        description="Time every algorithm of every layer and pass once (kept in the search cache), print the step "
        "time and arena under each cap that changes a choice, and recommend the smallest cap within --max-slowdown. "
        "Tune at the batch, dtype and layout the job runs: under the settings --apply prints, its calls then run "
        "as timed here, under the cap picked for them.",
    )
    _model_flags(tune)
    tune.add_argument(
        "--max-slowdown", type=max_slowdown_arg, default=0.02, metavar="PCT",
        help="the slowdown against no cap the recommended cap may cost (default 2%%; 0.02 is the same: without "
        "%%, a fraction below 1)",
    )
    tune.add_argument("--format", choices=("table", "json", "csv"), default=None, help="default: table")
    tune.add_argument("--plot", type=_plot_file_name, metavar="FILE.png", help="draw the curve (needs wsarena[plot])")
    tune.add_argument("--apply", action="store_true", help="print only the settings that run the tuned choices: "
                      "WSARENA_CAP_WORKSPACE=<recommended cap> WSARENA_ALGO_SEARCH=exhaustive, for "
                      "export $(wsarena tune MODEL --apply)")

    cache = sub.add_parser(
        "cache", help="the persistent search cache: its entries, or empty it",
        description="The search cache, where exhaustive searches keep each candidate's time and workspace: info "
        "shows its folder and the setting that folder comes from, its entries per device, wsarena version and cuDNN "
        "API, their size on disk and its limit, and the files that are no readable entry; clear removes the entries "
        "and those unreadable files, nothing else.",
    )
    cache.add_argument("action", choices=("info", "clear"), help="info: the folder (WSARENA_CACHE_DIR, else the user "
                       "cache folder), its entries, their size on disk and its limit; clear: remove the entries and "
                       "the unreadable files")
    cache.add_argument("--format", choices=("text", "json"), default="text", help="default text")

    what = ("versions (PyTorch's too), library paths, devices, the backend 'auto' picks, and the settings in force "
            "with where each comes from")
    info = sub.add_parser(
        "info", help=what,
        description=f"What wsarena found here: {what} (an invalid variable with its error), and each WSARENA_* "
        "variable of the environment that the package does not read, naming the setting's variable closest to it, "
        "if any.",
    )
    info.add_argument("--format", choices=("text", "json"), default="text", help="default text")
    return command
