"""pinpool's pytest plugin (pinpool/pytest_plugin.py), run through pytester in-process."""

from __future__ import annotations

from pathlib import Path

import pytest

from pinpool import PinnedPool  # noqa: F401  (loaded before pytester's in-process runs, which would unload it)

pytest_plugins = ["pytester"]

PLUGIN = ("-p", "pinpool.pytest_plugin")


def test_fixtures_pass_when_everything_is_exited(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pinpool
        from pinpool.testing import FakeRuntime

        MiB = 1 << 20

        def test_fake_is_fresh(fake_runtime):
            assert isinstance(fake_runtime, FakeRuntime)
            assert fake_runtime.register_calls == [] and fake_runtime.registered == {}

        def test_factory_defaults(pinned_pool_factory, fake_runtime):
            pool = pinned_pool_factory(size=4 * MiB, chunk_bytes="1MiB")
            assert pool.runtime is fake_runtime is pinned_pool_factory.fake_runtime
            with pool:
                assert len(fake_runtime.registered) == 4
            assert fake_runtime.registered == {}
            assert pinned_pool_factory.registry.get_sample_value(
                "pinpool_chunks_registered_total", {"pool": "default", "runtime": "fake"}
            ) == 4.0
            assert pinned_pool_factory.pools == [pool]

        def test_each_test_gets_its_own_registry(pinned_pool_factory):
            with pinned_pool_factory(size=2 * MiB, chunk_bytes="1MiB"):
                pass
            assert pinned_pool_factory.registry.get_sample_value(
                "pinpool_chunks_registered_total", {"pool": "default", "runtime": "fake"}
            ) == 2.0

        def test_factory_pin_and_overrides(pinned_pool_factory):
            import torch
            t = torch.zeros(1 << 20, dtype=torch.uint8)
            with pinned_pool_factory.pin(t, registry=None) as pinned:
                assert pinned.tensor.data_ptr() == t.data_ptr()
            mine = FakeRuntime()
            with pinned_pool_factory(size=1 * MiB, runtime=mine, name="mine"):
                assert mine.registered
            assert mine.registered == {}

        def test_constructed_but_never_entered_is_fine(pinned_pool_factory):
            pinned_pool_factory(size=1 * MiB)

        def test_failed_pin_is_fine(pinned_pool_factory, fake_runtime):
            fake_runtime.fail_next(1)
            try:
                with pinned_pool_factory(size=1 * MiB):
                    pass
            except pinpool.PinError:
                pass
        """
    )
    result = pytester.runpytest(*PLUGIN)
    result.assert_outcomes(passed=6)


def test_a_leaked_registration_fails_the_test_at_teardown(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        def test_leaks(fake_runtime):
            fake_runtime.register(0x10000, 8192)
        """
    )
    result = pytester.runpytest(*PLUGIN)
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*ERROR at teardown of test_leaks*",
            "*fake_runtime: 1 range(s) still registered after the test, 8192 bytes: [[]0x10000, +8192 B)*",
        ]
    )


def test_a_pool_left_open_is_exited_and_reported(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        MiB = 1 << 20
        pools = []

        def test_forgets_to_exit(pinned_pool_factory):
            pool = pinned_pool_factory(size=2 * MiB, chunk_bytes="1MiB", name="forgotten")
            pool.__enter__()
            pools.append(pool)

        def test_the_pool_was_closed_by_the_fixture():
            (pool,) = pools
            assert pool.pinned_bytes == 0 and pool.runtime.registered == {}
        """
    )
    result = pytester.runpytest(*PLUGIN)
    result.assert_outcomes(passed=2, errors=1)
    result.stdout.fnmatch_lines(
        [
            "*pinned_pool_factory:*",
            "*pool 'forgotten' was entered and never exited; the fixture exited it: <PinnedPool 'forgotten'*",
        ]
    )
    result.stdout.no_fnmatch_line("*fake_runtime: *still registered*")  # exited first, so the fake is clean


def test_a_leak_on_a_fake_of_the_tests_own_is_reported(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(
        """
        import pytest
        import pinpool
        from pinpool.testing import FakeRuntime

        def test_unpin_fails(pinned_pool_factory):
            mine = FakeRuntime(fail_unregister_on=1)
            with pytest.raises(pinpool.UnpinError):
                with pinned_pool_factory(size=1 << 20, runtime=mine, name="kv"):
                    pass
        """
    )
    result = pytester.runpytest(*PLUGIN)
    result.assert_outcomes(passed=1, errors=1)
    result.stdout.fnmatch_lines(["*the FakeRuntime of pool(s) 'kv': 1 range(s) still registered*"])


def test_fake_auto_runtime_is_what_the_default_runtime_resolves_to_during_the_test(pytester: pytest.Pytester) -> None:
    """A server that builds its own pool (runtime="auto", the default) gets the test's fake, in every thread,
    and only during the test; what it leaves registered fails the test as fake_runtime's would."""
    pytester.makepyfile(
        """
        import threading

        import pinpool
        from pinpool.runtimes import resolve_runtime
        from pinpool.testing import FakeRuntime, auto_runtime

        MiB = 1 << 20
        pools = []

        def build():  # the server's code: no runtime= anywhere
            pools.append(pinpool.PinnedPool(size=2 * MiB, chunk_bytes="1MiB", registry=None))

        def test_the_default_runtime_is_the_fake(fake_auto_runtime, fake_runtime):
            assert fake_auto_runtime is fake_runtime
            worker = threading.Thread(target=build)  # a test client runs the app on a thread of its own
            worker.start()
            worker.join()
            with pools[0] as pool:
                assert pool.runtime is fake_auto_runtime and len(fake_auto_runtime.registered) == 2
            assert pinpool.PinnedPool(size=MiB, runtime="mlock", registry=None).runtime.name == "mlock"
            inner = FakeRuntime()
            with auto_runtime(inner):  # blocks nest
                assert resolve_runtime("auto") is inner
            assert resolve_runtime("auto") is fake_auto_runtime

        def test_and_only_during_the_test():
            assert not isinstance(resolve_runtime("auto"), FakeRuntime)

        def test_a_pool_the_server_left_open_fails_the_test(fake_auto_runtime):
            pools[0] = pinpool.PinnedPool(size=2 * MiB, chunk_bytes="1MiB", registry=None)
            pools[0].__enter__()

        def test_closed_by_hand():
            pools[0].__exit__(None, None, None)
        """
    )
    result = pytester.runpytest(*PLUGIN)
    result.assert_outcomes(passed=4, errors=1)
    result.stdout.fnmatch_lines(
        ["*ERROR at teardown of test_a_pool_the_server_left_open_fails_the_test*", "*2 range(s) still registered*"]
    )


GPU_TESTS = """
    import pytest

    @pytest.mark.gpu
    def test_needs_cuda():
        pass

    def test_plain():
        pass
    """


def test_gpu_tests_skip_without_cuda(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    pytester.makepyfile(GPU_TESTS)
    result = pytester.runpytest(*PLUGIN, "--strict-markers", "-rs")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*SKIPPED*needs a CUDA device (torch.cuda.is_available() is False)*"])


def test_gpu_tests_run_with_cuda(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    pytester.makepyfile(GPU_TESTS)
    result = pytester.runpytest(*PLUGIN, "--strict-markers")
    result.assert_outcomes(passed=2)


def test_gpu_marker_declared_by_the_project_too_is_listed_once(pytester: pytest.Pytester) -> None:
    pytester.makepyprojecttoml(
        """
        [tool.pytest.ini_options]
        addopts = ["--strict-markers"]
        markers = ["gpu: the project's own words"]
        """
    )
    pytester.makepyfile(GPU_TESTS)
    result = pytester.runpytest(*PLUGIN, "--markers")
    gpu_lines = [line for line in result.stdout.lines if line.startswith("@pytest.mark.gpu")]
    assert gpu_lines == ["@pytest.mark.gpu: the project's own words"]
    assert pytester.runpytest(*PLUGIN).ret == pytest.ExitCode.OK


def test_gpu_marker_is_registered_for_strict_markers(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(GPU_TESTS)
    result = pytester.runpytest(*PLUGIN, "--markers")
    result.stdout.fnmatch_lines(["@pytest.mark.gpu: needs a CUDA device; skipped cleanly without one"])
    assert pytester.runpytest(*PLUGIN, "--strict-markers").ret == pytest.ExitCode.OK


def _install_entry_point(root: Path) -> None:
    """A distribution on sys.path that declares the pytest11 entry point the pyproject will."""
    info = root / "pinpool_plugin_under_test-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: pinpool-plugin-under-test\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[pytest11]\npinpool = pinpool.pytest_plugin:entry_point\n")


USES_FIXTURES = """
    def test_uses_the_plugin(fake_runtime, pinned_pool_factory):
        with pinned_pool_factory(size=1 << 20):
            assert fake_runtime.registered
    """


@pytest.mark.parametrize(
    ("args", "conftest"),
    [
        ((), False),  # the entry point alone
        (PLUGIN, False),  # and -p with the module's name
        (("-p", "pinpool"), False),  # and -p with the entry point's name
        (PLUGIN, True),  # and -p and a conftest's pytest_plugins
    ],
    ids=["entry-point", "entry-point+-p module", "entry-point+-p pinpool", "entry-point+-p+conftest"],
)
def test_loaded_through_the_entry_point_and_explicitly_it_registers_once(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, args: tuple[str, ...], conftest: bool
) -> None:
    monkeypatch.delenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    site = pytester.mkdir("site")
    _install_entry_point(site)
    monkeypatch.syspath_prepend(str(site))
    if conftest:
        pytester.makeconftest('pytest_plugins = ["pinpool.pytest_plugin"]')
    pytester.makepyfile(USES_FIXTURES)
    result = pytester.runpytest(*args, "--trace-config")
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*PLUGIN registered: <module 'pinpool.pytest_plugin'*"])
    registered = [line for line in result.stdout.lines if "PLUGIN registered: <module 'pinpool.pytest_plugin'" in line]
    assert len(registered) == 1


def test_no_pinpool_turns_the_entry_point_off(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTEST_DISABLE_PLUGIN_AUTOLOAD", raising=False)
    site = pytester.mkdir("site")
    _install_entry_point(site)
    monkeypatch.syspath_prepend(str(site))
    pytester.makepyfile(USES_FIXTURES)
    result = pytester.runpytest("-p", "no:pinpool")
    result.assert_outcomes(errors=1)
    result.stdout.fnmatch_lines(["*fixture 'fake_runtime' not found*"])


def test_loaded_twice_explicitly_it_registers_once(pytester: pytest.Pytester) -> None:
    pytester.makeconftest('pytest_plugins = ["pinpool.pytest_plugin"]')
    pytester.makepyfile(USES_FIXTURES)
    pytester.runpytest(*PLUGIN).assert_outcomes(passed=1)


def test_plugin_module_does_not_import_torch() -> None:
    source = (Path(__file__).parents[2] / "pinpool" / "pytest_plugin.py").read_text()
    top_level = [line for line in source.splitlines() if line.startswith(("import ", "from "))]
    assert not [line for line in top_level if "torch" in line or "pinpool" in line], top_level
