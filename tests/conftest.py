"""Shared fixtures: a temporary Trackio directory for the whole run, both async backends; how
pytest-xdist's workers share the tests out."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from typing import Any

# Trackio reads TRACKIO_DIR once, at import; it must point at a scratch directory before any
# test module imports trackio or asynctrace. Child processes inherit it.
_TRACKIO_DIR = tempfile.mkdtemp(prefix="asynctrace-tests-")
os.environ["TRACKIO_DIR"] = _TRACKIO_DIR

import pytest  # noqa: E402


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(_TRACKIO_DIR, ignore_errors=True)


# The modules whose tests run on the shared Ray cluster (`ray_cluster`): one xdist worker runs
# them all, so a run starts one cluster. A test on the cluster elsewhere fails the collection.
RAY_CLUSTER_MODULES = (
    "tests/adapters/test_ray_hooks.py",
    "tests/distributed/test_ray.py",
    "tests/distributed/test_ray_composition.py",
    "tests/distributed/test_ray_local_selection.py",
)

# The modules that import the training frameworks (AReaL alone takes ~16 CPU-s to import):
# tests/test_doc_snippets.py runs each framework page's snippets with the objects of that
# framework's test module, so one xdist worker runs them all and imports each framework once.
# (test_ray_hooks.py imports its frameworks in Ray actors, on the cluster's worker.)
FRAMEWORK_MODULES = ("tests/adapters/", "tests/test_doc_snippets.py")


# The work units that take longest (seconds summed on 2 cores at load 4-13: ray-cluster 484,
# the frameworks 313 as separate modules, the examples 85 in one fixture, test_parquet 85, ...),
# handed out first: xdist orders units by their number of tests, which left a unit of a few slow
# tests (test_kill: 2 tests, about 40 s) to start last while the other worker had nothing left.
LONGEST_FIRST = (
    "ray-cluster",
    "frameworks",
    "tests/test_examples.py",
    "tests/sinks/test_parquet.py",
    "tests/faults/test_signals.py",
    "tests/faults/test_kill.py",
    "tests/sinks/test_wandb.py",
    "tests/sinks/test_wandb_persisted.py",
    "tests/distributed/test_torch_distributed.py",
    "tests/view/test_sidecar_summary.py",
    "tests/sinks/test_parquet_faults.py",
    "tests/test_security.py",
    "tests/test_composition.py",
    "tests/sinks/test_mlflow.py",
)


def _work_unit(nodeid: str) -> str:
    """What one xdist worker runs whole: the test's module, every module on the Ray cluster, or
    every module that imports the training frameworks."""
    module = nodeid.split("::", 1)[0]
    if module in RAY_CLUSTER_MODULES:
        return "ray-cluster"
    return "frameworks" if module.startswith(FRAMEWORK_MODULES) else module


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """A test on the Ray cluster in a module RAY_CLUSTER_MODULES leaves out fails the run."""
    stray = sorted({i.nodeid.split("::", 1)[0] for i in items if "ray_cluster" in i.fixturenames})
    stray = [module for module in stray if module not in RAY_CLUSTER_MODULES]
    if stray:
        raise pytest.UsageError(f"tests on the Ray cluster outside RAY_CLUSTER_MODULES: {stray}")


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """Each xdist worker runs whole modules (a module-scoped fixture, such as the examples' run,
    is built once, not once per worker), the Ray cluster's modules together and the frameworks'
    together, the longest first. xdist's own
    `--dist loadgroup` would carry `xdist_group` marks, but it ignores them under pytest 9.2's
    node ids (pytest-xdist issue 1386); the scope comes from the node id instead."""
    from xdist.scheduler import LoadFileScheduling

    class ByModule(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _work_unit(nodeid)

        def _assign_work_unit(self, node: Any) -> None:
            # The longest unit still waiting goes next (LONGEST_FIRST), then xdist's own order.
            waiting = [unit for unit in LONGEST_FIRST if unit in self.workqueue]
            if waiting:
                self.workqueue.move_to_end(waiting[0], last=False)
            super()._assign_work_unit(node)

    return ByModule(config, log)


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
def project() -> str:
    """A Trackio project name no other test uses."""
    return f"t-{uuid.uuid4().hex[:10]}"


@pytest.fixture
def trackio_dir() -> Iterator[str]:
    yield _TRACKIO_DIR


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    """One local Ray cluster for the whole run, started by the first test that needs one (a start
    takes seconds, more under load); its workers inherit TRACKIO_DIR."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        yield
    finally:
        ray.shutdown()
