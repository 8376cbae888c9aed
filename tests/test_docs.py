"""Generated files stay current: completions/* and docs/cli.md match what the CLI gives now."""

from __future__ import annotations

from pathlib import Path

import pytest

from tfserve.cli import gen_docs


@pytest.fixture(scope="module")
def generated():
    return gen_docs.render_all()


@pytest.mark.parametrize("name", ["completions/tfserve.bash", "completions/_tfserve", "completions/tfserve.fish",
                                  "docs/cli.md"])
def test_generated_file_is_current(generated, name):
    path = gen_docs.ROOT / name
    assert path.is_file(), f"{name} is missing: run `python -m tfserve.cli.gen_docs`"
    assert path.read_text() == generated[Path(name)], f"{name} is stale: run `python -m tfserve.cli.gen_docs`"


def test_cli_md_covers_every_command(generated):
    text = generated[Path("docs/cli.md")]
    for path in gen_docs.command_paths():
        assert f"## `{' '.join(['tfserve', *path])}`" in text
    assert "\x1b[" not in text  # no ANSI colours


def test_completion_scripts_call_back_tfserve(generated):
    assert "_TFSERVE_COMPLETE=complete_bash" in generated[Path("completions/tfserve.bash")]
    assert "#compdef tfserve" in generated[Path("completions/_tfserve")]
    assert "complete --command tfserve" in generated[Path("completions/tfserve.fish")]


def test_architecture_names_modules_that_exist():
    import re

    root = Path(__file__).resolve().parents[1]
    text = (root / "docs" / "architecture.md").read_text()
    paths = set(re.findall(r"((?:server|serving|engine|models|protocol|chat|cli|bench)/[\w/]+\.py|config\.py)", text))
    assert len(paths) > 10
    missing = sorted(p for p in paths if not (root / "tfserve" / p).is_file())
    assert not missing, f"docs/architecture.md names modules that are gone: {missing}"
