//! `bench-worker`: the worker's cell round trip over its real pipes, next to raw Eryx.
//!
//! Spawns `sandcell-worker-python` with fds 3 and 4 as the daemon does (a best-effort
//! confinement plan, so it runs unprivileged), then for each cell writes the request and reads
//! reply lines on this thread until its `Done`: no reader thread or channel of the
//! measurement's own in the way. Reports p50/p99 of that round trip, how many `read`s and
//! reply lines a cell took (an `Output` and its `Done` arriving in one read cost the daemon one
//! wake-up, not two), and a raw in-process `SessionExecutor::execute` of the same code on the
//! same runtime for comparison.

use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use eryx::{ResourceLimits, SessionExecutor};
use sandcell_proto::worker::{RequestHeader, Stream, WorkerMessage, WorkerStatus};
use sandcell_worker_python::runtime;
use serde_json::json;

use super::summary;

/// Untimed cells before the timed ones.
const WARMUP: usize = 20;

/// A pipe (read, write), close-on-exec, above fd 100 so it never collides with 3 and 4.
fn pipe() -> Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: a two-int array for pipe2 to fill.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    let high = |fd: RawFd| -> Result<OwnedFd> {
        // SAFETY: duplicates a descriptor we own, then closes the original.
        let n = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 100) };
        // SAFETY: closing the original, which we own.
        unsafe { libc::close(fd) };
        if n < 0 {
            return Err(std::io::Error::last_os_error().into());
        }
        // SAFETY: a fresh descriptor nobody else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(n) })
    };
    Ok((high(fds[0])?, high(fds[1])?))
}

/// Reply lines read on the calling thread, counting `read` calls.
struct Replies {
    file: File,
    buf: Vec<u8>,
    reads: u64,
}

impl Replies {
    fn next(&mut self) -> Result<WorkerMessage> {
        loop {
            if let Some(i) = self.buf.iter().position(|&b| b == b'\n') {
                let msg = WorkerMessage::parse(&self.buf[..i]).map_err(anyhow::Error::msg)?;
                self.buf.drain(..=i);
                return Ok(msg);
            }
            let mut chunk = [0u8; 16 * 1024];
            let n = self.file.read(&mut chunk)?;
            if n == 0 {
                bail!("the worker closed its reply pipe");
            }
            self.reads += 1;
            self.buf.extend_from_slice(&chunk[..n]);
        }
    }
}

/// The default worker: next to this executable.
fn default_worker() -> Result<PathBuf> {
    let me = std::env::current_exe()?;
    Ok(me.with_file_name("sandcell-worker-python"))
}

/// The source of the `i`th cell: `code`, or with `vary` a distinct source each time (a trailing
/// comment), so that nothing compiled for an earlier cell can be reused.
fn source(code: &str, vary: bool, i: usize) -> String {
    if vary {
        format!("{code}\n# {i}\n")
    } else {
        code.to_string()
    }
}

/// Runs the benchmark and returns its figures.
pub fn run(
    dir: &Path,
    worker: Option<PathBuf>,
    code: &str,
    vary: bool,
    n: usize,
) -> Result<serde_json::Value> {
    let worker = match worker {
        Some(w) => w,
        None => default_worker()?,
    };
    let session_dir = std::env::temp_dir().join(format!("sandcell-bench-{}", std::process::id()));
    std::fs::create_dir_all(&session_dir)?;
    let r = drive(dir, &worker, &session_dir, code, vary, n);
    let _ = std::fs::remove_dir_all(&session_dir);
    let mut figures = r?;
    figures["raw_eryx_session_execute"] = super::runtime_block_on(raw(dir, code, vary, n))?;
    Ok(figures)
}

fn drive(
    dir: &Path,
    worker: &Path,
    session_dir: &Path,
    code: &str,
    vary: bool,
    n: usize,
) -> Result<serde_json::Value> {
    let plan = json!({
        "uid": null, "gid": null, "session_dir": session_dir,
        "read_paths": [dir], "exec_paths": [], "write_paths": ["/dev/null"],
        "keep_fds": sandcell_proto::worker::WORKER_FDS, "max_open_files": 256, "max_file_bytes": 1u64 << 20,
        "max_processes": 256, "max_address_space": null, "new_net_namespace": false,
        "new_ipc_namespace": false, "syscalls": "wasm", "enforcement": "best_effort"
    });
    let (req_r, req_w) = pipe()?;
    let (rep_r, rep_w) = pipe()?;
    let mut cmd = Command::new(worker);
    cmd.env_clear()
        .env("SANDCELL_CONFINE", plan.to_string())
        .env("SANDCELL_PYTHON_RUNTIME", dir)
        .env("SANDCELL_SESSION_DIR", session_dir)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    let (a, b) = (req_r.as_raw_fd(), rep_w.as_raw_fd());
    // SAFETY: only async-signal-safe dup2 calls between fork and exec; the sources are above
    // 100, so they never alias 3 or 4, and dup2 clears close-on-exec on the copies.
    unsafe {
        cmd.pre_exec(move || {
            use sandcell_proto::worker::{REPLY_FD, REQUEST_FD};
            if libc::dup2(a, REQUEST_FD) != REQUEST_FD || libc::dup2(b, REPLY_FD) != REPLY_FD {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let start = Instant::now();
    let mut child = cmd
        .spawn()
        .with_context(|| format!("starting {}", worker.display()))?;
    drop((req_r, rep_w));
    let mut requests = File::from(req_w);
    let mut replies = Replies {
        file: File::from(rep_r),
        buf: Vec::new(),
        reads: 0,
    };
    let r = (|| -> Result<serde_json::Value> {
        match replies.next()? {
            WorkerMessage::Ready { .. } => {}
            other => bail!("expected Ready, got {other:?}"),
        }
        let ready = start.elapsed();
        let mut round_trip = Vec::with_capacity(n);
        let mut first_output = Vec::with_capacity(n);
        let (mut reads, mut lines) = (0u64, 0u64);
        let mut stdout = String::new();
        for i in 0..WARMUP + n {
            let cell = i as u64 + 1;
            let code = source(code, vary, i);
            let mut h = RequestHeader::exec(cell, code.len() as u64);
            h.timeout_ms = Some(30_000);
            h.max_output = Some(1 << 20);
            let mut bytes = h.to_line().into_bytes();
            bytes.extend_from_slice(code.as_bytes());
            let reads0 = replies.reads;
            let t = Instant::now();
            requests.write_all(&bytes)?;
            let mut count = 0;
            let mut first = None;
            stdout.clear();
            loop {
                let msg = replies.next()?;
                count += 1;
                match msg {
                    WorkerMessage::Output { stream, data, .. } => {
                        first.get_or_insert_with(|| t.elapsed());
                        if stream == Stream::Stdout {
                            stdout.push_str(&data);
                        }
                    }
                    WorkerMessage::Dropped { .. } => {}
                    WorkerMessage::Done { status, .. } => {
                        let d = t.elapsed();
                        if status != WorkerStatus::Ok {
                            bail!("cell {cell} ended with {status:?}");
                        }
                        if i >= WARMUP {
                            round_trip.push(d);
                            first_output.extend(first);
                            reads += replies.reads - reads0;
                            lines += count;
                        }
                        break;
                    }
                    other => bail!("unexpected {other:?}"),
                }
            }
        }
        // The snapshot that follows a cell is not in its round trip but in the next one's
        // wait; pace the cells to see it apart.
        let mut paced = Vec::with_capacity(n.min(200));
        for i in 0..n.min(200) {
            std::thread::sleep(Duration::from_millis(2));
            let cell = (WARMUP + n + i) as u64 + 1;
            let code = source(code, vary, WARMUP + n + i);
            let mut h = RequestHeader::exec(cell, code.len() as u64);
            h.timeout_ms = Some(30_000);
            let mut bytes = h.to_line().into_bytes();
            bytes.extend_from_slice(code.as_bytes());
            let t = Instant::now();
            requests.write_all(&bytes)?;
            while !matches!(replies.next()?, WorkerMessage::Done { .. }) {}
            paced.push(t.elapsed());
        }
        let status = std::fs::read_to_string(format!("/proc/{}/status", child.id()))?;
        let kib = |field: &str| -> Option<u64> {
            let line = status.lines().find(|l| l.starts_with(field))?;
            line.split_whitespace().nth(1)?.parse().ok()
        };
        Ok(json!({
            "worker_rss_bytes": kib("VmRSS:").map(|k| k * 1024),
            "worker_peak_rss_bytes": kib("VmHWM:").map(|k| k * 1024),
            "code": code,
            "vary": vary,
            "last_stdout": stdout,
            "start_to_ready_ms": super::ms(ready),
            "worker_round_trip": summary(round_trip),
            "worker_first_output": if first_output.is_empty() { json!(null) } else { summary(first_output) },
            "worker_round_trip_paced_2ms": summary(paced),
            "reads_per_cell": reads as f64 / n as f64,
            "reply_lines_per_cell": lines as f64 / n as f64,
        }))
    })();
    // EOF ends the worker; kill it if it does not end by itself.
    drop(requests);
    let t = Instant::now();
    while matches!(child.try_wait(), Ok(None)) && t.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(5));
    }
    let _ = child.kill();
    let _ = child.wait();
    r
}

/// Raw Eryx: `SessionExecutor::execute(code)` on the same runtime, output captured by Eryx.
async fn raw(dir: &Path, code: &str, vary: bool, n: usize) -> Result<serde_json::Value> {
    let (executor, _) = runtime::load_executor(dir)?;
    let mut session =
        SessionExecutor::new_with_limits(Arc::new(executor), &[], &ResourceLimits::default())
            .await?;
    let mut t = Vec::with_capacity(n);
    for i in 0..WARMUP + n {
        let s = Instant::now();
        session.execute(source(code, vary, i)).run().await?;
        if i >= WARMUP {
            t.push(s.elapsed());
        }
    }
    Ok(summary(t))
}
