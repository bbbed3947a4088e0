"""`--malloc`: which processes want tcmalloc, the re-exec that puts it under a process, and its refusals."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from omnimesh import allocator
from omnimesh.config.serve_args import ServeArgs

TCMALLOC = allocator.find_tcmalloc()
needs_tcmalloc = pytest.mark.skipif(TCMALLOC is None, reason="tcmalloc is not installed (apt-get install libtcmalloc-minimal4)")


@pytest.mark.parametrize("mode, device, want", [
    ("auto", "cpu", True), ("auto", None, True), ("auto", "cuda", False), ("auto", "cuda:1", False),
    ("tcmalloc", "cuda", True), ("tcmalloc", "cpu", True), ("system", "cpu", False), ("system", None, False),
])
def test_which_processes_want_tcmalloc(mode, device, want) -> None:
    assert allocator.wanted(mode, device) is want


def test_a_bad_mode_names_the_choices() -> None:
    with pytest.raises(ValueError, match="--malloc must be one of auto, tcmalloc, system"):
        allocator.wanted("jemalloc", "cpu")
    with pytest.raises(ValueError, match="--malloc must be one of"):
        ServeArgs(malloc="fast")


def test_the_gateway_command_refuses_a_bad_mode() -> None:
    out = subprocess.run([sys.executable, "-m", "omnimesh.cli", "gateway", "--stages", "thinker=127.0.0.1:1",
                          "--malloc", "fast"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "--malloc must be one of auto, tcmalloc, system, got 'fast'" in out.stderr


def _in_child(mode: str, device: str | None, **env: str) -> subprocess.CompletedProcess:
    """A fresh interpreter that asks for `mode` and prints what it then runs on and its LD_PRELOAD."""
    code = ("import os; from omnimesh.allocator import use_allocator; "
            f"print(use_allocator({mode!r}, {device!r}), os.environ.get('LD_PRELOAD', ''))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})


@needs_tcmalloc
def test_auto_reexecutes_a_cpu_process_on_tcmalloc() -> None:
    out = _in_child("auto", "cpu")
    assert out.returncode == 0, out.stderr
    name, preload = out.stdout.split(maxsplit=1)
    assert name == "tcmalloc" and TCMALLOC in preload  # printed once: by the re-executed interpreter


def test_system_and_cuda_processes_keep_their_allocator() -> None:
    for mode, device in (("system", "cpu"), ("auto", "cuda")):
        out = _in_child(mode, device, LD_PRELOAD="")
        assert out.returncode == 0, out.stderr
        assert out.stdout.split()[0] == "glibc", (mode, device, out.stdout)


def test_tcmalloc_required_but_missing_says_what_to_install(monkeypatch) -> None:
    monkeypatch.setattr(allocator, "loaded", lambda pid="self": "glibc")
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: None)
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("must not re-execute"))
    with pytest.raises(RuntimeError, match="apt-get install libtcmalloc-minimal4"):
        allocator.reexec_with_allocator("tcmalloc", "cpu")
    allocator.reexec_with_allocator("auto", "cpu")  # auto goes on with glibc's


def test_a_preload_that_did_not_take_never_loops(monkeypatch, caplog) -> None:
    monkeypatch.setattr(allocator, "loaded", lambda pid="self": "glibc")
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: "libtcmalloc_minimal.so.4")
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("must not re-execute twice"))
    monkeypatch.setenv("OMNIMESH_MALLOC_REEXEC", "1")
    with caplog.at_level(logging.WARNING, logger="omnimesh.allocator"):
        allocator.reexec_with_allocator("auto", "cpu")
    assert "did not load libtcmalloc_minimal.so.4" in caplog.text


def test_an_operators_own_allocator_stays_under_auto(monkeypatch) -> None:
    monkeypatch.setattr(allocator, "loaded", lambda pid="self": "jemalloc")
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("must not re-execute"))
    allocator.reexec_with_allocator("auto", "cpu")


def test_loaded_reads_what_a_process_maps() -> None:
    assert allocator.loaded() in ("glibc", "tcmalloc", "jemalloc", "mimalloc")
    assert allocator.loaded(2**30) == "unknown"  # no such process


def test_the_launcher_passes_malloc_to_every_child(tmp_path) -> None:
    from omnimesh.launcher import MeshLauncher

    launcher = MeshLauncher(ServeArgs(malloc="system"), tmp_path)
    for argv in (launcher._stage_argv("talker", 50053), launcher._gateway_argv({"thinker": "127.0.0.1:50052"})):
        assert argv[argv.index("--malloc") + 1] == "system"


def test_the_start_up_log_names_the_process_and_its_allocator(monkeypatch, caplog) -> None:
    monkeypatch.setattr(allocator, "reexec_with_allocator", lambda mode, device: None)
    monkeypatch.setattr(allocator, "loaded", lambda pid="self": "tcmalloc")
    with caplog.at_level(logging.INFO, logger="omnimesh.allocator"):
        assert allocator.use_allocator("auto", "cpu", "stage thinker") == "tcmalloc"
    assert "stage thinker runs on tcmalloc's malloc (--malloc auto)" in caplog.text


def test_the_cli_fails_at_start_when_tcmalloc_is_required_but_missing(monkeypatch, capsys) -> None:
    """`omnimesh stage|gateway --malloc tcmalloc` on a host without the library: exit 2 with the install hint,
    before anything loads (in-process, as the command's own program would run it)."""
    from omnimesh import cli

    monkeypatch.setattr(allocator, "loaded", lambda pid="self": "glibc")
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: None)
    monkeypatch.setattr(os, "execve", lambda *a: pytest.fail("must not re-execute"))
    ns = cli.build_parser().parse_args(["gateway", "--stages", "thinker=127.0.0.1:1", "--malloc", "tcmalloc"])
    ns.own_process = True
    assert ns.func(ns) == cli.EXIT_USAGE
    assert "--malloc tcmalloc: the tcmalloc library is not installed; install it with `apt-get install " \
           "libtcmalloc-minimal4`" in capsys.readouterr().err


_KEEP_AND_RELEASE = """
import numpy as np
from omnimesh.allocator import release_free_memory
def rss(): return int(open("/proc/self/status").read().split("VmRSS:")[1].split()[0]) // 1024
start = rss()
held = [np.ones(2**17) for _ in range(400)]  # 400 MB in 1 MB arrays
del held
kept = rss() - start
print(release_free_memory(), kept, rss() - start)
"""


@needs_tcmalloc
def test_the_free_pages_tcmalloc_keeps_go_back_on_release() -> None:
    """What the gateway does once its media budget falls idle after a large build (gateway/media_budget.py):
    tcmalloc keeps 400 MB of freed arrays in the process; `release_free_memory` hands them to the OS."""
    out = subprocess.run([sys.executable, "-c", _KEEP_AND_RELEASE], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "LD_PRELOAD": TCMALLOC})
    which, kept, after = out.stdout.split()
    assert which == "tcmalloc" and int(kept) > 300 and int(after) < 100, out.stdout + out.stderr
    glibc = subprocess.run([sys.executable, "-c", _KEEP_AND_RELEASE], capture_output=True, text=True, timeout=60,
                           env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"})
    assert glibc.stdout.split()[0] == "glibc", glibc.stdout + glibc.stderr
