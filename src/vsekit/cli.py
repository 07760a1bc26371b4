"""`vse`: one command for training, evaluation, data and search. Each subcommand lives in vsekit.commands."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys

from vsekit.commands import COMMAND_MODULES


class CliError(Exception):
    """An error to print as one clear line, without a traceback."""


LOG_FORMAT = "%(levelname)s %(name)s: %(message)s"


def package_version() -> str:
    """The installed vsekit version, from the package metadata (no torch is imported)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("vsekit")
    except PackageNotFoundError:  # a source tree on sys.path, not installed
        from vsekit import __version__

        return __version__


class _VersionAction(argparse.Action):
    """`--version`: the metadata is read only when asked (it costs ~20 ms of every start-up otherwise)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None) -> None:
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(f"vsekit {package_version()}")
        parser.exit()


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is at the time of the record (pytest's capture, a redirect), and leaves
    out records of loggers that have a handler of their own (the search server's JSON access log)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass

    def format(self, record: logging.LogRecord) -> str:
        """The record as a line the terminal shows and never obeys (`vsekit.utils.printable`: a name from
        elsewhere holding ESC or CR cannot forge or erase a line); the newlines of a message are kept."""
        from vsekit.utils.printable import printable_lines

        return printable_lines(super().format(record))

    def filter(self, record: logging.LogRecord) -> bool:
        owner = logging.getLogger(record.name)
        while owner is not None and self not in owner.handlers:
            if owner.handlers:
                return False
            owner = owner.parent if owner.propagate else None
        return super().filter(record)


_HANDLER: _StderrHandler | None = None


def configure_logging(level: int = logging.INFO, packages: tuple[str, ...] | list[str] = ()) -> None:
    """The CLI's logging, set up once per process (library modules never configure logging): records of `vsekit.*`
    and of the `packages` that give `vse` verbs (vsekit_lab) at `level` and above go to stderr as
    `LEVEL logger: message`. Calling it again only sets the level (and adds packages not seen yet)."""
    global _HANDLER
    if _HANDLER is None:
        _HANDLER = _StderrHandler()
        _HANDLER.setFormatter(logging.Formatter(LOG_FORMAT))
    for name in ("vsekit", *packages):
        root = logging.getLogger(name)
        if _HANDLER not in root.handlers:
            root.addHandler(_HANDLER)
        root.setLevel(level)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vse", description="Visual-semantic embedding toolkit.")
    parser.add_argument("--version", action=_VersionAction, help="print vsekit's version and exit")
    loud = parser.add_mutually_exclusive_group()
    loud.add_argument(
        "-q",
        "--quiet",
        dest="vse_log_level",
        action="store_const",
        const=logging.WARNING,
        help="log warnings and errors only (what a verb prints as its result still prints)",
    )
    loud.add_argument(
        "-v",
        "--verbose",
        dest="vse_log_level",
        action="store_const",
        const=logging.DEBUG,
        help="log debug messages too",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMAND_MODULES:
        module.register(sub)
    from vsekit.commands import embed  # `vse embed` (no torch at import, like every command module)

    embed.register(sub)
    from vsekit.commands.plugins import COMMANDS_GROUP, register_verbs

    register_verbs(
        COMMANDS_GROUP, sub
    )  # `vse demo`, `vse bench …`, `vse experiment …`: vsekit_lab's entry points
    return parser


def debug_enabled() -> bool:
    """`VSE_DEBUG=1` (or true/yes): show full tracebacks instead of one-line errors."""
    return os.environ.get("VSE_DEBUG", "").strip().lower() in ("1", "true", "yes", "on")


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand. Bad input -> one line naming the problem and exit 2; a bug -> one line that says
    so and exit 1; `VSE_DEBUG=1` re-raises both with their full traceback."""
    _ignore_file_size_signal()
    try:
        from vsekit.checks import EXPECTED_ERRORS  # no torch: each command imports what it needs itself
    except KeyboardInterrupt:
        print("vse: interrupted (nothing was started)", file=sys.stderr)
        return 130

    from vsekit.commands.plugins import verb_packages

    packages = verb_packages()
    configure_logging(
        logging.INFO, packages
    )  # before the parser: a verb that cannot be loaded says so in one line
    parser = build_parser()
    from vsekit.commands.argtypes import OptionValueError

    try:
        args = parser.parse_args(argv)
    except OptionValueError as e:  # a numeric option out of range: refused before anything is loaded
        if debug_enabled():
            raise
        print(f"{e.command}: error: {e}", file=sys.stderr)
        return 2
    configure_logging(getattr(args, "vse_log_level", None) or logging.INFO, packages)
    try:
        if getattr(args, "device", None) is not None:  # every verb's --device, before anything is loaded
            from vsekit.errors import check_device_name

            check_device_name(args.device)
        from vsekit.commands import jsonout

        jsonout.prepare(args)
        if jsonout.wants_stdout(
            args
        ):  # --json: the JSON alone on stdout, what the verb prints goes to stderr
            args._json_stream = sys.stdout
            with contextlib.redirect_stdout(sys.stderr):
                result = args.func(args)
        else:
            result = args.func(args)
        sys.stdout.flush()  # a reader that went away (`| head -1`) shows here, not at interpreter exit
    except BrokenPipeError:
        return _stdout_closed()
    except (*EXPECTED_ERRORS, FloatingPointError, CliError) as e:
        if debug_enabled():
            raise
        from vsekit.utils.printable import printable_lines

        print(f"vse {args.command}: error: {printable_lines(e)}", file=sys.stderr)
        return 2
    except MemoryError as e:  # and torch's OutOfMemoryError (a RuntimeError): a resource limit, not a bug
        return _out_of_memory(args, e)
    except KeyboardInterrupt as e:
        if debug_enabled():
            raise
        hint = str(e)  # a command may say what to run next (vse train: how to resume or restart)
        print(f"vse {args.command}: interrupted{'; ' + hint if hint else ''}", file=sys.stderr)
        return 130
    except Exception as e:
        if debug_enabled():
            raise
        if isinstance(e, (OSError, RuntimeError)) and (storage := _storage_full(e)):
            from vsekit.utils.printable import printable_lines

            print(f"vse {args.command}: error: {printable_lines(storage)}", file=sys.stderr)
            return 2
        if type(e).__name__ == "OutOfMemoryError":  # torch.OutOfMemoryError, without importing torch here
            return _out_of_memory(args, e)
        print(
            f"vse {args.command}: internal error ({type(e).__name__}: {e}); this is a bug in vsekit: "
            "rerun with VSE_DEBUG=1 for the full traceback and report it",
            file=sys.stderr,
        )
        return 1
    return int(result or 0)


def _ignore_file_size_signal() -> None:
    """A file-size limit (`ulimit -f`) makes the kernel send SIGXFSZ, which kills the process outright by
    default; ignored, the write fails with EFBIG instead and is reported like a full disk (one line, exit 2,
    the previous files kept)."""
    import signal

    if hasattr(signal, "SIGXFSZ"):
        with contextlib.suppress(ValueError, OSError):  # not the main thread (an embedding host): leave it
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


def _storage_full(e: BaseException) -> str | None:
    """One line for a write stopped by a full disk, quota or file-size limit that no command named a file
    for (`vsekit.utils.io.storage_full_errno`): the file the OS names, else the working folder's free space."""
    from vsekit.utils.io import STORAGE_FULL_ERRNOS, free_space_text, storage_full_errno, storage_full_error

    number = storage_full_errno(e)
    if number is None:
        return None
    if getattr(e, "filename", None):
        return str(storage_full_error(e.filename, e))
    hint = STORAGE_FULL_ERRNOS[number]
    why = os.strerror(number) + (f": {hint}" if hint else "")
    return f"a write failed: {why} ({free_space_text(os.getcwd())})"


def _stdout_closed() -> int:
    """The reader of stdout went away (`vse recipes NAME | head -1`): stop quietly, as the Python docs' "Note on
    SIGPIPE" says: stdout now goes to devnull, so the interpreter's last flush cannot fail again; exit 1."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # a stdout without a file descriptor (captured in tests)
        pass
    return 1


def _out_of_memory(args: argparse.Namespace, e: BaseException) -> int:
    if debug_enabled():
        raise e
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    # advice names only the options this command has (argparse sets every option's attribute)
    tips = [
        tip
        for dest, tip in (
            ("batch_size", "a smaller --batch-size"),
            ("image_size", "a smaller --image-size"),
            ("device", "another --device"),
        )
        if hasattr(args, dest)
    ]
    advice = "try " + " or ".join(tips) if tips else "free some memory or use a machine with more"
    print(f"vse {args.command}: error: out of memory ({first}); {advice}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
