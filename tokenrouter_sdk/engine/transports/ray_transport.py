"""Sub-servers hosted by Ray actors, on any node of a Ray cluster (``Router(..., cluster="ray")``).

Ray places, starts, watches and stops the sub-servers; the data path stays ours: each actor runs
the same sub-server loop as a local process (`process_child.run_subserver`) and connects to this
process's pyzmq hub over TCP, so handoffs and events take the route they take on one machine
(`hub.HubTransport` is the hub; `RayLauncher` is how the actors start, get their spec, are
watched and end, as `process_transport.ProcessLauncher` is for local processes).

- Placement: one placement group per Router with one bundle per model (``{"CPU": threads}`` plus
  the model's own ``resources``, e.g. ``{"GPU": 2}`` or a custom node resource), packed by
  default (``strategy="PACK"``; ``"SPREAD"``/``"STRICT_SPREAD"`` on request), as vLLM's Ray
  executor places its ranks. Each actor runs in its model's bundle.
- Spec: the sub-server's spec travels by value through Ray's object store (cloudpickle; weights
  inside it), since shared-memory descriptors cannot cross nodes; the actor builds the runner
  from its `RunnerSpec` (`process_child.build_subserver`). A tensor-parallel model
  travels as its recipe (a folder its ranks load), its ranks start on the actor's node.
- Liveness: each actor's long-running ``run`` call; a watcher thread per actor waits on its
  object ref, and when it ends (an actor or its node died: Ray raises ``ActorDiedError`` /
  ``ActorUnavailableError``) the hub reports the model dead with the node it ran on, as it
  does for a local process's exit.
- Clocks: an actor's ``hi`` carries its clock; when it differs from the hub's by more than
  `CLOCK_SKEW_S` (another host: monotonic clocks start at each host's boot), the times of its
  events are moved onto the hub's clock.
- `close` shuts the sub-servers down, kills every actor and removes the placement group (and
  shuts Ray down if this transport started it).

The hub binds the node's address as Ray reports it (``ray.util.get_node_ip_address()``; on a
loopback cluster 127.0.0.1) on a free port.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import threading
import time
from typing import Callable

from .hub import HubTransport, Started, boot_record
from .wire import _child_spec

CLOCK_SKEW_S = 0.05  # a clock this far from the hub's is another host's: its event times are moved
TIME_FIELDS = ("t", "t_admit", "t_start", "t_end")
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


class SubServerActor:
    """The Ray actor that hosts one sub-server (made a Ray actor class by `RayLauncher.launch`)."""

    def node(self) -> dict:
        """Where this actor runs: ``{"node_id", "ip", "pid"}``."""
        import ray

        return {
            "node_id": ray.get_runtime_context().get_node_id(),
            "ip": ray.util.get_node_ip_address(),
            "pid": os.getpid(),
        }

    def run(self, name: str, address: str, threads: int, payload: bytes) -> int:
        """Serve model ``name``'s sub-server (its spec: ``payload``) until `Shutdown`; returns
        its exit code."""
        import pickle

        from .process_child import run_subserver
        from .wire import _LoadError

        def load(data):
            try:
                return pickle.loads(data)
            except BaseException as e:  # noqa: BLE001 - reported through the hub
                return _LoadError(f"could not load the sub-server spec in the Ray actor: {type(e).__name__}: {e}")

        return run_subserver(
            name, address, threads, lambda: (payload,), load, t_main=time.perf_counter(), watch_parent=False
        )


class ActorProcess:
    """One actor as the hub watches it (`hub.Started`): a watcher thread waits on its ``run``
    call's object ref; when that ends (returned, or the actor or its node died) a pipe and a
    socket pair turn readable (``sentinels``), and ``exitcode`` holds the code ``run`` returned."""

    def __init__(self, name: str, actor, ref, node: dict, on_error: Callable[[str, str], None]):
        self.name, self.actor, self.ref, self.node = name, actor, ref, node
        self.pid = node.get("pid")
        self.exitcode: int | None = None
        self._r, self._w = os.pipe()
        self.sentinel = self._r
        self.chan, self._peer = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._ended = threading.Event()
        self._on_error = on_error
        self._watch = threading.Thread(target=self._wait, name=f"tokenrouter-ray-{name}", daemon=True)
        self._watch.start()

    def _wait(self) -> None:
        import ray

        try:
            code = ray.get(self.ref)
            self.exitcode = int(code) if isinstance(code, int) else 0
        except Exception as e:  # noqa: BLE001 - the actor or its node died (no exit code to tell)
            where = f"node {self.node.get('node_id', '?')[:12]} ({self.node.get('ip', '?')})"
            self._on_error(
                self.name,
                f"its Ray actor on {where} is gone: {type(e).__name__}: "
                f"{str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}",
            )
        finally:
            self._ended.set()
            try:
                os.close(self._w)
            except OSError:
                pass
            self._peer.close()

    def join(self, timeout: float | None = None) -> None:
        self._ended.wait(timeout)

    def sentinels(self) -> list:
        return [self.chan, self._r]

    def ended(self) -> bool:
        return self._ended.is_set()

    def signal(self, sig: int) -> None:
        """Kill the actor (Ray has no gentler way to end a busy one)."""
        if not self.ended():
            import ray

            try:
                ray.kill(self.actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass

    def close(self) -> None:
        for close in (lambda: os.close(self._r), self.chan.close):
            try:
                close()
            except OSError:
                pass


class RayLauncher:
    """Starts each sub-server in a Ray actor (`hub.Launcher`); see the module docstring.

    Args: as `RayTransport`'s.

    Attributes:
        kind: ``"ray"``.
        threads: CPUs of each bundle and torch threads of each sub-server.
        nodes: model -> ``{"node_id", "ip", "pid"}`` of its actor (set by `launch`).
        actors: model -> its Ray actor handle (emptied by `close`).
        placement_group: the Router's placement group (None before `prepare` and after `close`).
        launched, pickled: model -> when starting its actor / pickling its spec began and ended.
    """

    kind = "ray"
    what = "the sub-servers' Ray actors"

    def __init__(self, address: str | None, resources: dict, strategy: str, threads: int, start_timeout: float | None):
        self.ray_address, self.resources, self.strategy = address, resources, strategy
        self.threads = threads
        self.start_timeout = start_timeout
        self.nodes: dict[str, dict] = {}
        self.actors: dict = {}
        self._bundle: dict[str, int] = {}  # model -> its bundle of the placement group (a restart reuses it)
        self.placement_group = None
        self.launched: dict[str, tuple[float, float]] = {}
        self.pickled: dict[str, tuple[float, float]] = {}
        self._own_ray = False
        self._offsets: dict[str, float] = {}

    def prepare(self, specs: dict) -> str | None:
        """Connect to (or start) Ray and place one bundle per model; the hub binds this node's
        address.

        Raises:
            ValueError: ``resources`` names a model that is not there.
            RuntimeError: the placement group could not be placed within ``start_timeout``.
        """
        import ray
        from ray.util.placement_group import placement_group

        bad = sorted(set(self.resources) - set(specs))
        if bad:
            raise ValueError(f"resources name model(s) {bad} that the Router does not have ({sorted(specs)})")
        if not ray.is_initialized():
            ray.init(address=self.ray_address, log_to_driver=False)
            self._own_ray = True
        bundles = [{"CPU": self.threads, **self.resources.get(name, {})} for name in specs]
        self.placement_group = placement_group(bundles, strategy=self.strategy)
        self._bundle = {name: i for i, name in enumerate(specs)}
        try:
            ray.get(self.placement_group.ready(), timeout=self.start_timeout)
        except Exception as e:  # noqa: BLE001 - cannot be placed: say what was asked
            raise RuntimeError(
                f"Ray could not place the sub-servers ({bundles}, {self.strategy}) within "
                f"{self.start_timeout} s: {type(e).__name__}; check the cluster's resources "
                f"(ray status)"
            ) from e
        return f"tcp://{ray.util.get_node_ip_address()}:*"

    def launch(
        self, specs: dict, address: str, report: Callable[[str, str], None], started: dict[str, Started]
    ) -> None:
        """One actor per model in its bundle, handed its spec (by value, through Ray's object
        store) and the hub's address."""
        import cloudpickle
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        cls = ray.remote(num_cpus=self.threads, max_concurrency=2)(SubServerActor)
        refs = {}
        for i, (name, spec) in enumerate(specs.items()):
            t0 = time.perf_counter()
            payload = cloudpickle.dumps(_child_spec(spec))
            self.pickled[name] = (t0, time.perf_counter())
            strategy = PlacementGroupSchedulingStrategy(
                self.placement_group, placement_group_bundle_index=self._bundle.get(name, i)
            )
            actor = cls.options(scheduling_strategy=strategy, name=None).remote()
            self.actors[name] = actor
            refs[name] = (actor, actor.node.remote(), payload)
        for name, (actor, node_ref, payload) in refs.items():
            t0 = time.perf_counter()
            self.nodes[name] = ray.get(node_ref, timeout=self.start_timeout)
            run = actor.run.remote(name, address, self.threads, payload)
            started[name] = ActorProcess(name, actor, run, self.nodes[name], report)
            self.launched[name] = (t0, time.perf_counter())

    def deliver(self, specs: dict) -> None:
        """Nothing: each actor got its spec with its ``run`` call."""

    def boot(self, model: str, hello: dict, now: float) -> dict:
        """The start-up times, and the actor's clock offset when its host's clock differs."""
        try:
            theirs = float(hello["now"])
            if abs(now - theirs) > CLOCK_SKEW_S:
                self._offsets[model] = now - theirs
        except (KeyError, TypeError, ValueError):
            pass
        return boot_record(hello, self.launched[model], self.pickled[model], now)

    def adjust(self, event):
        """``event`` with its times moved onto this host's clock (an actor on another host)."""
        off = self._offsets.get(getattr(event, "model", None))
        if off and dataclasses.is_dataclass(event):
            moved = {f: getattr(event, f) + off for f in TIME_FIELDS if isinstance(getattr(event, f, None), float)}
            event = dataclasses.replace(event, **moved)
        return event

    def kill_all(self, started: dict[str, Started]) -> None:
        """Kill every actor, then wait (5 s each) for their ``run`` calls to end."""
        for p in started.values():
            p.signal(signal.SIGKILL)
        for p in started.values():
            p.join(5.0)

    def close(self) -> None:
        """Kill the actors left, remove the placement group, and shut Ray down when `prepare`
        started it. Idempotent."""
        try:
            import ray
        except ImportError:
            return
        if ray.is_initialized():
            for actor in self.actors.values():
                try:
                    ray.kill(actor, no_restart=True)
                except Exception:  # noqa: BLE001 - already gone
                    pass
            if self.placement_group is not None:
                from ray.util.placement_group import remove_placement_group

                try:
                    remove_placement_group(self.placement_group)
                except Exception:  # noqa: BLE001 - the cluster is gone
                    pass
        self.placement_group = None
        self.actors = {}
        if self._own_ray and ray.is_initialized():
            ray.shutdown()
            self._own_ray = False

    def start_error(self, e: BaseException) -> BaseException:
        return e


class RayTransport(HubTransport):
    """Each sub-server in a Ray actor (a `HubTransport` with a `RayLauncher`; see the module
    docstring).

    Args:
        address: the Ray cluster to connect to (``"auto"``, ``"ray://host:10001"``, a GCS
            address); None: the Ray this process is connected to, else a local one started
            here (and shut down by `close`).
        resources: per model, extra Ray resources of its bundle (e.g. ``{"large": {"GPU": 2}}``
            or a custom resource that pins it to a node).
        strategy: placement group strategy, one of `STRATEGIES` (default ``"PACK"``).
        threads: CPUs of each bundle and torch threads of each sub-server (default 1).
        start_timeout: seconds `start` waits for the placement group and for every actor to
            connect.
        close_timeout: seconds `close` waits for each sub-server to end before killing its actor.

    Raises:
        ImportError: Ray is not installed (names the extra).
        ValueError: an unknown strategy.

    Attributes:
        nodes: model -> ``{"node_id", "ip", "pid"}`` of its actor (set by `start`).
        actors: model -> its Ray actor handle (emptied by `close`).
        placement_group: the Router's placement group (None before `start` and after `close`).
    """

    def __init__(
        self,
        address: str | None = None,
        *,
        resources: dict | None = None,
        strategy: str = "PACK",
        threads: int | None = None,
        start_timeout: float | None = 600.0,
        close_timeout: float = 5.0,
    ):
        try:
            import ray  # noqa: F401
        except ImportError as e:
            raise ImportError("sub-servers on Ray need Ray: pip install 'tokenrouter-sdk[ray]'") from e
        if strategy not in STRATEGIES:
            raise ValueError(f"placement strategy must be one of {STRATEGIES}, got {strategy!r}")
        launcher = RayLauncher(address, dict(resources or {}), strategy, threads or 1, start_timeout)
        super().__init__(launcher, address="tcp", start_timeout=start_timeout, close_timeout=close_timeout)

    @property
    def nodes(self) -> dict[str, dict]:
        return self.launcher.nodes

    @property
    def actors(self) -> dict:
        return self.launcher.actors

    @property
    def placement_group(self):
        return self.launcher.placement_group
