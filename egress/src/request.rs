//! The request head a cell sends the proxy, parsed with `httparse` and bounded.
//!
//! Two forms are served (RFC 9110 section 9.3.6 and RFC 9112 section 3.2.2): `CONNECT
//! host:port HTTP/1.1` (a tunnel, TLS not terminated: the decision is on the requested name)
//! and absolute-form plain HTTP (`GET http://host[:port]/path HTTP/1.1`). Any other method or
//! target form is refused.

/// Most bytes of a request head (request line and headers, through the blank line).
pub const MAX_HEAD: usize = 8 * 1024;
/// Most header fields in a head.
pub const MAX_HEADERS: usize = 64;

/// Why a request head is refused. The `Display` text is the one-line reason of the `4xx`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadRequest {
    /// No blank line within [`MAX_HEAD`] bytes.
    #[error("request head longer than {MAX_HEAD} bytes")]
    TooLong,
    /// Not HTTP/1.x, or more than [`MAX_HEADERS`] fields.
    #[error("malformed request: {0}")]
    Malformed(String),
    /// A method other than CONNECT with an origin-form target, or a scheme other than http.
    #[error("only CONNECT host:port and absolute http:// requests are proxied")]
    Form,
    /// The target names no valid host and port.
    #[error("bad target: {0}")]
    Target(String),
}

/// What a complete head asks for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// `CONNECT host:port`.
    Connect {
        /// Host as given (a name or an IP literal, brackets removed).
        host: String,
        /// Port.
        port: u16,
    },
    /// Absolute-form plain HTTP; the head is forwarded rewritten to origin form.
    Http {
        /// Host as given.
        host: String,
        /// Port (80 when absent).
        port: u16,
        /// The head to send to the origin: request line in origin form, the headers without
        /// hop-by-hop and proxy fields, `Connection: close`.
        head: Vec<u8>,
    },
}

/// Parses the head at the start of `buf`. `Ok(None)`: incomplete, read more (while
/// `buf.len() < MAX_HEAD`). `Ok(Some((target, n)))`: the head is `buf[..n]`.
///
/// Errors: [`BadRequest`].
pub fn parse(buf: &[u8]) -> Result<Option<(Target, usize)>, BadRequest> {
    let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut req = httparse::Request::new(&mut headers);
    let n = match req.parse(buf) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => {
            return if buf.len() >= MAX_HEAD {
                Err(BadRequest::TooLong)
            } else {
                Ok(None)
            };
        }
        Err(e) => return Err(BadRequest::Malformed(e.to_string())),
    };
    if n > MAX_HEAD {
        return Err(BadRequest::TooLong);
    }
    let method = req.method.unwrap_or_default();
    let path = req.path.unwrap_or_default();
    if method.eq_ignore_ascii_case("CONNECT") {
        let (host, port) = host_port(path, None)?;
        return Ok(Some((Target::Connect { host, port }, n)));
    }
    let Some(rest) = strip_prefix_ci(path, "http://") else {
        return Err(BadRequest::Form);
    };
    let (authority, origin) = match rest.find(['/', '?']) {
        Some(i) if rest.as_bytes()[i] == b'/' => (&rest[..i], &rest[i..]),
        Some(i) => (&rest[..i], &rest[i..]), // "?q" without a path: keep it after "/"
        None => (rest, "/"),
    };
    if authority.contains('@') {
        return Err(BadRequest::Target(
            "credentials in the URL are not proxied".into(),
        ));
    }
    let (host, port) = host_port(authority, Some(80))?;
    let origin = if origin.starts_with('?') {
        format!("/{origin}")
    } else {
        origin.to_string()
    };
    // The client's own version (httparse reads HTTP/1.0 and HTTP/1.1 only): an HTTP/1.0
    // client must not be answered with what only HTTP/1.1 has (a chunked body).
    let minor = req.version.unwrap_or(1);
    let mut head = format!("{method} {origin} HTTP/1.{minor}\r\n").into_bytes();
    let mut host_sent = false;
    for h in req.headers.iter() {
        let name = h.name.to_ascii_lowercase();
        if matches!(
            name.as_str(),
            "connection"
                | "proxy-connection"
                | "keep-alive"
                | "proxy-authorization"
                | "proxy-authenticate"
                | "te"
                | "trailer"
                | "upgrade"
        ) {
            continue;
        }
        if name == "host" {
            // The origin sees the host the decision was made on, never a different one.
            host_sent = true;
            head.extend_from_slice(format!("Host: {}\r\n", authority).as_bytes());
            continue;
        }
        head.extend_from_slice(h.name.as_bytes());
        head.extend_from_slice(b": ");
        head.extend_from_slice(h.value);
        head.extend_from_slice(b"\r\n");
    }
    if !host_sent {
        head.extend_from_slice(format!("Host: {authority}\r\n").as_bytes());
    }
    head.extend_from_slice(b"Connection: close\r\n\r\n");
    Ok(Some((Target::Http { host, port, head }, n)))
}

/// `s` without an ASCII `prefix` matched in any case. `None` also when `s` is shorter or its
/// first `prefix.len()` bytes end inside a multi-byte character (a target is the cell's
/// bytes: slicing there would panic).
fn strip_prefix_ci<'a>(s: &'a str, prefix: &str) -> Option<&'a str> {
    let head = s.get(..prefix.len())?;
    head.eq_ignore_ascii_case(prefix)
        .then(|| &s[prefix.len()..])
}

/// `host:port`, `[v6]:port`, or (with a default port) a bare host.
fn host_port(s: &str, default: Option<u16>) -> Result<(String, u16), BadRequest> {
    let bad = || BadRequest::Target(s.chars().take(80).collect());
    let (host, port) = if let Some(rest) = s.strip_prefix('[') {
        let end = rest.find(']').ok_or_else(bad)?;
        let after = &rest[end + 1..];
        let port = match after.strip_prefix(':') {
            Some(p) => Some(p),
            None if after.is_empty() => None,
            None => return Err(bad()),
        };
        (&rest[..end], port)
    } else {
        match s.rsplit_once(':') {
            Some((h, p)) => (h, Some(p)),
            None => (s, None),
        }
    };
    let port = match port {
        Some(p) if !p.is_empty() && p.len() <= 5 && p.bytes().all(|b| b.is_ascii_digit()) => {
            p.parse::<u16>().ok().filter(|p| *p != 0).ok_or_else(bad)?
        }
        Some(_) => return Err(bad()),
        None => default.ok_or_else(bad)?,
    };
    if host.is_empty() {
        return Err(bad());
    }
    Ok((host.to_string(), port))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Found by the `egress_request` fuzz target: a multi-byte character across the end of
    /// `http://` is a refusal, never a panic.
    #[test]
    fn a_character_across_the_scheme_is_refused() {
        let head = b"GET http:/\xd1\x97ast/ HTTP/1.1\r\nHost: a\r\n\r\n";
        assert!(
            matches!(parse(head), Err(BadRequest::Form)),
            "{:?}",
            parse(head)
        );
    }

    #[test]
    fn connect() {
        let (t, n) = parse(b"CONNECT pypi.org:443 HTTP/1.1\r\nHost: pypi.org:443\r\n\r\nxx")
            .unwrap()
            .unwrap();
        assert_eq!(
            t,
            Target::Connect {
                host: "pypi.org".into(),
                port: 443
            }
        );
        assert_eq!(n, 53);
        let (t, _) = parse(b"CONNECT [2001:db8::1]:443 HTTP/1.1\r\n\r\n")
            .unwrap()
            .unwrap();
        assert_eq!(
            t,
            Target::Connect {
                host: "2001:db8::1".into(),
                port: 443
            }
        );
        for bad in [
            "CONNECT pypi.org HTTP/1.1\r\n\r\n",
            "CONNECT pypi.org:0 HTTP/1.1\r\n\r\n",
            "CONNECT pypi.org:99999 HTTP/1.1\r\n\r\n",
            "CONNECT :443 HTTP/1.1\r\n\r\n",
            "CONNECT pypi.org:+443 HTTP/1.1\r\n\r\n",
        ] {
            assert!(
                matches!(parse(bad.as_bytes()), Err(BadRequest::Target(_))),
                "{bad}"
            );
        }
    }

    #[test]
    fn absolute_http_is_rewritten() {
        let req = b"GET http://Data.Example.org:8080/a/b?c=1 HTTP/1.1\r\nHost: evil.org\r\n\
            Proxy-Connection: keep-alive\r\nProxy-Authorization: x\r\nAccept: */*\r\n\r\n";
        let (t, _) = parse(req).unwrap().unwrap();
        let Target::Http { host, port, head } = t else {
            panic!()
        };
        assert_eq!((host.as_str(), port), ("Data.Example.org", 8080));
        let head = String::from_utf8(head).unwrap();
        assert_eq!(
            head,
            "GET /a/b?c=1 HTTP/1.1\r\nHost: Data.Example.org:8080\r\nAccept: */*\r\n\
             Connection: close\r\n\r\n"
        );
        let (t, _) = parse(b"GET http://example.org/ HTTP/1.0\r\n\r\n")
            .unwrap()
            .unwrap();
        let Target::Http { head, .. } = t else {
            panic!()
        };
        assert!(
            head.starts_with(b"GET / HTTP/1.0\r\n"),
            "the client's version is kept"
        );
        let (t, _) = parse(b"GET http://example.org HTTP/1.1\r\n\r\n")
            .unwrap()
            .unwrap();
        let Target::Http { port, head, .. } = t else {
            panic!()
        };
        assert_eq!(port, 80);
        assert!(head.starts_with(b"GET / HTTP/1.1\r\nHost: example.org\r\n"));
    }

    #[test]
    fn other_forms_refused() {
        assert_eq!(parse(b"GET /x HTTP/1.1\r\n\r\n"), Err(BadRequest::Form));
        assert_eq!(
            parse(b"GET https://x.org/ HTTP/1.1\r\n\r\n"),
            Err(BadRequest::Form)
        );
        assert!(matches!(
            parse(b"GET http://u:p@x.org/ HTTP/1.1\r\n\r\n"),
            Err(BadRequest::Target(_))
        ));
        assert!(matches!(
            parse(b"\x16\x03\x01\x02\x00"),
            Err(BadRequest::Malformed(_))
        ));
    }

    #[test]
    fn bounds() {
        assert_eq!(parse(b"CONNECT a.org:443 HTTP/1.1\r\nX: y\r\n"), Ok(None));
        let mut long = b"CONNECT a.org:443 HTTP/1.1\r\n".to_vec();
        while long.len() < MAX_HEAD {
            long.extend_from_slice(b"X-Pad: aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\r\n");
        }
        assert_eq!(
            parse(&long),
            Err(BadRequest::Malformed("too many headers".into()))
        );
        let mut one = b"CONNECT a.org:443 HTTP/1.1\r\nX-Pad: ".to_vec();
        one.resize(MAX_HEAD + 10, b'a');
        assert_eq!(parse(&one), Err(BadRequest::TooLong));
        let mut many = b"CONNECT a.org:443 HTTP/1.1\r\n".to_vec();
        for _ in 0..=MAX_HEADERS {
            many.extend_from_slice(b"A: b\r\n");
        }
        many.extend_from_slice(b"\r\n");
        assert!(matches!(parse(&many), Err(BadRequest::Malformed(_))));
    }
}
