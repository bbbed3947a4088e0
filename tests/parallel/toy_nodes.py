"""The toy program (toy_program.py) as the two ends of a stage spread over two "nodes" on this host, each its
own process: `python toy_nodes.py headless PORT PP TP [FACTORY]` runs node 1's ranks (headless_ranks), and
`python toy_nodes.py driver PORT PP TP` runs node 0's executor, prints `driver ready` and idles (a test kills it).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import toy_program

from omnimesh.log_setup import setup_logging
from omnimesh.parallel.headless_ranks import run_headless
from omnimesh.parallel.mp_executor import MpExecutor, Rendezvous
from omnimesh.parallel.node_rendezvous import NodeSpec

HERE = Path(__file__).resolve().parent
TIMEOUT_S = 30.0


def spec(node_rank: int, timeout_s: float = TIMEOUT_S) -> NodeSpec:
    return NodeSpec(stage="toy", num_nodes=2, node_rank=node_rank, model="toy-weights", timeout_s=timeout_s)


def driver(port: int, pp: int, tp: int, **executor: object) -> MpExecutor:
    """Node 0's executor (this process is rank 0), started."""
    ex = MpExecutor(pp, tp, toy_program.make_toy, master_port=port, timeout_s=TIMEOUT_S, nodes=spec(0), **executor)  # type: ignore[arg-type]
    ex.start()
    return ex


def start(role: str, port: int, pp: int, tp: int, factory: str = "make_toy") -> subprocess.Popen:
    """This file as a process (output captured as text)."""
    return subprocess.Popen([sys.executable, str(HERE / "toy_nodes.py"), role, str(port), str(pp), str(tp), factory],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def main(argv: list[str]) -> int:
    setup_logging("INFO")
    role, port, pp, tp = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    if role == "headless":
        factory = getattr(toy_program, argv[4] if len(argv) > 4 else "make_toy")
        factory = factory() if isinstance(factory, type) else factory  # a class: its instance is the factory
        return run_headless(factory, pp, tp, Rendezvous("127.0.0.1", port, "gloo", TIMEOUT_S), spec(1))
    driver(port, pp, tp)
    print("driver ready", flush=True)
    time.sleep(600)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
