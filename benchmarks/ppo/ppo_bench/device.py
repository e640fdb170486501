"""Device helpers shared by the rows: synchronising before reading a clock, peak memory."""

import resource


def sync(device: str) -> None:
    """Waits for the device's queued work, so that a clock read afterwards sees it done."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def peak_memory(device: str) -> dict:
    """Peak memory of this process: max allocated on CUDA, max RSS on CPU (setup included).

    Returns:
        dict: ``peak_memory_mib`` and ``peak_memory_kind`` (what was measured).
    """
    if device.startswith("cuda"):
        import torch

        return {"peak_memory_mib": torch.cuda.max_memory_allocated() / 2**20,
                "peak_memory_kind": "max allocated (CUDA)"}
    # ru_maxrss is in KiB on Linux.
    return {"peak_memory_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            "peak_memory_kind": "max RSS"}
