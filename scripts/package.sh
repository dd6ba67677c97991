#!/usr/bin/env bash
# Builds the distribution packages from the already-built release binaries:
#   scripts/package.sh [--deb] [--rpm] [--build] [--no-lint]
# --deb    Debian 12 packages with dpkg-deb from staged trees (default when nothing is named):
#          sandcell (amd64) and python3-sandcell (all: the Python client, clients/python)
# --rpm    binary RPMs with rpmbuild from packaging/rpm/sandcell.spec (prebuilt mode): sandcell
#          (x86_64) and python3-sandcell (noarch: the Python client, clients/python)
# --build  run `cargo build` first (otherwise the binaries in $CARGO_TARGET_DIR/release are used)
# --no-lint  skip lintian / rpmlint
# Output: /var/tmp/sandcell-pkg/out/ (SANDCELL_PKG_DIR). Also checks that the man pages
# document every option the binaries' --help lists, and that the example configuration is
# accepted by `sandcelld --check-config` with every key uncommented.
#
# Why dpkg-deb and not cargo-deb or dh: the package gathers files from several crates, the
# units, man pages and the D-Bus/polkit files; cargo-deb keeps its metadata in crate
# Cargo.toml files, and dh would rebuild the workspace. A staged tree keeps the package's whole
# content in packaging/ and this script, and lintian checks the result.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh
want_deb=0 want_rpm=0 build=0 lint=1
while (($#)); do
    case $1 in
    --deb) want_deb=1 ;;
    --rpm) want_rpm=1 ;;
    --build) build=1 ;;
    --no-lint) lint=0 ;;
    -h | --help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "package: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
done
((want_deb || want_rpm)) || want_deb=1
top=$PWD
pkgdir=${SANDCELL_PKG_DIR:-/var/tmp/sandcell-pkg}
out="$pkgdir/out"
mkdir -p "$out"

if ((build)); then
    cargo build "${CARGO_FLAGS[@]}" --workspace
fi
bins=(sandcelld sandcellctl sandcell-worker-python sandcell-worker-r sandcell-worker-python-native sandcell-python-runtime sandcell-bench sandcell-egress)
for b in "${bins[@]}"; do
    [[ -x $BIN/$b ]] || { echo "package: $BIN/$b is missing: run scripts/setup.sh or pass --build" >&2; exit 2; }
done
version=$(awk -F'"' '/^\[workspace.package\]/ { w = 1 } w && /^version *=/ { print $2; exit }' Cargo.toml)
debrev=1

# ---- checks that need no packaging tool ------------------------------------------------
# Man pages: every long option of every --help (and of every subcommand's) is documented.
check_man() {
    local bin=$1 page=$2 opts o missing=0
    opts=$("$BIN/$bin" --help | grep -oE -- '--[a-z][a-z-]+' | sort -u)
    for sub in $("$BIN/$bin" --help | awk '/^Commands:/ { c = 1; next } c && /^  [a-z]/ { print $1 } c && /^$/ { c = 0 }'); do
        [[ $sub == help ]] && continue
        grep -q "^\.B $sub\b\|^\.B $sub \|^\.B $sub$" "$page" || { echo "package: $page does not document the command $sub" >&2; missing=1; }
        opts+=$'\n'$("$BIN/$bin" "$sub" --help | grep -oE -- '--[a-z][a-z-]+' | sort -u)
    done
    for o in $(sort -u <<<"$opts"); do
        [[ $o == --help || $o == --version ]] && continue
        # roff escapes the hyphens: --wall-time is written \-\-wall\-time.
        grep -qF -- "$(sed 's/-/\\-/g' <<<"$o")" "$page" || { echo "package: $page does not document $o" >&2; missing=1; }
    done
    return $missing
}
# Every page renders without a groff warning (a stray escape is otherwise only a lintian W:).
for page in man/*.[1-8]; do
    warn=$(LC_ALL=C groff -man -ww -z "$page" 2>&1)
    [[ -z $warn ]] || { echo "package: $page: $warn" >&2; exit 1; }
done
check_man sandcelld man/sandcelld.8
check_man sandcellctl man/sandcellctl.1
# API pages: every Varlink method and error, every D-Bus method, signal and property is named.
for name in $(awk '/^(method|error) / { sub(/\(.*/, "", $2); print $2 }' proto/org.sandcell.Kernel.varlink); do
    grep -q "$name" man/org.sandcell.Kernel.7 || { echo "package: man/org.sandcell.Kernel.7 does not document $name" >&2; exit 1; }
done
for f in dbus/*.xml; do
    [[ -f $f ]] || continue
    for name in $(grep -oE '<(method|signal|property) name="[^"]+"' "$f" | sed 's/.*name="//; s/"//'); do
        grep -q "$name" man/org.sandcell.Sandcell1.5 || { echo "package: man/org.sandcell.Sandcell1.5 does not document $name ($f)" >&2; exit 1; }
    done
done
# Example configuration: valid as shipped (all commented) and with every key uncommented.
"$BIN/sandcelld" --check-config --config packaging/sandcelld.toml >/dev/null
tmpconf=$(mktemp)
sed -E 's/^#([a-z_]+ = )/\1/' packaging/sandcelld.toml >"$tmpconf"
"$BIN/sandcelld" --check-config --config "$tmpconf" >/dev/null
# Every key the daemon knows appears in the example and in sandcelld.toml(5): the keys of [limits] and [daemon] as the
# binary itself prints the configuration in force (`--check-config`, every key resolved).
keys=$("$BIN/sandcelld" --check-config --config /dev/null \
    | awk '/^\[/ { s = ($0 == "[limits]" || $0 == "[daemon]") } s && /^[a-z_]+ = / { print $1 }')
[[ $(wc -w <<<"$keys") -ge 40 ]] || { echo "package: sandcelld --check-config printed too few keys: $keys" >&2; exit 1; }
for key in $keys; do
    grep -q "^#$key = " packaging/sandcelld.toml || { echo "package: packaging/sandcelld.toml lacks $key" >&2; exit 1; }
    grep -qw -- "$key" man/sandcelld.toml.5 || { echo "package: man/sandcelld.toml.5 does not document $key" >&2; exit 1; }
done
rm -f "$tmpconf"
echo "package: man pages and example configuration are current"

# ---- the staged tree, shared by both formats --------------------------------------------
# $1: root; $2: systemd unit directory (Debian 12: /lib/systemd/system; RPM: /usr/lib/...);
# $3: zsh's directory for packaged completions (Debian: vendor-completions; RPM: site-functions).
stage() {
    local root=$1 unitdir=$2 zshdir=$3
    rm -rf "$root"
    install -d "$root/usr/libexec/sandcell" "$root/usr/bin" "$root$unitdir" \
        "$root/usr/lib/sysusers.d" "$root/usr/lib/tmpfiles.d" "$root/etc/sandcell" \
        "$root/usr/share/sandcell" "$root/usr/share/doc/sandcell"
    install -m 0755 "$BIN/sandcelld" "$root/usr/libexec/sandcelld"
    for b in sandcell-worker-python sandcell-worker-r sandcell-worker-python-native sandcell-python-runtime sandcell-bench sandcell-egress; do
        install -m 0755 "$BIN/$b" "$root/usr/libexec/sandcell/$b"
    done
    install -m 0644 worker-native/r/worker.R "$root/usr/libexec/sandcell/sandcell-worker.R"
    # The worker script is the shared Complete/Help module followed by worker.py, as the
    # launcher's embedded copy is.
    cat worker-native/python/query.py worker-native/python/worker.py \
        >"$root/usr/libexec/sandcell/sandcell-worker.py"
    chmod 0644 "$root/usr/libexec/sandcell/sandcell-worker.py"
    install -m 0755 scripts/font-cache.sh "$root/usr/libexec/sandcell/sandcell-font-cache"
    install -m 0755 "$BIN/sandcellctl" "$root/usr/bin/sandcellctl"
    # Shell completions, generated by sandcellctl itself (clap_complete).
    install -d "$root/usr/share/bash-completion/completions" "$root$zshdir" \
        "$root/usr/share/fish/vendor_completions.d"
    "$BIN/sandcellctl" completions bash >"$root/usr/share/bash-completion/completions/sandcellctl"
    "$BIN/sandcellctl" completions zsh >"$root$zshdir/_sandcellctl"
    "$BIN/sandcellctl" completions fish >"$root/usr/share/fish/vendor_completions.d/sandcellctl.fish"
    chmod 0644 "$root/usr/share/bash-completion/completions/sandcellctl" "$root$zshdir/_sandcellctl" \
        "$root/usr/share/fish/vendor_completions.d/sandcellctl.fish"
    # Debug information and symbol tables stay out of the package.
    strip --strip-unneeded --remove-section=.comment --remove-section=.note \
        "$root/usr/libexec/sandcelld" "$root/usr/bin/sandcellctl" \
        "$root"/usr/libexec/sandcell/sandcell-{worker-python,worker-r,worker-python-native,python-runtime,bench,egress}
    install -m 0644 units/sandcelld.socket units/sandcelld.service units/sandcell-sessions.service \
        units/sandcell-egress.socket units/sandcell-egress.service "$root$unitdir/"
    # The egress drop-ins: data, inactive until the operator links them into
    # /etc/systemd/system/<unit>.d/ (sandcelld(8), EGRESS).
    install -d "$root/usr/share/sandcell/egress"
    install -m 0644 units/egress/sandcelld.service.conf units/egress/sandcell-sessions.service.conf \
        "$root/usr/share/sandcell/egress/"
    install -m 0644 units/sysusers.d/sandcell.conf "$root/usr/lib/sysusers.d/sandcell.conf"
    install -m 0644 units/tmpfiles.d/sandcell.conf "$root/usr/lib/tmpfiles.d/sandcell.conf"
    install -m 0644 packaging/sandcelld.toml "$root/etc/sandcell/sandcelld.toml"
    install -m 0644 proto/org.sandcell.Kernel.varlink "$root/usr/share/sandcell/org.sandcell.Kernel.varlink"
    for f in man/*.[1-8]; do
        local sec=${f##*.}
        install -d "$root/usr/share/man/man$sec"
        gzip -9nc "$f" >"$root/usr/share/man/man$sec/$(basename "$f").gz"
        chmod 0644 "$root/usr/share/man/man$sec/$(basename "$f").gz"
    done
    # D-Bus and polkit files, when the control plane is in the tree (dbus/, polkit/).
    local f
    for f in dbus/*.conf; do
        [[ -f $f ]] && install -Dm 0644 "$f" "$root/usr/share/dbus-1/system.d/$(basename "$f")"
    done
    for f in dbus/*.service; do
        [[ -f $f ]] && install -Dm 0644 "$f" "$root/usr/share/dbus-1/system-services/$(basename "$f")"
    done
    for f in dbus/*.xml; do
        [[ -f $f ]] && install -Dm 0644 "$f" "$root/usr/share/dbus-1/interfaces/$(basename "$f")"
    done
    for f in polkit/*.policy; do
        [[ -f $f ]] && install -Dm 0644 "$f" "$root/usr/share/polkit-1/actions/$(basename "$f")"
    done
    # The example rules file is data, not documentation: it lives beside the package's other
    # data so that images that drop /usr/share/doc (dpkg path-exclude) keep it.
    for f in polkit/*.rules.example; do
        [[ -f $f ]] && install -Dm 0644 "$f" "$root/usr/share/sandcell/polkit/$(basename "${f%.example}")"
    done
    # The default rule is active: group sandcell may run code (a gateway in the group
    # connects and runs code after `systemctl enable --now sandcelld.socket`).
    for f in polkit/*.rules; do
        [[ -f $f ]] && install -Dm 0644 "$f" "$root/usr/share/polkit-1/rules.d/$(basename "$f")"
    done
    return 0
}

if ((want_deb)); then
    command -v dpkg-deb >/dev/null || { echo "package: dpkg-deb is missing" >&2; exit 2; }
    root="$pkgdir/deb/root"
    stage "$root" /lib/systemd/system /usr/share/zsh/vendor-completions
    install -m 0644 packaging/debian/copyright "$root/usr/share/doc/sandcell/copyright"
    gzip -9nc packaging/debian/changelog >"$root/usr/share/doc/sandcell/changelog.Debian.gz"
    chmod 0644 "$root/usr/share/doc/sandcell/changelog.Debian.gz"
    install -Dm 0644 packaging/debian/lintian-overrides "$root/usr/share/lintian/overrides/sandcell"
    install -d "$root/DEBIAN"
    install -m 0755 packaging/debian/preinst packaging/debian/postinst packaging/debian/prerm packaging/debian/postrm "$root/DEBIAN/"
    install -m 0644 packaging/debian/conffiles "$root/DEBIAN/conffiles"
    # Shared-library dependencies of the binaries, as dh_shlibdeps would compute them.
    shl=$(mktemp -d)
    mkdir -p "$shl/debian"
    printf 'Source: sandcell\n\nPackage: sandcell\nArchitecture: amd64\n' >"$shl/debian/control"
    shlibs=$(cd "$shl" && dpkg-shlibdeps -O -e"$root/usr/libexec/sandcelld" -e"$root/usr/bin/sandcellctl" \
        "$root"/usr/libexec/sandcell/sandcell-{worker-python,worker-r,worker-python-native,python-runtime,bench,egress} 2>/dev/null |
        sed -n 's/^shlibs:Depends=//p')
    rm -rf "$shl"
    [[ -n $shlibs ]] || shlibs="libc6 (>= 2.34)"
    size=$(du -sk --exclude=DEBIAN "$root" | cut -f1)
    sed -e "s/@VERSION@/$version-$debrev/" -e "s/@INSTALLED_SIZE@/$size/" -e "s/@SHLIBS@/$shlibs/" \
        packaging/debian/control >"$root/DEBIAN/control"
    (cd "$root" && find . -type f ! -path './DEBIAN/*' ! -path './etc/*' -printf '%P\0' | sort -z |
        xargs -0 md5sum) >"$root/DEBIAN/md5sums"
    chmod 0644 "$root/DEBIAN/md5sums"
    deb="$out/sandcell_${version}-${debrev}_amd64.deb"
    SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(date +%s)} dpkg-deb --root-owner-group -Zxz --build "$root" "$deb" >/dev/null
    echo "package: built $deb ($(du -h "$deb" | cut -f1))"
    if ((lint)); then
        if command -v lintian >/dev/null; then
            # Errors fail the build; warnings and info are printed.
            lintian --fail-on error --tag-display-limit 0 "$deb" || { echo "package: lintian found errors" >&2; exit 1; }
            echo "package: lintian: no errors"
        else
            echo "package: lintian not installed: not checked (apt-get install lintian)"
        fi
    fi

    # python3-sandcell: the Python client (clients/python) in Debian's python3 layout
    # (/usr/lib/python3/dist-packages/sandcell, with its .dist-info so importlib.metadata
    # knows it), architecture-independent, byte-compiled by py3compile at installation as
    # dh_python3's maintainer scripts do. Built from the same source version as sandcell.
    pyver=$(python3 packaging/python-metadata.py --version clients/python/pyproject.toml)
    [[ $pyver == "$version" ]] || { echo "package: clients/python/src/sandcell/__init__.py says $pyver, the workspace $version: keep them equal" >&2; exit 1; }
    pyroot="$pkgdir/deb/python3-sandcell"
    rm -rf "$pyroot"
    site="$pyroot/usr/lib/python3/dist-packages"
    install -d "$site/sandcell" "$site/sandcell-$pyver.dist-info" "$pyroot/usr/share/doc/python3-sandcell" "$pyroot/DEBIAN"
    for f in clients/python/src/sandcell/*.py clients/python/src/sandcell/py.typed; do
        install -m 0644 "$f" "$site/sandcell/"
    done
    install -Dm 0644 -t "$site/sandcell/jupyter" clients/python/src/sandcell/jupyter/*.py
    # The Jupyter kernelspecs, where Jupyter looks system-wide.
    PYTHONPATH=clients/python/src python3 -m sandcell.jupyter write-specs "$pyroot/usr/share/jupyter/kernels" /usr/bin/python3 /usr/bin/sandcellctl
    chmod 0644 "$pyroot"/usr/share/jupyter/kernels/*/kernel.json
    python3 packaging/python-metadata.py clients/python/pyproject.toml "$site/sandcell-$pyver.dist-info/METADATA" "$version"
    chmod 0644 "$site/sandcell-$pyver.dist-info"/*
    install -m 0644 packaging/debian/copyright "$pyroot/usr/share/doc/python3-sandcell/copyright"
    gzip -9nc packaging/debian/changelog >"$pyroot/usr/share/doc/python3-sandcell/changelog.Debian.gz"
    install -m 0644 clients/python/README.md "$pyroot/usr/share/doc/python3-sandcell/README.md"
    chmod 0644 "$pyroot/usr/share/doc/python3-sandcell/changelog.Debian.gz"
    install -Dm 0644 packaging/debian/python3-sandcell/lintian-overrides "$pyroot/usr/share/lintian/overrides/python3-sandcell"
    install -m 0755 packaging/debian/python3-sandcell/postinst packaging/debian/python3-sandcell/prerm "$pyroot/DEBIAN/"
    size=$(du -sk --exclude=DEBIAN "$pyroot" | cut -f1)
    sed -e "s/@VERSION@/$version-$debrev/" -e "s/@INSTALLED_SIZE@/$size/" \
        packaging/debian/python3-sandcell/control >"$pyroot/DEBIAN/control"
    (cd "$pyroot" && find . -type f ! -path './DEBIAN/*' -printf '%P\0' | sort -z | xargs -0 md5sum) >"$pyroot/DEBIAN/md5sums"
    chmod 0644 "$pyroot/DEBIAN/md5sums"
    pydeb="$out/python3-sandcell_${version}-${debrev}_all.deb"
    SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-$(date +%s)} dpkg-deb --root-owner-group -Zxz --build "$pyroot" "$pydeb" >/dev/null
    echo "package: built $pydeb ($(du -h "$pydeb" | cut -f1))"
    listing=$(dpkg-deb -c "$pydeb")
    for f in clients/python/src/sandcell/*.py clients/python/src/sandcell/py.typed clients/python/src/sandcell/jupyter/*.py; do
        g=${f#clients/python/src/}
        grep -q " \./usr/lib/python3/dist-packages/$g$" <<<"$listing" ||
            { echo "package: $pydeb lacks $g" >&2; exit 1; }
    done
    for k in sandcell-python sandcell-pydata sandcell-r; do
        grep -q " \./usr/share/jupyter/kernels/$k/kernel.json$" <<<"$listing" ||
            { echo "package: $pydeb lacks the $k kernelspec" >&2; exit 1; }
    done
    if ((lint)) && command -v lintian >/dev/null; then
        lintian --fail-on error --tag-display-limit 0 "$pydeb" || { echo "package: lintian found errors in $pydeb" >&2; exit 1; }
        echo "package: lintian: no errors (python3-sandcell)"
    fi
fi

if ((want_rpm)); then
    command -v rpmbuild >/dev/null || { echo "package: rpmbuild is missing (apt-get install rpm)" >&2; exit 2; }
    rpmtop="$pkgdir/rpm"
    rm -rf "$rpmtop"
    mkdir -p "$rpmtop"/{BUILD,RPMS,SOURCES,SPECS,SRPMS}
    # Prebuilt mode: the spec copies the binaries from a staged tree instead of building.
    stage "$rpmtop/SOURCES/staged" /usr/lib/systemd/system /usr/share/zsh/site-functions
    # --nodeps: this host's rpm database knows none of the build dependencies; the systemd
    # directories are those of systemd-rpm-macros, which Debian does not ship.
    # The Python client comes from this checkout (sandcell_source); python3_sitelib is the
    # spec's own fallback (Fedora/RHEL layout, python3_version 3.12): this host has no
    # python3-rpm-macros.
    rpmbuild -bb --nodeps --define "_topdir $rpmtop" --define "sandcell_prebuilt $rpmtop/SOURCES/staged" \
        --define "sandcell_source $top" \
        --define "_unitdir /usr/lib/systemd/system" --define "_sysusersdir /usr/lib/sysusers.d" \
        --define "_tmpfilesdir /usr/lib/tmpfiles.d" --define "_sharedstatedir /var/lib" \
        --define "_build_id_links none" packaging/rpm/sandcell.spec >"$rpmtop/build.log" 2>&1 ||
        { tail -30 "$rpmtop/build.log" >&2; exit 1; }
    rpm=$(ls "$rpmtop"/RPMS/*/sandcell-*.rpm | head -1)
    cp "$rpm" "$out/"
    echo "package: built $out/$(basename "$rpm")"
    pyrpm=$(ls "$rpmtop"/RPMS/noarch/python3-sandcell-*.noarch.rpm 2>/dev/null | head -1)
    [[ -n $pyrpm ]] || { echo "package: rpmbuild made no python3-sandcell noarch package" >&2; exit 1; }
    cp "$pyrpm" "$out/"
    pyrpm="$out/$(basename "$pyrpm")"
    echo "package: built $pyrpm"
    # python3-sandcell: exactly the client's modules, py.typed, the metadata and the README
    # (rpmbuild itself refuses a build root file the spec's %files does not list), noarch,
    # requiring python3; it imports from its payload and importlib.metadata knows it.
    pysite=$(rpm -qlp "$pyrpm" | sed -n 's|/sandcell/__init__.py$||p')
    [[ $pysite == /usr/lib/python3.*/site-packages ]] || { echo "package: $pyrpm: no sandcell/__init__.py under /usr/lib/python3.*/site-packages" >&2; exit 1; }
    want=$( (echo "$pysite/sandcell"
        for f in clients/python/src/sandcell/*.py clients/python/src/sandcell/py.typed; do echo "$pysite/sandcell/$(basename "$f")"; done
        echo "$pysite/sandcell/jupyter"
        for f in clients/python/src/sandcell/jupyter/*.py; do echo "$pysite/sandcell/jupyter/$(basename "$f")"; done
        echo /usr/share/jupyter
        echo /usr/share/jupyter/kernels
        for k in sandcell-pydata sandcell-python sandcell-r; do
            echo "/usr/share/jupyter/kernels/$k"
            echo "/usr/share/jupyter/kernels/$k/kernel.json"
        done
        echo "$pysite/sandcell-$version.dist-info"
        echo "$pysite/sandcell-$version.dist-info/METADATA"
        echo /usr/share/doc/python3-sandcell
        echo /usr/share/doc/python3-sandcell/README.md) | sort)
    have=$(rpm -qlp "$pyrpm" | grep -v '/__pycache__' | sort)
    [[ $have == "$want" ]] || { echo "package: $pyrpm does not hold exactly the client's files:" >&2; diff <(echo "$want") <(echo "$have") >&2; exit 1; }
    [[ $(rpm -qp --qf '%{ARCH}' "$pyrpm") == noarch ]] || { echo "package: $pyrpm is not noarch" >&2; exit 1; }
    grep -q '^python3 >= 3.11' <<<"$(rpm -qp --requires "$pyrpm")" || { echo "package: $pyrpm does not require python3" >&2; exit 1; }
    pyx=$(mktemp -d)
    (cd "$pyx" && rpm2cpio "$pyrpm" | cpio -idm --quiet)
    (cd "$pyx" && python3 -I -c 'import sys; sys.path.insert(0, sys.argv[1]); import importlib.metadata, sandcell, sandcell.aio, sandcell.openai; assert sandcell.__file__.startswith(sys.argv[1]), sandcell.__file__; assert importlib.metadata.version("sandcell") == sys.argv[2]' "$pyx$pysite" "$version") ||
        { rm -rf "$pyx"; echo "package: $pyrpm: the client does not import from the payload" >&2; exit 1; }
    rm -rf "$pyx"
    echo "package: $(basename "$pyrpm"): $(wc -l <<<"$have") paths, the client's $(ls clients/python/src/sandcell/*.py | wc -l) modules under $pysite, imports"
    if ((lint)); then
        rpmspec --parse packaging/rpm/sandcell.spec >/dev/null
        if command -v rpmlint >/dev/null; then
            # The spec must be clean; the binary packages' findings are printed.
            rpmlint -r packaging/rpm/sandcell.rpmlintrc packaging/rpm/sandcell.spec
            rpmlint "$out/$(basename "$rpm")" || true
            rpmlint "$pyrpm" || true
        fi
    fi
fi
