//! The elapsed-time line of a silent cell: when standard error is a terminal, a cell that has
//! printed nothing for [`SILENT_SECONDS`] shows `sandcellctl: cell N running, T s` on one
//! line of standard error, rewritten every second and erased before the cell's next output
//! (so nothing of it reaches a pipe or a log, and the cell's own text is never interleaved
//! with it: sandcellctl's runtime is single-threaded, and both writers take the same lock).

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Seconds without output before the line appears.
pub const SILENT_SECONDS: u64 = 2;

#[derive(Debug)]
struct State {
    started: Instant,
    last_output: Instant,
    cell: Option<u64>,
    shown: bool,
}

/// The line's state and its ticker; dropping it erases the line and stops the ticker.
#[derive(Debug)]
pub struct Progress {
    state: Option<Arc<Mutex<State>>>,
    ticker: Option<tokio::task::JoinHandle<()>>,
}

impl Progress {
    /// A line that is shown only when `enabled` (standard error is a terminal and the
    /// output is not JSON); otherwise every method does nothing.
    pub fn start(enabled: bool) -> Progress {
        if !enabled {
            return Progress {
                state: None,
                ticker: None,
            };
        }
        let now = Instant::now();
        let state = Arc::new(Mutex::new(State {
            started: now,
            last_output: now,
            cell: None,
            shown: false,
        }));
        let s = state.clone();
        let ticker = tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_secs(1));
            loop {
                tick.tick().await;
                let mut st = s.lock().unwrap();
                if st.last_output.elapsed() < Duration::from_secs(SILENT_SECONDS) {
                    continue;
                }
                let what = match st.cell {
                    Some(n) => format!("cell {n}"),
                    None => "cell".to_owned(),
                };
                let mut err = std::io::stderr();
                let _ = write!(
                    err,
                    "\r\x1b[2Ksandcellctl: {what} running, {} s",
                    st.started.elapsed().as_secs()
                );
                let _ = err.flush();
                st.shown = true;
            }
        });
        Progress {
            state: Some(state),
            ticker: Some(ticker),
        }
    }

    /// The cell's number, from its `started` frame.
    pub fn started(&self, cell: u64) {
        if let Some(s) = &self.state {
            let mut st = s.lock().unwrap();
            st.cell = Some(cell);
        }
    }

    /// Called before anything is written for the cell: erases the line if it is shown.
    pub fn output(&self) {
        if let Some(s) = &self.state {
            let mut st = s.lock().unwrap();
            st.last_output = Instant::now();
            if st.shown {
                let mut err = std::io::stderr();
                let _ = write!(err, "\r\x1b[2K");
                let _ = err.flush();
                st.shown = false;
            }
        }
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        if let Some(t) = self.ticker.take() {
            t.abort();
        }
        self.output();
    }
}
