#!/usr/bin/env python3
"""The gap a client sees when sandcelld restarts, crashes or re-executes in place, measured
on this machine without emulation; figures only, no assertions.

This script plays the socket unit: it binds the socket once and hands it to every daemon it
starts (``LISTEN_FDS``, as systemd's socket activation does), so connections made while no
daemon runs wait in the listen backlog. One daemon at a time runs with the shipped defaults
(warm pools on; 8 detached sessions allowed to one uid, and a wall time long enough for the
cell below), its session records on tmpfs as the shipped ``adopt_dir`` is. It opens 8
detached sessions (3 Eryx ``python``, 2 ``pydata``, 3 ``r``; fewer languages when the
machine lacks one), sets a variable in each and submits one cell that prints a tick every
quarter of a second for as long as the run lasts. Then, ``--rounds`` times each, in turn:

- ``restart``: SIGUSR2 (a planned exit that keeps every session, what the daemon does when
  systemd restarts the unit), the successor started as soon as the old process has exited;
- ``crash``: SIGKILL, the successor started as soon as the old process is gone (systemd's
  ``Restart=on-failure`` with ``RestartSec=0``; an OOM kill of the daemon is the same event
  to the successor);
- ``reexec``: SIGUSR1, the same process executes its binary again (the package upgrade's
  path).

Per event it prints the gap (from the signal to the first ``Execute`` answered on a kept
session by the new daemon or image, through a new connection as a returning client makes),
the sessions kept (their variable seen again; the running cell's session by its
``CellStatus``) out of 8, whether every worker kept its pid, whether the cell was running
when the signal was sent, and the successor's ``daemon_start`` stages (microseconds, from its
log). At the end: p50 and max of the gap per event; then the cell is interrupted and its
output read back with ``Attach``, every tick from the first without a gap.

systemd's own share of a restart under the shipped unit (its stop job, the fork and the
unit's namespaces before the daemon's ``main``) is not in these figures: this machine's
systemd is not PID 1. The VM tier (scripts/vm-test.sh) measures the same events under real
systemd.

Usage: bench_restart.py --bin DIR --runtime DIR [--rounds N]
  --rounds N   events of each kind (default 3)
  SANDCELL_BENCH_LOG_TAIL=1 in the environment prints the end of the daemons' log at the end.
Needs root (adoption is root's: the records' directory is root-only). Not root: prints why
and exits 0.
"""

import argparse
import glob
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "clients",
                                "python", "src"))
import sandcell  # noqa: E402
from bench_shipped import LogWatch, daemon_env  # noqa: E402

# The submitted cell prints a tick every TICK_SECONDS for at most CELL_SECONDS (its wall
# time is raised to fit); the run interrupts it at the end.
TICK_SECONDS = 0.25
CELL_SECONDS = 1800


class Daemons(LogWatch):
    """The socket (held here) and the daemon running now."""

    def __init__(self, bindir, runtime):
        self.bindir = bindir
        self.dir = tempfile.mkdtemp(prefix="sandcell-bench-restart.", dir="/var/tmp")
        os.chmod(self.dir, 0o711)
        self.adopt = tempfile.mkdtemp(prefix="sandcell-bench-restart-adopt.", dir="/dev/shm")
        self.sock_path = os.path.join(self.dir, "org.sandcell.Kernel")
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(self.sock_path)
        os.chmod(self.sock_path, 0o660)
        self.listener.listen(128)
        self.cgroup = "sandcell-bench-restart-%d" % os.getpid()
        self.conf = os.path.join(self.dir, "sandcelld.toml")
        with open(self.conf, "w") as f:
            # Shipped defaults but two: 8 detached sessions of one uid (the default allows 6),
            # and a wall time that lets the ticking cell run through every event.
            f.write("[limits]\nmax_detached_sessions_per_uid = 8\n"
                    "execution_wall_time_seconds = %d\n" % (CELL_SECONDS + 60))
        self.env = daemon_env(bindir, runtime, self.dir, self.cgroup, self.adopt,
                              "info,sandcelld::timing=debug")
        self.env.update({"LISTEN_FDS": "1", "LISTEN_FDNAMES": "varlink"})
        self.log = os.path.join(self.dir, "daemon.log")
        self.proc = None
        # Images started so far (each start and each re-exec logs "ready to serve" once).
        self.images = 0

    def start(self):
        """Starts a daemon on the held socket (descriptor 3, LISTEN_PID its own pid)."""
        fd = self.listener.fileno()
        # The shell below names the descriptor in a redirection, where dash takes one digit.
        if fd > 9:
            raise SystemExit("bench_restart: the socket got descriptor %d (more than 9)" % fd)
        # The shell moves the socket to descriptor 3 and sets LISTEN_PID to its own pid,
        # which exec keeps for sandcelld.
        script = ('[ "$0" = 3 ] || eval "exec 3<&$0 $0<&-"; '
                  'LISTEN_PID=$$ exec "$@"')
        with open(self.log, "a") as log:
            self.proc = subprocess.Popen(
                ["/bin/sh", "-c", script, str(fd), os.path.join(self.bindir, "sandcelld"),
                 "--config", self.conf],
                env=self.env, pass_fds=[fd], stdout=subprocess.DEVNULL, stderr=log,
                start_new_session=True)
        self.images += 1

    def last_stages(self, what):
        lines = re.findall(r'what="%s".*' % what, self.text())
        if not lines:
            return None
        m = re.search(r"stages=(.*?) total_us=(\d+)", lines[-1])
        return (m.group(1), int(m.group(2))) if m else None

    def stop(self):
        """Ends the daemon and its sessions (SIGTERM without systemd: nothing is kept). With
        no daemon running while sessions are kept (an error between an exit and the next
        start), one is started first, so that its stop ends them."""
        kept = glob.glob(os.path.join(self.adopt, "*.json"))
        if (self.proc is None or self.proc.poll() is not None) and kept:
            self.start()
        if self.proc is not None and self.proc.poll() is None:
            # Not in the first milliseconds of a start, before its handlers exist.
            self.wait_log("ready to serve", self.images, 120)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.listener.close()
        if os.environ.get("SANDCELL_BENCH_LOG_TAIL"):
            print(self.text()[-4000:])
        shutil.rmtree(self.dir, ignore_errors=True)
        shutil.rmtree(self.adopt, ignore_errors=True)


def worker_pids(sid):
    """The processes of session `sid`'s cgroup (its worker and keeper): on cgroup v1 the
    memory hierarchy's group, on v2 the unified one's."""
    pids = set()
    local = sid.rsplit(".", 1)[-1]  # the id without its node
    root = "/sys/fs/cgroup/memory" if os.path.isdir("/sys/fs/cgroup/memory") else "/sys/fs/cgroup"
    for path in glob.glob("%s/**/%s/cgroup.procs" % (root, local), recursive=True):
        try:
            with open(path) as f:
                pids.update(int(p) for p in f.read().split())
        except OSError:
            pass
    return sorted(pids)


def first_answer(sock, sid, lang, want, t0, timeout=60.0, fresh=lambda: True):
    """Seconds from `t0` to the first Execute on `sid` that shows `want` and is answered once
    `fresh()` holds (the answering daemon is the new one), through a new client, retrying
    while the call is cut, refused for a shutdown or times out, or while a cut call's cell
    still runs. A session that ended or answered something else ends the run."""
    code = "print(v)" if lang == "python" else "cat(v, '\\n')"
    while True:
        left = timeout - (time.perf_counter() - t0)
        if left <= 0:
            raise SystemExit("no Execute on %s answered within %.0f s" % (sid, timeout))
        try:
            c = sandcell.Client(sock, timeout=left)
            try:
                r = c.session_by_id(sid, lang).execute(code)
            finally:
                c.close()
        except sandcell.NoSuchSession as e:
            raise SystemExit("session %s is gone: %s" % (sid, e))
        except sandcell.SandcellError:
            time.sleep(0.002)
            continue
        if r.stdout.strip() != want:
            raise SystemExit("session %s answered %r, not %r" % (sid, r.stdout, want))
        if fresh():
            return time.perf_counter() - t0
        time.sleep(0.002)  # the old image answered: it had not stopped accepting yet


def pct(samples, p):
    s = sorted(samples)
    return s[min(len(s) - 1, round((len(s) - 1) * p))]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", required=True)
    ap.add_argument("--runtime", required=True)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    if os.geteuid() != 0:
        print("bench_restart: skipped: adoption needs root (the daemon keeps sessions across "
              "a restart only as root)")
        return 0
    d = Daemons(os.path.abspath(a.bin), os.path.abspath(a.runtime))
    try:
        return run(d, a.rounds)
    finally:
        d.stop()


def run(d, rounds):
    d.start()
    if not d.wait_log("ready to serve", 1, 300):
        print("bench_restart: the daemon did not start:\n" + d.text()[-3000:])
        return 1
    c = sandcell.Client(d.sock_path)
    have = {e["name"] for e in c.list_environments()}
    plan = [("python", "python")] * 3 + [("python", "pydata")] * 2 + [("r", "r")] * 3
    plan = [p for p in plan if p[1] in have]
    sessions = []
    for i, (lang, env) in enumerate(plan):
        s = c.session(lang, env, detached_idle_seconds=3600)
        want = "v%d" % i
        s.execute("v = '%s'" % want if lang == "python" else "v <- '%s'" % want)
        sessions.append((s.id, lang, env, want))
    # The cell that runs through every event, in the last Python session.
    runner = next((x for x in reversed(sessions) if x[1] == "python"), None)
    sessions_probe = [x for x in sessions if x is not runner]
    if not sessions_probe:
        print("bench_restart: no environment to open sessions in")
        return 1
    cell = None
    if runner is not None:
        cell = c.submit(runner[0], "import time\nfor i in range(%d):\n    print('tick', i, "
                                   "flush=True)\n    time.sleep(%s)\n"
                        % (int(CELL_SECONDS / TICK_SECONDS), TICK_SECONDS))
    c.close()
    print("bench_restart: %d sessions (%s), one detached cell ticking in %s"
          % (len(sessions), " ".join(x[2] for x in sessions),
             runner[0] if runner else "none"))
    gaps = {"restart": [], "crash": [], "reexec": []}
    events = [("restart", signal.SIGUSR2), ("crash", signal.SIGKILL),
              ("reexec", signal.SIGUSR1)]
    n = 0
    for r in range(rounds):
        for name, sig in events:
            before = {sid: worker_pids(sid) for sid, *_ in sessions}
            running = runner is not None and cell_running(d.sock_path, runner[0], cell)
            probe = sessions_probe[n % len(sessions_probe)]
            n += 1
            starts = d.text().count('what="daemon_start"')
            reexecs = d.text().count("re-executing in place")
            t0 = time.perf_counter()
            d.proc.send_signal(sig)
            if name == "reexec":
                d.images += 1
                fresh = lambda: d.text().count("re-executing in place") > reexecs  # noqa: E731
            else:
                d.proc.wait(60)
                d.start()
                fresh = lambda: True  # noqa: E731
            gap = first_answer(d.sock_path, probe[0], probe[1], probe[3], t0, fresh=fresh)
            gaps[name].append(gap)
            started = d.wait_log('what="daemon_start"', starts + 1, 120)
            kept = 0
            for sid, lang, _env, want in sessions:
                try:
                    if runner is not None and sid == runner[0]:
                        # Its cell runs on: the session is kept if the cell is known.
                        cell_running(d.sock_path, sid, cell)
                    else:
                        first_answer(d.sock_path, sid, lang, want, time.perf_counter(), 30)
                    kept += 1
                except (SystemExit, sandcell.SandcellError) as e:
                    print("  lost %s: %s" % (sid, e))
            after = {sid: worker_pids(sid) for sid, *_ in sessions}
            same = sum(1 for sid in before if before[sid] and before[sid] == after[sid])
            st = d.last_stages("daemon_start") if started else None
            print("bench_restart: %-7s round %d: gap %7.1f ms (Execute on %s %s), kept %d of "
                  "%d, workers with the same pids %d of %d, cell running before: %s; "
                  "successor's start %s us: %s"
                  % (name, r + 1, gap * 1000, probe[2], probe[0].rsplit(".", 1)[-1][:8], kept,
                     len(sessions), same, len(sessions), "yes" if running else "no",
                     st[1] if st else "?", st[0] if st else "(no daemon_start line)"))
    for name, g in gaps.items():
        if g:
            print("bench_restart: %-7s gap p50 %7.1f ms, max %7.1f ms (n=%d)"
                  % (name, pct(g, 0.5) * 1000, max(g) * 1000, len(g)))
    if runner is not None:
        c = sandcell.Client(d.sock_path, timeout=60)
        c.interrupt(runner[0], cell)
        out = []
        res = c.attach(runner[0], cell, lambda o: out.append(getattr(o, "text", "")))
        ticks = [ln.split()[1] for ln in "".join(out).splitlines() if ln.startswith("tick ")]
        whole = ticks == [str(i) for i in range(len(ticks))]
        print("bench_restart: the detached cell, interrupted at the end: status %s, %d ticks "
              "read back with Attach, %s" % (res.status, len(ticks),
                                             "every one from 0 without a gap" if whole
                                             else "SOME MISSING OR OUT OF ORDER"))
        c.close()
    return 0


def cell_running(sock, sid, cell):
    """Whether cell `cell` of `sid` is running (CellStatus); raises when the daemon does not
    know the cell or the session."""
    c = sandcell.Client(sock, timeout=30)
    try:
        return c.cell_status(sid, cell)["state"] == "running"
    finally:
        c.close()


if __name__ == "__main__":
    sys.exit(main())
