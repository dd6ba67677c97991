#!/usr/bin/python3
"""Writes the core metadata (METADATA of a .dist-info directory) of the Python client from its
pyproject.toml, for the Debian and RPM packages (scripts/package.sh, packaging/rpm/sandcell.spec),
so that importlib.metadata knows the installed package.

Usage: python-metadata.py PYPROJECT OUT [VERSION]
VERSION, when given, must be the pyproject's version (the packages' version), else exit 1.
Needs Python >= 3.11 (tomllib), as the client itself does.
"""
import sys
import tomllib

if len(sys.argv) not in (3, 4):
    sys.exit(__doc__)
with open(sys.argv[1], "rb") as f:
    p = tomllib.load(f)["project"]
if len(sys.argv) == 4 and p["version"] != sys.argv[3]:
    sys.exit(f"{sys.argv[1]} says version {p['version']}, the package {sys.argv[3]}: keep them equal")
lines = [
    "Metadata-Version: 2.1",
    f"Name: {p['name']}",
    f"Version: {p['version']}",
    f"Summary: {p['description']}",
    f"License: {p['license']['text']}",
    f"Requires-Python: {p['requires-python']}",
]
lines += [f"Classifier: {c}" for c in p.get("classifiers", [])]
with open(sys.argv[2], "w", encoding="utf-8") as f:
    f.write("\n".join(lines) + "\n")
