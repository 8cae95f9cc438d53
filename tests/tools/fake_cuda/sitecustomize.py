"""Make a CPU-only PyTorch claim a GPU, to find on a machine without one the tests that reach CUDA implicitly.

Not a test and not imported by the suite. With ``JCSAUG_FAKE_CUDA=1`` and this folder first on ``PYTHONPATH``,
every Python process of the run (the bundle runs and spawned ranks too) sees ``torch.cuda.is_available()`` true
and one device, unless it was started with the GPUs hidden (``CUDA_VISIBLE_DEVICES=""``). A test that then fails
with "Torch not compiled with CUDA enabled" takes a CUDA path on a GPU machine; see tests/README.md.
"""

import os

if os.environ.get("JCSAUG_FAKE_CUDA") and os.environ.get("CUDA_VISIBLE_DEVICES") != "":
    import torch

    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
