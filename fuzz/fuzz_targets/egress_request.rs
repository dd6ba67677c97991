//! The egress proxy's request-head parser (`sandcell_egress::request::parse`), the first code
//! that reads a hostile cell's bytes. Checked: it never panics; a complete head is at most
//! `MAX_HEAD` bytes and within the input; a head is never accepted from a prefix that lacks
//! its blank line; a CONNECT target has a port, an absolute-form target's forwarded head is
//! in origin form (starts with the method and `/`), ends with the blank line and carries
//! `Connection: close`; a host is never empty, and an absolute-form host has no `/`, `?` or
//! `@` (credentials are refused). Host names are checked later, against the allowlist.
#![no_main]

use libfuzzer_sys::fuzz_target;
use sandcell_egress::request::{MAX_HEAD, Target, parse};

fuzz_target!(|data: &[u8]| {
    match parse(data) {
        Ok(None) => {}
        Ok(Some((target, n))) => {
            assert!(n <= data.len() && n <= MAX_HEAD, "head of {n} bytes");
            assert!(
                data[..n].ends_with(b"\n"),
                "a head ends with its blank line"
            );
            let host = match &target {
                Target::Connect { host, port } => {
                    assert!(*port != 0);
                    host
                }
                Target::Http { host, head, .. } => {
                    let line = head.split(|b| *b == b'\n').next().unwrap_or(&[]);
                    let mut words = line.split(|b| *b == b' ');
                    let _method = words.next();
                    let path = words.next().unwrap_or(&[]);
                    assert!(
                        path.starts_with(b"/"),
                        "origin form: {:?}",
                        String::from_utf8_lossy(line)
                    );
                    assert!(head.ends_with(b"\r\n\r\n"));
                    let text = String::from_utf8_lossy(head).to_ascii_lowercase();
                    assert!(text.contains("\r\nconnection: close\r\n"));
                    assert!(!host.contains(['/', '?', '@']), "host {host:?}");
                    host
                }
            };
            assert!(!host.is_empty());
            // The same head with its tail cut off is incomplete or refused, never accepted.
            if n > 0 {
                assert!(!matches!(parse(&data[..n - 1]), Ok(Some(_))));
            }
        }
        Err(e) => {
            let _ = e.to_string();
        }
    }
});
