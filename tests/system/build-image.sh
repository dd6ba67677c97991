#!/usr/bin/env bash
# Builds a cached guest image of the system test (scripts/vm-test.sh), or reuses it.
#
#   tests/system/build-image.sh [bookworm|trixie]
#
# bookworm (the default, Debian 12): one image holding two kernels; the test boots it once
# with each (qemu's -kernel picks one):
#   $SANDCELL_VM_CACHE/rootfs.img              ext4 root file system (booted with snapshot=on)
#   $SANDCELL_VM_CACHE/vmlinux-stable          bookworm's own linux-image-amd64 (6.1), uncompressed
#   $SANDCELL_VM_CACHE/vmlinux-backports       bookworm-backports' linux-image-amd64 (6.12)
#   $SANDCELL_VM_CACHE/initrd-{stable,backports}.img  busybox + that kernel's virtio/ext4 modules
#   $SANDCELL_VM_CACHE/release-{stable,backports}     the kernel release (uname -r)
# trixie (Debian 13: its own kernel and systemd 257): rootfs-trixie.img, vmlinux-trixie,
# initrd-trixie.img and release-trixie, built the same way from the trixie suites of the same
# archives.
# The uncompressed kernel boots through PVH and skips the slow in-guest decompressor.
# An image is rebuilt when absent or when this script, the package list or a guest file changes.
# The mirror comes from the host's apt configuration, read at run time (a bookworm host's
# suites are renamed to trixie's for the trixie image).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
cache=${SANDCELL_VM_CACHE:-/var/tmp/sandcell-vm}
dist=${1:-bookworm}
case $dist in
bookworm) kernels=(stable backports); img=rootfs.img; stamp=stamp ;;
trixie) kernels=(trixie); img=rootfs-trixie.img; stamp=stamp-trixie ;;
*) echo "vm: unknown release $dist (bookworm or trixie)" >&2; exit 2 ;;
esac
# What the guest needs: systemd as PID 1, the system bus and polkit (the control plane), a
# login-capable PAM stack, R (the R worker's runtime and the package's dependency), the kernel
# (modules for 9p and the initramfs), and a few tools the guest test uses.
packages=(systemd-sysv udev dbus polkitd pkexec libpam-systemd r-base-core r-cran-jsonlite
    kmod procps util-linux iproute2 psmisc less bc)
# What the package recommends for the pydata environment (native CPython with the scientific
# stack); the guest test fails when they are missing, so the image must carry them.
packages+=(python3-numpy python3-pandas python3-scipy python3-matplotlib fontconfig)
# The Python client's own test suite runs in the guest against the installed python3-sandcell.
packages+=(python3-pytest)
# trixie's apt variant no longer has passwd (useradd, which the guest test uses, and passwd).
[[ $dist == trixie ]] && packages+=(passwd)
# The kernels: bookworm's own (6.1, Landlock ABI 2) from --include, then bookworm-backports'
# (6.12, Landlock ABI 6) by upgrading the linux-image-amd64 metapackage in a customize hook.
# The upgrade keeps the 6.1 image package installed (apt does not remove a package the old
# metapackage depended on), so both kernels and their modules share one root file system.
# trixie: its own linux-image-amd64 only.
packages+=(linux-image-amd64)
want=$( (echo "$dist ${kernels[*]}"; cat "$0" "$here/initramfs-init" "$here/sandcell-vm-run" "$here/sandcell-vm-test.service") \
    | sha256sum | cut -c1-16)
ready=1
for k in "${kernels[@]}"; do
    [[ -f $cache/vmlinux-$k && -f $cache/initrd-$k.img && -f $cache/release-$k ]] || ready=0
done
if [[ -f $cache/$stamp && $(cat "$cache/$stamp") == "$want" && -f $cache/$img && $ready == 1 ]]; then
    echo "vm: reusing the $dist guest image in $cache"
    exit 0
fi
for t in mmdebstrap mkfs.ext4 busybox cpio zstd python3; do
    command -v "$t" >/dev/null || { echo "vm: $t is missing (apt-get install mmdebstrap e2fsprogs busybox-static cpio)" >&2; exit 2; }
done
[[ $(id -u) == 0 ]] || { echo "vm: building the image needs root" >&2; exit 2; }

# deb822 sources of the host -> one-line "deb URI SUITE COMPONENTS" mirrors for mmdebstrap.
mirrors=()
while IFS= read -r line; do mirrors+=("$line"); done < <(
    awk '
        function flush() { if (uris != "" && types ~ /(^| )deb( |$)/) { n = split(uris, u, " "); m = split(suites, s, " ");
              for (i = 1; i <= n; i++) for (j = 1; j <= m; j++) print "deb " u[i] " " s[j] " " comps }
          types = uris = suites = comps = "" }
        /^[[:space:]]*#/ { next }
        /^[[:space:]]*$/ { flush(); next }
        { key = $1; sub(/:$/, "", key); $1 = ""; sub(/^ /, "");
          if (key == "Types") types = $0; else if (key == "URIs") uris = $0;
          else if (key == "Suites") suites = $0; else if (key == "Components") comps = $0 }
        END { flush() }' /etc/apt/sources.list.d/*.sources 2>/dev/null
    grep -hE '^deb[[:space:]]' /etc/apt/sources.list 2>/dev/null || true)
((${#mirrors[@]})) || { echo "vm: no Debian mirror in /etc/apt/sources.list{,.d}" >&2; exit 2; }
if [[ $dist == bookworm ]]; then
    # bookworm-backports from the same archive as bookworm itself.
    base=$(printf '%s\n' "${mirrors[@]}" | awk '$3 == "bookworm" { print $2; exit }')
    [[ -n $base ]] || { echo "vm: no bookworm mirror to derive bookworm-backports from" >&2; exit 2; }
    mirrors+=("deb $base bookworm-backports main")
    hooks=(--customize-hook='chroot "$1" env DEBIAN_FRONTEND=noninteractive apt-get install -y -q -t bookworm-backports linux-image-amd64')
else
    # The same archives' trixie suites (bookworm -> trixie, bookworm-security ->
    # trixie-security, ...); a host that already lists trixie keeps its lines.
    mapfile -t mirrors < <(printf '%s\n' "${mirrors[@]}" | awk '{ sub(/^bookworm/, "trixie", $3); print }' | awk '!seen[$0]++')
    printf '%s\n' "${mirrors[@]}" | awk '$3 == "trixie" { ok = 1 } END { exit !ok }' ||
        { echo "vm: no Debian archive in the host's apt sources to take trixie from" >&2; exit 2; }
    hooks=()
fi
printf 'vm: mirror: %s\n' "${mirrors[@]}"

mkdir -p "$cache"
root="$cache/rootfs-$dist.dir"
rm -f "$cache/$img" "$cache/$stamp"
for k in "${kernels[@]}"; do rm -f "$cache/vmlinux-$k" "$cache/initrd-$k.img" "$cache/release-$k"; done
start=$SECONDS
if [[ -f $root.ok && $(cat "$root.ok") == "$want" && -d $root ]]; then
    echo "vm: reusing the bootstrapped tree $root"
else
rm -rf "$root" "$root.ok"
# Documentation and locales are dropped: the guest is a test rig, nobody reads them there.
mmdebstrap --variant=apt --mode=root --format=directory \
    --aptopt='Acquire::Check-Valid-Until "false"' \
    --aptopt='APT::Install-Recommends "false"' \
    --dpkgopt='path-exclude=/usr/share/doc/*' --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --dpkgopt='path-exclude=/usr/share/locale/*' --dpkgopt='path-exclude=/usr/share/info/*' \
    --include="$(IFS=,; echo "${packages[*]}")" \
    --customize-hook='echo sandcell-vm > "$1/etc/hostname"' \
    --customize-hook='printf "/dev/vda / ext4 rw,noatime 0 1\n" > "$1/etc/fstab"' \
    --customize-hook="install -m 0755 '$here/sandcell-vm-run' \"\$1/usr/local/sbin/sandcell-vm-run\"" \
    --customize-hook="install -m 0644 '$here/sandcell-vm-test.service' \"\$1/etc/systemd/system/sandcell-vm-test.service\"" \
    --customize-hook='chroot "$1" systemctl enable sandcell-vm-test.service' \
    "${hooks[@]}" \
    --customize-hook='chroot "$1" passwd -d root' \
    --customize-hook='rm -f "$1"/etc/machine-id; touch "$1"/etc/machine-id' \
    "$dist" "$root" "${mirrors[@]}"
echo "$want" >"$root.ok"
echo "vm: debootstrap took $((SECONDS - start)) s"
fi

# Kernels: each .deb's vmlinuz, and the uncompressed ELF inside it (PVH boot in qemu). In the
# bookworm image the older release is bookworm's own, the newer one bookworm-backports'.
mapfile -t vmlinuzes < <(ls "$root"/boot/vmlinuz-* | sort -V)
if ((${#vmlinuzes[@]} != ${#kernels[@]})); then
    echo "vm: expected ${#kernels[@]} kernels in the $dist image (${kernels[*]}), found: ${vmlinuzes[*]##*/}" >&2
    exit 1
fi
releases=()
for ((i = 0; i < ${#kernels[@]}; i++)); do
k=${kernels[$i]}
vmlinuz=${vmlinuzes[$i]}
kver=${vmlinuz##*/vmlinuz-}
releases+=("$k $kver")
python3 - "$vmlinuz" "$cache/vmlinux-$k" <<'PY'
# The bzImage carries the ELF kernel compressed (zstd on Debian's 6.12, xz/gzip elsewhere):
# find the first stream that decompresses to an ELF image.
import lzma, subprocess, sys, zlib
data = open(sys.argv[1], "rb").read()
def zstd(b):
    return subprocess.run(["zstd", "-dcq"], input=b, capture_output=True).stdout
codecs = ((b"\x28\xb5\x2f\xfd", zstd),
          (b"\xfd7zXZ\x00", lambda b: lzma.LZMADecompressor().decompress(b)),
          (b"\x1f\x8b\x08", lambda b: zlib.decompressobj(31).decompress(b)))
for magic, fn in codecs:
    i = data.find(magic)
    while i >= 0:
        try:
            out = fn(data[i:])
        except Exception:
            out = b""
        if out[:4] == b"\x7fELF":
            open(sys.argv[2], "wb").write(out)
            sys.exit(0)
        i = data.find(magic, i + 1)
sys.exit("vm: cannot extract vmlinux from " + sys.argv[1])
PY

# Initramfs: busybox and the modules that reach the root disk, in dependency order.
ird="$cache/initrd-$k.dir"
rm -rf "$ird"
mkdir -p "$ird/bin" "$ird/lib/modules"
cp "$(command -v busybox)" "$ird/bin/busybox"
install -m 0755 "$here/initramfs-init" "$ird/init"
moddir="$root/lib/modules/$kver"
python3 - "$moddir" "$ird" virtio_pci virtio_blk crc32c_generic ext4 <<'PY'
import lzma, os, shutil, sys
moddir, ird, wanted = sys.argv[1], sys.argv[2], sys.argv[3:]
deps, byname = {}, {}
for line in open(os.path.join(moddir, "modules.dep")):
    path, _, rest = line.partition(":")
    deps[path] = rest.split()
    name = os.path.basename(path).split(".ko")[0].replace("-", "_")
    byname[name] = path
builtin = {os.path.basename(l.strip()).split(".ko")[0].replace("-", "_")
           for l in open(os.path.join(moddir, "modules.builtin"))}
order, seen = [], set()
def visit(p):
    if p in seen:
        return
    seen.add(p)
    for d in deps.get(p, []):
        visit(d)
    order.append(p)
for w in wanted:
    if w in builtin:
        continue
    visit(byname[w])
with open(os.path.join(ird, "modules"), "w") as lst:
    for p in order:
        src = os.path.join(moddir, p)
        name = os.path.basename(p)
        dst = os.path.join(ird, "lib/modules", name.replace(".xz", ""))
        if name.endswith(".xz"):
            open(dst, "wb").write(lzma.open(src).read())
        else:
            shutil.copy(src, dst)
        lst.write(os.path.basename(dst) + "\n")
print("vm: initramfs modules:", " ".join(os.path.basename(p) for p in order))
PY
(cd "$ird" && find . | cpio -o -H newc --quiet | gzip -1) >"$cache/initrd-$k.img"
rm -rf "$ird"
echo "$kver" >"$cache/release-$k"
done
# initramfs-tools' images are not booted (the tiny initramfs above is): not worth their space.
rm -f "$root"/boot/initrd.img-*

mkfs.ext4 -q -F -L sandcell-root -d "$root" "$cache/$img" 4G
rm -rf "$root" "$root.ok"
echo "$want" >"$cache/$stamp"
echo "vm: $dist guest image ready in $cache ($((SECONDS - start)) s, kernels: $(IFS=,; echo "${releases[*]}"))"
