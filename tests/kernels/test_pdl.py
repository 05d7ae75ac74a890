"""pagoda.kernels.launch.pdl: programmatic dependent launch of the decode kernels.

PDL is a property of the device (pagoda.kernels.launch.config.LaunchConfig): on the CPU
(the interpreter) a launch gets USE_PDL=False and no launch_pdl, so the kernels compile
without the wait. On a Hopper GPU, whole models (the tiny Qwen3-MoE and Llama presets,
CUDA graphs and eager steps) must give the same greedy tokens and logprobs with PDL as
without it: every participating kernel waits for its predecessor before touching
memory, so nothing may change but the timing.
"""

import pytest
import torch
from helpers.tiny_models import greedy_dummy_run

from pagoda.kernels.launch import pdl
from pagoda.kernels.launch.config import LaunchConfig

SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def test_never_on_the_cpu():
    # The interpreter cannot run griddepcontrol: the CPU never gets the flag.
    assert pdl.launch_options(torch.device("cpu")) == {"USE_PDL": False}
    assert LaunchConfig.for_device(torch.device("cpu")) == LaunchConfig(pdl=False)
    assert LaunchConfig(pdl=True).options() == {"USE_PDL": True, "launch_pdl": True}


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="PDL needs a CUDA GPU of compute capability 9.0+")
def test_on_sm90_the_wait_comes_with_the_launch_flag():
    assert LaunchConfig.for_device(torch.device("cuda")).pdl
    assert pdl.launch_options(torch.device("cuda")) == {"USE_PDL": True, "launch_pdl": True}


@pytest.mark.gpu
@pytest.mark.skipif(not SM90, reason="PDL needs a CUDA GPU of compute capability 9.0+")
@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-llama"])
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_models_unchanged_with_pdl(monkeypatch, preset, enforce_eager):
    on = greedy_dummy_run(preset, enforce_eager=enforce_eager)
    # Without PDL: every launch as on a device that cannot run it.
    monkeypatch.setattr(LaunchConfig, "for_device", classmethod(lambda cls, device: cls(False)))
    off = greedy_dummy_run(preset, enforce_eager=enforce_eager)
    assert on == off
