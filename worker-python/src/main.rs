//! `sandcell-worker-python`: the Python worker executable (see the library docs and
//! `sandcell_worker_python::worker` for descriptors, environment and exit statuses).

fn main() {
    // Confinement comes first, while the process has one thread and before any runtime file or
    // request is read (no untrusted code before the worker is fully confined).
    let plan = match sandcell_confine::Plan::from_env() {
        Ok(p) => p,
        Err(e) => {
            sandcell_proto::worker::report_fatal("confine", &e.to_string());
            std::process::exit(sandcell_confine::EXIT_CONFINE_FAILED);
        }
    };
    if let Err(e) = sandcell_confine::enter(&plan) {
        sandcell_proto::worker::report_fatal("confine", &e.to_string());
        std::process::exit(sandcell_confine::EXIT_CONFINE_FAILED);
    }
    // RLIMIT_FSIZE is the session's disk budget: a write to /mnt/data past it fails with
    // EFBIG (the cell sees an OSError) instead of SIGXFSZ killing the worker.
    // SAFETY: installing SIG_IGN is always sound; no other thread exists yet.
    unsafe { libc::signal(libc::SIGXFSZ, libc::SIG_IGN) };
    std::process::exit(sandcell_worker_python::worker::run_confined());
}
