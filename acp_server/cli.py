"""The ``acp-server`` command line.

Exit codes: 0 clean exit, 1 a runtime failure (port in use, a live Unix socket), 2 a bad command line
(the message names the flag and what it accepts, under the subcommand's own usage).
"""

from __future__ import annotations

import argparse
import gc
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from . import __version__, cluster_cli
from .cli_flags import POLICY_FLAGS, add_serve_arguments, parse_listen
from .lazy import lazy_exports

if TYPE_CHECKING:
    from .cli_config import backends_from, http_from, metrics_from, policy_from, server_config

__all__ = [
    "GC_THRESHOLD",
    "POLICY_FLAGS",
    "backends_from",
    "build_parser",
    "http_from",
    "main",
    "metrics_from",
    "parse_listen",
    "policy_from",
    "server_config",
    "tune_gc",
    "tune_scheduler",
]

#: Names this module re-exports from modules that load trio and the server: imported on first use
#: (PEP 562), so that building the parser (``--help``, ``--version``, a usage error) imports neither.
_LAZY = {
    "backends_from": ".cli_config",
    "http_from": ".cli_config",
    "metrics_from": ".cli_config",
    "policy_from": ".cli_config",
    "server_config": ".cli_config",
    "serve": ".server",
}


__getattr__, __dir__ = lazy_exports(globals(), _LAZY)


def build_parser() -> argparse.ArgumentParser:
    """The whole command line."""
    return _build()[0]


def _build(command: str | None = None) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The parser and its ``serve`` subparser; with ``command="serve"``, the other commands are left out.

    A command line that starts with ``serve`` is parsed by the ``serve`` subparser alone (argparse hands
    it everything after the command), so its answers, usage and errors are the same without the other
    commands; building them was ~13M instructions (~2 ms) of every ``serve`` start-up.
    """
    parser = argparse.ArgumentParser(prog="acp-server", description="A gateway for the Agent Client Protocol.")
    parser.add_argument("--version", action="version", version=f"acp-server {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    s = sub.add_parser("serve", help="serve ACP over stdio, TCP and Unix sockets", description="Serve ACP clients.")
    add_serve_arguments(s)
    if command == "serve":
        return parser, s
    from .auth import cli as auth_cli  # the other commands' flags, with their modules
    from .client import cli_flags as client_flags

    client_flags.add_commands(sub)  # prompt, sessions: after serve, which --help lists first
    auth_cli.add_commands(sub)  # token
    cluster_cli.add_commands(sub)
    c = sub.add_parser(
        "connect",
        help="relay stdio to a running acp-server (for editors that spawn their agent)",
        description="Relay stdin/stdout to a running acp-server, byte for byte, until it closes the connection "
        "(with --token, an authenticate is sent after the client's initialize and its answer kept back).",
    )
    c.add_argument(
        "url",
        metavar="URL",
        help="tcp://HOST:PORT, tls://HOST:PORT, unix:/path, http(s)://HOST:PORT/acp or ws(s)://HOST:PORT/acp of a running acp-server",
    )
    auth_cli.add_connect_flags(c)
    d = sub.add_parser(
        "doctor",
        help="check what `serve` with these flags needs: the state directory, agent commands, ports",
        description="Check the setup `acp-server serve` would use with the same flags (state directory and "
        "who holds it, the configured agents' commands, the listeners' ports) and say what to do about each "
        "problem. Exit 0 when all is well, 1 when a check failed.",
    )
    add_serve_arguments(d)
    return parser, s


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse, naming a stray flag under its subcommand's own usage (``serve --bogus`` shows serve's)."""
    args, extras = parser.parse_known_args(argv)
    if extras:
        _subparser(parser, args.command).error(f"unrecognized arguments: {' '.join(extras)}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``acp-server`` with ``argv`` (default ``sys.argv[1:]``); returns the exit code.

    Each command imports what it runs only once it is chosen: parsing loads no trio.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    parser, serve_parser = _build(argv[0] if argv else None)
    args = _parse(parser, argv)
    if args.command == "serve":
        return _serve(args, serve_parser)
    from .auth import cli as auth_cli
    from .client import cli_flags as client_flags

    if args.command in client_flags.COMMANDS:
        from .client import cli as client_cli

        return client_cli.run(args)
    if args.command in auth_cli.COMMANDS:
        return auth_cli.run(args)
    if args.command == "connect":
        return _connect(args.url, args.token, args.ca_file)
    if args.command == "cluster":
        return cluster_cli.run(args)
    if args.command == "doctor":
        from .cli_config import server_config
        from .doctor import run_doctor  # only the doctor needs it

        doctor_parser = _subparser(parser, "doctor")
        return run_doctor(server_config(args, doctor_parser), args)
    return _serve(args, serve_parser)


def _serve(args: argparse.Namespace, serve_parser: argparse.ArgumentParser) -> int:
    """``acp-server serve``: trio, the server and what the flags ask for load here."""
    import logging
    import pathlib

    import trio

    from .cli_config import server_config

    serve = globals().get("serve") or __getattr__("serve")  # the server's, or a probe's put here as cli.serve
    logging.basicConfig(
        level=getattr(logging, args.log_level.upper()),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    config = server_config(args, serve_parser)
    if config.state_dir is not None and args.state_dir is None:
        from .statedir import adopt_legacy  # the store loads only when a state directory is used

        moved = adopt_legacy(pathlib.Path(config.state_dir))
        if moved is not None:
            print(f"acp-server: {moved}", file=sys.stderr, flush=True)
    tune_gc()
    tune_scheduler()
    try:
        trio.run(serve, config)
    except KeyboardInterrupt:
        return 0
    except Exception as exc:
        failure = _os_error(exc)
        if failure is None:
            raise
        print(f"acp-server: {failure.strerror or failure}", file=sys.stderr)
        return 1
    return 0


def _subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sub: argparse.ArgumentParser = subparsers.choices.get(name, parser)
    return sub


#: Allocations between young-generation collections for a serving process (CPython's default is 700).
GC_THRESHOLD = (50_000, 20, 20)


def tune_gc() -> None:
    """Collect garbage less often in a serving process.

    With CPython's defaults a loaded server collected every few prompts, and its full collections walk
    every live session's history: 21-26% of server CPU in the pipelined echo benchmark, with full
    collections of 60-80 ms each. Objects made at start-up are frozen out of collection, and the young
    generation is collected every 50,000 allocations instead of every 700.
    """
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLD)


def tune_scheduler() -> None:
    """Have trio run the tasks that became runnable together in the order they became runnable.

    trio takes each batch of runnable tasks from its end, reversed first at random (one draw of the
    ``random.Random`` of ``trio._core._run`` per batch) so that no program comes to rely on an order.
    For a server that coin decides whose answer leaves first: with 8 sessions whose prompts came in one
    read, the session answered first in one pass was answered last in the next half the time, and a
    client that handles answers in the order they arrive (the official SDK's) saw that session's
    prompt wait for 7 others' handling, or for none: the slowest 1% of its prompts took twice the
    median. A draw that always reverses makes every batch first-come, first-served, as asyncio runs
    its callbacks. The draw is ``float``, whose call with no argument is ``0.0`` (below 0.5: reverse),
    made in C, with no Python frame per pass. Without that generator (another trio), trio's order stays.
    """
    import random

    scheduler = sys.modules.get("trio._core._run")
    draw = getattr(scheduler, "_r", None)
    if isinstance(draw, random.Random):
        draw.random = float  # type: ignore[method-assign]
    _two_argument_min_max()


def _min2(a: Any, b: Any, /) -> Any:
    """``min(a, b)``: the first of the smallest (the builtin's comparison, ``b < a``)."""
    return b if b < a else a


def _max2(a: Any, b: Any, /) -> Any:
    """``max(a, b)``: the first of the largest (the builtin's comparison, ``b > a``)."""
    return b if b > a else a


#: trio's modules whose ``min``/``max`` calls run at every scheduling pass, each with two arguments
_MIN_MAX_MODULES = ("trio._core._run", "trio._core._io_epoll")


def _two_argument_min_max() -> None:
    """Give trio's run loop and its epoll manager a ``min`` and a ``max`` of two arguments in Python.

    Every scheduling pass calls ``min(max(0, timeout), _MAX_TIMEOUT)`` and ``max(1, len(registered))``:
    the builtins parse their arguments as an iterable with keywords, ~800 instructions a call on this
    CPython, where a two-argument Python function takes about a third. The names are module globals
    that shadow the builtins in those modules only, and give what the builtins give (the same
    comparison, the first argument on a tie). Only where trio calls them with two positional arguments
    alone (read from the modules' code); otherwise, or without those modules, the builtins stay.
    """
    import dis

    for name in _MIN_MAX_MODULES:
        module = sys.modules.get(name)
        if module is None or "min" in vars(module) or "max" in vars(module):
            continue
        if all(_called_with_two(code, dis) for code in _codes(module)):
            module.min = _min2  # type: ignore[attr-defined]
            module.max = _max2  # type: ignore[attr-defined]


def _codes(module: Any) -> list[Any]:
    """The code objects of ``module``'s functions and methods (nested ones included)."""
    import types

    out: list[Any] = []
    seen: set[int] = set()

    def add(code: types.CodeType) -> None:
        if id(code) in seen:
            return
        seen.add(id(code))
        out.append(code)
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                add(const)

    for value in list(vars(module).values()):
        members = list(vars(value).values()) if isinstance(value, type) else []
        members += [getattr(m, part) for m in members if isinstance(m, property) for part in ("fget", "fset", "fdel")]
        for item in [value, *members]:
            func = getattr(item, "__func__", item)
            func = getattr(func, "__wrapped__", func)
            code = getattr(func, "__code__", None)
            if isinstance(code, types.CodeType) and func.__module__ == module.__name__:
                add(code)
    return out


def _called_with_two(code: Any, dis: Any) -> bool:
    """Whether every load of the global ``min``/``max`` in ``code`` is called with two positional
    arguments and nothing else: followed, before any jump, by the ``PRECALL`` that takes exactly what
    was pushed above it (nested calls simulated by their stack effects), with ``2``, and no ``KW_NAMES``.

    A ``LOAD_GLOBAL`` names its global in ``co_names``: code without ``min`` or ``max`` there loads
    neither, and is not disassembled (3 of trio's 108 code objects have them; disassembling all of
    them took ~19 ms of every start-up)."""
    if "min" not in code.co_names and "max" not in code.co_names:
        return True
    ops = _instructions(code, dis)
    for i, (opname, _, arg) in enumerate(ops):
        # LOAD_GLOBAL's argument: the name's index in co_names, shifted left by one, and 1 when the
        # load pushes NULL first, to be called
        if opname != "LOAD_GLOBAL" or arg is None or code.co_names[arg >> 1] not in ("min", "max"):
            continue
        if not arg & 1:  # not loaded to be called (NULL + the function)
            return False
        depth = 0
        previous = opname
        for later, opcode, later_arg in ops[i + 1 :]:
            if later == "PRECALL" and later_arg == depth:
                if later_arg != 2 or previous == "KW_NAMES":
                    return False
                break
            if "JUMP" in later or later in ("CALL_FUNCTION_EX", "RETURN_VALUE", "RAISE_VARARGS"):
                return False
            depth += dis.stack_effect(opcode, later_arg)
            if depth < 0:
                return False
            previous = later
        else:
            return False
    return True


def _instructions(code: Any, dis: Any) -> list[tuple[str, int, int | None]]:
    """``(opname, opcode, arg)`` of each instruction of ``code`` (``arg`` ``None`` below
    ``HAVE_ARGUMENT``), inline caches skipped: what ``dis.get_instructions`` lists, read with the
    decoder it uses itself, without building its records (trio's three: ~0.2 ms instead of ~1.8 ms).
    Through ``get_instructions`` where that decoder is not there (another CPython)."""
    unpack = getattr(dis, "_unpack_opargs", None)
    if unpack is None:
        return [(op.opname, op.opcode, op.arg) for op in dis.get_instructions(code)]
    return [(dis.opname[opcode], opcode, arg) for _, opcode, arg in unpack(code.co_code)]


def _os_error(exc: BaseException) -> OSError | None:
    """The ``OSError`` behind a runtime failure, out of trio's nursery exception groups (else ``None``).

    A state directory that cannot be used (a newer schema, not a database) counts as one.
    """
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    sqlite3 = sys.modules.get("sqlite3")  # loaded only with a state directory: without one, no store error
    if sqlite3 is not None:
        from .store import StoreVersionError, StoreWriterError

        if isinstance(exc, StoreVersionError | StoreWriterError | sqlite3.DatabaseError):
            return OSError(str(exc))
    return exc if isinstance(exc, OSError) else None


def _connect(url: str, token: str | None = None, ca_file: str | None = None) -> int:
    import trio

    from .transports.relay import relay_stdio

    try:
        trio.run(relay_stdio, url, token, ca_file)
    except KeyboardInterrupt:
        return 0
    except (OSError, ValueError) as exc:
        failure = _os_error(exc) or exc
        print(f"acp-server connect: cannot relay to {url}: {failure}", file=sys.stderr)
        return 1
    return 0
