"""Executors: run the engine's steps on one rank (uniproc) or on tensor-parallel ranks (mp, ray, external).

The engine talks to one Executor: `execute(batch, states, max_steps)` returns the new tokens of
the step. The driver rank (rank 0) always lives in the engine's process, so scheduling, sampling
and their state never cross a process boundary; the other ranks only run forward passes on the
inputs the driver sends them (core/parallel.py). What differs between executors is who starts
those ranks:

- uniproc: none, one rank;
- mp: one spawned process per rank on this machine (torch.distributed over loopback);
- ray: one Ray actor per rank, placed by a Ray cluster (several machines; `pip install flashllm[ray]`);
- external: the ranks were launched by torchrun (RANK / WORLD_SIZE / MASTER_ADDR in the
  environment); rank 0 runs the command, the others serve its steps and exit with it.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import dataclasses
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

from flashllm.config import DISTRIBUTED_EXECUTOR_BACKENDS, EngineConfig
from flashllm.core import parallel
from flashllm.core.builder import EngineConfigError, EngineParts, build_engine_parts
from flashllm.core.model_runner import ModelRunner
from flashllm.core.parallel import DistributedError, RankContext, StepChannel
from flashllm.core.sampler import SamplerOutput, SamplingState
from flashllm.core.scheduler import SchedulerOutput
from flashllm.registry.plugins import FlashPlugins, make_plugin_manager

logger = logging.getLogger(__name__)

TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
JOIN_TIMEOUT_S = 10.0
RANK_EXIT_GRACE_S = 2.0  # how long a failed collective waits for the watcher to name a dead rank
_T = TypeVar("_T")


class Executor:
    """One rank, in this process: the engine's parts and the driver's runner."""

    def __init__(self, parts: EngineParts) -> None:
        self.parts = parts
        self.runner: ModelRunner = parts.runner

    def max_tokens_per_step(self, states: list[SamplingState]) -> int:
        """The most tokens per sequence one `execute` may return for a decode batch with these states."""
        return self.runner.max_tokens_per_step(states)

    def execute(self, batch: SchedulerOutput, states: list[SamplingState], max_steps: int = 1) -> list[SamplerOutput]:
        """Run the batch on every rank; the driver's tokens (see ModelRunner.execute)."""
        return self.runner.execute(batch, states, max_steps)

    def check_health(self) -> None:
        """Raise DistributedError if a rank has failed (nothing to check on one rank)."""
        return None

    def heartbeat(self) -> None:
        """While the engine idles, on the thread that steps it: raise DistributedError if a rank does not
        answer (nothing to ask on one rank)."""
        return None

    def shutdown(self) -> None:
        """Stop the other ranks (none here); safe to call twice."""
        return None


def executor_backend(config: EngineConfig) -> str:
    """The executor ParallelConfig asks for: its own choice, else external under torchrun, else
    uniproc for one rank and mp for more."""
    parallel_config = config.parallel
    size, name = parallel_config.tensor_parallel_size, parallel_config.distributed_executor_backend
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise EngineConfigError(f"--tensor-parallel-size must be a positive integer, got {size!r}")
    if name is None:
        if _under_torchrun():
            return "external"
        return "uniproc" if size == 1 else "mp"
    if name not in DISTRIBUTED_EXECUTOR_BACKENDS:
        raise EngineConfigError(f"--distributed-executor-backend {name!r} is not one of "
                                f"{', '.join(DISTRIBUTED_EXECUTOR_BACKENDS)}")
    if name == "uniproc" and size != 1:
        raise EngineConfigError(f"--distributed-executor-backend uniproc runs one rank; --tensor-parallel-size is "
                                f"{size}: use mp, ray or torchrun (external)")
    return name


def make_executor(config: EngineConfig, plugins: FlashPlugins | None = None) -> Executor:
    """Build the executor (and with it the driver's engine parts) that `config` asks for.

    Under torchrun, ranks other than 0 serve the driver's steps here and then exit the process."""
    name = executor_backend(config)
    if name == "uniproc":
        return Executor(build_engine_parts(config, plugins))
    if name == "external":
        rank = _torchrun_rank(config)
        if rank.rank != 0:
            run_worker(_plain(config), rank, None)
            sys.exit(0)
        return DistributedExecutor(config, plugins, rank, None, launcher=None)
    size = config.parallel.tensor_parallel_size
    host = "127.0.0.1" if name == "mp" else _ray_driver_address()
    resource = _selection(config, plugins).adapter.cluster_resource
    launcher: _Launcher = _ProcessLauncher() if name == "mp" else _RayLauncher(resource)
    return DistributedExecutor(config, plugins, RankContext(0, size), f"{host}:{_free_port(host)}", launcher)


class DistributedExecutor(Executor):
    """The driver rank in this process, the others started by `launcher` (None: by torchrun).

    A rank that dies fails the driver's next collective at once (its sockets close) and one that
    hangs fails it after FLASHLLM_DIST_TIMEOUT_S; either way `execute` raises DistributedError
    and the executor stops the remaining ranks. While the engine idles, `heartbeat` pings the ranks
    every FLASHLLM_DIST_HEARTBEAT_S, so a rank that hangs then fails the engine without a step."""

    def __init__(self, config: EngineConfig, plugins: FlashPlugins | None, rank: RankContext, address: str | None,
                 launcher: _Launcher | None) -> None:
        self._launcher = launcher
        self._failure: str | None = None
        self._rank_exited = threading.Event()
        self._closed = False
        # a malformed FLASHLLM_DIST_* setting fails in one line before any rank starts
        self._heartbeat_s = parallel.heartbeat_interval()
        self._timeout_s = parallel.dist_timeout().total_seconds()
        plain = _plain(config)
        plugins = plugins or make_plugin_manager()
        try:
            backend = _dist_backend(config, plugins)
            if address is None:  # torchrun's ranks: its environment says where to meet
                parallel.init_process_group(rank, backend, init_method="env://")
            else:
                store = parallel.rendezvous(address, rank)
                launcher.start(plain, rank.world_size, address, self._on_rank_exit)
                parallel.wait_for_ranks(store, rank.world_size, lambda: self._failure)
                parallel.init_process_group(rank, backend, store=store)
            parts = build_engine_parts(config, plugins, rank)
        except BaseException:
            self._stop_ranks(graceful=False)
            raise
        super().__init__(parts)
        self._channel = StepChannel(parts.runner.device, getattr(parts.runner, "lora", None), driver=True)
        self.runner.on_inputs = self._channel.send
        self._last_exchange = time.monotonic()  # when the ranks last answered the driver (here: agreed on the cache)
        atexit.register(self.shutdown)  # the other ranks leave their loops (torchrun's exit with code 0)

    def _on_rank_exit(self, rank: int, how: str) -> None:
        if not self._closed and self._failure is None:
            self._failure = f"tensor-parallel rank {rank} {how}"
            logger.error("%s; the engine stops", self._failure)
        self._rank_exited.set()

    def max_tokens_per_step(self, states: list[SamplingState]) -> int:
        return 1  # the other ranks run one forward pass per step they receive

    def check_health(self) -> None:
        if self._failure is not None:
            self._stop_ranks(graceful=False)
            raise DistributedError(f"{self._failure}; restart the engine")

    def execute(self, batch: SchedulerOutput, states: list[SamplingState], max_steps: int = 1) -> list[SamplerOutput]:
        self.check_health()
        return self._with_ranks("step", lambda: self.runner.execute(batch, states, 1))

    def heartbeat(self) -> None:
        """Ping the ranks when nothing crossed to them for FLASHLLM_DIST_HEARTBEAT_S (never under load: each
        step is an answer); a failed ping fails the engine as a failed step does."""
        if self._closed or not self._heartbeat_s or time.monotonic() - self._last_exchange < self._heartbeat_s:
            return
        self._with_ranks("heartbeat", self._channel.ping)

    def _with_ranks(self, what: str, exchange: Callable[[], _T]) -> _T:
        """exchange() with the other ranks; DistributedError, after stopping them, if a collective fails."""
        started = time.monotonic()
        try:
            result = exchange()
        except RuntimeError as exc:  # gloo / nccl: a peer's socket closed, or the timeout passed
            raise self._failed(what, exc, timed_out=time.monotonic() - started >= self._timeout_s) from exc
        self._last_exchange = time.monotonic()
        return result

    def _failed(self, what: str, exc: RuntimeError, timed_out: bool) -> DistributedError:
        """Stop the ranks after a failed collective; the error to raise, naming the rank or the hang."""
        if self._launcher is not None and not timed_out:
            # a killed rank's sockets close before the watcher reaps its exit: give the watcher a moment
            # to name the rank, so the error says which one died, not only that a collective failed (after
            # a timeout there is no exit to wait for: a rank hangs)
            self._rank_exited.wait(RANK_EXIT_GRACE_S)
        if self._failure is None:
            self._failure = (f"a rank did not answer within {parallel.DIST_TIMEOUT_ENV}={self._timeout_s:g} s (it "
                             f"hangs or was stopped)" if timed_out else
                             f"a collective failed ({type(exc).__name__}: {str(exc).splitlines()[0]})")
        self._stop_ranks(graceful=False)
        return DistributedError(f"tensor-parallel {what} failed: {self._failure}; restart the engine")

    def shutdown(self) -> None:
        self._stop_ranks(graceful=self._failure is None)

    def _stop_ranks(self, graceful: bool) -> None:
        if self._closed:
            return
        self._closed = True
        if graceful:
            with contextlib.suppress(Exception):
                self._channel.send_stop()
        if self._launcher is not None:
            self._launcher.stop(graceful)
        with contextlib.suppress(Exception):
            parallel.destroy_process_group()


def run_worker(plain: dict[str, Any], rank: RankContext, address: str | None) -> None:
    """A rank other than the driver: join the group (at the driver's `address`, "host:port", or
    through torchrun's environment when None), load this rank's shard, run the steps the driver
    sends until it stops."""
    config = _config_from_plain(plain)
    plugins = make_plugin_manager()
    backend = _dist_backend(config, plugins)
    if address is None:
        parallel.init_process_group(rank, backend, init_method="env://")
    else:
        parallel.init_process_group(rank, backend, store=parallel.rendezvous(address, rank))
    try:
        parts = build_engine_parts(config, plugins, rank)
        channel = StepChannel(parts.runner.device, getattr(parts.runner, "lora", None))
        while (inputs := channel.receive()) is not None:
            parts.runner.execute_inputs(inputs)
    finally:
        parallel.destroy_process_group()


# -- launchers ---------------------------------------------------------------------------------------

class _Launcher:
    """Starts ranks 1..world_size-1 and reports each one that exits while the engine runs."""

    def start(self, plain: dict[str, Any], world_size: int, address: str,
              on_exit: Callable[[int, str], None]) -> None:
        raise NotImplementedError

    def stop(self, graceful: bool = True) -> None:
        """End the ranks: after they were told to stop (graceful), give them JOIN_TIMEOUT_S to leave; after a
        failure, none was told, and a hung one would never leave, so they are ended at once."""
        raise NotImplementedError


class _ProcessLauncher(_Launcher):
    """mp: a spawned process per rank; a watcher thread reports any that exits."""

    def __init__(self) -> None:
        self.procs: list[Any] = []
        self._threads: int | None = None  # this process's torch threads before the ranks split the cores

    def start(self, plain: dict[str, Any], world_size: int, address: str,
              on_exit: Callable[[int, str], None]) -> None:
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        threads = max(1, (os.cpu_count() or 1) // world_size)
        for rank in range(1, world_size):
            proc = context.Process(target=_process_main, args=(plain, rank, world_size, address, threads),
                                   name=f"flashllm-rank{rank}", daemon=True)
            proc.start()
            self.procs.append(proc)
        import torch

        self._threads = torch.get_num_threads()
        _limit_threads(threads)
        watcher = threading.Thread(target=self._watch, args=(on_exit,), name="flashllm-rank-watch", daemon=True)
        watcher.start()

    def _watch(self, on_exit: Callable[[int, str], None]) -> None:
        from multiprocessing.connection import wait

        waiting = {proc.sentinel: rank for rank, proc in enumerate(self.procs, start=1)}
        while waiting:
            for sentinel in wait(list(waiting)):
                rank = waiting.pop(sentinel)
                proc = self.procs[rank - 1]
                proc.join(0)
                on_exit(rank, f"(pid {proc.pid}) exited with code {proc.exitcode}")

    def stop(self, graceful: bool = True) -> None:
        for proc in self.procs:
            proc.join(JOIN_TIMEOUT_S if graceful and proc.exitcode is None else 0)
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(JOIN_TIMEOUT_S)
        if self._threads is not None:
            _limit_threads(self._threads)


def _process_main(plain: dict[str, Any], rank: int, world_size: int, address: str, threads: int) -> None:
    """A spawned rank: dies with its parent, so no rank outlives the engine that started it."""
    _die_with_parent()
    _limit_threads(threads)
    logging.basicConfig(level=logging.WARNING, format=f"rank {rank}: %(levelname)s %(name)s: %(message)s")
    run_worker(plain, RankContext(rank, world_size, local_rank=rank), address)


class _RayLauncher(_Launcher):
    """ray: an actor per rank on the Ray cluster this process is connected to (ray.init's address or
    RAY_ADDRESS); each actor runs the rank's loop as one long task."""

    def __init__(self, resource: str | None) -> None:
        self.resource = resource
        self.actors: list[Any] = []
        self.tasks: list[Any] = []

    def start(self, plain: dict[str, Any], world_size: int, address: str,
              on_exit: Callable[[int, str], None]) -> None:
        ray = _import_ray()
        # a rank on an accelerator asks Ray for one (Ray then shows the actor that device alone); the
        # driver's device adapter names the resource (DeviceAdapter.cluster_resource)
        options: dict[str, Any] = {"num_cpus": 1}
        if self.resource == "GPU":
            options["num_gpus"] = 1
        elif self.resource is not None:
            options["resources"] = {self.resource: 1}
        worker = ray.remote(**options)(_RayRank)
        for rank in range(1, world_size):
            actor = worker.remote()
            self.actors.append(actor)
            self.tasks.append(actor.run.remote(plain, rank, world_size, address))
        threading.Thread(target=self._watch, args=(ray, on_exit), name="flashllm-ray-watch", daemon=True).start()

    def _watch(self, ray: Any, on_exit: Callable[[int, str], None]) -> None:
        pending = list(self.tasks)
        while pending:
            done, pending = ray.wait(pending, num_returns=1)
            rank = self.tasks.index(done[0]) + 1
            try:
                ray.get(done[0])
                on_exit(rank, "(ray actor) left its loop")
            except Exception as exc:  # the actor died or its task raised
                on_exit(rank, f"(ray actor) failed: {type(exc).__name__}: {str(exc).splitlines()[0]}")

    def stop(self, graceful: bool = True) -> None:
        ray = _import_ray()
        with contextlib.suppress(Exception):
            ray.wait(self.tasks, num_returns=len(self.tasks), timeout=JOIN_TIMEOUT_S if graceful else 0)
        for actor in self.actors:
            with contextlib.suppress(Exception):
                ray.kill(actor)


class _RayRank:
    """The actor class of one rank (wrapped by ray.remote when the launcher starts)."""

    def run(self, plain: dict[str, Any], rank: int, world_size: int, address: str) -> None:
        run_worker(plain, RankContext(rank, world_size), address)


def _import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise EngineConfigError("--distributed-executor-backend ray needs Ray: pip install 'flashllm[ray]'") from None
    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=False)
    return ray


def _ray_driver_address() -> str:
    """The address the other ranks reach this process at: the Ray node's IP (loopback on one machine)."""
    ray = _import_ray()
    return ray.util.get_node_ip_address()


# -- helpers ----------------------------------------------------------------------------------------

def _under_torchrun() -> bool:
    return all(name in os.environ for name in TORCHRUN_ENV) and int(os.environ.get("WORLD_SIZE", "1")) > 1


def _torchrun_rank(config: EngineConfig) -> RankContext:
    missing = [name for name in TORCHRUN_ENV if name not in os.environ]
    if missing:
        raise EngineConfigError(f"--distributed-executor-backend external needs torchrun's environment; "
                                f"{', '.join(missing)} not set: launch with torchrun --nproc-per-node N -m flashllm ...")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    size = config.parallel.tensor_parallel_size
    if size not in (1, world):
        raise EngineConfigError(f"--tensor-parallel-size {size} but torchrun started {world} ranks; they must match")
    config.parallel.tensor_parallel_size = world
    return RankContext(rank, world, int(os.environ.get("LOCAL_RANK", rank)))


def _selection(config: EngineConfig, plugins: FlashPlugins | None) -> Any:
    from flashllm.registry.resolve import select_device

    return select_device(config.device.device, config.device.backend, plugins=plugins or make_plugin_manager())


def _dist_backend(config: EngineConfig, plugins: FlashPlugins) -> str:
    """The collective backend the selected device's adapter names (nccl on CUDA, gloo on CPUs, ...)."""
    return _selection(config, plugins).adapter.dist_backend


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _plain(config: EngineConfig) -> dict[str, Any]:
    """The config as plain data (str / int / float / bool / None), what crosses to the other ranks."""
    return dataclasses.asdict(config)


def _config_from_plain(plain: dict[str, Any]) -> EngineConfig:
    groups = {f.name: f.default_factory for f in dataclasses.fields(EngineConfig)}  # each group's dataclass
    return EngineConfig(**{name: group(**plain[name]) for name, group in groups.items()})


def _limit_threads(threads: int) -> None:
    """Ranks sharing one machine's cores split them (each rank's torch otherwise takes them all)."""
    import torch

    torch.set_num_threads(threads)


def _die_with_parent() -> None:
    """Linux: this process gets SIGKILL when its parent exits, however the parent ends."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
