# The system test's egress checks (sourced by guest-test.sh, which defines check, pass, fail,
# skip, journal, as_gw, wait_for): egress under the real shipped units, turned on by the
# packages' drop-ins as sandcelld(8) EGRESS tells an operator.
#
# The "internet" is a web server in a network namespace this script creates (addresses
# 11.0.0.0/24 over a veth pair from the guest's own namespace, where sandcell-egress runs; the
# VM has no other network), with names from a hosts file the proxy is told to use.
#   1. An environment with egress, units as shipped: Open/Run refused (EgressUnavailable,
#      naming the drop-in), `sandcelld --check` says UNAVAILABLE.
#   2. The drop-ins linked in, daemon-reload, the proxy's socket enabled: a cell fetches the
#      allowed host through the proxy, another host is a 403 with the reason, and a session of
#      an environment without egress cannot make a TCP socket.
#   3. Everything put back (links, configuration, namespace, proxy).
egress_checks() {
    local conf=/etc/sandcell/sandcelld.toml out rc
    cp "$conf" /tmp/sandcelld.toml.before-egress
    cat >>"$conf" <<'TOML'

[environments.net]
language = "python"
engine = "native"
interpreter = "/usr/bin/python3"
egress = { hosts = ["data.test"], ports = [80] }
TOML
    check egress-config-valid bash -c '/usr/libexec/sandcelld --check-config >/dev/null'
    systemctl stop sandcelld.service

    # 1. Units as shipped.
    out=$(/usr/libexec/sandcelld --check 2>&1 | grep '^egress sandbox:')
    echo "    --check: $out"
    [[ $out == *UNAVAILABLE* && $out == */usr/share/sandcell/egress/* ]] &&
        pass egress-check-unavailable-without-drop-ins || fail egress-check-unavailable-without-drop-ins "$out"
    out=$(echo 'print("reached")' | as_gw sandcellctl run -e net - 2>&1)
    rc=$?
    echo "    refused: $out"
    [[ $rc != 0 && $out == *"/usr/share/sandcell/egress/sandcelld.service.conf"* ]] &&
        pass egress-refused-without-drop-ins || fail egress-refused-without-drop-ins "exit $rc: $out"
    out=$(echo 'print(6*7)' | as_gw sandcellctl run -e pydata - 2>&1)
    [[ $out == 42 ]] && pass egress-other-environments-unaffected || fail egress-other-environments-unaffected "$out"

    # The private internet.
    ip netns add scweb
    ip link add scv0 type veth peer name scv1 netns scweb
    ip addr add 11.0.0.1/24 dev scv0
    ip link set scv0 up
    ip -n scweb addr add 11.0.0.2/24 dev scv1
    ip -n scweb link set scv1 up
    ip -n scweb link set lo up
    mkdir -p /tmp/egress-www
    echo "hello through the proxy" >/tmp/egress-www/hello.txt
    ip netns exec scweb python3 -m http.server 80 --bind 11.0.0.2 --directory /tmp/egress-www \
        >/dev/null 2>&1 &
    local web=$!
    echo "11.0.0.2 data.test other.test" >/etc/sandcell/egress-hosts
    mkdir -p /etc/systemd/system/sandcell-egress.service.d
    cat >/etc/systemd/system/sandcell-egress.service.d/50-vmtest.conf <<'CONF'
[Service]
ExecStart=
ExecStart=/usr/libexec/sandcell/sandcell-egress --hosts-file /etc/sandcell/egress-hosts --hosts-only
CONF

    # 2. The drop-ins, as sandcelld(8) EGRESS says.
    mkdir -p /etc/systemd/system/sandcelld.service.d /etc/systemd/system/sandcell-sessions.service.d
    ln -s /usr/share/sandcell/egress/sandcelld.service.conf /etc/systemd/system/sandcelld.service.d/egress.conf
    ln -s /usr/share/sandcell/egress/sandcell-sessions.service.conf /etc/systemd/system/sandcell-sessions.service.d/egress.conf
    systemctl daemon-reload
    check egress-proxy-socket systemctl enable --now sandcell-egress.socket
    systemctl restart sandcelld.service
    echo "    sandcelld.service: $(systemctl show -p RestrictAddressFamilies -p IPAddressAllow sandcelld.service | tr '\n' ' ')"
    echo "    sandcell-sessions.service: $(systemctl show -p IPAddressAllow -p IPAddressDeny sandcell-sessions.service | tr '\n' ' ')"
    out=$(/usr/libexec/sandcelld --check 2>&1 | grep '^egress sandbox:')
    [[ $out == *available* && $out != *UNAVAILABLE* ]] &&
        pass egress-check-available-with-drop-ins || fail egress-check-available-with-drop-ins "$out"
    out=$(as_gw sandcellctl run -e net - 2>&1 <<'PY'
import time, urllib.request, urllib.error
body = None
for _ in range(50):
    try:
        body = urllib.request.urlopen("http://data.test/hello.txt", timeout=20).read().decode()
        break
    except urllib.error.HTTPError as e:
        body = "http %d %s" % (e.code, e.read().decode().strip())
        if e.code != 502:
            break
    except OSError as e:
        body = "error %r" % (e,)
    time.sleep(0.5)
print("allowed:", body.strip())
try:
    urllib.request.urlopen("http://other.test/hello.txt", timeout=20)
    print("other: fetched")
except urllib.error.HTTPError as e:
    print("other:", e.code, e.read().decode().strip())
PY
)
    echo "$out" | sed 's/^/    egress cell: /'
    [[ $out == *"allowed: hello through the proxy"* ]] && pass egress-fetch-through-proxy ||
        { fail egress-fetch-through-proxy "$out"; journal 30; journalctl -b -u sandcell-egress.service --no-pager | tail -20 | sed 's/^/    proxy: /'; }
    [[ $out == *"other: 403 sandcell egress: host not allowed: other.test"* ]] &&
        pass egress-refused-host-403 || fail egress-refused-host-403 "$out"
    out=$(as_gw sandcellctl run -e pydata - 2>&1 <<'PY'
import socket
try:
    s = socket.socket()
    s.settimeout(5)
    s.connect(("11.0.0.2", 80))
    print("connected")
except OSError as e:
    print("errno", e.errno)
PY
)
    [[ $out == "errno 1" ]] && pass egress-none-elsewhere || fail egress-none-elsewhere "$out"

    # A detached session keeps its grant across `systemctl restart sandcelld` (its keeper holds
    # the listener; the successor hands it to the proxy again), and its counters are on D-Bus
    # (`sandcellctl list`, EGRESS column: allowed/refused).
    local esid fetch='import urllib.request
print("fetched:", urllib.request.urlopen("http://data.test/hello.txt", timeout=20).read().decode().strip())'
    esid=$(as_gw sandcellctl open -e net --idle 600 2>/dev/null)
    out=$(echo "$fetch" | as_gw sandcellctl exec "$esid" - 2>/dev/null)
    echo "    egress session before the restart: $out"
    systemctl restart sandcelld.service
    out=$(echo "$fetch" | as_gw sandcellctl exec "$esid" - 2>/dev/null)
    echo "    egress session after the restart: $out"
    [[ $out == "fetched: hello through the proxy" ]] && pass egress-grant-kept-across-restart ||
        { fail egress-grant-kept-across-restart "$out"; journal 20; }
    sleep 3 # the counters are asked of the proxy every 2 s
    out=$(sandcellctl list 2>&1)
    echo "$out" | head -4 | sed 's/^/    sandcellctl list: /'
    [[ $(head -1 <<<"$out") == *EGRESS* && $(grep -F "${esid##*.}" <<<"$out") =~ [[:space:]][1-9][0-9]*/[0-9]+$ ]] &&
        pass egress-counters-on-dbus || fail egress-counters-on-dbus "$out"
    as_gw sandcellctl close "$esid" >/dev/null 2>&1

    # 3. Back as shipped.
    rm -f /etc/systemd/system/sandcelld.service.d/egress.conf /etc/systemd/system/sandcell-sessions.service.d/egress.conf \
        /etc/systemd/system/sandcell-egress.service.d/50-vmtest.conf /etc/sandcell/egress-hosts
    cp /tmp/sandcelld.toml.before-egress "$conf"
    systemctl disable --now sandcell-egress.socket sandcell-egress.service >/dev/null 2>&1
    systemctl daemon-reload
    systemctl stop sandcelld.service
    kill "$web" 2>/dev/null
    ip netns del scweb
    ip link del scv0 2>/dev/null
    rm -rf /tmp/egress-www
}
