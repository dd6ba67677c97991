#!/usr/bin/env bash
# System test tier: boot a Debian 12 VM (qemu, TCG) with systemd as PID 1 and pure cgroup v2,
# install the built sandcell .deb in it, and drive it as an operator would
# (scripts/vm/guest-test.sh). Exit status: the guest test's (0 = every check passed).
#
#   scripts/vm-test.sh [--deb FILE] [--keep]
#
# --deb FILE  test this package (default: build one with scripts/package.sh --deb)
# --keep      keep the staging directory (guest log, console log) even on success
#
# Environment: SANDCELL_VM_CACHE (/var/tmp/sandcell-vm; the image is rebuilt when absent),
# SANDCELL_VM_KERNEL (backports|stable, see scripts/vm/build-image.sh), SANDCELL_VM_MEMORY
# (MiB, 3072), SANDCELL_VM_CPUS (2), SANDCELL_VM_TIMEOUT (seconds, 1500),
# SANDCELL_VM_LANGUAGES (python,r: what the daemon serves and the test runs),
# SANDCELL_VM_FRESH_RUNTIME=1 (do not seed the guest with the Python runtime the previous run
# prepared; the package's postinst then prepares it, about 6 minutes under TCG).
# Needs root; installs what it needs (scripts/setup.sh, then mmdebstrap, qemu-system-x86, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/env.sh
deb=""
keep=0
while (($#)); do
    case $1 in
    --deb) deb=$(realpath "$2"); shift 2 ;;
    --keep) keep=1; shift ;;
    -h | --help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "vm-test: unknown argument $1" >&2; exit 2 ;;
    esac
done
cache=${SANDCELL_VM_CACHE:-/var/tmp/sandcell-vm}
export SANDCELL_VM_CACHE=$cache
mem=${SANDCELL_VM_MEMORY:-3072}
cpus=${SANDCELL_VM_CPUS:-2}
limit=${SANDCELL_VM_TIMEOUT:-1500}
# What a fresh machine lacks: the base set (scripts/setup.sh builds too), then the VM tools.
bash scripts/setup.sh
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

t0=$SECONDS
bash scripts/vm/build-image.sh
t_image=$((SECONDS - t0))

if [[ -z $deb ]]; then
    bash scripts/package.sh --deb
    deb=$(ls -t "${SANDCELL_PKG_DIR:-/var/tmp/sandcell-pkg}"/out/sandcell_*_amd64.deb | head -1)
fi
[[ -f $deb ]] || { echo "vm-test: no package $deb" >&2; exit 2; }

run=$(mktemp -d "$cache/run.XXXXXX")
chmod 0755 "$run"
cp "$deb" "$run/sandcell.deb"
cp scripts/vm/guest-test.sh "$run/guest-test.sh"
cp -r examples "$run/examples" 2>/dev/null || true
echo "${SANDCELL_VM_LANGUAGES:-python,r}" >"$run/languages"
if [[ -f $cache/python-runtime.tar && ${SANDCELL_VM_FRESH_RUNTIME:-0} != 1 ]]; then
    cp "$cache/python-runtime.tar" "$run/"
fi
echo "vm-test: staging in $run (package $(basename "$deb"))"

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

# The uncompressed kernel boots through PVH and skips the slow in-guest decompressor.
kernel="$cache/vmlinux"
t1=$SECONDS
rc=0
timeout --foreground "$limit" qemu-system-x86_64 \
    -machine pc -accel tcg,thread=multi -cpu max -smp "$cpus" -m "$mem" \
    -kernel "$kernel" -initrd "$cache/initrd.img" -append "$cmdline" \
    -drive "file=$cache/rootfs.img,if=virtio,format=raw,snapshot=on" \
    -virtfs "local,path=$run,mount_tag=share,security_model=none,id=share" \
    -nic none -display none -monitor none -serial "file:$run/console.log" \
    -no-reboot || rc=$?
t_vm=$((SECONDS - t1))

echo "---- guest log ($run/guest.log) ----"
cat "$run/guest.log" 2>/dev/null || echo "(no guest log)"
echo "---- end of guest log ----"
if [[ $rc == 124 ]]; then
    echo "vm-test: the VM did not power off within ${limit}s; console tail:" >&2
    tail -40 "$run/console.log" >&2
    exit 1
fi
if [[ ! -f $run/guest.rc ]]; then
    echo "vm-test: the guest test did not run (qemu exit $rc); console tail:" >&2
    tail -60 "$run/console.log" >&2
    exit 1
fi
guest_rc=$(cat "$run/guest.rc")
# A runtime the guest had to prepare is kept for the next run.
[[ -f $run/python-runtime.new.tar ]] && mv "$run/python-runtime.new.tar" "$cache/python-runtime.tar"
grep -h '^sandcell-vm-run:' "$run/console.log" 2>/dev/null || true
passed=$(grep -c '^PASS' "$run/guest.log" || true)
failed=$(grep -c '^FAIL' "$run/guest.log" || true)
skipped=$(grep -c '^SKIP' "$run/guest.log" || true)
echo "vm-test: image ${t_image}s, boot+test+poweroff ${t_vm}s; checks: $passed passed, $failed failed, $skipped skipped; guest exit $guest_rc"
if [[ $guest_rc == 0 && $keep == 0 ]]; then
    rm -rf "$run"
else
    echo "vm-test: logs kept in $run"
fi
exit "$guest_rc"
