"""``acp-server cluster`` and the coordinator's flags: where the shared limits live, and what they hold.

``add_flags`` puts the coordinator's flags on a parser (``serve``, ``cluster``); ``settings_from``
merges them over the ``[coordinator]`` table of ``--config`` into a
:class:`~acp_server.coordinator.settings.CoordinatorSettings`; ``run`` serves the ``cluster`` command.
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: the flags alone (serve --help) need neither the config nor trio
    from .config import FileConfig
    from .coordinator.settings import CoordinatorSettings

__all__ = ["add_commands", "add_flags", "run", "settings_from"]


def _positive_int(flag: str, minimum: int) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be an integer of at least {minimum}; got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{flag} must be an integer of at least {minimum}; got {value}")
        return value

    return parse


def _seconds(flag: str) -> Any:
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} must be a number of seconds; got {text!r}") from None
        if not value >= 0.5 or value == float("inf"):
            raise argparse.ArgumentTypeError(f"{flag} must be a number of seconds of at least 0.5; got {text}")
        return value

    return parse


def add_flags(parser: argparse.ArgumentParser, *, serve: bool) -> None:
    """The coordinator's flags (defaults ``None``: the ``[coordinator]`` table or the built-in default)."""
    g = parser.add_argument_group(
        "shared limits (coordinator)",
        "With --coordinator, the global seats, tenant caps, waiting room and backend pools are counted across "
        "every replica on the same Redis and prefix. In --config, the [coordinator] table takes url, prefix, "
        "replica_id, failure, expected_replicas, lease_ttl_s and timeout_ms; flags override the file.",
    )
    g.add_argument("--coordinator", metavar="URL", help="redis://HOST:PORT/DB or rediss:// (TLS) of the shared limits")
    g.add_argument("--coordinator-prefix", metavar="P", help="the hash tag of every key (default acp-server)")
    g.add_argument(
        "--coordinator-timeout-ms",
        type=_positive_int("--coordinator-timeout-ms", 1),
        metavar="MS",
        help="a call unanswered this long means Redis is away (default 500)",
    )
    g.add_argument(
        "--lease-ttl-s",
        type=_seconds("--lease-ttl-s"),
        metavar="S",
        help="a lease not renewed this long stops counting; renewed every S/3 (default 30)",
    )
    if not serve:
        return
    g.add_argument("--replica-id", metavar="ID", help="this replica's id in the registry (default host:pid)")
    g.add_argument(
        "--coordinator-failure",
        choices=("closed", "local"),
        help="while Redis is away: refuse prompts that need a shared limit (closed, the default), or admit "
        "them against a local share ceil(limit / N) (local)",
    )
    g.add_argument(
        "--expected-replicas",
        type=_positive_int("--expected-replicas", 0),
        metavar="N",
        help="N of the local share (default 0: the live replicas last seen in Redis)",
    )


_DESTS = {
    "url": "coordinator",
    "prefix": "coordinator_prefix",
    "replica_id": "replica_id",
    "failure": "coordinator_failure",
    "expected_replicas": "expected_replicas",
    "lease_ttl_s": "lease_ttl_s",
    "timeout_ms": "coordinator_timeout_ms",
}


def settings_from(
    args: argparse.Namespace, parser: argparse.ArgumentParser, file_config: FileConfig | None = None
) -> CoordinatorSettings:
    """The ``[coordinator]`` table of ``--config``, then the flags over it."""
    import msgspec

    from .config import ConfigError, FileConfig, load_config
    from .coordinator.settings import CoordinatorSettings

    if file_config is None:
        file_config = FileConfig()
        if getattr(args, "config", None):
            try:
                file_config = load_config(args.config)
            except ConfigError as exc:
                parser.error(str(exc))
    values = file_config.coordinator.given()
    for field, dest in _DESTS.items():
        value = getattr(args, dest, None)
        if value is not None:
            values[field] = value
    try:
        return CoordinatorSettings(**values)
    except (ValueError, msgspec.ValidationError) as exc:
        parser.error(str(exc))


def add_commands(sub: Any) -> None:
    """Add ``cluster`` to the ``acp-server`` subcommands."""
    c = sub.add_parser(
        "cluster",
        help="show the replicas and the shared limits of a coordinator",
        description="Print the replicas (last renewal), the seats, tenants, waiting room and backend pools "
        "counted in a coordinator. Reads only: it registers no replica and takes nothing.",
    )
    c.add_argument("--config", metavar="FILE", help="read the [coordinator] table of this configuration file")
    c.add_argument("--json", action="store_true", help="print JSON instead of text")
    add_flags(c, serve=False)
    c.set_defaults(cluster_parser=c)


def run(args: argparse.Namespace) -> int:
    """Run ``acp-server cluster``; 1 when the coordinator cannot be read."""
    parser: argparse.ArgumentParser = args.cluster_parser
    settings = settings_from(args, parser)
    if settings.url is None:
        parser.error("cluster needs --coordinator URL (or url in the [coordinator] table of --config)")
    import msgspec
    import trio

    from .coordinator.redis import read_cluster
    from .coordinator.settings import format_cluster

    try:
        stats = trio.run(
            lambda: read_cluster(
                settings.url or "", settings.prefix, lease_ttl_s=settings.lease_ttl_s,
                timeout_s=max(settings.timeout_ms / 1000, 2.0),
            )
        )
    except Exception as exc:  # noqa: BLE001 - any failure to read is reported the same way
        print(f"acp-server cluster: cannot read {settings.url}: {exc or type(exc).__name__}", file=sys.stderr)
        return 1
    if args.json:
        sys.stdout.write(msgspec.json.encode(stats).decode() + "\n")
    else:
        sys.stdout.write(format_cluster(stats))
    return 0
