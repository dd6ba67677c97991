//! Following a cell across a daemon restart: when sandcelld restarts (`systemctl restart`, a
//! package upgrade, `SIGUSR2`) or crashes while a client reads a cell's frames, the call is
//! cut ([`Error::is_call_cut`]) but a retained cell (`Submit`, or `Execute` on a detached
//! session) goes on in the successor, which adopts the session. [`Client::next_frame_following`]
//! then connects again to the same socket and follows the cell with `Attach`, with bounded
//! retries and backoff ([`Reattach`]) while the daemon is not back, and hands on only what it
//! had not delivered yet. A cell started with a token ([`CellTrack::executing`]) is followed
//! by sending its `Execute` again with the same token instead, which also covers a cut before
//! the `started` frame: the daemon follows the cell the first call started, or starts it if
//! none did, so the code runs once.

use crate::{Client, Error, Frame, KernelError};
use std::collections::HashSet;
use std::time::Duration;

/// How a cut cell is followed again: `attempts` new connections to the same socket, each
/// followed by `Attach`, the first after `first_delay`, each later one after twice the
/// previous wait, at most `max_delay`. [`Reattach::default`]: 13 attempts, 0.01 s doubling to
/// at most 4 s (about 21 s in all), as the Python client's `execute`. The first attempt comes
/// at once: under socket activation a connection made while the daemon restarts waits on the
/// socket for the successor, so waiting longer before it only adds to the restart's gap.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Reattach {
    /// Attempts before the cut is reported.
    pub attempts: u32,
    /// Wait before the first attempt.
    pub first_delay: Duration,
    /// Longest wait between two attempts.
    pub max_delay: Duration,
}

impl Default for Reattach {
    fn default() -> Self {
        Reattach {
            attempts: 13,
            first_delay: Duration::from_millis(10),
            max_delay: Duration::from_secs(4),
        }
    }
}

/// What a follower of one cell has delivered, so that the replay of a re-attach repeats
/// nothing: the `started` frame once, output by characters per stream (the replay may cut
/// the text into other chunks), display bundles by sequence number.
#[derive(Debug, Clone, Default)]
pub struct CellTrack {
    policy: Reattach,
    session: Option<String>,
    cell: Option<u64>,
    started: bool,
    /// Characters delivered per stream: stdout, stderr.
    chars: [u64; 2],
    /// Characters of the replay still to drop per stream.
    skip: [u64; 2],
    displays: HashSet<u64>,
    /// A frame a re-attach read first (its `Attach` was accepted).
    pending: Option<Frame>,
    /// Re-attaches so far.
    reattached: u32,
    /// Whether the cell was started by `Execute` (a cell of a session that is not detached
    /// is not retained, so an `Attach` after the cut finds no cell: the cut is reported).
    executed: bool,
    /// The `Execute` to send again after a cut: session, code, token.
    repeat: Option<(String, String, String)>,
}

impl CellTrack {
    /// A follower of a cell started on this connection (`Execute`, `Submit` then `Attach`):
    /// the session and cell come from its `started` frame.
    pub fn new(policy: Reattach) -> CellTrack {
        CellTrack {
            policy,
            executed: true,
            ..CellTrack::default()
        }
    }

    /// A follower of an `Execute` of `code` in `session` sent with `token`
    /// ([`Client::execute_with_token`]): after a cut, even one before the `started` frame, the
    /// same call is sent again; the daemon follows the cell the first one started, or starts
    /// it if none did. On a session that is not detached the repeat finds no retained cell
    /// and the cut is reported.
    pub fn executing(policy: Reattach, session: &str, code: &str, token: &str) -> CellTrack {
        CellTrack {
            repeat: Some((session.to_owned(), code.to_owned(), token.to_owned())),
            ..CellTrack::new(policy)
        }
    }

    /// A follower of cell `cell` of `session` (`Attach`).
    pub fn attached(policy: Reattach, session: &str, cell: u64) -> CellTrack {
        CellTrack {
            policy,
            session: Some(session.to_owned()),
            cell: Some(cell),
            ..CellTrack::default()
        }
    }

    /// The followed cell's number, once known (from its `started` frame, or the one a repeat
    /// of a cell that never ran started).
    pub fn cell(&self) -> Option<u64> {
        self.cell
    }

    /// How many times the cell was followed again after a cut.
    pub fn reattached(&self) -> u32 {
        self.reattached
    }

    /// `f` without what was already delivered; `None` when nothing is left of it.
    fn filter(&mut self, mut f: Frame) -> Option<Frame> {
        if let Some(s) = &f.started {
            if self.started {
                // A repeat of a cell that never ran started it under a new number.
                self.cell = Some(s.cell);
                f.started = None;
            } else {
                self.started = true;
                self.session = Some(s.session.clone());
                self.cell = Some(s.cell);
            }
        }
        if let Some(mut o) = f.output.take() {
            let i = match o.stream {
                crate::k::Stream::Stdout => 0,
                crate::k::Stream::Stderr => 1,
            };
            let n = o.text.chars().count() as u64;
            let drop = self.skip[i].min(n);
            self.skip[i] -= drop;
            if drop < n {
                if drop > 0 {
                    o.text = o.text.chars().skip(drop as usize).collect();
                }
                self.chars[i] += n - drop;
                f.output = Some(o);
            }
        }
        if let Some(d) = f.display.take()
            && self.displays.insert(d.seq)
        {
            f.display = Some(d);
        }
        let empty = f.started.is_none()
            && f.output.is_none()
            && f.display.is_none()
            && f.host_call.is_none()
            && f.result.is_none();
        (!empty).then_some(f)
    }
}

/// Whether `e` says the daemon is not back yet (try again): the socket refused or missing,
/// the call cut again, `ShuttingDown`.
fn not_back(e: &Error) -> bool {
    matches!(
        e,
        Error::Connect { .. } | Error::Kernel(KernelError::ShuttingDown {})
    ) || e.is_call_cut()
}

impl Client {
    /// [`Client::next_frame`], following the cell again when a daemon restart cuts the call:
    /// on a cut ([`Error::is_call_cut`]) once the cell's number is known, it connects to the
    /// same socket and sends `Attach`, as `track`'s [`Reattach`] policy says, while the
    /// daemon is not back (connection refused or missing, cut again, `ShuttingDown`). On
    /// success this client is the new connection; the replay's frames already delivered are
    /// dropped (characters per stream, displays by number, `started` once).
    ///
    /// Errors: those of [`Client::next_frame`]; the cut itself when the attempts are spent,
    /// when the cell's number was not known yet, or when an `Execute` cell is not found after
    /// the cut (a session that is not detached: its cell was interrupted, the session kept);
    /// the typed error of a cell or session that really ended (`NoSuchCell` after
    /// `Attach`, `SessionEnded`, `NoSuchSession`) at once.
    pub async fn next_frame_following(&mut self, track: &mut CellTrack) -> Result<Frame, Error> {
        loop {
            let got = match track.pending.take() {
                Some(f) => Ok(f),
                None => self.next_frame().await,
            };
            match got {
                // A frame with a result is never dropped.
                Ok(f) => {
                    if let Some(f) = track.filter(f) {
                        return Ok(f);
                    }
                }
                Err(e) if e.is_call_cut() && (track.cell.is_some() || track.repeat.is_some()) => {
                    self.reattach(track, e).await?
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Follows the cell again on a new connection ([`Client::next_frame_following`]).
    async fn reattach(&mut self, track: &mut CellTrack, cut: Error) -> Result<(), Error> {
        let attach = track.session.clone().zip(track.cell);
        if attach.is_none() && track.repeat.is_none() {
            return Err(cut);
        }
        let mut delay = track.policy.first_delay;
        for _ in 0..track.policy.attempts {
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(track.policy.max_delay);
            let mut c = match Client::connect(&self.socket).await {
                Ok(c) => c,
                Err(e) if not_back(&e) => continue,
                Err(e) => return Err(e),
            };
            let sent = match (&track.repeat, &attach) {
                (Some((session, code, token)), _) => {
                    c.execute_with_token(session, code, Some(token)).await
                }
                (None, Some((session, cell))) => c.attach(session, *cell).await,
                (None, None) => return Err(cut),
            };
            match sent {
                Ok(()) => {}
                Err(e) if not_back(&e) => continue,
                Err(e) => return Err(e),
            }
            match c.next_frame().await {
                Ok(f) => {
                    *self = c;
                    track.skip = track.chars;
                    track.pending = Some(f);
                    track.reattached += 1;
                    return Ok(());
                }
                Err(e) if not_back(&e) => continue,
                Err(Error::Kernel(KernelError::NoSuchCell { .. })) if track.executed => {
                    return Err(cut);
                }
                Err(e) => return Err(e),
            }
        }
        Err(cut)
    }

    /// [`Client::finish`] across restarts ([`Client::next_frame_following`] with
    /// [`Reattach::default`]): reads frames until the result, calling `on_output` once for
    /// each output chunk.
    pub async fn finish_following(
        &mut self,
        track: &mut CellTrack,
        mut on_output: impl FnMut(&crate::Output),
    ) -> Result<crate::Collected, Error> {
        let mut c = crate::Collector::default();
        loop {
            let mut f = self.next_frame_following(track).await?;
            if let Some(done) = c.take(&mut f, &mut on_output) {
                return Ok(done);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::k;

    fn out(stream: k::Stream, seq: u64, text: &str) -> Frame {
        Frame {
            output: Some(k::Output {
                cell: 2,
                seq,
                stream,
                text: text.into(),
            }),
            ..Frame::default()
        }
    }

    /// The replay after a re-attach delivers only what was not delivered, whatever its chunks.
    #[test]
    fn the_replay_repeats_nothing() {
        let mut t = CellTrack::new(Reattach::default());
        let started = Frame {
            started: Some(k::Started {
                session: "s".into(),
                cell: 2,
            }),
            ..Frame::default()
        };
        assert!(t.filter(started.clone()).is_some());
        assert_eq!(t.cell, Some(2));
        for (i, s) in ["0\n", "1\n", "é2"].iter().enumerate() {
            assert!(t.filter(out(k::Stream::Stdout, i as u64, s)).is_some());
        }
        assert!(t.filter(out(k::Stream::Stderr, 3, "warn\n")).is_some());
        // Re-attached: the replay starts again, in other chunks.
        t.skip = t.chars;
        assert!(t.filter(started).is_none());
        assert!(t.filter(out(k::Stream::Stdout, 0, "0\n1\n")).is_none());
        let f = t.filter(out(k::Stream::Stdout, 1, "é2\n3\n")).unwrap();
        assert_eq!(f.output.unwrap().text, "\n3\n");
        assert!(t.filter(out(k::Stream::Stderr, 2, "warn\n")).is_none());
        let f = t.filter(out(k::Stream::Stderr, 4, "more\n")).unwrap();
        assert_eq!(f.output.unwrap().text, "more\n");
    }
}
