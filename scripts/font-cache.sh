#!/usr/bin/env bash
# Builds, once per host, the font caches that workers only read: fontconfig's system cache
# (/var/cache/fontconfig, `fc-cache -s`) and matplotlib's font list
# (/var/cache/sandcell/matplotlib/fontlist-v*.json, or the directory given as $1), both
# root-owned and read-only to workers. Without them, the first plot of every session scans all
# fonts again (about a second for matplotlib) and, for a stale fontconfig cache, writes a
# per-user cache into the session.
#
# matplotlib's list is built confined: as nobody, without network (a new network namespace),
# with an empty environment, in an empty directory, by Debian's own interpreter in isolated
# mode (-I: no PYTHON* variables, no user site, no working directory on sys.path). What it
# wrote is checked (valid JSON, a FontManager list) before it is installed. Idempotent; a host
# without matplotlib gets only the fontconfig cache. Run again after installing fonts or
# upgrading matplotlib (scripts/setup.sh does; matplotlib ignores a list from another version).
set -euo pipefail
out="${1:-/var/cache/sandcell/matplotlib}"
python="${SANDCELL_PYTHON:-/usr/bin/python3}"

if command -v fc-cache >/dev/null; then
    fc-cache -s
fi

if ! [ -x "$python" ] || ! "$python" -I -c 'import matplotlib' 2>/dev/null; then
    echo "font-cache: $python has no matplotlib; only the fontconfig cache was built"
    exit 0
fi

work="$(mktemp -d /tmp/sandcell-font-cache.XXXXXX)"
trap 'rm -rf "$work"' EXIT
chown nobody: "$work" 2>/dev/null || chown nobody:nogroup "$work"
chmod 0700 "$work"
build=(env -i HOME="$work" MPLCONFIGDIR="$work" MPLBACKEND=Agg LANG=C.UTF-8 PATH=/usr/bin:/bin
    "$python" -I -B -c 'import matplotlib.font_manager as fm; print(len(fm.fontManager.ttflist))')
if [ "$(id -u)" = 0 ]; then
    (cd "$work" && unshare --net -- setpriv --reuid=nobody --regid="$(id -g nobody)" \
        --clear-groups --no-new-privs --inh-caps=-all -- "${build[@]}") >/dev/null
else
    (cd "$work" && "${build[@]}") >/dev/null
fi

shopt -s nullglob
lists=("$work"/fontlist-v*.json)
if ((${#lists[@]} != 1)); then
    echo "font-cache: matplotlib wrote no font list in $work" >&2
    exit 1
fi
"$python" -I -c '
import json, sys
d = json.load(open(sys.argv[1]))
assert d.get("__class__") == "FontManager" and isinstance(d.get("ttflist"), list) and d["ttflist"]
' "${lists[0]}"
install -d -m 0755 "$out"
install -m 0644 "${lists[0]}" "$out/"
if [ "$(id -u)" = 0 ]; then
    chown -R root:root "$out"
fi
echo "font-cache: $(basename "${lists[0]}") installed in $out"
