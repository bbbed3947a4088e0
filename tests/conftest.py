"""Suite-wide guard: a test that leaves torch.distributed initialised in the pytest process fails alone.

Drivers run their stage's rank 0 in this process (MpExecutor, NodeHost), so a test whose driver starts
when it should not, or whose shutdown is skipped by a failed assertion, would leave the default process
group up, and every later process-group test in the run would then fail with "already initialised" (one
race at c25f858 showed as 10 failures). The guard tears the group down and reports the test that left it.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist


@pytest.fixture(autouse=True)
def no_process_group_left_behind():
    # a module- or session-scoped fixture may hold a process group across its tests: only a group that
    # this test itself brought up is its to answer for
    held_before = dist.is_available() and dist.is_initialized()
    yield
    if held_before or not (dist.is_available() and dist.is_initialized()):
        return
    dist.destroy_process_group()
    pytest.fail("the test left torch.distributed initialised (its driver was not shut down); the guard in "
                "tests/conftest.py destroyed the process group so the tests after it start clean")
