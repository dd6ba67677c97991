//! sandcell-egress: the allowlisting proxy a session with egress reaches through the one
//! listener in its worker's network namespace.
//!
//! sandcelld (root, no network of its own) creates a TCP listener on `127.0.0.1` inside each
//! egress session's network namespace and hands its descriptor, with the session's policy as
//! one JSON line, over the control socket ([`control`]). This process (unprivileged, its own
//! unit) serves it ([`proxy`]): `CONNECT host:port` and absolute-form plain HTTP
//! ([`request`]), host names matched against the session's list ([`allow`]) before any
//! resolution, every resolved address checked against the refused classes ([`addr`]) before
//! connecting, caps on bytes, connections and time per session. A refusal is an HTTP answer
//! (`403` for policy) whose body is one line: `sandcell egress: REASON`.

pub mod addr;
pub mod allow;
pub mod control;
pub mod proxy;
pub mod request;
