#!/usr/bin/env bash
# The Python client (clients/python): unit tests, then pytest against a real sandcelld that
# the tests start as scripts/demo.sh does (systemd-socket-activate, built workers, private
# state dir and cgroup name, as root); the package installs with pip; the example deployment
# manifests in docs/deploy/ parse (YAML parser; not applied); mypy --strict passes on the
# package (scripts/mypy-venv.sh). Needs scripts/setup.sh's build.
# Exits non-zero on any failure, including "no tests collected".
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh
py=/usr/bin/python3   # Debian's Python 3.11 (a python3 on PATH may be another interpreter)

need=()
"$py" -c 'import pytest' 2>/dev/null || need+=(python3-pytest)
"$py" -c 'import yaml' 2>/dev/null || need+=(python3-yaml)
"$py" -c 'import ensurepip' 2>/dev/null || need+=(python3-venv)
"$py" -c 'import setuptools' 2>/dev/null || need+=(python3-setuptools)
if ((${#need[@]})); then
    echo "python client: installing ${need[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null ||
        { apt-get update -qq && apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null; }
fi

echo "== deployment manifests (docs/deploy): syntax and shape"
"$py" - <<'PY'
import glob, json, sys
import yaml

bad = 0
for path in sorted(glob.glob("docs/deploy/*.yaml") + glob.glob("docs/deploy/*.yml")):
    docs = [d for d in yaml.safe_load_all(open(path, encoding="utf-8")) if d is not None]
    for d in docs:
        if not (isinstance(d, dict) and d.get("apiVersion") and d.get("kind")
                and d.get("metadata", {}).get("name")):
            print(f"{path}: a document without apiVersion, kind and metadata.name"); bad += 1
        if d.get("kind") == "DaemonSet":
            spec = d["spec"]
            labels = spec["template"]["metadata"]["labels"]
            if any(labels.get(k) != v for k, v in spec["selector"]["matchLabels"].items()):
                print(f"{path}: {d['metadata']['name']}: selector does not match the template"); bad += 1
    print(f"{path}: {len(docs)} documents: " + ", ".join(f"{d['kind']}/{d['metadata']['name']}" for d in docs))
for path in sorted(glob.glob("docs/deploy/*.json")):
    job = json.load(open(path, encoding="utf-8"))
    yaml.safe_load(open(path, encoding="utf-8"))  # JSON is YAML too
    j = job.get("Job", {})
    if j.get("Type") != "system" or not j.get("TaskGroups"):
        print(f"{path}: not a Nomad system job with task groups"); bad += 1
    print(f"{path}: Nomad job {j.get('ID')} ({j.get('Type')})")
sys.exit(1 if bad else 0)
PY

echo "== python client: pip install ./clients/python (offline, Debian's setuptools)"
tmp=$(mktemp -d /var/tmp/sandcell-pyclient.XXXXXX)
trap 'rm -rf "$tmp"' EXIT
cp -r clients/python "$tmp/src"
rm -rf "$tmp/src/build" "$tmp"/src/src/*.egg-info
"$py" -m venv --system-site-packages "$tmp/venv"
"$tmp/venv/bin/pip" install -q --no-build-isolation --no-index "$tmp/src"
(cd "$tmp" && "$tmp/venv/bin/python" -c \
    'import sandcell, sandcell.openai; assert sandcell.__file__.startswith("'"$tmp"'/venv"); print("installed:", sandcell.__file__)')

echo "== python client: the installed version is sandcell.__version__ (written once)"
(cd "$tmp" && "$tmp/venv/bin/python" -c \
    'import importlib.metadata as m, sandcell; v = m.version("sandcell"); assert v == sandcell.__version__, (v, sandcell.__version__); print("version:", v)')

echo "== python client: mypy --strict (pinned; configuration in clients/python/pyproject.toml)"
mypy=$(bash scripts/mypy-venv.sh)
(cd clients/python && MYPY_CACHE_DIR="$tmp/mypy-cache" "$mypy" --strict)

echo "== python client: pytest (unit, and against a real sandcelld)"
rc=0
# As root (CI) the daemon tests must run: a missing build is a failure, not a skip.
[[ $(id -u) -eq 0 ]] && export SANDCELL_REQUIRE_DAEMON=1
PYTHONPATH="$PWD/clients/python/src" timeout 600 "$py" -m pytest -p no:cacheprovider -q -rs \
    clients/python/tests || rc=$?
case $rc in
    0) echo "python client: all tests passed" ;;
    5) echo "python client: pytest collected no tests" >&2; exit 1 ;;
    124) echo "python client: pytest timed out" >&2; exit 1 ;;
    *) echo "python client: pytest failed (exit status $rc)" >&2; exit 1 ;;
esac
