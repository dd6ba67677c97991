"""The client's TypedDicts name every field the daemon's Varlink interface declares for the
types a client reads from ``ListEnvironments``; fails when the interface grows a field the
Python types do not describe."""

from __future__ import annotations

import re
import typing
from pathlib import Path

import pytest

import sandcell

IDL = Path(__file__).resolve().parents[3] / "proto" / "org.sandcell.Kernel.varlink"


def idl_fields(name: str) -> set[str]:
    """The field names of ``type NAME (...)`` in the interface definition."""
    text = IDL.read_text()
    m = re.search(rf"^type {name} \((.*?)^\)", text, re.S | re.M)
    assert m, f"type {name} not in {IDL}"
    body = "\n".join(l.split("#", 1)[0] for l in m.group(1).splitlines())
    return set(re.findall(r"^\s*([a-z_][a-z0-9_]*)\s*:", body, re.M))


@pytest.mark.parametrize("name,typed", [
    ("Environment", sandcell.Environment),
    ("PackageSource", sandcell.PackageSource),
    ("Package", sandcell.Package),
    ("EgressPolicy", sandcell.EgressPolicy),
])
def test_typed_dicts_cover_the_interface(name: str, typed: type) -> None:
    if not IDL.is_file():
        pytest.skip(f"{IDL} not found: the client is tested outside its source tree")
    keys = set(typing.get_type_hints(typed))
    assert idl_fields(name) <= keys, idl_fields(name) - keys


def test_package_source_is_exported() -> None:
    assert "PackageSource" in sandcell.__all__
    assert "package_sources" in typing.get_type_hints(sandcell.Environment)
