"""pagoda.kernels.launch.pdl: programmatic dependent launch of the decode kernels.

On the CPU (and wherever it is off) a launch gets USE_PDL=False and no launch_pdl, so
the kernels compile and run exactly as before. On a Hopper GPU, whole models (the
tiny Qwen3-MoE and Llama presets, CUDA graphs and eager steps) must give the same
greedy tokens and logprobs with PDL on as with it off: every participating kernel waits
for its predecessor before touching memory, so nothing may change but the timing.
"""

import pytest
import torch

from pagoda.kernels.launch import pdl
from tests.tiny_models import greedy_dummy_run

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def test_off_by_default_and_never_on_the_cpu(monkeypatch):
    assert pdl.launch_options(torch.device("cpu")) == {"USE_PDL": False}
    monkeypatch.setattr(pdl, "ENABLED", True)
    # The interpreter cannot run griddepcontrol: the CPU never gets the flag.
    assert pdl.launch_options(torch.device("cpu")) == {"USE_PDL": False}
    monkeypatch.setattr(pdl, "ENABLED", False)
    if torch.cuda.is_available():
        assert pdl.launch_options(torch.device("cuda")) == {"USE_PDL": False}


@pytest.mark.skipif(not SM90, reason="PDL needs a CUDA GPU of compute capability 9.0+")
def test_on_sm90_the_wait_comes_with_the_launch_flag(monkeypatch):
    monkeypatch.setattr(pdl, "ENABLED", True)
    assert pdl.launch_options(torch.device("cuda")) == {"USE_PDL": True, "launch_pdl": True}
    monkeypatch.setattr(pdl, "TRIGGER_FIRST", True)  # USE_PDL carries the order
    assert pdl.launch_options(torch.device("cuda")) == {"USE_PDL": 2, "launch_pdl": True}


def test_trigger_first_never_reaches_the_cpu(monkeypatch):
    monkeypatch.setattr(pdl, "ENABLED", True)
    monkeypatch.setattr(pdl, "TRIGGER_FIRST", True)
    assert pdl.launch_options(torch.device("cpu")) == {"USE_PDL": False}


@pytest.mark.skipif(not SM90, reason="PDL needs a CUDA GPU of compute capability 9.0+")
@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-llama"])
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_models_unchanged_with_pdl(monkeypatch, preset, enforce_eager):
    monkeypatch.setattr(pdl, "ENABLED", False)
    off = greedy_dummy_run(preset, enforce_eager=enforce_eager)
    monkeypatch.setattr(pdl, "ENABLED", True)
    on = greedy_dummy_run(preset, enforce_eager=enforce_eager)
    assert on == off
    monkeypatch.setattr(pdl, "TRIGGER_FIRST", True)  # dependents released before the wait
    assert greedy_dummy_run(preset, enforce_eager=enforce_eager) == off


class _Compiled:  # what a launch returns: Triton's compiled kernel, with its CUfunction
    def __init__(self, function):
        self.function = function


def test_carveout_preference_is_set_once_and_taken_back(monkeypatch):
    """PREFER_MAX_SHARED: the first launch of a function after the switch changes sets its
    carveout (100 on, -1 = the driver's default off), later launches set nothing, and a
    function never touched is left alone while the switch is off."""
    calls = []
    monkeypatch.setattr(pdl, "_set_function_attribute",
                        lambda handle, attribute, value: calls.append((handle, attribute, value)))
    monkeypatch.setattr(pdl, "_carveouts", {})
    monkeypatch.setattr(pdl, "PREFER_MAX_SHARED", False)
    pdl.launched(_Compiled(7))
    pdl.launched(None)  # the interpreter's launches return no compiled kernel
    pdl.launched(_Compiled(0))
    assert calls == []
    monkeypatch.setattr(pdl, "PREFER_MAX_SHARED", True)
    for handle in (7, 7, 8, 0):
        pdl.launched(_Compiled(handle))
    assert calls == [(7, 9, 100), (8, 9, 100)]
    monkeypatch.setattr(pdl, "PREFER_MAX_SHARED", False)
    pdl.launched(_Compiled(8))
    pdl.launched(_Compiled(8))
    pdl.launched(_Compiled(9))
    assert calls[2:] == [(8, 9, -1)]


@pytest.mark.skipif(not SM90, reason="PDL needs a CUDA GPU of compute capability 9.0+")
@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-llama"])
def test_models_unchanged_with_the_max_shared_carveout(monkeypatch, preset):
    """The carveout changes where programs may start, never what they compute; the driver
    accepts the attribute on every participating kernel (no CUDA error)."""
    monkeypatch.setattr(pdl, "ENABLED", True)
    monkeypatch.setattr(pdl, "PREFER_MAX_SHARED", False)
    off = greedy_dummy_run(preset)
    monkeypatch.setattr(pdl, "PREFER_MAX_SHARED", True)
    on = greedy_dummy_run(preset)
    assert on == off
    assert set(pdl._carveouts.values()) == {100}
