"""Sub-servers hosted by Ray actors, on any node of a Ray cluster (``Router(..., cluster="ray")``).

Ray places, starts, watches and stops the sub-servers; the data path stays ours: each actor runs
the same sub-server loop as a local process (`process_child.run_subserver`) and connects to this
process's pyzmq hub over TCP, so handoffs and events take the route they take on one machine
(`ProcessTransport` is the hub; this class only replaces how processes start, get their spec,
are watched and end).

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
import socket
import threading
import time
from typing import Callable

from .process_transport import ProcessTransport, _release_pools
from .wire import _child_spec

CLOCK_SKEW_S = 0.05  # a clock this far from the hub's is another host's: its event times are moved
TIME_FIELDS = ("t", "t_admit", "t_start", "t_end")
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


class SubServerActor:
    """The Ray actor that hosts one sub-server (made a Ray actor class by `RayTransport.start`)."""

    def node(self) -> dict:
        """Where this actor runs: ``{"node_id", "ip", "pid"}``."""
        import ray
        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(),
                "pid": os.getpid()}

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

        return run_subserver(name, address, threads, lambda: (payload,), load, t_main=time.perf_counter(),
                     watch_parent=False)


class _ActorProcess:
    """What the hub watches for one actor, shaped as the `multiprocessing.Process` it watches
    for a local sub-server: ``sentinel`` (a pipe that turns readable when the actor's ``run``
    ends), ``exitcode``, ``pid``, ``join``, ``close``; and ``chan``, a socket whose peer closes
    at the same moment (the hub's other signal of a process's end)."""

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
            self._on_error(self.name, f"its Ray actor on {where} is gone: {type(e).__name__}: "
                                      f"{str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}")
        finally:
            self._ended.set()
            try:
                os.close(self._w)
            except OSError:
                pass
            self._peer.close()

    def join(self, timeout: float | None = None) -> None:
        self._ended.wait(timeout)

    def is_alive(self) -> bool:
        return not self._ended.is_set()

    def close(self) -> None:
        try:
            os.close(self._r)
        except OSError:
            pass


class RayTransport(ProcessTransport):
    """Each sub-server in a Ray actor (see the module docstring).

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

    def __init__(self, address: str | None = None, *, resources: dict | None = None, strategy: str = "PACK",
                 threads: int | None = None, start_timeout: float | None = 600.0, close_timeout: float = 5.0):
        try:
            import ray  # noqa: F401
        except ImportError as e:
            raise ImportError("sub-servers on Ray need Ray: pip install 'tokenrouter-sdk[ray]'") from e
        if strategy not in STRATEGIES:
            raise ValueError(f"placement strategy must be one of {STRATEGIES}, got {strategy!r}")
        super().__init__(threads=threads or 1, address="tcp", start_timeout=start_timeout,
                         close_timeout=close_timeout, start_method="spawn")
        self.start_method = "ray"
        self.ray_address = address
        self.resources = dict(resources or {})
        self.strategy = strategy
        self.nodes: dict[str, dict] = {}
        self.placement_group = None
        self.actors: dict = {}
        self._own_ray = False
        self._offsets: dict[str, float] = {}

    # -- start -----------------------------------------------------------------------------
    def start(self, specs: dict, on_event: Callable[[object], None]) -> None:
        """Connect to (or start) Ray, place one actor per model in a placement group, bind the
        hub on the node's address, send each actor its spec and wait until every one has
        connected.

        Raises:
            RuntimeError: the placement group could not be placed, or an actor died or did not
                connect within ``start_timeout`` (names the model); everything started is removed.
            ValueError: ``resources`` names a model that is not there.
        """
        import cloudpickle
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bad = sorted(set(self.resources) - set(specs))
        if bad:
            raise ValueError(f"resources name model(s) {bad} that the Router does not have ({sorted(specs)})")
        if self._started:
            raise RuntimeError("RayTransport.start was called twice")
        if not ray.is_initialized():
            ray.init(address=self.ray_address, log_to_driver=False)
            self._own_ray = True
        threads = self.child_threads = self.threads
        self.address_spec = f"tcp://{ray.util.get_node_ip_address()}:*"
        try:
            bundles = [{"CPU": threads, **self.resources.get(name, {})} for name in specs]
            self.placement_group = placement_group(bundles, strategy=self.strategy)
            try:
                ray.get(self.placement_group.ready(), timeout=self.start_timeout)
            except Exception as e:  # noqa: BLE001 - cannot be placed: say what was asked
                raise RuntimeError(f"Ray could not place the sub-servers ({bundles}, {self.strategy}) within "
                                   f"{self.start_timeout} s: {type(e).__name__}; check the cluster's resources "
                                   f"(ray status)") from e
            self._open_hub(on_event)
            cls = ray.remote(num_cpus=threads, max_concurrency=2)(SubServerActor)
            refs = {}
            for i, (name, spec) in enumerate(specs.items()):
                t0 = time.perf_counter()
                payload = cloudpickle.dumps(_child_spec(spec))
                self._t_pickle[name] = (t0, time.perf_counter())
                strategy = PlacementGroupSchedulingStrategy(self.placement_group, placement_group_bundle_index=i)
                actor = cls.options(scheduling_strategy=strategy, name=None).remote()
                self.actors[name] = actor
                refs[name] = (actor, actor.node.remote(), payload)
            for name, (actor, node_ref, payload) in refs.items():
                t0 = time.perf_counter()
                self.nodes[name] = ray.get(node_ref, timeout=self.start_timeout)
                run = actor.run.remote(name, self._connect_address(), threads, payload)
                proc = _ActorProcess(name, actor, run, self.nodes[name], self._actor_error)
                self._t_launch[name] = (t0, time.perf_counter())
                self.procs[name] = proc
                self._chans[name] = proc.chan
            self._start_hub()
        except BaseException:
            self._closing = True
            self.close()
            raise
        _release_pools(specs)  # each actor has its own KV pool
        if self.start_timeout is not None and not self.wait_ready(self.start_timeout):
            why = "; ".join(f"'{m}': " + ("died" if m in self._dead else "still starting")
                            + (f": {self._errors[m]}" if m in self._errors else "")
                            for m in self.procs if m not in self._ready)
            self._closing = True
            self.close()
            raise RuntimeError(f"the sub-servers' Ray actors could not start (each must connect within "
                               f"{self.start_timeout} s): {why}")

    def _actor_error(self, name: str, text: str) -> None:
        self._errors.setdefault(name, text)

    # -- clocks ----------------------------------------------------------------------------
    def _record_boot(self, name: str, data: bytes) -> None:
        import json
        now = time.perf_counter()
        super()._record_boot(name, data)
        try:
            theirs = float(json.loads(data)["now"])
        except (ValueError, KeyError, TypeError):
            return
        if abs(now - theirs) > CLOCK_SKEW_S:
            self._offsets[name] = now - theirs

    def _emit(self, event) -> None:
        off = self._offsets.get(getattr(event, "model", None))
        if off and dataclasses.is_dataclass(event):
            moved = {f: getattr(event, f) + off for f in TIME_FIELDS if isinstance(getattr(event, f, None), float)}
            event = dataclasses.replace(event, **moved)
        super()._emit(event)

    # -- end -------------------------------------------------------------------------------
    def _signal(self, model: str, sig: int) -> None:
        actor = self.actors.get(model)
        if actor is not None and self._running(model):
            import ray
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass

    def _kill_all(self) -> None:
        import ray
        for name, actor in self.actors.items():
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # noqa: BLE001 - already gone
                pass
        for p in self.procs.values():
            p.join(5.0)

    def close(self, timeout: float | None = None) -> None:
        """Shut the sub-servers down, kill every actor, remove the placement group (and shut Ray
        down when `start` started it). Idempotent."""
        import ray
        started = self._started
        if started:
            super().close(timeout)
        else:
            self._closed = True
        if ray.is_initialized():
            self._kill_all()
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
