"""The public classes and functions users touch first carry runnable examples in their docstrings; pytest runs them
(``--doctest-modules`` on these modules, see setup.cfg), and here each must exist, pass and take under a second.

The second is CPU time of this process on one torch thread, not wall-clock time: on a shared machine the wall clock
measures the other processes (the project's rule: no wall-clock timings in tests)."""

from __future__ import annotations

import doctest
import importlib
import time

import pytest
import torch

#: object -> module: what a new user meets first (README, bundles, examples)
DOCUMENTED = {
    "CategoricalPolicy": "jcsaug.policy.categorical",
    "LearnableOneOfd": "jcsaug.policy.transforms",
    "TRACascaded": "jcsaug.policy.cascade",
    "ClassGroupd": "jcsaug.policy.transforms",
    "TRAPolicyUpdater": "jcsaug.engine.tra_updater",
    "TEAPolicyUpdater": "jcsaug.engine.tea_updater",
    "TEAInferer": "jcsaug.inference.tta",
    "BlendedTTAInferer": "jcsaug.inference.tta",
    "make_tra_policy": "jcsaug.policy.factory",
    "load_policies": "jcsaug.policy.io",
    "LockstepThreadDataLoader": "jcsaug.policy.lockstep",
}


@pytest.fixture(scope="module")
def warm():
    """One-off imports (torch's optimiser pulls in torch._dynamo, MONAI's networks) outside the timed examples; one
    torch thread, so the process's CPU time is the examples' cost."""
    importlib.import_module("monai.networks.nets")
    importlib.import_module("ignite.engine")
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("name", list(DOCUMENTED))
def test_docstring_example_runs_in_under_a_second(name, warm):
    module = importlib.import_module(DOCUMENTED[name])
    tests = [t for t in doctest.DocTestFinder().find(getattr(module, name), name, module=module) if t.examples]
    assert tests and tests[0].name == name, f"{name} has no example in its docstring"
    runner = doctest.DocTestRunner(verbose=False)
    start = time.process_time()
    for test in tests:
        runner.run(test)
    seconds = time.process_time() - start
    assert runner.failures == 0, f"the example of {name} fails (run pytest --doctest-modules {module.__file__})"
    assert seconds < 1.0, f"the example of {name} took {seconds:.2f} s of CPU time"
