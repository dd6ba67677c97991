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
    std::process::exit(sandcell_worker_python::worker::run_confined());
}
