"""MpExecutor with real gloo ranks on this host: lock-step commands, results from the right rank, a
worker that dies is reported by rank with its exit code (never a hang), and nothing outlives shutdown; one
rank (pp = tp = 1) runs in this process, on the stage's device (CUDA's first device for an NCCL stage)."""

from __future__ import annotations

import threading
import time

import pytest
import torch
import toy_program

from omnimesh.parallel.mp_executor import MpExecutor, RankFailure


@pytest.mark.parametrize("pp, tp", [(2, 1), (1, 2), (2, 2)])
def test_sharded_toy_equals_unsharded(pp: int, tp: int) -> None:
    ex = MpExecutor(pp, tp, toy_program.make_toy, timeout_s=30)
    ex.start()
    try:
        toy_program.check_lock_step(ex, pp, tp)
        pids = ex.pids
    finally:
        ex.shutdown()
    assert not any(toy_program.alive(pid) for rank, pid in pids.items() if rank != 0)


def test_dead_worker_is_named_and_nothing_hangs() -> None:
    failures: list[str] = []
    ex = MpExecutor(1, 2, toy_program.make_toy, timeout_s=20, on_failure=failures.append)
    ex.start()
    try:
        toy_program.check_crash_is_named(ex, failures, rf"rank 1 \(pid {ex.pids[1]}\) exited with code 3")
    finally:
        ex.shutdown()


def test_start_up_failure_names_the_rank() -> None:
    ex = MpExecutor(1, 2, toy_program.make_broken, timeout_s=60)
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="rank 1 failed to start: RuntimeError: weights for rank 1 are missing"):
        ex.start()
    assert time.monotonic() - t0 < 30  # named at once, well inside the rendezvous timeout


@pytest.mark.parametrize("case", ["unpicklable factory", "device it cannot take"])
def test_a_rank_that_never_reaches_the_rendezvous_fails_the_start_at_once(case: str) -> None:
    """Rank 0 joins the rendezvous only after every local rank reported that it is about to (rank_worker.JOINING):
    a rank whose factory does not unpickle dies at spawn, one given a device it cannot take fails before joining;
    either is named within seconds, where rank 0 used to wait out the whole timeout and then blame the network."""
    if case == "unpicklable factory":
        ex = MpExecutor(1, 2, toy_program.ParentOnly(), timeout_s=60)
        said = r"rank 1 \(pid \d+\) exited with code 1 during start-up"
    else:
        ex = MpExecutor(1, 2, toy_program.make_toy, timeout_s=60, devices=("cpu", "cuda:99"))
        said = r"rank 1 failed to start: \w+"
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match=said):
        ex.start()
    assert time.monotonic() - t0 < 30


def test_a_process_can_start_ranks_again_after_a_shutdown() -> None:
    """A driver that already had (and tore down) a process group starts a new one with fresh ranks (torch's
    per-process group counter would otherwise name rendezvous keys the new ranks never write)."""
    import torch.distributed as dist

    x = torch.randn(3, toy_program.H, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        dist.distributed_c10d._world.group_count = 3  # as left by earlier groups in this process (seen in CI)
        ex = MpExecutor(2, 1, toy_program.make_toy, timeout_s=30)
        ex.start()
        try:
            torch.testing.assert_close(ex.execute(("run", x)), toy_program.reference(x), rtol=1e-5, atol=1e-5)
        finally:
            ex.shutdown()


def test_a_command_during_shutdown_is_refused_and_one_after_it_too(monkeypatch) -> None:
    """Once shutdown began, the ranks may already have had their STOP: a command then is refused at once by name
    (nothing would answer it), and after shutdown the executor says it is not started; neither waits."""
    ex = MpExecutor(1, 2, toy_program.make_toy, timeout_s=30)
    ex.start()
    x = torch.randn(2, toy_program.H)
    joining, release = threading.Event(), threading.Event()
    join_ranks = ex._join_ranks

    def held_join(deadline: float) -> None:  # shutdown has sent STOP and now waits for the ranks to end
        joining.set()
        release.wait(10)
        join_ranks(deadline)

    monkeypatch.setattr(ex, "_join_ranks", held_join)
    stopper = threading.Thread(target=ex.shutdown)
    stopper.start()
    try:
        assert joining.wait(10)
        t0 = time.monotonic()
        with pytest.raises(RankFailure, match="the stage is shutting down"):
            ex.execute(("run", x))
        assert time.monotonic() - t0 < 1
    finally:
        release.set()
        stopper.join(timeout=20)
    assert not stopper.is_alive()
    with pytest.raises(RankFailure, match="the executor is not started"):
        ex.execute(("run", x))


def test_shutdown_returns_after_the_threads_that_call_gloo(monkeypatch) -> None:
    """The result receiver (pp = 2: the last pipeline rank owns the results) may still be on its way out of its
    last `recv` when the ranks are gone; shutdown waits for it (and the keep-alive) before the process group
    ends and the caller goes on to exit, since a thread the interpreter ends inside gloo's C++ code aborts the
    process (seen as exit -6 where a refused start exits 2). The receiver here is slowed after the echoed STOP."""
    from omnimesh.parallel import mp_executor

    real_recv = mp_executor.recv_obj

    def slow_recv(src, group):
        result = real_recv(src, group)
        if result == mp_executor.STOP:
            time.sleep(1.5)  # a thread not scheduled at once on a busy host
        return result

    monkeypatch.setattr(mp_executor, "recv_obj", slow_recv)
    ex = MpExecutor(2, 1, toy_program.make_toy, timeout_s=30)
    before = set(threading.enumerate())
    ex.start()
    threads = [t for t in set(threading.enumerate()) - before
               if t.name in ("omnimesh-rank-results", "omnimesh-rank-keepalive")]
    assert len(threads) == 2
    ex.shutdown()
    assert not [t.name for t in threads if t.is_alive()]


@pytest.mark.parametrize(("args", "device"), [({}, "cpu"), ({"backend": "gloo", "devices": ()}, "cpu"),
                                              ({"backend": "nccl", "devices": ()}, "cuda:0"),
                                              ({"backend": "nccl", "devices": ("cuda:3", "cuda:4")}, "cuda:3")])
def test_one_rank_runs_in_process_on_the_stage_device(monkeypatch, args: dict, device: str) -> None:
    """pp = tp = 1 starts no process: the program is built here, on the device the stage's rank 0 would have
    (a CUDA stage's default layout must not fall back to the CPU), made this process's current device as a rank
    process's is (so nothing that names plain "cuda" lands on GPU 0 of a stage given GPU 3)."""
    from omnimesh.parallel.mp_executor import start_program

    seen: list[torch.device] = []
    current: list[torch.device] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # no CUDA here: what the stage asks of it
    monkeypatch.setattr(torch.cuda, "set_device", current.append)

    class Program:
        def __init__(self, ps: object) -> None:
            seen.append(ps.device)  # type: ignore[attr-defined]

        def execute(self, command: int) -> int:
            return command + 1

    run, executor, _ = start_program(Program, 1, 1, executor="mp", **args)
    assert executor is None and run(1) == 2 and seen == [torch.device(device)]
    assert current == ([torch.device(device)] if device != "cpu" else [])


def test_a_taken_rendezvous_port_is_named_with_the_fix() -> None:
    """Rank 0 listens for its ranks right after they spawn; a --master-port another process holds is a RankFailure
    that names the address and the flag, and the spawned ranks do not outlive it."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ex = MpExecutor(1, 2, toy_program.make_toy, master_port=port, timeout_s=30)
        t0 = time.monotonic()
        with pytest.raises(RankFailure, match=rf"rank 0 could not listen for the stage's rendezvous at "
                                              rf"127\.0\.0\.1:{port}: .*; choose another --master-port"):
            ex.start()
        assert time.monotonic() - t0 < 20
    assert not any(toy_program.alive(pid) for rank, pid in ex.pids.items() if rank != 0)


def test_a_stage_idle_past_its_collective_timeout_still_serves() -> None:
    """A rank waits for the driver's next command in a gloo recv bounded by the process-group timeout (the
    stage's --rendezvous-timeout, 120 s), and pp > 1's result channel likewise: idle longer than that, every
    worker rank of a served stage died (at e1042a7 a pp x tp mesh lost a stage after two quiet minutes). The
    driver keeps them alive while idle, and commands after the quiet spell run."""
    x = torch.randn(3, toy_program.H, generator=torch.Generator().manual_seed(2))
    failures: list[str] = []
    ex = MpExecutor(2, 1, toy_program.make_toy, timeout_s=3, on_failure=failures.append,  # pp 2: results idle too
                    start_timeout_s=60)  # a fresh rank's `import torch` alone can take longer than 3 s
    ex.start()
    try:
        torch.testing.assert_close(ex.execute(("run", x)), toy_program.reference(x), rtol=1e-5, atol=1e-5)
        time.sleep(7.5)  # idle for 2.5 timeouts
        assert not failures
        torch.testing.assert_close(ex.execute(("run", x)), toy_program.reference(x), rtol=1e-5, atol=1e-5)
        pids = ex.pids
    finally:
        ex.shutdown()
    assert not failures
    assert not any(toy_program.alive(pid) for rank, pid in pids.items() if rank != 0)
    keepalive = [t for t in threading.enumerate() if t.name == "omnimesh-rank-keepalive"]
    for t in keepalive:
        t.join(timeout=0.2)  # well inside its 0.75 s wait: only the shutdown ends it this soon
    assert not any(t.is_alive() for t in keepalive)  # shutdown wakes it and it ends: no thread outlives the stage
    with pytest.raises(RankFailure, match="not started"):  # nothing goes to ranks that had their STOP
        ex.submit(("run", x))
