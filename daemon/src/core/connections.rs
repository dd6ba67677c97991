//! The connection caps and the room they keep for others.
//!
//! `daemon.max_connections` (M) bounds the client connections open at once and
//! `daemon.max_connections_per_uid` (P) those of one uid. Without more, M / P uids that each
//! fill their share lock everyone out, root included, until `connection_idle_seconds` passes.
//! So M is split into three tiers ([`Shares`]):
//!
//! - root's reserve, `min(8, M / 8)` connections, which only uid 0 may take;
//! - the shared reserve, `M / 4`, which a uid may take only while it holds fewer than
//!   `min(P, max(1, M / 64))` connections (its share of the reserve);
//! - the general room, the rest: any uid up to P.
//!
//! With the shipped M = 1024 and P = 256: root's reserve 8, shared reserve 256 at 16 per uid,
//! general room 760. Three uids at their cap fill the general room; a fourth, fresh uid
//! still gets 16 connections, and the reserve holds 16 such uids before it is full; root
//! gets in while fewer than M connections are open. A refused connection is answered
//! `CapacityExceeded` on its first call (varlink/mod.rs), then closed.

use super::{ConnectionGuard, Core};
use std::sync::atomic::Ordering;

/// How `max_connections` (M) is split, connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shares {
    /// Open to every uid up to its `max_connections_per_uid`: M - reserve - root_reserve.
    pub general: u64,
    /// Open to a uid that holds fewer than `reserve_per_uid`: M / 4.
    pub reserve: u64,
    /// A uid's share of the shared reserve: min(P, max(1, M / 64)).
    pub reserve_per_uid: u64,
    /// Open to root only: min(8, M / 8).
    pub root_reserve: u64,
}

impl Shares {
    /// The split of `max_connections` given `max_connections_per_uid`.
    pub fn of(max_connections: u64, max_connections_per_uid: u64) -> Shares {
        let m = max_connections;
        let root_reserve = (m / 8).min(8);
        let reserve = m / 4;
        Shares {
            general: m - reserve - root_reserve,
            reserve,
            reserve_per_uid: (m / 64).max(1).min(max_connections_per_uid),
            root_reserve,
        }
    }
}

/// A connection refused by a cap: the budget (`max_connections`, `max_connections_per_uid`
/// or `connections_reserved`), its use and its size, as `CapacityExceeded` names them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectionRefused {
    /// The budget's name.
    pub budget: &'static str,
    /// Connections held (daemon-wide for `max_connections`, the uid's otherwise).
    pub in_use: u64,
    /// The budget's size.
    pub max: u64,
}

/// Whether a connection of `uid`, which holds `mine` of the `total` open, fits the caps
/// (`m`, `p`): `Err` names the budget that refuses it.
pub fn admit(uid: u32, mine: u64, total: u64, m: u64, p: u64) -> Result<(), ConnectionRefused> {
    let s = Shares::of(m, p);
    let refused = |budget, in_use, max| {
        Err(ConnectionRefused {
            budget,
            in_use,
            max,
        })
    };
    if total >= m {
        return refused("max_connections", total, m);
    }
    if mine >= p {
        return refused("max_connections_per_uid", mine, p);
    }
    if uid == 0 {
        return Ok(());
    }
    if total >= m - s.root_reserve {
        // Only root's reserve is left.
        return refused("max_connections", total, m);
    }
    if total >= s.general && mine >= s.reserve_per_uid {
        return refused("connections_reserved", mine, s.reserve_per_uid);
    }
    Ok(())
}

impl Core {
    /// Registers a new client connection of `uid` (process `pid`), or refuses it (logged with
    /// the uid, at most a few lines per uid) by the rule of [`admit`].
    pub fn connection_opened(
        &self,
        uid: u32,
        pid: u32,
    ) -> Result<ConnectionGuard, ConnectionRefused> {
        self.connection_opened_as(uid, pid, None)
    }

    /// Keeps connection ids `1..=last` from the ids the core gives out (they were given before
    /// the core existed, `varlink::early`): later connections are numbered after `last`.
    pub fn reserve_connection_ids(&self, last: u64) {
        self.next_connection.fetch_max(last + 1, Ordering::SeqCst);
    }

    /// [`Core::connection_opened`] for a connection numbered `id` before the core existed
    /// (`varlink::early`: ids from 1, in accept order, reserved first with
    /// [`Core::reserve_connection_ids`]), or numbered now (`None`).
    pub fn connection_opened_as(
        &self,
        uid: u32,
        pid: u32,
        id: Option<u64>,
    ) -> Result<ConnectionGuard, ConnectionRefused> {
        if let Some(id) = id {
            self.reserve_connection_ids(id);
        }
        let cfg = self.config();
        let mut per_uid = self.connections_per_uid.lock().unwrap();
        let total = self.connections.load(Ordering::SeqCst);
        let mine = per_uid.get(&uid).copied().unwrap_or(0);
        if let Err(r) = admit(
            uid,
            mine,
            total,
            cfg.daemon.max_connections,
            cfg.daemon.max_connections_per_uid,
        ) {
            drop(per_uid);
            if let Some(held_back) = self.refusal_log.admit(uid) {
                tracing::warn!(
                    uid,
                    pid,
                    budget = r.budget,
                    in_use = r.in_use,
                    max = r.max,
                    held_back,
                    "connection refused: capacity exceeded"
                );
            }
            return Err(r);
        }
        *per_uid.entry(uid).or_default() += 1;
        self.connections.fetch_add(1, Ordering::SeqCst);
        let id = id.unwrap_or_else(|| self.next_connection.fetch_add(1, Ordering::SeqCst));
        Ok(ConnectionGuard { id, uid })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_caps_split_as_documented() {
        assert_eq!(
            Shares::of(1024, 256),
            Shares {
                general: 760,
                reserve: 256,
                reserve_per_uid: 16,
                root_reserve: 8
            }
        );
    }

    /// Fills the caps the way three hostile uids would and checks who still gets in.
    #[test]
    fn uids_at_their_cap_leave_room_for_a_fresh_uid_and_root() {
        let (m, p) = (1024, 256);
        let mut held: std::collections::HashMap<u32, u64> = Default::default();
        let mut total = 0;
        let mut connect = |uid: u32, held: &mut std::collections::HashMap<u32, u64>| {
            let mine = held.get(&uid).copied().unwrap_or(0);
            let r = admit(uid, mine, total, m, p);
            if r.is_ok() {
                *held.entry(uid).or_default() += 1;
                total += 1;
            }
            r
        };
        for uid in [1001, 1002, 1003, 1004] {
            while connect(uid, &mut held).is_ok() {}
        }
        assert_eq!(held[&1001], 256);
        assert_eq!(held[&1002], 256);
        // The third fills the general room; the fourth, fresh, takes its reserve share.
        assert_eq!(held[&1003], 760 - 512);
        assert_eq!(held[&1004], 16);
        let e = connect(1004, &mut held).unwrap_err();
        assert_eq!(
            (e.budget, e.in_use, e.max),
            ("connections_reserved", 16, 16)
        );
        assert!(connect(1005, &mut held).is_ok());
        assert!(connect(0, &mut held).is_ok());
        // Sixteen uids' shares fill the reserve; then only root gets in, up to M.
        for uid in 2000..2020 {
            while connect(uid, &mut held).is_ok() {}
        }
        assert_eq!(
            connect(3000, &mut held).unwrap_err().budget,
            "max_connections"
        );
        while connect(0, &mut held).is_ok() {}
        assert_eq!(held.values().sum::<u64>(), 1024);
    }

    #[test]
    fn small_caps_still_keep_room() {
        // max_connections 32, per uid 16: general 20, reserve 8 at 1 per uid, root 4.
        let s = Shares::of(32, 16);
        assert_eq!(
            (s.general, s.reserve, s.reserve_per_uid, s.root_reserve),
            (20, 8, 1, 4)
        );
        assert!(admit(7, 0, 20, 32, 16).is_ok());
        assert_eq!(
            admit(7, 1, 20, 32, 16).unwrap_err().budget,
            "connections_reserved"
        );
        assert_eq!(
            admit(7, 0, 28, 32, 16).unwrap_err().budget,
            "max_connections"
        );
        assert!(admit(0, 0, 31, 32, 16).is_ok());
        assert_eq!(
            admit(0, 0, 32, 32, 16).unwrap_err().budget,
            "max_connections"
        );
        // A cap of 1 leaves no reserve at all: the first comer takes it.
        assert!(admit(7, 0, 0, 1, 1).is_ok());
    }
}
