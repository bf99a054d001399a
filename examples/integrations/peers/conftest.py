"""./dev peers: the drop-ins inside the released SGLang, LMCache and vLLM (not part of ./dev test).

``torch.cuda.cudart()`` (and vLLM's CudaRTLibrary) answer with one ``pinpool.testing.FakeCudart``,
which pinpool's CudaRuntime also uses: their calls and pinpool's share CUDA's books (712/713)
and really mlock."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from pinpool.runtimes import CudaRuntime
from pinpool.testing import FakeCudart

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "stand_ins"))  # torchvision's import surface, for SGLang's srt package


def vmlck() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmLck:"))


def load_shim(name: str, fake: FakeCudart) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"peers_{name}", HERE.parent / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.RUNTIME = CudaRuntime.from_binding(fake)  # type: ignore[attr-defined]
    return module


@pytest.fixture
def fake(monkeypatch: pytest.MonkeyPatch) -> Any:
    cudart = FakeCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    before = vmlck()
    yield cudart
    assert cudart.registered == {}, "something is still registered"
    assert vmlck() == before, "VmLck did not come back"
