"""What the profile_step modes share: the torch.profiler activities of a run and the
device synchronisation around timed steps."""


def profiler_activities(on_cuda: bool) -> list:
    """torch.profiler's activities: CPU, and CUDA on a GPU run."""
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU]
    if on_cuda:
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return activities


def device_sync(device: str):
    """A function that waits for the device (nothing on the CPU)."""
    import torch

    return torch.cuda.synchronize if device == "cuda" else (lambda: None)
