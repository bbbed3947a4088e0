"""RayExecutor (--distributed-executor-backend ray) with real gloo ranks in Ray actors on this host: the same
lock-step commands and results as MpExecutor, a start-up failure and a dead actor named by rank (never a hang),
and clear bounded errors for a cluster that cannot place the ranks or cannot be reached."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import toy_program

ray = pytest.importorskip("ray", reason="Ray is installed by scripts/setup.sh (omnimesh[ray])")

from omnimesh.parallel.rank_worker import RankFailure  # noqa: E402
from omnimesh.parallel import ray_executor  # noqa: E402
from omnimesh.parallel.ray_executor import RayExecutor  # noqa: E402
from omnimesh.proc_utils import free_port  # noqa: E402

HERE = Path(__file__).parent


@pytest.fixture(scope="module", autouse=True)
def ray_instance():
    """The actors unpickle `toy_program` (tests/parallel): the Ray instance this process starts passes its
    environment on to its workers. One instance serves the module; it is shut down after it."""
    before = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), before) if p)
    yield
    if ray.is_initialized():
        ray.shutdown()
    if before is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = before


@pytest.mark.parametrize("pp, tp", [(1, 2), (2, 1)])
def test_ray_ranks_equal_unsharded(pp: int, tp: int) -> None:
    ex = RayExecutor(pp, tp, toy_program.make_toy, timeout_s=60)
    ex.start()
    try:
        assert set(ex.pids) == {0, 1} and ex.pids[1] != os.getpid()
        toy_program.check_lock_step(ex, pp, tp)
        pid = ex.pids[1]
    finally:
        ex.shutdown()
    deadline = time.monotonic() + 10
    while toy_program.alive(pid) and time.monotonic() < deadline:  # the actor is killed at shutdown
        time.sleep(0.1)
    assert not toy_program.alive(pid)


def test_dead_actor_is_named_and_nothing_hangs() -> None:
    failures: list[str] = []
    ex = RayExecutor(1, 2, toy_program.make_toy, timeout_s=20, on_failure=failures.append)
    ex.start()
    try:
        toy_program.check_crash_is_named(ex, failures, rf"rank 1 \(Ray actor on node \S+, pid {ex.pids[1]}\) ended")
    finally:
        ex.shutdown()


def test_start_up_failure_names_the_rank() -> None:
    """At once, not after the collective timeout: the actor outlives its failed start, so a STOP sent to it would
    block for the whole 60 s (it did, before shutdown learnt to abort)."""
    ex = RayExecutor(1, 2, toy_program.make_broken, timeout_s=60)
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1 failed to start: RuntimeError: weights for rank 1 are missing"):
        ex.start()
    assert time.monotonic() - t0 < 30


def test_an_actor_that_cannot_take_its_factory_fails_the_start_at_once() -> None:
    """The factory reaches the actor in `prepare`, before rank 0 joins the rendezvous: one the actor cannot unpickle
    is named with its error, not a rendezvous timeout."""
    ex = RayExecutor(1, 2, toy_program.ParentOnly(), timeout_s=60)
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=r"rank 1 failed to start: .*No module named 'weights_plugin'"):
        ex.start()
    assert time.monotonic() - t0 < 30


def test_an_actor_whose_prepare_failed_runs_its_queued_calls_as_no_ops() -> None:
    """`start` and `serve` are queued behind `prepare` on the actor: after a failed prepare (or start) they return
    instead of raising an AttributeError that Ray printed as an unhandled error beside the real one."""
    actor = ray_executor._RankActor()
    assert actor.start() is None and actor.serve() is None


def test_ranks_the_cluster_cannot_place_are_a_clear_error() -> None:
    """NCCL ranks ask Ray for a GPU each; this host's Ray instance has none: an error naming what it has,
    within the timeout, and no placement left behind."""
    ex = RayExecutor(1, 2, toy_program.make_toy, backend="nccl", timeout_s=5)
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=r"could not place this stage's 1 worker rank\(s\) \(\{'GPU': 1, 'CPU': 1\} "
                                          r"each\) within 5s: it has CPU .* / GPU 0 free"):
        ex.start()
    assert time.monotonic() - t0 < 20
    assert ex.placement is None and not ex.actors


class _RefusingRay:
    """Stands in for the `ray` module whose `init` fails as the real one was seen to."""

    def __init__(self, error: BaseException):
        self.error = error

    def is_initialized(self) -> bool:
        return False

    def init(self, **kwargs: object) -> None:
        raise self.error


@pytest.mark.parametrize("error, said", [
    # what ray.init raised here against a head whose token this host did not have
    (RuntimeError("Failed to connect to GCS. Last connection error: Traceback (most recent call last):\n  ...\n"
                  "ray.exceptions.RpcError: Unauthenticated: RPC error: InvalidAuthToken: Authentication token is "
                  "missing or incorrect"),
     r"the Ray cluster at 10.0.0.9:6379 refused this host's Ray auth token: .* set RAY_AUTH_TOKEN"),
    (ConnectionError("Failed to connect to Ray cluster at 10.0.0.9:6379\nsecond line"),
     r"could not start or reach the Ray cluster at 10.0.0.9:6379: ConnectionError: Failed to connect to Ray "
     r"cluster at 10.0.0.9:6379$"),
])
def test_connect_errors_say_what_to_fix(monkeypatch, error: BaseException, said: str) -> None:
    monkeypatch.setattr(ray_executor, "import_ray", lambda: _RefusingRay(error))
    with pytest.raises(RankFailure, match=said):
        ray_executor.connect("10.0.0.9:6379", timeout_s=5)


def test_unreachable_cluster_is_a_clear_error_in_bounded_time() -> None:
    """--ray-address naming a port nothing listens on: the stage says what to check instead of hanging (in a
    process of its own: this one is already connected to its Ray instance)."""
    port = free_port("127.0.0.1")
    code = ("import toy_program, sys\n"
            "from omnimesh.parallel.ray_executor import RayExecutor\n"
            f"ex = RayExecutor(1, 2, toy_program.make_toy, ray_address='127.0.0.1:{port}', timeout_s=8)\n"
            "try:\n    ex.start()\nexcept Exception as e:\n    print('ERROR', e, flush=True)\n")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(HERE)})
    assert time.monotonic() - t0 < 45
    assert "ERROR could not" in out.stdout and f"127.0.0.1:{port}" in out.stdout, (out.stdout, out.stderr[-2000:])


def test_ranks_on_a_running_cluster_meet_at_this_nodes_address(tmp_path) -> None:
    """--ray-address: a cluster started apart (`ray start --head`, as an operator would; token auth off for this
    throwaway cluster) takes the worker rank; the rendezvous moves from 127.0.0.1 to this node's address as Ray
    sees it, so ranks on other nodes could dial it. In a process of its own (this one has its own instance)."""
    port = free_port("127.0.0.1")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": str(HERE)}
    ray_cli = Path(sys.executable).with_name("ray")
    head = subprocess.Popen([str(ray_cli), "start", "--head", "--block", f"--port={port}", "--num-cpus=2",
                             "--include-dashboard=false", "--disable-usage-stats"], env=env, start_new_session=True,
                            stdout=(tmp_path / "head.log").open("w"), stderr=subprocess.STDOUT)
    code = ("import toy_program\n"
            "from omnimesh.parallel.ray_executor import RayExecutor\n"
            f"ex = RayExecutor(1, 2, toy_program.make_toy, ray_address='127.0.0.1:{port}', timeout_s=60)\n"
            "ex.start()\n"
            "try:\n    toy_program.check_lock_step(ex, 1, 2)\n"
            "    print('OK', ex.rdzv.master_addr, ex.where[1][0], flush=True)\n"
            "finally:\n    ex.shutdown()\n")
    try:
        out = None
        for _ in range(3):  # the head may still be starting: Ray's own connect retries are short
            out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
            if "OK" in out.stdout:
                break
            time.sleep(3)
        assert out is not None and "OK" in out.stdout, (out and out.stdout, out and out.stderr[-3000:],
                                                        (tmp_path / "head.log").read_text()[-2000:])
        master, node = out.stdout.split("OK", 1)[1].split()[:2]
        assert master == node and master not in ("127.0.0.1", "localhost"), out.stdout
    finally:
        os.kill(head.pid, 15)  # `ray start` alone: it drains its node and stops GCS and raylet itself (~2 s); a
        # SIGTERM to the whole group took GCS down first, and the drain then waited out its 30-s GCS timeout
        try:
            head.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, 9)
            head.wait(timeout=10)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(head.pid, 9)  # Ray's own processes (GCS, raylet) share the head's process group


def test_worker_gpus_leave_rank_0s_device_to_rank_0() -> None:
    """Without devices of its own, rank 0 takes cuda:0: a Ray instance told of every GPU would hand GPU 0 to a
    worker too, and NCCL fails with "Duplicate GPU detected". Workers take cuda:1 onwards instead."""
    assert ray_executor.worker_gpus((), 4) == ("cuda:1", "cuda:2", "cuda:3")
    assert ray_executor.worker_gpus(("cuda:2", "cuda:5"), 2) == ("cuda:5",)


def test_visible_gpus_index_into_the_processs_own_visible_devices(monkeypatch) -> None:
    """A stage's devices index the GPUs this process sees: under CUDA_VISIBLE_DEVICES=4,5,6,7 the Ray instance
    for cuda:1 and cuda:3 is told 5,7 (not GPUs 1 and 3, outside the operator's allotment); restored after."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    with ray_executor._visible_gpus(("cuda:1", "cuda:3")):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "5,7"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"
    with pytest.raises(ValueError, match=r"cuda:4 are not among the 4 this process sees"):
        ray_executor.visible_ids(("cuda:4",), "4,5,6,7")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    with ray_executor._visible_gpus(("cuda:1",)):
        assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"
    assert "CUDA_VISIBLE_DEVICES" not in os.environ
