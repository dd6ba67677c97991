#!/usr/bin/python3
"""Writes the core metadata (METADATA of a .dist-info directory) of the Python client from its
pyproject.toml, for the Debian and RPM packages (scripts/package.sh, packaging/rpm/sandcell.spec),
so that importlib.metadata knows the installed package.

Usage: python-metadata.py PYPROJECT OUT [VERSION]
       python-metadata.py --version PYPROJECT    (prints the client's version)
VERSION, when given, must be the client's version (the packages' version), else exit 1. The
version is the project's, or, when it is dynamic, the module attribute that
[tool.setuptools.dynamic] names (sandcell.__version__), read as setuptools reads it: the
literal assigned in the module's source, without importing it.
Needs Python >= 3.11 (tomllib), as the client itself does.
"""
import ast
import os
import sys
import tomllib


def client_version(pyproject):
    with open(pyproject, "rb") as f:
        doc = tomllib.load(f)
    p = doc["project"]
    if "version" in p:
        return p["version"]
    st = doc["tool"]["setuptools"]
    module, _, attr = st["dynamic"]["version"]["attr"].rpartition(".")
    where = st.get("packages", {}).get("find", {}).get("where", ["."])[0]
    base = os.path.join(os.path.dirname(pyproject), where, *module.split("."))
    path = os.path.join(base, "__init__.py") if os.path.isdir(base) else base + ".py"
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == attr for t in node.targets):
            return ast.literal_eval(node.value)
    sys.exit(f"{path}: no {attr} = '...'")


if len(sys.argv) == 3 and sys.argv[1] == "--version":
    print(client_version(sys.argv[2]))
    sys.exit(0)
if len(sys.argv) not in (3, 4):
    sys.exit(__doc__)
with open(sys.argv[1], "rb") as f:
    p = tomllib.load(f)["project"]
p["version"] = client_version(sys.argv[1])
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
