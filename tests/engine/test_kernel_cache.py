"""The CPU kernels' build cache: keyed by everything that shapes the binary, under the tfserve home."""

from __future__ import annotations

from tfserve.engine import kernels


def test_key_covers_the_cpu_features_and_flags(monkeypatch):
    key = kernels.cache_key()
    kernels.cache_key.cache_clear()
    monkeypatch.setattr(kernels, "cpu_features", lambda: frozenset({"sse2"}))
    other_cpu = kernels.cache_key()
    kernels.cache_key.cache_clear()
    monkeypatch.setattr(kernels, "_CFLAGS", [*kernels._CFLAGS, "-DEXTRA"])
    other_flags = kernels.cache_key()
    kernels.cache_key.cache_clear()
    assert len({key, other_cpu, other_flags}) == 3


def test_build_dir_is_under_the_home_unless_moved(monkeypatch, tmp_path):
    monkeypatch.delenv("TFSERVE_KERNELS_DIR", raising=False)
    monkeypatch.setenv("TFSERVE_HOME", str(tmp_path / "home"))
    assert kernels.build_dir() == tmp_path / "home" / "kernels" / f"cpu_ops-{kernels.cache_key()}"
    monkeypatch.setenv("TFSERVE_KERNELS_DIR", str(tmp_path / "k"))
    assert kernels.build_dir().parent == tmp_path / "k"


def test_isa_names_the_widest_path(monkeypatch):
    for features, expected in [({"avx2", "avx512f"}, "AVX-512"), ({"avx2", "fma"}, "AVX2"), ({"asimd"}, "NEON"),
                               (set(), "scalar")]:
        monkeypatch.setattr(kernels, "cpu_features", lambda features=features: frozenset(features))
        assert kernels.isa() == expected


def test_switched_off_kernels_are_never_built(monkeypatch):
    from tfserve.config import EngineConfig

    monkeypatch.setenv("TFSERVE_CPU_KERNELS", "0")  # what operators set: the config's default follows it
    assert EngineConfig().cpu_kernels is False
    assert EngineConfig(cpu_kernels=True).cpu_kernels is True


def test_each_environment_has_its_own_build_and_checkouts_share_one(monkeypatch, tmp_path):
    import sys

    key = kernels.cache_key()
    kernels.cache_key.cache_clear()
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "another-venv"))
    assert kernels.cache_key() != key  # torch writes the environment's paths into build.ninja
    kernels.cache_key.cache_clear()
    # the build compiles a copy inside its own directory, so the checkout the source came from is not in it
    copy = kernels._source_copy(tmp_path)
    assert copy.parent == tmp_path and copy.read_bytes() == kernels._SOURCE.read_bytes()
    assert kernels._source_copy(tmp_path) == copy


def test_the_target_cpu_is_part_of_the_key(monkeypatch):
    kernels.cache_key.cache_clear()
    native = kernels.cache_key()
    monkeypatch.setenv("TFSERVE_KERNELS_MARCH", "x86-64-v3")
    kernels.cache_key.cache_clear()
    assert kernels.cache_key() != native
    assert kernels.cache_key("native") == native  # an explicit target wins over the environment
    kernels.cache_key.cache_clear()


def test_a_build_started_beside_the_load_is_shown_and_waited_for(monkeypatch):
    """`start_building` compiles on a thread of its own (once); `build_with_progress` names the stage and waits."""
    import threading

    built, release, calls = threading.Event(), threading.Event(), []

    def build():
        calls.append(threading.current_thread().name)
        release.wait(10)
        built.set()

    monkeypatch.setattr(kernels, "cpu_ops", build)
    monkeypatch.setattr(kernels, "needs_build", lambda: not built.is_set())
    monkeypatch.setattr(kernels, "_beside", None)
    kernels.start_building()
    kernels.start_building()  # already started: not again
    reports: list[str] = []
    threading.Timer(0.2, release.set).start()
    kernels.build_with_progress(reports.append)
    assert built.is_set() and calls[0] == "tfserve-kernel-build"
    assert len(reports) == 1 and reports[0].startswith("Building tfserve's CPU kernels")
    kernels.build_with_progress(reports.append)  # built: nothing to show
    assert len(reports) == 1


def test_a_build_begun_beside_the_load_is_shown_even_when_it_finished_first(monkeypatch):
    """The stage a first run shows does not depend on which of the load and the compiler finished first."""
    import threading

    built = threading.Event()
    monkeypatch.setattr(kernels, "cpu_ops", built.set)
    monkeypatch.setattr(kernels, "needs_build", lambda: not built.is_set())
    monkeypatch.setattr(kernels, "_beside", None)
    kernels.start_building()
    kernels._beside.join()  # the compiler was quicker than the load
    reports: list[str] = []
    kernels.build_with_progress(reports.append)
    assert len(reports) == 1 and reports[0].startswith("Building tfserve's CPU kernels")


def test_a_build_killed_part_way_does_not_hold_later_ones():
    """torch's lock file, left by a process killed while building (Ctrl-C in a first `serve`), made every later
    build or load wait for ever."""
    import threading

    if kernels.cpu_ops() is None:
        import pytest

        pytest.skip("no compiler here: the kernels do not build")
    (kernels.build_dir() / "lock").touch()  # what the killed process left
    (kernels.build_dir() / kernels._BUILT).unlink(missing_ok=True)  # through torch's load, which takes its lock
    done = []
    thread = threading.Thread(target=lambda: done.append(kernels.build()), daemon=True)
    thread.start()
    thread.join(60)
    assert done and done[0].isa == kernels.cpu_ops().isa
    assert not (kernels.build_dir() / "lock").exists()


def test_a_finished_build_loads_straight_from_its_file_only_as_it_was_marked():
    """A later start imports the .so its build marked straight from the file (no setuptools, compiler or ninja);
    a .so that is not the one marked, or that others may write, goes through torch's `load` again."""
    import os

    import pytest

    if kernels.cpu_ops() is None:
        pytest.skip("no compiler here: the kernels do not build")
    directory = kernels.build_dir()
    mark = directory / kernels._BUILT
    if not mark.is_file():
        kernels.build()  # a build from before the mark: torch's load marks it
    assert mark.read_text() == kernels._so_identity(directory / f"{kernels._module_name()}.so")
    assert kernels._load_built(directory, None).isa == kernels.cpu_ops().isa
    marked = mark.read_text()
    try:
        mark.write_text("0 0 0")  # another .so than the one loaded before
        assert kernels._load_built(directory, None) is None
        mark.write_text(marked)
        mode = directory.stat().st_mode
        os.chmod(directory, mode | 0o020)
        try:
            assert kernels._load_built(directory, None) is None
        finally:
            os.chmod(directory, mode)
    finally:
        mark.write_text(marked)
    assert kernels._load_built(directory, None) is not None
