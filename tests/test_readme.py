"""README is the user's manual: it must name every instrument and config key the code has,
with the defaults the code ships; every security promise must name a test that holds it;
no link may break where README is the package's description, away from the repository.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import yaml

from dask_otel.signals.instruments import INSTRUMENTS

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()


def flatten(tree: dict, prefix: str) -> dict[str, object]:
    keys: dict[str, object] = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}"
        keys.update(flatten(value, name) if isinstance(value, dict) else {name: value})
    return keys


def section(title: str) -> str:
    """The text of README's ``## title`` section, up to the next ``## `` heading."""
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end != -1 else len(README)]


def test_every_instrument_is_documented_with_its_unit():
    for name, instrument in INSTRUMENTS.items():
        (row,) = [line for line in README.splitlines() if line.startswith(f"| `{name}` |")]
        assert f"`{instrument.unit}`" in row, name


def test_every_config_key_is_documented():
    defaults = yaml.safe_load((ROOT / "dask_otel" / "otel.yaml").read_text())
    for key in flatten(defaults["otel"], "otel"):
        assert f"`{key}`" in README, key


def test_the_settings_table_has_one_row_per_key_with_its_default():
    shipped = yaml.safe_load((ROOT / "dask_otel" / "otel.yaml").read_text())
    rows: dict[str, object] = {}
    for line in section("Configuration").splitlines():
        if line.startswith("| `otel."):
            key, default = (cell.strip().strip("`") for cell in line.split("|")[1:3])
            assert key not in rows, f"{key} has two rows"
            rows[key] = yaml.safe_load(default)
    assert rows == flatten(shipped["otel"], "otel")


def test_every_security_line_names_a_test_that_exists():
    lines = section("Security").split("\n- ")[1:]
    assert len(lines) >= 8
    for line in lines:
        references = re.findall(r"`(tests/\w+\.py)::(\w+)`", line)
        assert len(references) == 1, f"names no single test: {line[:60]}"
        ((path, name),) = references
        tree = ast.parse((ROOT / path).read_text())
        tests = {
            node.name
            for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        }
        assert name in tests, f"{path}::{name}"


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_no_link_breaks_outside_the_repository():
    """README is also the package's description (PyPI, the wheel): a relative link would
    lead nowhere there. Links are web addresses or README's own headings; the files of
    the repository it names exist."""
    links = re.findall(r"\]\(([^)\s]+)\)", README)
    assert links
    headings = {slug(h) for h in re.findall(r"^#+ (.+)$", README, re.MULTILINE)}
    for link in links:
        assert link.startswith(("https://", "#")), link
        if link.startswith("#"):
            assert link[1:] in headings, link
    for path in set(re.findall(r"`((?:docs|tests|scripts|benchmarks|examples)/[\w./-]+)`", README)):
        assert (ROOT / path).exists(), path
    for path, heading in re.findall(r"`(docs/[\w-]+\.md)`,\s+\"([^\"]+)\"", README):
        heading = " ".join(heading.split())  # wrapped in README
        assert f"## {heading}\n" in (ROOT / path).read_text(), (path, heading)
