"""`--cpu-cost=N`: after the run, the N tests that cost the most CPU, counting the processes they
started. On a machine with few cores the suite's time follows its CPU, not any one test's wall time
(which depends on what runs beside it), and most of that CPU is in the launchers, training
processes and tools that the tests start (docs/testing.md, Time).

A test's cost is its setup, call and teardown: this process's CPU (every thread) and that of the
child processes it waited for, with theirs (a launcher waits for its workers). A fixture made once
for a module counts in the setup of the module's first test. Not counted: processes still running
when the test ends, which count when they exit, in no test: the gloo ranks' fork server (and its
ranks), torch inductor's pool of compile workers. Under pytest-xdist each worker measures its own
tests and the report carries the numbers.
"""

from __future__ import annotations

import resource
import time
from collections import defaultdict
from collections.abc import Iterator

import pytest

PROPERTY = "cpu_seconds"
"""The name of the (own, started processes') pair in a report's user_properties."""

_STARTED = pytest.StashKey[tuple[float, float]]()
_totals: defaultdict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cpu-cost",
        type=int,
        default=0,
        metavar="N",
        help="list the N tests that cost the most CPU, the processes they started included",
    )


def cpu_seconds() -> tuple[float, float]:
    """(CPU of this process, CPU of the children it has waited for), in seconds, so far."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time(), children.ru_utime + children.ru_stime


def _measured(item: pytest.Item) -> bool:
    return item.config.getoption("cpu_cost") > 0


def _start(item: pytest.Item) -> None:
    if _measured(item):
        item.stash[_STARTED] = cpu_seconds()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    _start(item)
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    _start(item)
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item) -> Iterator[None]:
    _start(item)
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """Each phase's report carries what that phase cost (measured from its start to here)."""
    outcome = yield
    if _measured(item) and _STARTED in item.stash:
        (own_before, children_before), (own, children) = item.stash[_STARTED], cpu_seconds()
        report = outcome.get_result()
        report.user_properties = [*report.user_properties, (PROPERTY, (own - own_before, children - children_before))]


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    for name, value in report.user_properties:
        if name == PROPERTY:
            own, started = value
            _totals[report.nodeid][0] += own
            _totals[report.nodeid][1] += started


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    count = config.getoption("cpu_cost")
    if count <= 0 or not _totals:
        return
    costs = sorted(_totals.items(), key=lambda entry: -sum(entry[1]))
    every = sum(own + started for own, started in _totals.values())
    terminalreporter.write_sep("=", f"CPU: {len(costs)} tests, {every:.1f} s; the {min(count, len(costs))} that cost the most")
    terminalreporter.write_line("  total  started  test   (seconds of CPU; started: in the processes the test started)")
    for nodeid, (own, started) in costs[:count]:
        terminalreporter.write_line(f"{own + started:7.2f}{started:9.2f}  {nodeid}")
