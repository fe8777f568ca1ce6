"""`device: auto` means the GPU when torch sees one, for every stage (one rule, nestling/devices.py)."""

from __future__ import annotations

import pytest
import torch

from nestling.capture.settings import CaptureSettings, resolve
from nestling.devices import resolve_device
from nestling.errors import NestlingError
from nestling.regenerate.settings import RegenerateSettings
from nestling.train.settings import TrainSettings


def test_auto_is_the_gpu_when_there_is_one_else_the_cpu():
    here = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto") == here
    assert resolve(CaptureSettings()).device == here  # capture, train and regenerate all default to auto
    assert TrainSettings().device == "auto" and RegenerateSettings().device == "auto"
    assert resolve_device("cpu") == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_asking_for_cuda_without_a_gpu_says_what_to_do():
    with pytest.raises(NestlingError, match="torch sees no CUDA GPU; use device cpu"):
        resolve_device("cuda:1")
