"""Device hosts as named Ray actors, and the `WorkerPool` that drives them without blocking.

* One actor per configured device, named `residency-device-<name>` in namespace `residency`, detached
  (it outlives the manager, so a restarted manager reattaches to it and reconciles with `status()`;
  one that is another kind, on another node, or (CUDA) on another GPU index than the config now says
  is replaced by a new one), with restarts allowed. A CUDA device asks for `num_gpus=1` (logical GPUs
  schedule on CPU-only machines); a device with `node:` is placed on that Ray node
  (`node:<address>` resource).
* A CUDA device's `index` names the same GPU under Ray as in-process. Ray counts the host's GPU
  (`num_gpus=1`: scheduling and `ray.available_resources()` as before) but is told, through the
  actor's runtime env (`RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES=1`), to leave its
  CUDA_VISIBLE_DEVICES alone: Ray would narrow it to the one GPU it picked, which the host then saw as
  cuda:0 whatever the config's index (and NVML, which numbers GPUs physically, read another GPU's
  power). The host sees the GPUs as the node's Ray does (a local Ray: the manager's own environment;
  a cluster node: the environment `ray start` ran in), so `cuda:<index>` is the GPU the config names.
  Which GPU Ray counts as taken need not be that one: two devices of one node with the same index
  share a GPU, and a GPU that other Ray work asks for is not kept from it. A CUDA host of an earlier
  run made without that runtime env is replaced (Ray's `get_if_exists` hands back an actor by name,
  whatever its options).
* `submit` queues the command; the pool keeps one command in flight per device (so a device's commands
  run in submission order) and `poll` uses `ray.wait(..., timeout=0)`, never blocking; an actor that
  died turns into `CommandResult(ok=False, error_code="worker_died")`. Re-submitting the same op id
  after a restart is safe: commands are declarative and results cached by op id. A call that fails
  while its host lives (the host's method raised: Ray's `RayTaskError`, whatever it wraps, a
  `GetTimeoutError` included; or any error that is not Ray saying the host is gone) is a failure of
  that call alone: `internal`, naming the exception, with no death recorded (and no resync by the
  manager). Ray says a host is gone with `RayActorError` (`ActorDiedError`, `ActorUnavailableError`)
  and, in Ray 2.60, in other words too (`_HOST_GONE`): `OutOfMemoryError` (Ray's memory monitor
  killed it), `NodeDiedError`, `WorkerCrashedError`, ...: those are its death (`worker_died`).
  A lost reply (`ObjectLostError` and its kinds, `OwnerDiedError` among them: Ray lost the call's
  reply, or its owner, this process) is not: the host may have run the call and live on. A command
  whose reply was lost is sent again once under its op id (the host answers it from its cache of
  results); a request's lost reply is answered `internal`, saying so.
* A host's death is reported once (the first call that fails on it). A command that then finds the
  host still restarting (Ray: `ActorUnavailableError`) is sent again every `UNAVAILABLE_RETRY_S`
  until the host answers, for at most `UNAVAILABLE_MAX_S`: the reload the manager asks for after a
  crash waits for the new host instead of failing a second time.
* A host no Ray node can take (it asks for a GPU and no node has one, or names a `node` not in the
  cluster) is said at once, not left pending for good: its commands are answered NOT_AVAILABLE,
  naming the device, what it asks for and what the cluster has, and the pool's start logs it as an
  error. Commands wait for the host's first answer (they are never sent to an actor not yet placed:
  a node that took it later would run them long after their answer); the cluster is asked again at
  each later attempt, so a node that joins meanwhile is used. One that the cluster could take but
  that is not placed within PLACEMENT_WAIT_S (its GPUs held elsewhere) is refused the same way until
  it is placed.
* `ray.address` null starts a local Ray; "auto" or an address joins an existing cluster.
  `unreachable` says at once when nothing answers at the address to join (Ray itself retries for
  minutes). A stop signal while Ray starts raises `StartInterrupted`, once what the start began is
  shut down (Ray's own SIGTERM handler, which `ray.init` installs, would exit the process at once).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import operator
import os
import signal
import socket
import stat
import subprocess
import threading
import time
import urllib.parse
import warnings
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import ray
from ray.exceptions import (
    ActorUnavailableError,
    ActorUnschedulableError,
    GetTimeoutError,
    LocalRayletDiedError,
    NodeDiedError,
    ObjectLostError,
    OutOfMemoryError,
    RayActorError,
    RayTaskError,
    RuntimeEnvSetupError,
    WorkerCrashedError,
)

from workers import procs
from workers import protocol as P
from workers.channel import (
    ChannelAddress,
    ChannelClient,
    ChannelError,
    ChannelServer,
    FrameTooLarge,
    ReplyLost,
    ReplyTooLarge,
    same_machine,
)
from workers.host import DESCRIBE_TIMEOUT_S, DeviceHost
from workers.pool import DeviceSpec, UnknownDevice, new_op_id
from workers.signals import StopSignal, stop_signals_raise

logger = logging.getLogger(__name__)

NAMESPACE = "residency"
UNAVAILABLE_RETRY_S = 0.5
"""How often a command is sent again to a host that is restarting."""
UNAVAILABLE_MAX_S = 60.0
"""How long a command waits for a restarting host before it fails as `worker_died`."""
ACTOR_PREFIX = "residency-device-"
PLACEMENT_CHECK_S = 1.0
"""How often the Ray cluster is asked again whether a host not yet placed can be (poll runs often)."""
PLACEMENT_WAIT_S = 30.0
"""How long a host whose resources the cluster has may wait for a node before its commands fail."""
NODE_SHARE = 0.001
"""How much of its `node:<address>` resource a host placed on a named node asks for."""
NOSET_CUDA_VISIBLE_DEVICES = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
"""Ray's switch (`ray._private.accelerators.nvidia_gpu`): set to "1" (or "true") in a worker's
environment, Ray does not set CUDA_VISIBLE_DEVICES there to the GPUs it assigned."""
CUDA_ENV_VARS = {NOSET_CUDA_VISIBLE_DEVICES: "1"}
"""The env_vars of a CUDA device's host actor's runtime env: they are in the worker's environment
from its start, before Ray sets the visible devices for the actor's creation task."""


_children = procs.descendants
"""This process's descendants (what a Ray start that failed left running)."""


class DeviceHostActor:
    """The thin Ray shell around `DeviceHost` (all logic lives there), with its data channel."""

    def __init__(self, name: str, kind: str, index: int, node: str | None) -> None:
        self.host = DeviceHost(name, kind, index=index, node=node)
        self.server: ChannelServer | None = None
        try:
            self.server = ChannelServer(self.host, actor_name(name))
        except OSError as e:  # inference then goes through Ray calls only
            logger.warning("device %s: no data channel (%s); inference goes through Ray calls", name, e)

    @ray.method(concurrency_group="data")
    def channel(self) -> ChannelAddress | None:
        return self.server.address if self.server is not None else None

    @ray.method(concurrency_group="data")
    def channel_reply(self, token: str) -> list[P.InferResult] | None:
        """The results of a batch that ran over the channel with a reply over its frame limit."""
        return self.server.take(token) if self.server is not None else None

    @ray.method(concurrency_group="commands")
    def apply(self, cmd: P.Command, op_id: str) -> P.CommandResult:
        return self.host.apply(cmd, op_id)

    @ray.method(concurrency_group="data")
    def infer(self, model: str, inputs: dict[str, np.ndarray]) -> P.InferResult:
        return self.host.infer(model, inputs)

    @ray.method(concurrency_group="data")
    def infer_many(self, items: list[tuple[str, dict[str, np.ndarray]]]) -> list[P.InferResult]:
        return self.host.infer_many(items)

    @ray.method(concurrency_group="data")
    def status(self) -> P.WorkerStatus:
        return self.host.status()

    @ray.method(concurrency_group="data")
    def session(self, method: str, *args: Any) -> P.SessionReply:
        reply: P.SessionReply = getattr(self.host, f"session_{method}")(*args)
        return reply

    @ray.method(concurrency_group="data")
    def describe(self, spec: P.ModelSpec) -> tuple[list[P.TensorSpec], list[P.TensorSpec]]:
        return self.host.describe(spec)


# Commands run one at a time, in the order the pool sends them; inference and status calls run beside
# them (a status read is never stuck behind a long load).
RemoteDeviceHost = ray.remote(concurrency_groups={"commands": 1, "data": 16})(  # type: ignore[call-overload]
    DeviceHostActor
)


def actor_name(device: str) -> str:
    return ACTOR_PREFIX + device


# Ray waits a fixed 30 s for a new local node's raylet to register; on a loaded two-core machine that
# is sometimes not enough (seen in CI), and the second start, with the machine warm, succeeds.
LOCAL_START_TRIES = 3
LOCAL_START_TIMEOUT = "timed out during startup"
# Ray 2.60 turns token authentication on for a new local cluster (unless RAY_AUTH_MODE says otherwise)
# and warns at every start that it did, telling how to opt out. Token authentication is what a home
# server should have, so that one warning is not passed on; the one for a cluster started without
# it is.
RAY_AUTH_LOGGER = "ray._private.authentication.authentication_token_setup"
TOKEN_AUTH_ON = "Token authentication is enabled for this Ray cluster"


class _QuietTokenAuthOn(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(TOKEN_AUTH_ON)


_QUIET_TOKEN_AUTH_ON = _QuietTokenAuthOn()


def keep_ray_token_private(home: Path | None = None) -> None:
    """A local Ray start turns Ray's token authentication on and keeps the cluster's token in
    ~/.ray/auth_token, written with the umask's mode (0644 under 022) in a folder of 0755: any user of
    the machine could read it, and with it run code as this user through Ray's ports, which listen on
    every interface. The folder is made (or kept) 0700 and the token 0600, where they are this user's
    (a symlink is left as it is: said). A failure is logged, never raised (Ray starts anyway)."""
    folder = (Path.home() if home is None else home) / ".ray"
    try:
        folder.mkdir(mode=0o700, exist_ok=True)
        for path, mode in ((folder, 0o700), (folder / "auth_token", 0o600)):
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            if stat.S_ISLNK(st.st_mode):
                logger.warning("%s is a symbolic link: left as it is (Ray's token is there)", path)
                continue
            if st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) & 0o077:
                os.chmod(path, mode)
    except OSError as e:
        logger.warning("could not make Ray's token folder %s private: %s", folder, e)


def start_local_ray(tries: int = LOCAL_START_TRIES, **init_kwargs: Any) -> None:
    """`ray.init` of a new local instance, started again (up to `tries` times in all) when Ray gives
    up waiting for its own node to come up; any other failure, and the last timeout, are raised.
    Ray's warning that it turned token authentication on (its default) is not passed on."""
    auth_log = logging.getLogger(RAY_AUTH_LOGGER)
    if _QUIET_TOKEN_AUTH_ON not in auth_log.filters:
        auth_log.addFilter(_QUIET_TOKEN_AUTH_ON)
    for attempt in range(1, tries + 1):
        before = _children()
        failed: Exception | None = None
        try:
            keep_ray_token_private()  # (its folder first: the token is written into it by the start)
            ray.init(**init_kwargs)
            keep_ray_token_private()
            return
        except Exception as e:
            if LOCAL_START_TIMEOUT not in str(e) or attempt == tries:
                raise
            failed = e
        with warnings.catch_warnings():
            # The failed start's traceback holds Ray's node and its Popen handles on processes that
            # still run (the kill below reaps them behind the handles' backs): each handle, let go,
            # warns "subprocess ... is still running", an error where warnings are (pytest's).
            warnings.simplefilter("ignore", ResourceWarning)
            why = str(failed)  # a log record keeps its args: not the exception (its traceback)
            failed = None
            logger.warning(
                "local Ray did not start (%s); starting it again (%d of %d)", why, attempt + 1, tries
            )
            _undo_start(before)


def _undo_start(before: set[int]) -> None:
    """Shut down what a start that failed or was interrupted began: Ray's state in this process, and
    the processes it started (this process's children not in `before`: Ray keeps no handle on the GCS
    and raylet of a start that raised)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)  # (see start_local_ray)
        ray.shutdown()
        _end_all(_children() - before)
        gc.collect()


def _end_all(pids: set[int]) -> None:
    """Kill `pids` and reap them; a Popen handle still held on one (Ray's) is told it ended, so it
    does not warn "still running" whenever it is let go."""
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            p.kill()
            procs.append(p)
    psutil.wait_procs(procs, timeout=10)
    ended = {p.pid: getattr(p, "returncode", None) for p in procs}  # (set by wait_procs)
    for obj in gc.get_objects():
        if issubclass(type(obj), subprocess.Popen) and obj.pid in ended and obj.returncode is None:
            obj.returncode = ended[obj.pid] if ended[obj.pid] is not None else -signal.SIGKILL


class StartInterrupted(StopSignal):
    """A stop signal (SIGINT, SIGTERM or SIGHUP) came while `ensure_ray` started or joined Ray; what
    the start had begun is shut down. A KeyboardInterrupt, so that no `except Exception` (in Ray's
    own start either) holds it up, and a caller stops as it does for Ctrl-C."""


@contextlib.contextmanager
def _stop_signals_interrupt() -> Iterator[None]:
    """Within it, SIGINT, SIGTERM or SIGHUP raises StartInterrupted at once; the handlers from before
    are put back after it. Ray's start blocks, so a caller's own handlers (`serve`'s, run by its event
    loop) would act only once it ended; and `ray.init` installs a SIGTERM handler of its own, which
    exits the process at once (`sys.exit(signum)`) and is left in place: that exit is taken for the
    StartInterrupted it is. Only on the main thread (the one Python runs signal handlers on)."""
    with stop_signals_raise(StartInterrupted):
        try:
            yield
        except SystemExit as e:
            if e.code != signal.SIGTERM:
                raise
            raise StartInterrupted(signal.SIGTERM) from None


def ensure_ray(address: str | None = None, **init_kwargs: Any) -> None:
    """Connect to Ray: a new local instance when `address` is None (started again if its node is slow
    to come up; RAY_ADDRESS, where set, is joined instead), else join the cluster at `address`. A stop
    signal meanwhile raises StartInterrupted once what the start began is shut down; the signal
    handlers are the ones from before, either way."""
    if ray.is_initialized():
        return
    kwargs = {"namespace": NAMESPACE, "include_dashboard": False, "log_to_driver": False, **init_kwargs}
    before = _children()
    try:
        with _stop_signals_interrupt():
            if address is None:
                # "local": Ray's None joins the cluster in its ray_current_cluster file instead (the last
                # `ray start` on this machine, alive or long dead: its retries then hang for minutes).
                # RAY_ADDRESS, where the environment sets it, is still joined, as Ray users expect.
                local: dict[str, Any] = {} if os.environ.get("RAY_ADDRESS") else {"address": "local"}
                start_local_ray(**local, **kwargs)
            else:
                ray.init(address=address, **kwargs)
    except StartInterrupted:
        _undo_start(before)
        raise


PROBE_TIMEOUT_S = 3.0
"""How long a TCP connection to the Ray cluster to join may take before it is said to be unreachable."""
RAY_CLIENT_PORT = 10001
"""The port of a "ray://HOST" address that names none (Ray client's default)."""


class RayUnreachable(ConnectionError):
    """Nothing answers at the address of the Ray cluster to join."""


def unreachable(address: str | None, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Why the Ray cluster `ray.init(address=address)` would join does not answer (a TCP connection to
    its host and port, within `timeout_s`), or None: it answers, or Ray starts a local instance or
    looks for one itself ("auto" without RAY_ADDRESS), or the address is one Ray itself refuses.
    Ray joins RAY_ADDRESS, when the environment sets it, in place of None or "auto"; it retries an
    address that does not answer for minutes before it gives up, saying nothing meanwhile."""
    env = os.environ.get("RAY_ADDRESS", "")
    from_env = bool(env) and address in (None, "auto")
    target = env if from_env else address
    if target is None or target in ("auto", "local"):
        return None
    try:
        if "://" in target:
            parts = urllib.parse.urlsplit(target)
            host = parts.hostname or ""
            _, _, port_s = parts.netloc.rpartition("@")[2].rpartition("]")[2].partition(":")
            port = int(port_s) if port_s else RAY_CLIENT_PORT  # (urllib's refuses one past 65535)
        else:
            host, _, port_s = target.rpartition(":")
            host, port = host.strip("[]"), int(port_s)
    except ValueError:
        return None
    if not host:
        return None
    why = _probe(host, port, timeout_s)
    if why is None:
        return None
    where = f"{host}:{port}"
    if from_env:
        where += f" (RAY_ADDRESS {env!r}, from the environment, which Ray joins in its place)"
    return f"cannot connect to {where}: {why}"


def _probe(host: str, port: int, timeout_s: float) -> str | None:
    """Why a TCP connection to `host`:`port` fails within `timeout_s`, or None when it is made."""
    if not 0 < port <= 65535:  # the resolver would take it modulo 65536, or for a service name
        return f"port {port} is not a TCP port (1-65535)"
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except TimeoutError:
        return f"no answer within {timeout_s:g} s"
    except ConnectionRefusedError:
        return "connection refused (is Ray running there?)"
    except socket.gaierror as e:
        return f"host name {host!r} not resolved ({e.strerror})"
    except UnicodeError:  # the IDNA codec's: an empty or over-long label
        return f"{host!r} is not a valid host name"
    except OSError as e:
        return str(e.strerror or e)


class HostNotPlaced(RuntimeError):
    """A device's host actor is on no Ray node: none offers what it asks for (the message says)."""


def needs(d: DeviceSpec) -> dict[str, float]:
    """The Ray resources a device's host actor asks of one node (beside `num_cpus=0`)."""
    asks: dict[str, float] = {}
    if d.kind == "cuda":
        asks["GPU"] = 1.0
    if d.node:
        asks[f"node:{d.node}"] = NODE_SHARE
    return asks


def _res(n: dict[str, Any]) -> dict[str, float]:
    res: dict[str, float] = n.get("Resources") or {}
    return res


def unplaceable(d: DeviceSpec, nodes: list[dict[str, Any]], where: str, *, local: bool = False) -> str | None:
    """Why no live node of `nodes` (`ray.nodes()` records) can take device `d`'s host, or None when
    one can. `where` names the cluster; `local`: it is the local Ray `serve` started (this machine)."""
    alive = [n for n in nodes if n.get("Alive")]
    asks = needs(d)
    if not asks or any(all(_res(n).get(k, 0.0) >= v for k, v in asks.items()) for n in alive):
        return None
    if d.node:
        at = [n for n in alive if f"node:{d.node}" in _res(n)]
        if not at:
            names = ", ".join(sorted(str(n.get("NodeManagerAddress", "?")) for n in alive)) or "none"
            hint = (
                "a local Ray has this machine's node only (ray.address is null)"
                if local
                else "it is placed once that node joins the cluster"
            )
            return (
                f"device {d.name!r} is to run on Ray node {d.node!r}, which is not in {where} "
                f"(its nodes: {names}); {hint}"
            )
        return (
            f"device {d.name!r} needs a GPU on Ray node {d.node!r}, which has none "
            f"(GPU: {_res(at[0]).get('GPU', 0.0):g})"
        )
    gpus = sum(_res(n).get("GPU", 0.0) for n in alive)
    count = "1 node" if len(alive) == 1 else f"{len(alive)} nodes"
    hint = (
        "on a machine without CUDA, serve without --no-cpu-fallback to run it on the CPU"
        if local
        else "it is placed once a Ray node with a GPU joins the cluster"
    )
    return f"device {d.name!r} needs a GPU, and {where} has none (GPU: {gpus:g} on its {count}); {hint}"


def not_placed(d: DeviceSpec, nodes: list[dict[str, Any]], free: dict[str, float], where: str) -> str:
    """Why device `d`'s host, which a live node of `nodes` could take, is on none after
    PLACEMENT_WAIT_S: what it needs is held elsewhere (`free`: `ray.available_resources()`)."""
    wants = (["a GPU"] if d.kind == "cuda" else []) + ([f"Ray node {d.node!r}"] if d.node else [])
    has = ""
    if d.kind == "cuda":
        total = sum(_res(n).get("GPU", 0.0) for n in nodes if n.get("Alive"))
        has = f" (GPU: {total:g}, free: {free.get('GPU', 0.0):g})"
    return (
        f"device {d.name!r} was not placed on a Ray node within {PLACEMENT_WAIT_S:g} s: it needs "
        f"{' on '.join(wants) or 'a node'}, which {where} has{has} but holds for other actors or "
        "tasks; it is placed once that comes free"
    )


def _scheduled(handle: Any) -> bool | None:
    """Whether Ray found the actor `handle` a node (its constructor may still run there), from its
    entry in the GCS actor table (Ray's private state API: the public one needs the dashboard); None
    when that cannot be told."""
    try:
        from ray._private import state

        entry = state.actors(handle._actor_id.hex())
    except Exception:
        return None
    if not entry:
        return None
    if entry.get("State") not in ("PENDING_CREATION", "DEPENDENCIES_UNREADY"):
        return True  # alive, restarting or dead: what its calls say is the answer
    return bool((entry.get("Address") or {}).get("IPAddress"))  # a worker is leased for it


def _cluster_name() -> str:
    try:
        gcs = ray.get_runtime_context().gcs_address
    except Exception:  # (a Ray client connection may not tell)
        gcs = None
    return f"the Ray cluster at {gcs}" if gcs else "the Ray cluster"


REATTACH_CHECK_S = 10.0
"""How long the host of an earlier run may take to say what device it runs (`_changed`)."""
_HOST_INDEX = operator.attrgetter("host.index")
"""Run on a host actor (`__ray_call__`): the device index its `DeviceHost` was made with. (Its status
does not say it; a function of the standard library, so that a host of any version runs it.)"""


def _gpu_env_asked() -> Callable[[Any], str | None]:
    """What `_GPU_ENV_ASKED` runs: made in a function, so that Ray sends it by value (a host whose
    `workers` package is older than this one runs it; one by reference it could not import)."""
    noset = NOSET_CUDA_VISIBLE_DEVICES

    def asked(actor: Any) -> str | None:
        import ray

        env_vars: dict[str, str] = ray.get_runtime_context().runtime_env.get("env_vars") or {}
        return env_vars.get(noset)

    return asked


_GPU_ENV_ASKED = _gpu_env_asked()
"""Run on a host actor (`__ray_call__`): the value its runtime env gives NOSET_CUDA_VISIBLE_DEVICES
(None: unset, as in a host of an earlier release, where Ray set CUDA_VISIBLE_DEVICES)."""


def _truthy(value: str | None) -> bool:
    """As Ray reads NOSET_CUDA_VISIBLE_DEVICES (`env_bool`): "1" or "true", any case."""
    return value is not None and value.lower() in ("1", "true")


def _changed(handle: Any, d: DeviceSpec) -> str | None:
    """How the host `handle` of an earlier run differs from device `d` (its kind; its node, where `d`
    names one: a host of a device that names none says its machine's name; a CUDA device's GPU index,
    and whether Ray leaves its CUDA_VISIBLE_DEVICES alone), or None: the same, or it cannot tell now
    (not placed, not answering: it is kept, as before)."""
    if _scheduled(handle) is False:
        return None
    try:
        asked = handle.status.remote()
        index_asked = handle.__ray_call__.remote(_HOST_INDEX) if d.kind == "cuda" else None
        st: P.WorkerStatus = ray.get(asked, timeout=REATTACH_CHECK_S)
    except Exception as e:
        logger.info("device %s: its host from an earlier run did not say what it runs (%s)", d.name, e)
        return None
    if st.kind != d.kind:
        return f"its host from an earlier run is a {st.kind} device, the config's is a {d.kind} one"
    if d.node and st.node != d.node:
        return f"its host from an earlier run is on Ray node {st.node!r}, the config names {d.node!r}"
    if index_asked is not None:  # (a CPU device's index selects nothing)
        try:
            index = ray.get(index_asked, timeout=REATTACH_CHECK_S)
        except Exception as e:
            logger.info("device %s: its host from an earlier run did not say which GPU it runs (%s); "
                        "it is kept", d.name, _named(e))  # fmt: skip
            return None
        if index != d.index:
            return f"its host from an earlier run serves cuda:{index}, the config's entry says cuda:{d.index}"
    if d.kind == "cuda":  # asked once it is known to serve the config's index
        try:
            noset = ray.get(handle.__ray_call__.remote(_GPU_ENV_ASKED), timeout=REATTACH_CHECK_S)
        except Exception as e:
            logger.info("device %s: its host from an earlier run did not say how it sees its GPUs (%s); "
                        "it is kept", d.name, _named(e))  # fmt: skip
            return None
        if not _truthy(noset):
            return (
                "its host from an earlier run has CUDA_VISIBLE_DEVICES set by Ray to the GPU Ray picked "
                f"(made by an earlier release), so its cuda:{d.index} need not be the GPU the config names"
            )
    return None


def _until_gone(name: str, namespace: str, timeout_s: float = 30.0) -> None:
    """Until the named actor (killed) is gone from Ray's names, so that its name is free again."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=namespace)
        except ValueError:
            return
        time.sleep(0.1)
    logger.warning("actor %s: still named %g s after it was killed", name, timeout_s)


class _Placing:
    """A host that has not answered yet: its readiness call, since when it is waited for, and the last
    verdict on it (why it is refused, or None) with when that was reached."""

    def __init__(self, probe: Any, since: float) -> None:
        self.probe = probe
        self.since = since
        self.checked_at = -math.inf
        self.why: str | None = None


class RayWorkerPool:
    """`WorkerPool` over named, detached device-host actors (created, or reattached if they exist)."""

    def __init__(
        self,
        devices: list[DeviceSpec],
        *,
        namespace: str = NAMESPACE,
        max_restarts: int = -1,
        local: bool = False,
    ) -> None:
        """`local`: the cluster is the local Ray `serve` started (a GPU it lacks is this machine's)."""
        if not ray.is_initialized():
            ensure_ray()
        self.local = local
        self.specs = {d.name: d for d in devices}
        self.actors: dict[str, Any] = {}
        self.reattached: dict[str, bool] = {}
        for d in devices:
            self.actors[d.name], self.reattached[d.name] = self._actor(d, namespace, max_restarts)
        # Per device: commands waiting their turn, and the one in flight (ObjectRef). Sending one at a
        # time keeps each device's commands in submission order.
        self._queued: dict[str, deque[tuple[str, P.Command]]] = {d: deque() for d in self.actors}
        self._inflight: dict[str, tuple[Any, str, P.Command] | None] = dict.fromkeys(self.actors)
        self._not_before: dict[str, float] = dict.fromkeys(self.actors, 0.0)
        self._unavailable_since: dict[str, float] = {}  # op id -> when its host first was unreachable
        self._lost_replies: set[str] = set()  # op ids sent again once because their reply was lost
        self._deaths = _Deaths()
        self._lock = threading.Lock()
        self._batchers: dict[str, _Batcher] = {}
        # Hosts not yet heard from; commands wait for them (or are refused: `_placement`).
        self._where = _cluster_name()
        now = time.monotonic()
        self._placing = {d: _Placing(h.__ray_ready__.remote(), now) for d, h in self.actors.items()}
        self._refused: list[P.CommandResult] = []  # answered meanwhile, for the next `poll`
        with self._lock:
            for device in self.actors:  # one no node can take is said at the start
                self._placement(device, now)

    @staticmethod
    def _actor(d: DeviceSpec, namespace: str, max_restarts: int) -> tuple[Any, bool]:
        """`d`'s host: the one of an earlier run, reattached (True), unless it is another kind, on
        another node or (CUDA) on another GPU index than `d` says (the config changed since): that one
        is replaced by a new one."""
        name = actor_name(d.name)
        try:
            held = ray.get_actor(name, namespace=namespace)
        except ValueError:
            held = None
        if held is not None:
            why = _changed(held, d)
            if why is None:
                return held, True
            logger.warning("device %s: %s; it is replaced by a new host (what it held is loaded again)",
                           d.name, why)  # fmt: skip
            ray.kill(held, no_restart=True)
            _until_gone(name, namespace)
        opts: dict[str, Any] = {
            "name": name,
            "namespace": namespace,
            "lifetime": "detached",
            "max_restarts": max_restarts,
            "max_task_retries": 0,
            "num_cpus": 0,
            "get_if_exists": True,
        }
        if d.kind == "cuda":
            opts["num_gpus"] = 1  # Ray's accounting; which GPU the host uses is its index (module doc)
            opts["runtime_env"] = {"env_vars": dict(CUDA_ENV_VARS)}
        if d.node:
            opts["resources"] = {f"node:{d.node}": NODE_SHARE}
        return RemoteDeviceHost.options(**opts).remote(d.name, d.kind, d.index, d.node), False

    def _handle(self, device: str) -> Any:
        if device not in self.actors:
            raise UnknownDevice(device)
        return self.actors[device]

    def devices(self) -> list[str]:
        return list(self.actors)

    def submit(self, device: str, cmd: P.Command, op_id: str | None = None) -> str:
        op = op_id or new_op_id()
        self._handle(device)
        with self._lock:
            self._queued[device].append((op, cmd))
            self._pump(device)
        return op

    def _pump(self, device: str) -> None:
        now = time.monotonic()
        held = now < self._not_before[device]  # its host is restarting: wait a moment
        if self._inflight[device] is None and self._queued[device] and not held:
            placed, why = self._placement(device, now)
            if why is not None:  # no node takes its host: every command waiting for it is answered
                queued = self._queued[device]
                while queued:
                    op, cmd = queued.popleft()
                    self._refused.append(_not_placed(device, op, cmd, why))
                return
            if not placed:
                return
            op, cmd = self._queued[device].popleft()
            self._inflight[device] = (self.actors[device].apply.remote(cmd, op), op, cmd)

    def _placement(self, device: str, now: float) -> tuple[bool, str | None]:
        """(placed, why): whether `device`'s host is placed on a Ray node (it answered, or Ray found it
        one a while ago), and, when not, why it is refused: no live node offers what it asks for, or
        it waited for one past PLACEMENT_WAIT_S; (False, None): it may just take a moment yet. The
        cluster is asked at most every PLACEMENT_CHECK_S; a refusal is logged as an error when it
        begins. Under the lock."""
        p = self._placing.get(device)
        if p is None:
            return True, None
        ready, _ = ray.wait([p.probe], num_returns=1, timeout=0)
        if ready:  # (an error there, a constructor that raised, is for its calls to report)
            del self._placing[device]
            if p.why is not None:
                logger.info("device %s: its host is placed on a Ray node now", device)
            return True, None
        if now - p.checked_at < PLACEMENT_CHECK_S:
            return False, p.why
        p.checked_at = now
        d, before = self.specs[device], p.why
        try:
            nodes = ray.nodes()  # type: ignore[no-untyped-call]
        except Exception as e:  # the cluster cannot be asked now: the host is waited for
            logger.debug("device %s: the Ray cluster's nodes could not be read (%s)", device, e)
            return False, p.why
        p.why = unplaceable(d, nodes, self._where, local=self.local)
        if p.why is None and now - p.since >= PLACEMENT_WAIT_S:
            scheduled = _scheduled(self.actors[device])
            if scheduled is None or scheduled:  # on a node, starting (slow imports): as before, sent
                del self._placing[device]
                return True, None
            free = ray.available_resources()  # type: ignore[no-untyped-call]
            p.why = not_placed(d, nodes, free, self._where)
        if p.why is not None and p.why != before:
            logger.error("%s", p.why)
        return False, p.why

    def _refusal(self, device: str) -> str | None:
        """Why `device`'s host, not yet placed, is refused (see `_placement`), or None."""
        if device not in self._placing:  # (placed: the common case, without the lock)
            return None
        with self._lock:
            return self._placement(device, time.monotonic())[1]

    def poll(self) -> list[P.CommandResult]:
        with self._lock:
            for device in self.actors:  # a command held back while its host restarts goes again
                self._pump(device)
            out, self._refused = self._refused, []
            flying = {v[0]: d for d, v in self._inflight.items() if v is not None}
            if not flying:
                return out
            ready, _ = ray.wait(list(flying), num_returns=len(flying), timeout=0)
            for ref in ready:
                device = flying[ref]
                entry = self._inflight[device]
                assert entry is not None
                _, op, cmd = entry
                self._inflight[device] = None
                try:
                    out.append(ray.get(ref, timeout=0))
                    self._unavailable_since.pop(op, None)
                    self._lost_replies.discard(op)
                    self._deaths.alive(device)
                except Exception as e:  # (any: the command must be answered)
                    failed = self._failed(device, op, cmd, e, time.monotonic())
                    if failed is not None:
                        out.append(failed)
                self._pump(device)
            return out

    def _failed(
        self, device: str, op: str, cmd: P.Command, e: Exception, now: float
    ) -> P.CommandResult | None:
        """The result of a command whose call raised `e`, or None when it is queued again (first in its
        device's queue, sent after UNAVAILABLE_RETRY_S) because its host, whose death was already
        reported, is still restarting. An error that is not the host's death (`_is_death`) fails this
        command alone (INTERNAL): no death is recorded. A command whose reply was lost (`_object_lost`: the
        host may have run it) is sent again once, first in its device's queue, under the same op id:
        the host answers a repeated op id from its cache of results, without running it again."""
        if not _is_death(e):
            self._unavailable_since.pop(op, None)
            what = f"{P.command_op(cmd)} of {P.command_model(cmd)!r}"
            if _object_lost(e):
                if op not in self._lost_replies:
                    self._lost_replies.add(op)
                    logger.warning("%s; sent again under its op id", _lost_reply(device, what, e))
                    self._queued[device].appendleft((op, cmd))
                    return None
                self._lost_replies.discard(op)  # (lost again: it fails, `_failure` says so)
            if isinstance(e, RayTaskError):  # it ran the command: the host answers
                self._deaths.alive(device)
            return _command_failed(device, op, cmd, _failure(device, what, e))
        if isinstance(e, ActorUnavailableError) and self._deaths.reported(device, now):
            first = self._unavailable_since.setdefault(op, now)
            if now - first < UNAVAILABLE_MAX_S:
                if first == now:
                    logger.info("device %s is restarting; %s waits for it", device, P.command_op(cmd))
                self._queued[device].appendleft((op, cmd))
                self._not_before[device] = now + UNAVAILABLE_RETRY_S
                return None
        self._unavailable_since.pop(op, None)
        self._lost_replies.discard(op)  # (a resend that found the host dead: answered now)
        self._deaths.seen(device, e, now)
        return _died(device, op, cmd, e)

    def pending(self) -> int:
        with self._lock:
            return sum(len(q) for q in self._queued.values()) + sum(
                v is not None for v in self._inflight.values()
            )

    def status(self, device: str, timeout_s: float = 10.0) -> P.WorkerStatus:
        """What `device`'s host holds; HostNotPlaced at once when no Ray node can take it."""
        why = self._refusal(device)
        if why is not None:
            raise HostNotPlaced(why)
        result: P.WorkerStatus = ray.get(self._handle(device).status.remote(), timeout=timeout_s)
        return result

    def describe(self, device: str, spec: P.ModelSpec, timeout_s: float = DESCRIBE_TIMEOUT_S + 15.0) -> Any:
        # longer than the host's own limit, so its clear error (the factory may hang) is the answer
        return ray.get(self._handle(device).describe.remote(spec), timeout=timeout_s)

    def _get(self, ref: Any, device: str, timeout_s: float, what: str) -> tuple[Any, str | None, str]:
        """`ray.get` with a deadline: (value, None, ""), or (None, why, code) when the host died
        (WORKER_DIED), did not answer in time (DEADLINE), or the call failed otherwise: the host
        raised, it lives on (INTERNAL)."""
        try:
            value = ray.get(ref, timeout=timeout_s)
        except Exception as e:
            if isinstance(e, GetTimeoutError) and not isinstance(e, RayTaskError):  # (not one it raised)
                return None, _silent(what, device, timeout_s), P.DEADLINE
            if _is_death(e):
                self._deaths.seen(device, e)
                return None, _why(device, e), P.WORKER_DIED
            if isinstance(e, RayTaskError):  # it ran the call: the host answers
                self._deaths.alive(device)
            return None, _failure(device, what, e), P.INTERNAL
        self._deaths.alive(device)
        return value, None, ""

    def infer(
        self, device: str, model: str, inputs: dict[str, np.ndarray], timeout_s: float = 30.0
    ) -> P.InferResult:
        refused = self._refusal(device)
        if refused is not None:
            return P.InferResult(
                model, False, error_code=P.NOT_AVAILABLE, error=f"model {model!r}: {refused}"
            )
        ref = self._handle(device).infer.remote(model, inputs)
        result, why, code = self._get(ref, device, timeout_s, f"model {model!r}")
        return P.InferResult(model, False, error_code=code, error=why) if why else result

    def session(self, device: str, method: str, *args: object, timeout_s: float = 120.0) -> P.SessionReply:
        refused = self._refusal(device)
        if refused is not None:
            return P.SessionReply(False, error_code=P.NOT_AVAILABLE, error=refused)
        ref = self._handle(device).session.remote(method, *args)
        reply, why, code = self._get(ref, device, timeout_s, f"world session {method}")
        # (silent too: a session call that outlasts its deadline is taken for a lost host, reopened;
        # one the host raised on is not: it is alive)
        code = P.WORKER_DIED if code == P.DEADLINE else code
        return P.SessionReply(False, error_code=code, error=why) if why else reply

    async def infer_async(
        self,
        device: str,
        model: str,
        inputs: dict[str, np.ndarray],
        timeout_s: float = 30.0,
        late: list[Any] | None = None,
    ) -> P.InferResult:
        """`infer` for an asyncio caller: requests queued for a model while its calls are in flight go
        together in one actor call (`infer_many`), so a burst pays one Ray round trip, not one each;
        a model whose calls take long holds only its own requests, not its device's other models'.
        A request answered DEADLINE after its batch was sent: that batch's call (an asyncio task,
        done when its host answers) is put in `late`, as the in-process host's thread is: the forward
        goes on there, and the model is busy (never dropped under it: the drop would wait for it,
        holding every later command of its device) until it ends."""
        import asyncio

        refused = self._refusal(device)
        if refused is not None:
            return P.InferResult(
                model, False, error_code=P.NOT_AVAILABLE, error=f"model {model!r}: {refused}"
            )
        batcher = self._batchers.get(device)
        if batcher is None:
            batcher = self._batchers[device] = _Batcher(self._handle(device), device, self._deaths)
        sent: list[Any] = []
        try:
            return await asyncio.wait_for(batcher.submit(model, inputs, sent), timeout=timeout_s)
        except TimeoutError:
            if late is not None and sent and not sent[0].done():
                late.append(sent[0])
            why = _silent(f"model {model!r}", device, timeout_s)
            return P.InferResult(model, False, error_code=P.DEADLINE, error=why)

    def kill(self, device: str, *, no_restart: bool = False) -> None:
        """Kill a device host (tests and fault drills); with restarts allowed Ray starts it again.
        Its data channel is dropped first: the process may answer on it for a moment after Ray has
        declared the actor dead, and what a killed host says should not count."""
        batcher = self._batchers.get(device)
        if batcher is not None:
            batcher.forget_channel()
        ray.kill(self._handle(device), no_restart=no_restart)

    def close(self) -> None:
        """Forget the actors (they live on, detached); `shutdown_actors` ends them."""
        with self._lock:
            for q in self._queued.values():
                q.clear()
        for b in self._batchers.values():
            b.close()

    def shutdown_actors(self) -> None:
        self.close()
        for h in self.actors.values():
            ray.kill(h, no_restart=True)
        self.actors.clear()


class _Deaths:
    """Per device: when a call first found its host dead (and said so), until a call succeeds again."""

    def __init__(self) -> None:
        self._at: dict[str, float] = {}

    def seen(self, device: str, e: Exception, now: float | None = None) -> None:
        if _is_death(e):
            self._at.setdefault(device, time.monotonic() if now is None else now)

    def alive(self, device: str) -> None:
        self._at.pop(device, None)

    def reported(self, device: str, now: float) -> bool:
        """Was this host's death reported within UNAVAILABLE_MAX_S (and has it not answered since)?"""
        t = self._at.get(device)
        return t is not None and now - t < UNAVAILABLE_MAX_S


def _silent(what: str, device: str, timeout_s: float) -> str:
    return f"{what}: no answer from device {device!r} within {timeout_s:.3g} s"


_HOST_GONE: tuple[type[Exception], ...] = (
    RayActorError,  # ActorDiedError, ActorUnavailableError
    OutOfMemoryError,  # Ray's memory monitor killed the host (its death cause: an OOM context)
    NodeDiedError,  # the host's node died
    WorkerCrashedError,  # the host's worker process died under the call
    LocalRayletDiedError,  # this node's raylet died (its workers with it)
    RuntimeEnvSetupError,  # the host could not be (re)made: its runtime env failed
    ActorUnschedulableError,  # nor placed: it is dead for good
)
"""What Ray 2.60 raises from a call on an actor that is gone (`ray._private.serialization`: an actor's
death cause becomes ACTOR_DIED, OUT_OF_MEMORY, RUNTIME_ENV_SETUP_FAILED or ACTOR_UNSCHEDULABLE_ERROR),
unless its own code raised it (`RayTaskError`). Not here: a lost reply (`_object_lost`: the next call says
whether the host is gone), a cancelled call, a full object store, Ray's own timeouts."""


def _object_lost(e: BaseException) -> bool:
    """Whether `e` says that the reply of a call was lost, not that the host died (`ray.exceptions`,
    Ray 2.60): `ObjectLostError`, every copy of the reply lost from the object store (node failure or
    system error), and its kinds: `ObjectReconstructionFailedError` (it cannot be made again: an actor
    call is not retried here), `ObjectFetchTimedOutError` (no copy found), `OwnerDiedError` (the
    reply's owner died: the process that made the call, this one, not the host). The host may have run
    the call, and may live on: its next call says (a dead host's raises `RayActorError`)."""
    return isinstance(e, ObjectLostError) and not isinstance(e, RayTaskError)


def _is_death(e: BaseException) -> bool:
    """Whether `e`, raised by a call on a device host, says that the host died or cannot be reached
    (`_HOST_GONE`: Ray's `RayActorError`, `OutOfMemoryError` for a host its memory monitor killed,
    ...), not that the call failed on a host that lives on: its method raised (`RayTaskError`, even
    one whose cause is a Ray error its own code met), or anything else."""
    return isinstance(e, _HOST_GONE) and not isinstance(e, RayTaskError)


def _named(e: BaseException) -> str:
    """`e` as "Type: first line of its message"; for an error a host's method raised, the error it
    raised (not Ray's wrapper, whose message is the remote traceback)."""
    cause = e.cause if isinstance(e, RayTaskError) and e.cause is not None else e
    lines = str(cause).strip().splitlines()
    return f"{type(cause).__name__}: {lines[0]}" if lines else type(cause).__name__


def _why(device: str, e: Exception) -> str:
    """Why a call found `device`'s host dead (`_is_death`)."""
    return f"device host {device!r} died: {_named(e)}"


def _lost_reply(device: str, what: str, e: BaseException) -> str:
    """Why `what` has no answer: its reply from `device`'s host was lost (`_object_lost`)."""
    return f"{what} on device host {device!r}: its reply was lost ({_named(e)}); the host may have run it"


def _failure(device: str, what: str, e: BaseException) -> str:
    """Why `what` (a command, a request, a session call) failed on `device`'s host, which lives on
    (`e` is not its death); logged as a warning, with the host's traceback where Ray brought one."""
    if _object_lost(e):  # (not "alive": the host's next call says)
        lost = _lost_reply(device, what, e)
        logger.warning("%s", lost)
        return lost
    why = f"{what} failed on device host {device!r} (alive): {_named(e)}"
    detail = str(e) if isinstance(e, RayTaskError) else ""
    logger.warning("%s%s", why, f"\n{detail}" if detail else "")
    return why


def _unheld(device: str, model: str, e: ReplyTooLarge) -> P.InferResult:
    """The answer to a request that ran, whose over-limit reply its host no longer held to fetch."""
    why = (
        f"model {model!r} ran on device {device!r}, but its batch's {e.nbytes}-byte reply (over the data "
        "channel's frame limit) was no longer held there to fetch; it is not run again"
    )
    return P.InferResult(model, False, error_code=P.INTERNAL, error=why)


def _lost(device: str, model: str, e: ReplyLost, why: str, code: str) -> P.InferResult:
    """The answer to a request whose batch went over the channel, which broke before its reply came
    (`e`): it may have run, so it is not run again. `why`: what became of the host; `code`: INTERNAL
    when it is alive (the manager keeps it and does not retry), WORKER_DIED when it is not."""
    error = (
        f"model {model!r} on device {device!r}: the data channel broke after the request was sent "
        f"({e}); it may have run, and its answer was lost; it is not run again ({why})"
    )
    return P.InferResult(model, False, error_code=code, error=error)


def _not_placed(device: str, op: str, cmd: P.Command, why: str) -> P.CommandResult:
    model = P.command_model(cmd)
    return P.CommandResult(
        op, model, P.command_op(cmd), False, error_code=P.NOT_AVAILABLE, error=f"model {model!r}: {why}",
        device=device,
    )  # fmt: skip


def _command_failed(device: str, op: str, cmd: P.Command, why: str) -> P.CommandResult:
    return P.CommandResult(
        op, P.command_model(cmd), P.command_op(cmd), False, error_code=P.INTERNAL, error=why, device=device
    )


def _died(device: str, op: str, cmd: P.Command, e: Exception) -> P.CommandResult:
    return P.CommandResult(
        op, P.command_model(cmd), P.command_op(cmd), False, error_code=P.WORKER_DIED, error=_why(device, e),
        device=device,
    )  # fmt: skip


class _Batcher:
    """Per device: each batch holds one model's requests (up to MAX_BATCH), at most MAX_INFLIGHT
    batches in flight per model and MAX_INFLIGHT_DEVICE per device; what queues meanwhile goes next.
    A model whose calls take long (or hang) so holds its own requests only, never the device's other
    models' (the host runs each model's calls under a lock of its own). A batch goes over the host's
    data channel when it is on this machine (`workers.channel`), else (or while the channel is being
    found, or after it broke) in one `infer_many` actor call. A batch that ran over the channel with
    a reply too large for it has its results fetched with a `channel_reply` actor call: it is never
    run a second time. Nor is one whose channel broke after it was sent (it may have run): its
    requests get an error saying so, `internal` while the host that was sent it answers (it is
    alive: no retry, no resync), else `worker_died`. Runs on the caller's event loop."""

    MAX_INFLIGHT = 2
    """Batches of one model in flight at once (one runs while the next is on its way)."""
    MAX_INFLIGHT_DEVICE = 8
    """Batches in flight to one device at once (its actor's data calls run on 16 threads: the rest
    are for status reads, sessions and describes)."""
    MAX_BATCH = 64
    REDISCOVER_S = 1.0
    CHECK_S = 10.0
    """How long the check of a host whose channel broke under a sent batch waits for its answer."""

    def __init__(self, handle: Any, device: str, deaths: _Deaths) -> None:
        self.handle = handle
        self.device = device
        self.deaths = deaths
        self.queue: list[tuple[str, dict[str, np.ndarray], Any]] = []
        self.inflight = 0
        self._inflight_of: dict[str, int] = {}  # per model, those with a batch in flight
        self.channel: ChannelClient | None = None
        self._looked_at = -math.inf
        self.channel_batches = 0
        self._tasks: set[Any] = set()
        self._sent: dict[Any, list[Any]] = {}  # a queued request's future -> where its batch's call goes
        self.loop: Any = None

    async def submit(
        self, model: str, inputs: dict[str, np.ndarray], sent: list[Any] | None = None
    ) -> P.InferResult:
        """The request's result; `sent` gets the call (an asyncio task) of the batch it goes in, once
        that is sent, so a caller that stops waiting can still tell when the host is done with it."""
        import asyncio

        loop = asyncio.get_running_loop()
        if loop is not self.loop:  # a new event loop (tests run several): its futures and tasks are gone
            self.loop, self.queue, self.inflight, self._inflight_of = loop, [], 0, {}
            self._sent = {}
        fut = loop.create_future()
        if sent is not None:
            self._sent[fut] = sent
        self.queue.append((model, inputs, fut))
        self._kick()
        result: P.InferResult = await fut
        return result

    def _kick(self) -> None:
        import asyncio

        loop = asyncio.get_running_loop()
        if self.channel is None and loop.time() - self._looked_at >= self.REDISCOVER_S:
            self._looked_at = loop.time()
            self._spawn(loop.create_task(self._discover()))
        # a request whose caller gave up while it queued (its wait timed out, its call was cancelled)
        # is not sent: it would run for no one, ahead of every newer request
        queued = [q for q in self.queue if not q[2].done()]
        for q in self.queue:
            if q[2].done():
                self._sent.pop(q[2], None)
        self.queue = []
        batches: list[list[tuple[str, dict[str, np.ndarray], Any]]] = []
        filling: dict[str, list[tuple[str, dict[str, np.ndarray], Any]]] = {}
        per_model = self.MAX_INFLIGHT
        for q in queued:  # in arrival order: a model's batch, or a new one where it has room, or wait
            batch = filling.get(q[0])
            if batch is not None and len(batch) < self.MAX_BATCH:
                batch.append(q)
            elif self.inflight < self.MAX_INFLIGHT_DEVICE and self._inflight_of.get(q[0], 0) < per_model:
                filling[q[0]] = batch = [q]
                batches.append(batch)
                self.inflight += 1
                self._inflight_of[q[0]] = self._inflight_of.get(q[0], 0) + 1
            else:
                self.queue.append(q)
        for batch in batches:
            task = loop.create_task(self._run(batch))
            self._spawn(task)
            for _, _, fut in batch:
                sent = self._sent.pop(fut, None)
                if sent is not None:
                    sent.append(task)

    def _spawn(self, task: Any) -> None:
        self._tasks.add(task)  # held until done (the loop keeps only weak references)
        task.add_done_callback(self._tasks.discard)

    def close(self) -> None:
        if self.channel is not None:
            self.channel.close()
            self.channel = None

    def forget_channel(self) -> None:
        """Drop the channel and look for the host's next one no sooner than REDISCOVER_S from now."""
        self.close()
        self._looked_at = time.monotonic()  # the event loop's clock is the monotonic one

    async def _discover(self) -> None:
        import asyncio

        try:
            addr = await asyncio.wait_for(asyncio.wrap_future(self.handle.channel.remote().future()), 10.0)
        except Exception as e:  # an older actor, a dead one, or a slow start: Ray calls meanwhile
            logger.debug("device %s: no data channel yet (%s)", self.device, e)
            return
        if addr is not None and same_machine(addr) and self.channel is None:
            self.channel = ChannelClient(addr, connections=self.MAX_INFLIGHT_DEVICE)

    async def _reply_lost(
        self, items: list[tuple[str, dict[str, np.ndarray]]], channel: ChannelClient, e: ReplyLost
    ) -> tuple[list[P.InferResult], bool]:
        """The answers to a batch whose channel broke after it was sent, and whether the device's
        host answered a check. Whether the host that was sent it lives on decides the code: it still
        answers (with the same channel address), or the check failed on it otherwise (it raised) =
        INTERNAL; it died, or a restarted one answers (a new address) = WORKER_DIED, as a call
        through Ray says."""
        import asyncio

        answered = False
        try:
            addr = await asyncio.wait_for(self.handle.channel.remote(), self.CHECK_S)
        except TimeoutError:  # unknown: the request still must not run twice
            why, code = f"its host did not answer a check within {self.CHECK_S:g} s", P.INTERNAL
        except Exception as err:
            if _is_death(err):
                self.deaths.seen(self.device, err)
                why, code = _why(self.device, err), P.WORKER_DIED
            else:  # it lives on (a check it raised on: it answered)
                answered = isinstance(err, RayTaskError)
                why, code = f"its host failed the check: {_named(err)}", P.INTERNAL
        else:
            answered = True
            if addr == channel.address:
                why, code = f"device host {self.device!r} is alive", P.INTERNAL
            else:
                why, code = f"device host {self.device!r} restarted meanwhile", P.WORKER_DIED
        return [_lost(self.device, m, e, why, code) for m, _ in items], answered

    async def _run(self, batch: list[tuple[str, dict[str, np.ndarray], Any]]) -> None:
        items = [(m, x) for m, x, _ in batch]
        answered = True  # (False: the host did not answer the check after its channel broke)
        try:
            results = None
            channel = self.channel
            if channel is not None:
                try:
                    results = await channel.infer_many(items)
                    self.channel_batches += 1
                except ReplyTooLarge as e:  # it ran: its results come through Ray, not a second run
                    logger.info("device %s: %s; its results come through Ray", self.device, e)
                    held = await self.handle.channel_reply.remote(e.token)
                    results = held if held is not None else [_unheld(self.device, m, e) for m, _ in items]
                except FrameTooLarge as e:
                    logger.info("device %s: %s; going through Ray", self.device, e)
                except ReplyLost as e:  # it may have run: an error, never a second run
                    logger.warning("device %s: data channel broke under a sent batch (%s)", self.device, e)
                    if self.channel is channel:
                        self.close()
                    results, answered = await self._reply_lost(items, channel, e)
                except ChannelError as e:
                    logger.warning("device %s: data channel broke (%s); going through Ray", self.device, e)
                    if self.channel is channel:  # (not one found again meanwhile)
                        self.close()
            if results is None:
                results = await self.handle.infer_many.remote(items)
            if answered:
                self.deaths.alive(self.device)
        except Exception as e:  # the actor died, or anything else: every waiter gets an answer
            if _is_death(e):
                self.deaths.seen(self.device, e)
                why, code = _why(self.device, e), P.WORKER_DIED
            else:  # the host raised (or the call failed here): it lives on
                if isinstance(e, RayTaskError):
                    self.deaths.alive(self.device)
                why, code = _failure(self.device, f"model {batch[0][0]!r}", e), P.INTERNAL
            results = [P.InferResult(m, False, error_code=code, error=why) for m, _, _ in batch]
        finally:
            self.inflight -= 1
            left = self._inflight_of.pop(batch[0][0], 0) - 1
            if left > 0:
                self._inflight_of[batch[0][0]] = left
        for (_, _, fut), r in zip(batch, results, strict=True):
            if not fut.done():
                fut.set_result(r)
        self._kick()
