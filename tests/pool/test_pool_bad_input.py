"""Bad input rejected before anything is mapped or pinned (the command line: tests/tools/test_cli.py)."""

from __future__ import annotations

import pytest

import pinpool
from pinpool import layouts
from pinpool.testing import FakeRuntime

MiB = 1 << 20


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"size": "lots"}, "size='lots'"),
        ({"size": 0}, "size=0"),
        ({"size": -5}, "size=-5"),
        ({"size": 1.5}, "size=1.5"),
        ({"size": True}, "size=True"),
        ({"size": "1GiB", "chunk_bytes": "tiny"}, "chunk_bytes='tiny'"),
        ({"size": "1GiB", "chunk_bytes": 0}, "chunk_bytes=0"),
        ({"size": "1GiB", "register_workers": 0}, "register_workers=0"),
        ({"size": "1GiB", "register_workers": 2.5}, "register_workers=2.5"),
        ({"size": "1GiB", "runtime": "rocm"}, "runtime='rocm'.*'mlock'"),
        ({"size": "1GiB", "runtime": object()}, "runtime=<object"),
        ({"size": "1GiB", "layout": "raw"}, "layout='raw'"),
        ({"size": "1GiB", "name": ""}, "name=''"),
        ({"size": "1GiB", "populate": "yes"}, "populate='yes'"),
        ({"size": "1GiB", "huge_pages": 1}, "huge_pages=1"),
        ({"size": 1000, "layout": layouts.Raw(granularity_bytes=MiB)}, "smaller than one page"),
        (
            {"size": "8GiB", "layout": layouts.Raw(granularity_bytes=3 << 30), "chunk_bytes": "1GiB"},
            "raise chunk_bytes",
        ),
        ({"size": "8GiB", "chunk_bytes": 100}, "OS page"),
    ],
)
def test_bad_input_is_a_config_error_before_anything_is_pinned(
    fake: FakeRuntime, kwargs: dict[str, object], match: str
) -> None:
    kwargs.setdefault("runtime", fake)
    with pytest.raises(pinpool.ConfigError, match=match):
        pinpool.PinnedPool(**kwargs)  # type: ignore[arg-type]
    assert fake.register_calls == []


@pytest.mark.parametrize("value", ["", "abc", "0", "-2", "nan", "inf"])
def test_bad_chunk_env_var_is_a_config_error(fake: FakeRuntime, monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("PINPOOL_REGISTER_CHUNK_GB", value)
    with pytest.raises(pinpool.ConfigError, match="PINPOOL_REGISTER_CHUNK_GB"):
        pinpool.PinnedPool(size="1GiB", runtime=fake)


def test_chunk_env_var_sets_the_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PINPOOL_REGISTER_CHUNK_GB", "0.25")
    pool = pinpool.PinnedPool(size="1GiB", runtime=FakeRuntime(), register_workers=1)
    assert pool.plan.chunk_bytes == 256 * MiB and len(pool.plan.chunks) == 4
    explicit = pinpool.PinnedPool(size="1GiB", runtime=FakeRuntime(), register_workers=1, chunk_bytes="512MiB")
    assert explicit.plan.chunk_bytes == 512 * MiB  # chunk_bytes= wins over the environment


def test_default_workers_split_chunks_but_never_below_one_gib() -> None:
    pool = pinpool.PinnedPool(size="16GiB", runtime=FakeRuntime(), register_workers=2, populate=False)
    assert pool.plan.chunk_bytes == 2 << 30 and len(pool.plan.chunks) == 8  # 4 per worker
    small = pinpool.PinnedPool(size="3GiB", runtime=FakeRuntime(), register_workers=4, populate=False)
    assert small.plan.chunk_bytes == 1 << 30 and small.plan.register_workers == 3
    single = pinpool.PinnedPool(size="16GiB", runtime=FakeRuntime(), register_workers=1, populate=False)
    assert len(single.plan.chunks) == 1  # one worker: the reference's single registration
    # Pre-faulting on 4 threads splits for them too: the pipeline needs chunks to overlap.
    piped = pinpool.PinnedPool(size="16GiB", runtime=FakeRuntime(), register_workers=1, populate_workers=4)
    assert piped.plan.chunk_bytes == 1 << 30 and len(piped.plan.chunks) == 16 and piped.plan.register_workers == 1
    assert piped.plan.populate_workers == 4 and piped._plan.span_bytes == 256 << 20


def test_auto_runtime_is_the_gpu_stack_or_mlock() -> None:
    import torch

    pool = pinpool.PinnedPool(size="1MiB")
    # ROCm builds answer torch.cuda.is_available() too; only torch.version.hip tells them apart.
    gpu = "rocm" if torch.version.hip else "cuda"
    assert pool.runtime.name == (gpu if torch.cuda.is_available() else "mlock")
