"""Shared fixtures: a temporary Trackio directory for the whole run, both async backends; how
pytest-xdist's workers share the tests out."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator

# Trackio reads TRACKIO_DIR once, at import; it must point at a scratch directory before any
# test module imports trackio or asynctrace. Child processes inherit it.
_TRACKIO_DIR = tempfile.mkdtemp(prefix="asynctrace-tests-")
os.environ["TRACKIO_DIR"] = _TRACKIO_DIR

import pytest  # noqa: E402


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    shutil.rmtree(_TRACKIO_DIR, ignore_errors=True)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Each test module runs whole on one xdist worker (`--dist loadgroup`), so a module-scoped
    fixture (the examples' run, a Ray actor's ended work, a trained model) is built once, not
    once per worker; every test on the Ray cluster runs on one worker, so the run starts one
    cluster. Runs before xdist's own hook, which reads these marks."""
    for item in items:
        group = "ray-cluster" if "ray_cluster" in item.fixturenames else item.nodeid.split("::", 1)[0]
        item.add_marker(pytest.mark.xdist_group(group))


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
