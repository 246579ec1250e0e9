"""``flywheel broker …`` and ``flywheel topics …``: typer sub-apps mounted by flywheel/cli.py.

Every command takes ``--bootstrap-servers`` (else ``FLYWHEEL_BOOTSTRAP_SERVERS``, else the
embedded broker at 127.0.0.1:19092). Errors raised on purpose (:class:`FlywheelError`) are
printed to stderr and exit with code 2.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, ParamSpec, TypeVar

import typer

from hebrus_flywheel.core.errors import ConfigError, FlywheelError
from hebrus_flywheel.core.kafka.security import (
    INSECURE_WARNING,
    ROLES,
    check_role,
    declare_role,
    insecure_marker,
    role_properties_path,
    security_dir,
)
from hebrus_flywheel.core.namespace import resolve_prefix
from hebrus_flywheel.core.settings import BOOTSTRAP_ENV, bootstrap_servers, flywheel_home
from hebrus_flywheel.streams import container, kafka_jars, security
from hebrus_flywheel.streams.acls import grant_catalogue
from hebrus_flywheel.streams.broker import (
    BrokerConfig,
    ClusterConfig,
    EmbeddedBroker,
    LocalCluster,
    cluster_view,
    grant_roles,
    is_embedded,
    pin_jars,
    probe_metadata,
    read_layout,
)
from hebrus_flywheel.streams.retention import CONFIGURABLE, RETENTION_CONFIG_ENV, load_policy
from hebrus_flywheel.streams.topics import (
    CATALOGUE,
    catalogue,
    compare_topics,
    create_topics,
    describe_topics,
    spec_differences,
)

P = ParamSpec("P")
R = TypeVar("R")

broker_app = typer.Typer(
    help="Run the embedded Kafka 4.x broker (KRaft): one node, or a local cluster "
    "(--nodes 3).", no_args_is_help=True
)
topics_app = typer.Typer(
    help="Create and inspect the flywheel topic catalogue.", no_args_is_help=True
)

BootstrapOpt = Annotated[
    str | None,
    typer.Option(
        "--bootstrap-servers",
        "-b",
        help=f"Kafka bootstrap servers [default: ${BOOTSTRAP_ENV} or the embedded broker].",
        show_default=False,
    ),
]
HomeOpt = Annotated[
    Path | None,
    typer.Option(
        "--home", help="State root [default: $FLYWHEEL_HOME or ./.flywheel].", show_default=False
    ),
]
TimeoutOpt = Annotated[float, typer.Option("--timeout", help="Seconds to wait for the cluster.")]


def _fail_cleanly(fn: Callable[P, R]) -> Callable[P, R]:
    """Turn a FlywheelError into its message on stderr and exit code 2."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except FlywheelError as exc:
            typer.echo(f"error: {exc}", err=True)
            # SystemExit, not typer.Exit: click returns typer.Exit's code instead of exiting
            # when the root app runs with standalone_mode=False.
            raise SystemExit(2) from exc

    return wrapper


@broker_app.callback()
@topics_app.callback()
def _admin_role() -> None:
    """Broker and topic administration runs as the embedded broker's admin."""
    declare_role("admin")


def _broker(home: Path | None, **overrides: Any) -> EmbeddedBroker:
    root = home or flywheel_home()
    overrides.setdefault("insecure_plaintext", insecure_marker(root).is_file())
    return EmbeddedBroker(BrokerConfig(home=root, **overrides))


def _cluster(home: Path | None, nodes: int | None = None, **overrides: Any) -> LocalCluster | None:
    """The local cluster of ``nodes`` (None: the layout ``up`` recorded in the home, if
    any); None for the single node."""
    root = home or flywheel_home()
    recorded = read_layout(root)
    count = nodes if nodes is not None else (recorded.nodes if recorded else 1)
    if count <= 1:
        return None
    if recorded is not None and recorded.nodes != count:
        raise ConfigError(f"a {recorded.nodes}-node cluster is recorded in {root}; run "
                          "`flywheel broker down` before starting one of another size")
    overrides.setdefault("insecure_plaintext", insecure_marker(root).is_file())
    return LocalCluster(ClusterConfig(home=root, nodes=count, **overrides))


# --------------------------------------------------------------------------- broker


@broker_app.command("up")
@_fail_cleanly
def broker_up(
    bootstrap_servers_: BootstrapOpt = None,
    home: HomeOpt = None,
    heap_mb: Annotated[int, typer.Option("--heap-mb", help="JVM max heap, 256..1024 MiB.")] = 768,
    start_timeout: Annotated[
        float, typer.Option("--start-timeout", help="Seconds to wait for the broker to answer.")
    ] = 90.0,
    insecure_plaintext: Annotated[
        bool,
        typer.Option(
            "--insecure-plaintext",
            help="Throwaway local runs only: PLAINTEXT, no authentication, no ACLs. Recorded "
            "in the home; every report made from such a run carries a red warning.",
        ),
    ] = False,
    nodes: Annotated[int | None, typer.Option(
        "--nodes", help="1: one node; 2..9: a local KRaft cluster (every node broker and "
        "controller; node i on ports BASE+2(i-1) and the next; RF 3 / min ISR 2 from 3 "
        "nodes) [default: the recorded cluster, else 1].", show_default=False)] = None,
) -> None:
    """Start the embedded broker or local cluster (idempotent) and wait until it answers
    metadata requests.

    Secure by default: the first start generates a local CA, the broker's certificate and
    one SCRAM-SHA-512 credential per role under $FLYWHEEL_HOME/kafka/security/; clients
    reach one SASL_SSL listener and each role has only its ACLs."""
    cluster = _cluster(home, nodes, start_timeout_s=max(start_timeout, 120.0),
                       heap_mb=min(heap_mb, 512), insecure_plaintext=insecure_plaintext)
    if cluster is not None:
        _cluster_up(cluster, bootstrap_servers_, insecure_plaintext)
        return
    broker = _broker(home, heap_mb=heap_mb, start_timeout_s=start_timeout,
                     insecure_plaintext=insecure_plaintext)
    bootstrap = bootstrap_servers(bootstrap_servers_)
    if not is_embedded(bootstrap, broker.config):
        typer.echo(
            f"an external Kafka cluster is configured ({bootstrap}); not starting the embedded "
            f"broker. Unset {BOOTSTRAP_ENV} / --bootstrap-servers to use the embedded one."
        )
        return
    started = broker.up()
    status = broker.status()
    verb = "started" if started else "already running"
    mode = "PLAINTEXT (insecure)" if insecure_plaintext else "SASL_SSL, SCRAM-SHA-512, ACLs"
    typer.echo(f"embedded Kafka broker {verb} on {status.bootstrap} (pid {status.pid}), {mode}")
    if insecure_plaintext:
        typer.secho(f"WARNING: {INSECURE_WARNING}", fg=typer.colors.RED, bold=True, err=True)
    else:
        typer.echo(f"client properties per role: `flywheel broker credentials --role ROLE` "
                   f"({security_dir(broker.config.home)})")


def _cluster_up(cluster: LocalCluster, bootstrap_servers_: str | None, insecure: bool) -> None:
    bootstrap = bootstrap_servers(bootstrap_servers_)
    if not is_embedded(bootstrap, cluster.nodes[1].config, cluster.config.client_ports):
        typer.echo(f"an external Kafka cluster is configured ({bootstrap}); not starting the "
                   f"local cluster. Unset {BOOTSTRAP_ENV} / --bootstrap-servers first.")
        return
    started = cluster.up()
    verb = "started" if started else "already running"
    mode = "PLAINTEXT (insecure)" if insecure else "SASL_SSL, SCRAM-SHA-512, ACLs"
    rf, isr = cluster.config.node(1).replication_factor, cluster.config.node(1).min_insync_replicas
    typer.echo(f"local Kafka cluster of {cluster.config.nodes} nodes {verb}, {mode}; topics "
               f"get replication factor {rf}, min.insync.replicas {isr}")
    typer.echo(f"bootstrap (every node): {cluster.bootstrap}  -- export {BOOTSTRAP_ENV}="
               f"{cluster.bootstrap} so clients start while any node is up")
    if insecure:
        typer.secho(f"WARNING: {INSECURE_WARNING}", fg=typer.colors.RED, bold=True, err=True)


@broker_app.command("credentials")
@_fail_cleanly
def broker_credentials(
    role: Annotated[str, typer.Option("--role", help=f"One of {', '.join(ROLES)}.")],
    home: HomeOpt = None,
) -> None:
    """Print the librdkafka properties of ROLE on the embedded broker, one key=value a line
    (paste them into any Kafka tool, or pass the file named in the header to
    --kafka-config / kcat -F)."""
    check_role(role)
    path = role_properties_path(role, home or flywheel_home())
    if insecure_marker(home or flywheel_home()).is_file():
        raise ConfigError("the embedded broker of this home runs with --insecure-plaintext: "
                          "it has no credentials (use security.protocol=PLAINTEXT); run "
                          "`flywheel broker down` and `flywheel broker up` to make it secure")
    if not path.is_file():
        raise ConfigError(f"no credentials yet ({path} is missing); run `flywheel broker up`")
    typer.echo(f"# file: {path}")
    typer.echo(path.read_text().rstrip("\n"))


@broker_app.command("render-config")
@_fail_cleanly
def broker_render_config(
    home: Annotated[Path, typer.Option("--home", help="Where to write (a volume).")],
    host: Annotated[str, typer.Option("--host", help="Host name clients and the "
                                      "controller use (the container's name).")],
    port: Annotated[int, typer.Option("--port", help="Client listener port.")] = 9094,
    controller_port: Annotated[int, typer.Option("--controller-port")] = 19093,
    bind_host: Annotated[str, typer.Option("--bind-host", help="Address the client "
                                           "listeners bind to.")] = "0.0.0.0",
    external: Annotated[str | None, typer.Option(
        "--external", help="HOST:PORT of a second listener for tools outside the "
        "container network (publish that port).")] = None,
    clients_mount: Annotated[Path, typer.Option(
        "--clients-mount", help="Where each worker mounts its clients/<role> directory.")
    ] = Path("/etc/flywheel/kafka"),
    owner: Annotated[str | None, typer.Option(
        "--owner", help="UID:GID to own <home>/kafka (the broker image's user).")] = None,
    nodes: Annotated[int, typer.Option(
        "--nodes", help="Render N nodes: containers HOST-1..HOST-N on the same ports, files "
        "under <home>/kafka/node-<i>, EXTERNAL on its port + 2(i-1); RF 3 / min ISR 2 "
        "from 3 nodes.")] = 1,
) -> None:
    """Write everything a secure broker starts from without starting it (compose.yaml):
    CA, broker certificate, SCRAM passwords, server.properties, a start script and each
    role's client properties. Idempotent: existing keys and passwords are kept."""
    config = BrokerConfig(home=home, host=host, port=port, controller_port=controller_port,
                          bind_host=bind_host, external=external)
    if not 1 <= nodes <= 9:
        raise ConfigError(f"--nodes must be in 1..9, got {nodes}")
    written = container.render_config(
        config, clients_mount=clients_mount,
        owner=container.parse_owner(owner) if owner else None, nodes=nodes)
    for path in written:
        typer.echo(f"wrote    {path}")
    configs = container.node_configs(config, nodes)
    scripts = " and ".join(f"`sh {c.state_dir / container.START_SCRIPT}`" for c in configs)
    bootstrap = ",".join(c.bootstrap for c in configs)
    typer.echo(f"start the broker with {scripts}, then "
               f"`flywheel broker grant --home {home} -b {bootstrap}`")


@broker_app.command("grant")
@_fail_cleanly
def broker_grant(
    bootstrap_servers_: BootstrapOpt = None,
    home: HomeOpt = None,
    prefix: Annotated[str, typer.Option("--prefix", help="Topic prefix of the catalogue.")] = "",
) -> None:
    """As the admin of HOME, store every role's SCRAM credential and the catalogue's ACLs
    on the broker (idempotent; `broker up` does this itself for the embedded broker)."""
    root = home or flywheel_home()
    bootstrap = bootstrap_servers(bootstrap_servers_)
    if insecure_marker(root).is_file():
        raise ConfigError(f"{root} holds an --insecure-plaintext broker: nothing to grant")
    count = grant_roles(security.admin_config(root, bootstrap, False), root, prefix)
    typer.echo(f"stored {len(ROLES)} role credentials and {count} ACL bindings for prefix "
               f"{prefix!r} on {bootstrap}")


@broker_app.command("down")
@_fail_cleanly
def broker_down(
    bootstrap_servers_: BootstrapOpt = None,
    home: HomeOpt = None,
    stop_timeout: Annotated[
        float, typer.Option("--stop-timeout", help="Seconds between SIGTERM and SIGKILL.")
    ] = 30.0,
) -> None:
    """Stop the embedded broker, or every node of the local cluster, started from this
    home (only the processes in their pid files)."""
    cluster = _cluster(home, stop_timeout_s=stop_timeout)
    if cluster is not None:
        stopped_nodes = cluster.down()
        typer.echo(f"local Kafka cluster ({cluster.config.nodes} nodes) "
                   + ("stopped" if stopped_nodes else "was not running"))
        return
    broker = _broker(home, stop_timeout_s=stop_timeout)
    bootstrap = bootstrap_servers(bootstrap_servers_)
    if not is_embedded(bootstrap, broker.config):
        typer.echo(f"note: {bootstrap} is an external cluster; only the embedded broker is stopped")
    stopped = broker.down()
    typer.echo(
        "embedded Kafka broker stopped" if stopped else "embedded Kafka broker was not running"
    )


@broker_app.command("status")
@_fail_cleanly
def broker_status(
    bootstrap_servers_: BootstrapOpt = None,
    home: HomeOpt = None,
    prefix: Annotated[str, typer.Option(
        "--prefix", help="Show the partitions of topics with this prefix only.")] = "",
) -> None:
    """Show whether the embedded broker (or each node of the local cluster) runs and
    answers, which nodes are up, and each partition's leader and in-sync replicas."""
    cluster = _cluster(home)
    if cluster is not None:
        for node in cluster.status():
            typer.echo(f"node {node.node_id}")
            for line in node.status.lines():
                typer.echo(f"  {line}")
        target: Any = cluster.admin_config()
        expected: tuple[int, ...] = tuple(cluster.nodes)
    else:
        broker = _broker(home)
        for line in broker.status().lines():
            typer.echo(line)
        bootstrap = bootstrap_servers(bootstrap_servers_)
        if not is_embedded(bootstrap, broker.config):
            ok = probe_metadata(bootstrap, 5.0)
            typer.echo(f"configured:  {bootstrap} (external), metadata "
                       f"{'ok' if ok else 'unreachable'}")
        target, expected = bootstrap, ()
    try:
        view = cluster_view(target, prefix=prefix, timeout_s=5.0)
    except FlywheelError as exc:
        typer.echo(f"partitions:  unknown ({exc})")
        return
    for line in view.lines(expected):
        typer.echo(line)


@broker_app.command("pin-jars")
@_fail_cleanly
def broker_pin_jars(home: HomeOpt = None) -> None:
    """Resolve the Kafka jars afresh with Maven and rewrite streams/kafka/jars.sha256.

    Run after changing KAFKA_VERSION (streams/kafka/kafka.env) or the pom; review the
    diff before committing it: every later `broker up` refuses jars that differ from it.
    """
    path = pin_jars(BrokerConfig(home=home or flywheel_home()))
    version = kafka_jars.kafka_version()
    count = len(kafka_jars.read_pins(path))
    typer.echo(f"pinned {count} jars of Kafka {version} in {path}; review `git diff` and commit it")


@broker_app.command("logs")
@_fail_cleanly
def broker_logs(
    bootstrap_servers_: BootstrapOpt = None,
    home: HomeOpt = None,
    lines: Annotated[int, typer.Option("--lines", "-n", help="How many lines to print.")] = 50,
) -> None:
    """Print the last lines of the embedded broker's server log."""
    del bootstrap_servers_  # accepted for uniformity; the log is always the embedded broker's
    cluster = _cluster(home)
    tail = cluster.log_tail(lines) if cluster is not None else _broker(home).log_tail(lines)
    if not tail:
        typer.echo("no broker log yet; start the broker with `flywheel broker up`", err=True)
    for line in tail:
        typer.echo(line)


# --------------------------------------------------------------------------- topics


@topics_app.command("create")
@_fail_cleanly
def topics_create(
    bootstrap_servers_: BootstrapOpt = None,
    prefix: Annotated[str | None, typer.Option(
        "--prefix", help="Prefix every topic name: the namespace ('' for the shared one) "
        "(default: $FLYWHEEL_NAMESPACE, else --teacher's namespace, else shared).",
        show_default=False)] = None,
    teacher: Annotated[Path | None, typer.Option(
        "--teacher", help="Create the namespace of this teacher checkpoint directory.")] = None,
    timeout: TimeoutOpt = 30.0,
    config: Annotated[Path | None, typer.Option(
        "--config", help=f"TOML file with a [retention] section (class = \"7d\") "
        f"[default: ${RETENTION_CONFIG_ENV}].", show_default=False)] = None,
    retention: Annotated[list[str] | None, typer.Option(
        "--retention", metavar="CLASS=DURATION",
        help=f"Retention of one topic class ({', '.join(CONFIGURABLE)}), e.g. capture=3d, "
        "quarantine=12h, control=forever; repeat for several.")] = None,
) -> None:
    """Create every catalogue topic that does not exist yet (idempotent), with the retention
    policy; existing topics keep the retention set on the broker, which is printed."""
    bootstrap = bootstrap_servers(bootstrap_servers_)
    policy = load_policy(config, retention or ())
    typer.echo("retention: " + ", ".join(f"{c}={d}" for c, d in policy.describe().items()))
    prefix = resolve_prefix(prefix, teacher=teacher)
    specs = catalogue(prefix, policy)
    result = create_topics(bootstrap, specs, timeout_s=timeout)
    for name, state in result.items():
        typer.echo(f"{state:8} {name}")
    existing = [s for s in specs if result.get(s.name) == "exists"]
    notes = (compare_topics(bootstrap, existing, timeout_s=timeout, log_notes=False).notes
             if existing else [])
    for note in notes:
        typer.echo(f"note: {note}")
    granted = grant_catalogue(bootstrap, prefix, timeout_s=timeout)
    if granted:
        typer.echo(f"granted  {granted} role ACL bindings for prefix {prefix!r}")


@topics_app.command("list")
@_fail_cleanly
def topics_list(
    bootstrap_servers_: BootstrapOpt = None,
    all_topics: Annotated[
        bool, typer.Option("--all", help="Also list topics outside the catalogue.")
    ] = False,
    timeout: TimeoutOpt = 15.0,
) -> None:
    """Show the catalogue topics (and with --all every topic) as the cluster sees them."""
    bootstrap = bootstrap_servers(bootstrap_servers_)
    infos = describe_topics(
        bootstrap, None if all_topics else [s.name for s in CATALOGUE], timeout_s=timeout
    )
    specs = {s.name: s for s in CATALOGUE}
    rows = [("topic", "partitions", "cleanup.policy", "retention.ms", "state")]
    for name in sorted(set(specs) | set(infos)):
        info, spec = infos.get(name), specs.get(name)
        if info is None:
            rows.append((name, "-", "-", "-", "missing"))
            continue
        problems, notes = spec_differences(spec, info) if spec is not None else ([], [])
        state = ("not in catalogue" if spec is None else "differs" if problems
                 else "ok (retention set on the broker)" if notes else "ok")
        cfg = info.configs
        policy, retention = cfg.get("cleanup.policy", "?"), cfg.get("retention.ms", "?")
        rows.append((name, str(info.partitions), policy, retention, state))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    for row in rows:
        typer.echo("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=False)) + "  " + row[4])


@topics_app.command("describe")
@_fail_cleanly
def topics_describe(
    names: Annotated[
        list[str] | None, typer.Argument(help="Topics [default: the catalogue].")
    ] = None,
    bootstrap_servers_: BootstrapOpt = None,
    timeout: TimeoutOpt = 15.0,
) -> None:
    """Print the spec (key, doc) and the live partitions/configs of topics."""
    bootstrap = bootstrap_servers(bootstrap_servers_)
    wanted = names or [s.name for s in CATALOGUE]
    infos = describe_topics(bootstrap, wanted, timeout_s=timeout)
    specs = {s.name: s for s in CATALOGUE}
    for name in wanted:
        typer.echo(name)
        if name in specs:
            typer.echo(f"  key:        {specs[name].key}")
            typer.echo(f"  doc:        {specs[name].doc}")
        info = infos.get(name)
        if info is None:
            typer.echo("  state:      missing (run `flywheel topics create`)")
            continue
        typer.echo(f"  partitions: {info.partitions}")
        for key in sorted(info.configs):
            if key in (
                "cleanup.policy",
                "retention.ms",
                "max.message.bytes",
                "min.insync.replicas",
            ):
                typer.echo(f"  {key}: {info.configs[key]}")
