"""``unicron-run``: torchrun's command line, unicron's agent and rendezvous.

Every torchrun flag works (the parser is ``torch.distributed.run``'s). The
differences: ``--rdzv-backend`` defaults to ``unicron``; ``--standalone``
starts a private etcd for the run (and removes it afterwards) instead of a
c10d TCP store; the agent is :class:`~unicron_elastic.agent.UnicronAgent`.

torchrun has no hook for a custom agent, so :func:`launch` rebuilds the short
part of ``torch.distributed.launcher.api.launch_agent`` that creates the agent.

``--slurm``: one task of a SLURM step per node (:func:`apply_slurm`): the run
id comes from ``SLURM_JOB_ID``, the node's name from ``SLURMD_NODENAME``;
SIGUSR1 (SLURM's warning) stops the node like SIGTERM (exit code 138) and a
drain of the node makes it leave at a step boundary (docs/slurm.md).

Stopping: SIGTERM, SIGINT, SIGHUP (and SIGQUIT) stop the whole job from the
start (before the private etcd is started): the workers get the signal, then
etcd and every temp dir are removed and the exit code is 128 + the signal.
Bad input (flags, ``--rdzv-conf``, endpoint, TLS files, a busy metrics port,
no etcd binary) and an unreachable etcd or a corrupt rendezvous state are one
``unicron-run: error: ...`` line and exit code 2 (the workers are stopped first).
"""

from __future__ import annotations

import argparse
import os
import uuid
from typing import Any

import structlog
from torch.distributed.elastic import events, metrics
from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.multiprocessing import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, record
from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousParameters, RendezvousStateError
from torch.distributed.elastic.rendezvous import registry as rdzv_registry
from torch.distributed.launcher.api import LaunchConfig, _get_addr_and_port
from torch.distributed.run import config_from_args, get_args_parser

from unicron_elastic.agent import UnicronAgent, _torch_compat
from unicron_elastic.agent.agent import make_detectors
from unicron_elastic.agent.api import ALL_DETECTORS, AgentConfig, NodeGaveUp
from unicron_elastic.agent.ladder import LadderPolicy
from unicron_elastic.agent.signals import (
    LEAVE_SIGNAL,
    LeftBeforeTraining,
    begin_shutdown,
    install_leave_signal,
    install_preemption_signal,
    install_stop_signals,
    stop_signals_deferred,
)
from unicron_elastic import env
from unicron_elastic.agent.warm.api import DEFAULT_SPARES, OFF, WarmConfig
from unicron_elastic.agent.warm.pool import WarmPool
from unicron_elastic.api import ConfigError, EtcdBinaryNotFoundError, EtcdStartError
from unicron_elastic.detection.hang import HangThresholds
from unicron_elastic.detection.straggler import StragglerThresholds
from unicron_elastic.env import PRELOAD, SPARES
from unicron_elastic.logging import configure_logging
from unicron_elastic.slurm.api import SlurmCommandError, SlurmJob
from unicron_elastic.store.embedded import EmbeddedEtcd

log = structlog.get_logger(__name__)


def get_parser() -> argparse.ArgumentParser:
    """torchrun's argument parser with unicron's defaults and flags."""
    parser = get_args_parser()
    parser.prog = "unicron-run"
    parser.description = (
        "Launch distributed training with unicron's self-healing agent. Accepts every torchrun "
        "flag; --rdzv-backend defaults to 'unicron' (etcd v3 at --rdzv-endpoint) and "
        "--standalone starts a private etcd for the run."
    )
    parser.set_defaults(rdzv_backend="unicron")
    _torch_compat.add_shutdown_timeout_flag(parser)  # (torch's own from 2.12)
    group = parser.add_argument_group("unicron agent")
    group.add_argument("--detectors", default=",".join(ALL_DETECTORS),
                       help="comma-separated detectors to run (default: %(default)s)")
    group.add_argument("--hang-factor", type=float, default=5.0,
                       help="a worker without any progress for this many times the largest gap between its "
                            "progress signals in the last --hang-gap-window iterations is hung (default 5)")
    group.add_argument("--hang-min-silence", type=float, default=3.0,
                       help="silence shorter than this many seconds is never a hang, however short the gaps: a "
                            "busy host, a garbage collection or a data-loading spike stalls a process that long "
                            "(default 3)")
    group.add_argument("--hang-gap-window", type=int, default=100,
                       help="iterations whose largest gap between progress signals calibrates the hang bound "
                            "(default 100)")
    group.add_argument("--hang-max-wait", type=float, default=90.0,
                       help="a worker waiting on its group (saying so) longer than this many seconds in one wait "
                            "is in a collective that never completes: SEV3 collective_timeout; keep it above the "
                            "strategy's collective timeout, 30 s by default (default 90)")
    group.add_argument("--peer-failure-grace", type=float, default=5.0,
                       help="after a worker of this node fails, the others' silence counts towards a hang only "
                            "this many seconds later: they may wait in a collective with it until they notice "
                            "(default 5)")
    group.add_argument("--straggler-factor", type=float, default=1.5,
                       help="a worker whose median busy time per step over --straggler-window steps is this many "
                            "times its node peers' median is a straggler: SEV3 straggler, reported, never "
                            "restarted (default 1.5)")
    group.add_argument("--straggler-window", type=int, default=10,
                       help="steps whose busy times decide a straggler (default 10)")
    group.add_argument("--max-reattempts", type=int, default=3, help="SEV3 reattempts per step before SEV2")
    group.add_argument("--max-worker-restarts", type=int, default=3,
                       help="single-worker restarts per rank before the node gives up (SEV1)")
    group.add_argument("--node-ttl", type=int, default=2, help="lease TTL of this node in etcd (seconds, >= 1)")
    group.add_argument("--node-name", default=None,
                       help="this node's name in events and node records (default: HOST-PID; "
                            "the node daemon passes its own name)")
    group.add_argument("--metrics-port", type=int, default=None,
                       help="serve Prometheus metrics (events, actions, detection latency) on this port")
    warm = parser.add_argument_group("warm workers (docs/agent.md)")
    warm.add_argument("--preload", default=None,
                      help="modules a zygote process imports once, from which every worker is forked "
                           "(MODULE[,MODULE...]; 'auto': the installed packages the script imports at "
                           f"its top level; 'none': off; default: ${PRELOAD.name}, else '{OFF}')")
    warm.add_argument("--no-preload", dest="preload", action="store_const", const=OFF,
                      help="start every worker as a plain subprocess, as torchrun does")
    warm.add_argument("--spares", type=int, default=None,
                      help=f"workers forked ahead of need, each ready to take a lost rank's place at once "
                           f"(default: ${SPARES.name}, else {DEFAULT_SPARES})")
    slurm = parser.add_argument_group("SLURM (docs/slurm.md)")
    slurm.add_argument("--slurm", action="store_true",
                       help="run as this node's task of a SLURM step (srun --ntasks-per-node=1 --no-kill "
                            "--kill-on-bad-exit=0): run id from SLURM_JOB_ID (and the restart count), node name "
                            "from SLURMD_NODENAME, SIGUSR1 stops like SIGTERM, a drained node leaves at a step "
                            "boundary")
    slurm.add_argument("--slurm-poll", type=float, default=10.0,
                       help="with --slurm: seconds between two looks at this node's state in SLURM (a drain); "
                            "0: never look (default 10)")
    parser.add_argument(
        "--log-format",
        choices=("auto", "json", "console"),
        default="auto",
        help="Agent log format: JSON lines unless stderr is a TTY (auto), or forced.",
    )
    return parser


def agent_config(args: argparse.Namespace) -> AgentConfig:
    """The agent settings from ``unicron-run`` flags.

    Raises:
        ConfigError: A threshold or bound is invalid, ``--node-ttl`` is < 1,
            ``--detectors`` is empty or names a detector no plugin provides, or
            ``--preload`` or ``--spares`` (or their variables) are not valid.
    """
    config = AgentConfig(
        detectors=tuple(d.strip() for d in args.detectors.split(",") if d.strip()),
        hang=HangThresholds(hang_factor=args.hang_factor, peer_failure_grace=args.peer_failure_grace,
                            min_silence=args.hang_min_silence, gap_window=args.hang_gap_window,
                            max_wait=args.hang_max_wait),
        straggler=StragglerThresholds(factor=args.straggler_factor, window=args.straggler_window),
        ladder=LadderPolicy(args.max_reattempts, args.max_worker_restarts),
        node_ttl=args.node_ttl,
        warm=WarmConfig.from_flag(args.preload if args.preload is not None else env.preload(OFF),
                                  spares=args.spares if args.spares is not None else env.spares(DEFAULT_SPARES)),
        **({"node": args.node_name} if args.node_name else {}),
    )
    make_detectors(config)  # unknown names fail now, before etcd or any worker starts
    return config


def apply_slurm(args: argparse.Namespace, job: SlurmJob) -> None:
    """``--slurm``: the flags a SLURM job step gives (those the user gave win).

    ``--rdzv-id``: :attr:`~unicron_elastic.slurm.api.SlurmJob.run_id`
    (``<job>-<restart count>``); ``--node-name``: ``SLURMD_NODENAME``;
    ``--metrics-port P``: ``P`` + the node's index in the job (nodes may share a host);
    ``OMP_NUM_THREADS`` (when unset) of each worker: the task's CPUs
    (``SLURM_CPUS_PER_TASK``, else this process's CPU affinity) divided by
    ``--nproc-per-node``, at least 1 (torchrun sets 1 for several workers
    and leaves one worker on every core).

    Raises:
        ConfigError: ``--standalone`` (a private etcd per node cannot be one
            store), no ``--rdzv-endpoint``, or a bad ``--slurm-poll``.
    """
    if args.standalone:
        raise ConfigError("--slurm with --standalone: every node would start an etcd of its own; give "
                          "--rdzv-endpoint (a site etcd, or $(unicron slurm endpoint) inside the allocation)")
    if not args.rdzv_endpoint:
        raise ConfigError("--slurm needs --rdzv-endpoint: a site etcd, or $(unicron slurm endpoint) for the members "
                          "`unicron slurm etcd` runs inside the allocation")
    if not (args.slurm_poll >= 0 and args.slurm_poll < 86400):
        raise ConfigError(f"--slurm-poll {args.slurm_poll}: seconds from 0 (never) to 86400")
    if args.rdzv_id in (None, "", "none"):
        args.rdzv_id = job.run_id
    if not args.node_name:
        args.node_name = job.node
    if args.metrics_port is not None:
        args.metrics_port += job.node_index
    _set_threads(args)
    log.info("slurm_step", job=job.requeue_id, restart_count=job.restart_count, node=job.node,
             run_id=args.rdzv_id, node_name=args.node_name, nodes=len(job.nodes))


def _set_threads(args: argparse.Namespace) -> None:
    """``--slurm``: ``OMP_NUM_THREADS`` for the workers (they inherit it), unless the user set it.

    Raises:
        ConfigError: A bad ``SLURM_CPUS_PER_TASK`` or ``--nproc-per-node``.
    """
    from torch.distributed.run import determine_local_world_size

    from unicron_elastic.slurm.api import threads_per_worker

    if "OMP_NUM_THREADS" in os.environ:
        return
    try:
        workers = determine_local_world_size(args.nproc_per_node)
    except ValueError as exc:
        raise ConfigError(f"--nproc-per-node {args.nproc_per_node}: {exc}") from None
    threads = threads_per_worker(os.environ.get("SLURM_CPUS_PER_TASK"), len(os.sched_getaffinity(0)), workers)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    log.info("slurm_threads", omp_num_threads=threads, workers=workers,
             cpus_per_task=os.environ.get("SLURM_CPUS_PER_TASK"))


def _watch_slurm_node(job: SlurmJob, interval: float) -> None:
    """``--slurm``: leave at a step boundary (the leave signal to this process) when SLURM drains the node."""
    from unicron_elastic.slurm.drain_watch import NodeWatch

    if interval > 0:
        NodeWatch(job.node, lambda: os.kill(os.getpid(), LEAVE_SIGNAL), interval).start()


def launch(
    config: LaunchConfig, entrypoint: Any, args: list[str], agent: AgentConfig | None = None,
    shutdown_timeout: int | None = None,
) -> dict[int, Any]:
    """Run one node's agent until the job ends.

    Args:
        config: The launch configuration (from torchrun's ``config_from_args``).
        entrypoint: Script path or callable of the workers.
        args: Arguments of the entrypoint.
        agent: unicron's agent settings (defaults if None).
        shutdown_timeout: Seconds the workers get between the stop signal and
            SIGKILL (None: ``config``'s where this torch has it, else
            ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` or 30).

    Returns:
        The workers' return values by global rank; empty when the run had
        finished before this node joined (its rendezvous closed after a node
        passed the exit barrier: :class:`~unicron_elastic.rendezvous.handler.RunFinished`),
        or when a stop signal came once this node's workers had all succeeded
        (in the exit barrier: training is finished, exit code 0).

    Raises:
        ChildFailedError: A worker failed and the agent gave up.
        NodeGaveUp: A SEV1 failure: this node leaves (the rendezvous stays open
            for the others).
        ConfigError: The shutdown timeout is negative or its variable not a number.
    """
    if shutdown_timeout is None:
        shutdown_timeout = _torch_compat.shutdown_timeout(config, argparse.Namespace())
    if not config.run_id:
        config.run_id = str(uuid.uuid4().int)
        log.warning("no_run_id_generated", run_id=config.run_id)
    params = RendezvousParameters(
        backend=config.rdzv_backend,
        endpoint=config.rdzv_endpoint,
        run_id=config.run_id,
        min_nodes=config.min_nodes,
        max_nodes=config.max_nodes,
        local_addr=config.local_addr,
        **config.rdzv_configs,
    )
    master_addr, master_port = _get_addr_and_port(params)
    spec = WorkerSpec(
        role=config.role,
        local_world_size=config.nproc_per_node,
        entrypoint=entrypoint,
        args=tuple(args),
        rdzv_handler=rdzv_registry.get_rendezvous_handler(params),
        max_restarts=config.max_restarts,
        monitor_interval=config.monitor_interval,
        master_addr=master_addr,
        master_port=master_port,
        local_addr=config.local_addr,
        **_torch_compat.worker_spec_options(config),
    )
    pool = _warm_pool(agent, entrypoint, args)
    try:
        elastic_agent = UnicronAgent(
            spec=spec,
            config=agent,
            logs_specs=config.logs_specs,
            start_method=config.start_method,
            log_line_prefix_template=config.log_line_prefix_template,
            shutdown_timeout=shutdown_timeout,
            warm_pool=pool,
        )
    except BaseException:
        _torch_compat.use_warm_pool(None)
        pool.close()
        raise
    shutdown_rdzv = True
    try:  # from here on the agent's temp dir exists: close() removes it, whatever happens
        metrics.initialize_metrics(metrics.MetricsConfig(config.metrics_cfg))
        result = elastic_agent.run()
        if result is None:  # torch's agent on a graceful exit: the run finished before this node joined
            log.info("run_already_finished", run_id=config.run_id)
            return {}
        if elastic_agent.left:  # the task goes on without this node: its rendezvous stays open
            shutdown_rdzv = False
        events.record(elastic_agent.get_event_succeeded(), config.event_log_handler)
        if result.is_failed():
            raise ChildFailedError(name=str(entrypoint), failures=result.failures)
        return result.return_values
    except ChildFailedError:
        raise
    except Exception as exc:
        if isinstance(exc, SignalException) and elastic_agent.finished:  # (in the exit barrier: the work is done)
            log.info("stopped_after_training_finished", signal=exc.sigval.name)
            shutdown_rdzv = False
            return {}
        # A signal, a node leaving or a node giving up must not close the rendezvous for the others.
        if isinstance(exc, (NodeGaveUp, LeftBeforeTraining)) or type(exc).__name__ == "SignalException":
            shutdown_rdzv = False
        events.record(elastic_agent.get_event_failed(), config.event_log_handler)
        raise
    finally:
        try:
            if shutdown_rdzv:
                spec.rdzv_handler.shutdown()
        finally:
            try:
                elastic_agent.close()
            finally:
                _torch_compat.use_warm_pool(None)
                pool.close()


def _warm_pool(agent: AgentConfig | None, entrypoint: Any, args: list[str]) -> WarmPool:
    """The node's warm pool, started (its zygote imports while the agent meets the others) and used by torch.

    A callable entrypoint (workers started by multiprocessing, not as subprocesses) gets none.
    """
    config = agent.warm if agent is not None else WarmConfig(preload=())
    if not isinstance(entrypoint, str):
        config = WarmConfig(preload=())
    pool = WarmPool(config, [entrypoint, *args] if isinstance(entrypoint, str) else [])
    pool.start()
    _torch_compat.use_warm_pool(pool)
    return pool


def _serve_metrics(port: int) -> None:
    """Serve Prometheus metrics on 127.0.0.1:``port``.

    Raises:
        ConfigError: The port cannot be bound (in use, not allowed, out of range).
    """
    from prometheus_client import start_http_server

    try:
        start_http_server(port, addr="127.0.0.1")
    except (OSError, OverflowError) as exc:
        raise ConfigError(f"--metrics-port {port}: {getattr(exc, 'strerror', None) or exc}") from None
    log.info("metrics_served", port=port)


def _run(args: argparse.Namespace, unicron: AgentConfig) -> None:
    """Start the private etcd if ``--standalone``, run the node, stop etcd (whatever happens)."""
    etcd: EmbeddedEtcd | None = None
    try:
        if args.standalone:
            etcd = EmbeddedEtcd()
            with stop_signals_deferred():  # its health probe would swallow the signal's exception
                etcd.start()
            args.rdzv_backend = "unicron"
            args.rdzv_endpoint = etcd.endpoint
            args.rdzv_id = str(uuid.uuid4())
            log.info("standalone_etcd", endpoint=etcd.endpoint, rdzv_id=args.rdzv_id)
        if args.master_port is None:
            args.master_port = 29500
        try:
            config, cmd, cmd_args = config_from_args(args)
        except ValueError as exc:  # torchrun's own flag checks (--nnodes, --nproc-per-node ...)
            raise ConfigError(f"bad torchrun flag: {exc}") from None
        launch(config, cmd, cmd_args, unicron, _torch_compat.shutdown_timeout(config, args))
    finally:
        begin_shutdown()  # a second signal must not break off the clean-up
        if etcd is not None:
            etcd.stop()


@record
def main(argv: list[str] | None = None) -> None:
    """Console entry point of ``unicron-run``.

    Raises:
        ChildFailedError: The training failed (torch's ``@record`` writes the
            error file and the exit code is 1).
        SystemExit: 2 for bad input or an etcd that cannot be used (one
            ``unicron-run: error:`` line; with ``--slurm``, also outside a
            SLURM step or when ``scontrol`` fails), 75 when the node gave up,
            128 + N after signal N (138: SLURM's SIGUSR1).
    """
    parser = get_parser()
    args = parser.parse_args(argv)
    configure_logging(args.log_format)
    install_stop_signals()  # before anything is started that would need cleaning up
    install_leave_signal()
    if args.slurm:
        install_preemption_signal()  # before any other thread starts
    try:
        job = None
        if args.slurm:
            from unicron_elastic.slurm.job import current_job

            job = current_job()
            apply_slurm(args, job)
        unicron = agent_config(args)
        if args.metrics_port is not None:
            _serve_metrics(args.metrics_port)
        if job is not None:
            _watch_slurm_node(job, args.slurm_poll)
        _run(args, unicron)
    except NodeGaveUp as exc:
        log.error("node_gave_up", reason=str(exc), exit_code=exc.exit_code)
        raise SystemExit(exc.exit_code) from None
    except LeftBeforeTraining:
        log.info("left_before_training", reason="asked to leave while waiting for a round: the others go on")
        raise SystemExit(0) from None
    except SignalException as exc:
        log.warning("stopped_by_signal", signal=exc.sigval.name)
        raise SystemExit(128 + int(exc.sigval)) from None
    except (ConfigError, EtcdBinaryNotFoundError, EtcdStartError, RendezvousConnectionError,
            RendezvousStateError, SlurmCommandError) as exc:
        parser.exit(2, f"{parser.prog}: error: {' '.join(str(exc).split())}\n")  # one line, even for etcd's log


if __name__ == "__main__":
    main()
