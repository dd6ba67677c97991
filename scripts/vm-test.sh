#!/usr/bin/env bash
# System test tier: boot a Debian VM (qemu, TCG) with systemd as PID 1 and pure cgroup v2,
# install the built sandcell and python3-sandcell .debs in it, and drive them as an operator
# would (tests/system/guest-test.sh: every Kernel method, the metrics file, the Python client's
# own test suite). By default the Debian 12 image boots twice: once with Debian 12's own kernel
# (bookworm's linux-image-amd64, 6.1, Landlock ABI 2) and once with bookworm-backports' (6.12,
# Landlock ABI 6). --kernel trixie boots a Debian 13 image (its own kernel, systemd 257), where
# the test also talks to the socket with systemd's varlinkctl. Exit status: 0 when every check
# passed on every kernel booted.
#
#   scripts/vm-test.sh [--kernel stable|backports|both|trixie|all] [--release bookworm|trixie]
#                      [--deb FILE] [--keep]
#
# --kernel K   which kernel(s) to boot (default both: stable, then backports; all: stable,
#              backports, then trixie)
# --release R  bookworm: the same as --kernel both; trixie: the same as --kernel trixie
# --deb FILE   test this package (default: build one with scripts/package.sh --deb); the
#              python3-sandcell package of the same version is taken from FILE's directory
# --keep       keep the staging directories (guest log, console log) even on success
#
# Environment: SANDCELL_VM_CACHE (/var/tmp/sandcell-vm; an image is rebuilt when absent),
# SANDCELL_VM_KERNEL (default of --kernel), SANDCELL_VM_MEMORY (MiB, 4096), SANDCELL_VM_CPUS
# (2), SANDCELL_VM_TIMEOUT (seconds per boot, 2700), SANDCELL_VM_LANGUAGES (python,r: what the
# daemon serves and the test runs), SANDCELL_VM_FRESH_RUNTIME=1 (do not seed the guest with the
# Python runtime a previous run prepared; the package's postinst then prepares it, about 6
# minutes under TCG), SANDCELL_VM_SESSIONS_SURVIVE (default 1: check that 8 sessions outlive
# a restart, an upgrade, a kill and an OOM kill of the daemon; 0: only print their figures),
# SANDCELL_VM_CELLS_SURVIVE (default 1: also check that a cell running across them is
# continued, its whole output and result retrievable; 0: only print its figures),
# SANDCELL_VM_ONLY=lifecycle (run only the install, the first cell, those four events and the
# stop: about a third of the guest run), SANDCELL_VM_ONLY=egress (the install, the first cell
# and the egress checks: the packages' drop-ins under the real units), SANDCELL_VM_ONLY=floor
# (the install, the first cell and systemd's own share of a restart: a unit doing nothing in
# sandcelld.service's sandbox, restarted and killed 5 times each, then the same sandbox without
# one part each (seccomp, the network namespace, the mounts...) and with one mount-namespace
# directive alone, 3 times each; figures, no check).
# Needs root; installs what it needs (scripts/setup.sh, then mmdebstrap, qemu-system-x86, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh
deb=""
keep=0
which=${SANDCELL_VM_KERNEL:-both}
while (($#)); do
    case $1 in
    --deb) deb=$(realpath "$2"); shift 2 ;;
    --kernel) which=$2; shift 2 ;;
    --kernel=*) which=${1#--kernel=}; shift ;;
    --release | --release=*)
        if [[ $1 == --release ]]; then r=${2:-}; shift 2; else r=${1#--release=}; shift; fi
        case $r in bookworm) which=both ;; trixie) which=trixie ;;
        *) echo "vm-test: --release must be bookworm or trixie" >&2; exit 2 ;; esac ;;
    --keep) keep=1; shift ;;
    -h | --help) sed -n '2,35p' "$0"; exit 0 ;;
    *) echo "vm-test: unknown argument $1" >&2; exit 2 ;;
    esac
done
case $which in
both) kernels=(stable backports) ;;
all) kernels=(stable backports trixie) ;;
stable | backports | trixie) kernels=("$which") ;;
*) echo "vm-test: --kernel must be stable, backports, both, trixie or all" >&2; exit 2 ;;
esac
# The image each kernel boots (tests/system/build-image.sh RELEASE builds it).
image_of() { [[ $1 == trixie ]] && echo rootfs-trixie.img || echo rootfs.img; }
release_of() { [[ $1 == trixie ]] && echo trixie || echo bookworm; }
cache=${SANDCELL_VM_CACHE:-/var/tmp/sandcell-vm}
export SANDCELL_VM_CACHE=$cache
# 4 GiB: the Python client's suite runs 16 one-shot Python workers at once.
mem=${SANDCELL_VM_MEMORY:-4096}
cpus=${SANDCELL_VM_CPUS:-2}
limit=${SANDCELL_VM_TIMEOUT:-2700}
# What a fresh machine lacks: the base set and the binaries (scripts/setup.sh; not needed to
# test a given package), then the VM tools.
[[ -n $deb ]] || bash scripts/setup.sh
vm_packages=(mmdebstrap qemu-system-x86 e2fsprogs busybox-static cpio zstd python3)
missing=()
for p in "${vm_packages[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
    echo "vm-test: installing ${missing[*]}"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
command -v qemu-system-x86_64 >/dev/null || { echo "vm-test: qemu-system-x86_64 is missing (apt-get install qemu-system-x86)" >&2; exit 2; }

# One image per Debian release (bookworm's holds both of its kernels; -kernel picks one).
declare -A t_image
for d in $(for k in "${kernels[@]}"; do release_of "$k"; done | awk '!seen[$0]++'); do
    t0=$SECONDS
    bash tests/system/build-image.sh "$d"
    t_image[$d]=$((SECONDS - t0))
done

if [[ -z $deb ]]; then
    bash scripts/package.sh --deb
    deb=$(ls -t "${SANDCELL_PKG_DIR:-/var/tmp/sandcell-pkg}"/out/sandcell_*_amd64.deb | head -1)
fi
[[ -f $deb ]] || { echo "vm-test: no package $deb" >&2; exit 2; }
# The Python client of the same version, beside the daemon's package.
debver=$(dpkg-deb -f "$deb" Version)
pydeb=$(dirname "$deb")/python3-sandcell_${debver}_all.deb
[[ -f $pydeb ]] || { echo "vm-test: no $pydeb beside $deb (scripts/package.sh --deb builds both)" >&2; exit 2; }

# Boot units the test does not need (a factor 2-3 in boot time under TCG).
masks=(modprobe@.service systemd-pstore.service systemd-random-seed.service
    systemd-journal-flush.service systemd-update-utmp.service
    systemd-update-utmp-runlevel.service systemd-binfmt.service
    proc-sys-fs-binfmt_misc.automount systemd-udev-trigger.service
    systemd-udev-settle.service sys-kernel-debug.mount sys-kernel-tracing.mount
    sys-kernel-config.mount sys-fs-fuse-connections.mount dev-hugepages.mount
    systemd-fsck-root.service systemd-hwdb-update.service
    systemd-journal-catalog-update.service ldconfig.service systemd-timesyncd.service
    getty@tty1.service serial-getty@ttyS0.service getty.target
    apt-daily.timer apt-daily-upgrade.timer e2scrub_all.timer fstrim.timer
    systemd-tmpfiles-clean.timer dpkg-db-backup.timer man-db.timer logrotate.timer)
cmdline="console=ttyS0 root=/dev/vda rw panic=-1 quiet loglevel=4 systemd.show_status=false"
cmdline+=" systemd.unified_cgroup_hierarchy=1 systemd.journald.forward_to_console=0"
for m in "${masks[@]}"; do cmdline+=" systemd.mask=$m"; done

# guest_value RUN KEY: the value of the guest log's "guest: KEY: VALUE" line.
guest_value() { sed -n "s/^guest: $2: //p" "$1/guest.log" 2>/dev/null | head -1 || true; }
declare -A summary
overall=0

# boot KERNEL: one VM run on that kernel; sets summary[KERNEL] and returns the guest's status.
boot() {
    local k=$1 run rc t1 t_vm guest_rc booted finished passed failed skipped release abi check
    run=$(mktemp -d "$cache/run-$k.XXXXXX")
    chmod 0755 "$run"
    cp "$deb" "$run/sandcell.deb"
    cp "$pydeb" "$run/python3-sandcell.deb"
    cp tests/system/guest-test.sh "$run/guest-test.sh"
    cp tests/system/guest-egress.sh "$run/guest-egress.sh"
    cp -r examples "$run/examples" 2>/dev/null || true
    # The Python client's tests (not shipped by python3-sandcell), laid out as in the tree so
    # they find the interface definition and the gateway example; they import the installed
    # package.
    mkdir -p "$run/pyclient/clients/python"
    cp -r clients/python/tests "$run/pyclient/clients/python/tests"
    cp -r proto "$run/pyclient/proto"
    cp -r examples "$run/pyclient/examples" 2>/dev/null || true
    echo "${SANDCELL_VM_LANGUAGES:-python,r}" >"$run/languages"
    # Whether the guest checks that sessions outlive the daemon (restart, upgrade, kill, OOM
    # kill) or only prints the figures (0).
    echo "${SANDCELL_VM_SESSIONS_SURVIVE:-1}" >"$run/sessions-survive"
    # Whether a cell running across those events must be continued (its output and result).
    echo "${SANDCELL_VM_CELLS_SURVIVE:-1}" >"$run/cells-survive"
    # A subset of the guest's checks (lifecycle: install, the first cell, the four daemon
    # events, systemd's floor and the stop; egress: install, the first cell, the egress
    # checks; floor: install, the first cell, systemd's floor), for a quicker run.
    echo "${SANDCELL_VM_ONLY:-}" >"$run/only"
    if [[ -f $cache/python-runtime.tar && ${SANDCELL_VM_FRESH_RUNTIME:-0} != 1 ]]; then
        cp "$cache/python-runtime.tar" "$run/"
    fi
    echo "==== vm-test[$k]: kernel $(cat "$cache/release-$k"), staging in $run (package $(basename "$deb"))"
    t1=$SECONDS
    rc=0
    timeout --foreground "$limit" qemu-system-x86_64 \
        -machine pc -accel tcg,thread=multi -cpu max -smp "$cpus" -m "$mem" \
        -kernel "$cache/vmlinux-$k" -initrd "$cache/initrd-$k.img" -append "$cmdline" \
        -drive "file=$cache/$(image_of "$k"),if=virtio,format=raw,snapshot=on" \
        -virtfs "local,path=$run,mount_tag=share,security_model=none,id=share" \
        -nic none -display none -monitor none -serial "file:$run/console.log" \
        -no-reboot || rc=$?
    t_vm=$((SECONDS - t1))

    echo "---- guest log [$k] ($run/guest.log) ----"
    cat "$run/guest.log" 2>/dev/null || echo "(no guest log)"
    echo "---- end of guest log [$k] ----"
    # systemd 257 writes terminal control sequences on the console before a line: unanchored.
    grep -ho 'sandcell-vm-run:.*' "$run/console.log" 2>/dev/null || true
    guest_rc=""
    if [[ $rc == 124 ]]; then
        echo "vm-test[$k]: the VM did not power off within ${limit}s; console tail:" >&2
        tail -40 "$run/console.log" >&2
    elif [[ ! -f $run/guest.rc ]]; then
        echo "vm-test[$k]: the guest test did not run (qemu exit $rc); console tail:" >&2
        tail -60 "$run/console.log" >&2
    else
        guest_rc=$(cat "$run/guest.rc")
    fi
    # A runtime the guest had to prepare is kept for the next run (and the next kernel).
    [[ -f $run/python-runtime.new.tar ]] && mv "$run/python-runtime.new.tar" "$cache/python-runtime.tar"

    # Figures: boot = kernel start to the test unit (guest uptime), guest run = the test itself.
    booted=$(sed -n 's/^.*sandcell-vm-run: guest booted in \([0-9.]*\) s.*/\1/p' "$run/console.log" 2>/dev/null | head -1)
    finished=$(sed -n 's/^.*sandcell-vm-run: guest test finished with [0-9]* after \([0-9.]*\) s.*/\1/p' "$run/console.log" 2>/dev/null | head -1)
    passed=$(grep -c '^PASS' "$run/guest.log" 2>/dev/null || true)
    failed=$(grep -c '^FAIL' "$run/guest.log" 2>/dev/null || true)
    skipped=$(grep -c '^SKIP' "$run/guest.log" 2>/dev/null || true)
    release=$(guest_value "$run" kernel)
    abi=$(guest_value "$run" "landlock abi")
    check=$(guest_value "$run" "sandcelld --check")
    summary[$k]="kernel ${release:-$(cat "$cache/release-$k") (not seen in the guest)}; lsm $(guest_value "$run" lsm); landlock abi ${abi:-?}; sandcelld --check: ${check:-?}
    checks: ${passed:-0} passed, ${failed:-0} failed, ${skipped:-0} skipped; guest exit ${guest_rc:-none (qemu $rc)}
    systemd's floor (ms, a unit doing nothing, 5 rounds): in sandcelld.service's sandbox restart [$(guest_value "$run" "floor sandboxed restart ms")] kill [$(guest_value "$run" "floor sandboxed kill ms")]; without it restart [$(guest_value "$run" "floor plain restart ms")] kill [$(guest_value "$run" "floor plain kill ms")]$(sed -n 's/^guest: floor \(no-[a-z]*\|mounts-[A-Za-z]*\) \([a-z]*\) ms: /\1 \2 [/p' "$run/guest.log" 2>/dev/null | sed 's/ *$/]/' | paste -sd';' | sed 's/;/; /g; s/^./; the sandbox without one part, or with one mount directive only (3 rounds): &/')
    times: image ${t_image[$(release_of "$k")]}s, boot ${booted:-?}s, guest run $(if [[ -n $booted && -n $finished ]]; then awk -v a="$booted" -v b="$finished" 'BEGIN { printf "%.0f", b - a }'; else echo "?"; fi)s, VM total ${t_vm}s (boot + run + power off)"
    echo "vm-test[$k]: ${summary[$k]}"
    if [[ $guest_rc == 0 && $keep == 0 ]]; then
        rm -rf "$run"
    else
        echo "vm-test[$k]: logs kept in $run"
        summary[$k]+="
    logs: $run"
    fi
    [[ $guest_rc == 0 ]]
}

results=()
for k in "${kernels[@]}"; do
    if boot "$k"; then results+=("$k PASS"); else results+=("$k FAIL"); overall=1; fi
done
echo "==== vm-test summary (package $(basename "$deb"))"
for r in "${results[@]}"; do
    k=${r%% *}
    echo "$r: ${summary[$k]}"
done
exit "$overall"
