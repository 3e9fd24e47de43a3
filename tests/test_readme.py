"""README is the user's manual: it must name every instrument and config key the code has."""

from __future__ import annotations

from pathlib import Path

import yaml

from dask_otel.metrics import INSTRUMENTS

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()


def flatten(tree: dict, prefix: str) -> list[str]:
    keys = []
    for key, value in tree.items():
        name = f"{prefix}.{key}"
        keys.extend(flatten(value, name) if isinstance(value, dict) else [name])
    return keys


def test_every_instrument_is_documented_with_its_unit():
    for name, instrument in INSTRUMENTS.items():
        (row,) = [line for line in README.splitlines() if line.startswith(f"| `{name}` |")]
        assert f"`{instrument.unit}`" in row, name


def test_every_config_key_is_documented():
    defaults = yaml.safe_load((ROOT / "dask_otel" / "otel.yaml").read_text())
    for key in flatten(defaults["otel"], "otel"):
        assert f"`{key}`" in README, key
