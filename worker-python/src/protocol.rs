//! Reading requests from the request pipe (fd 3), as `sandcell_proto::worker` defines them.

use std::io::{self, BufRead};

use sandcell_proto::worker::{MAX_HEADER_LINE, Op, RequestHeader};

/// Largest payload (cell source) the worker accepts, in bytes. The daemon bounds sources far
/// below this; a larger `len` is treated as a malformed request.
pub const MAX_PAYLOAD: u64 = 64 * 1024 * 1024;

/// One request.
#[derive(Debug, PartialEq, Eq)]
pub enum Request {
    /// Run `source` as a cell.
    Exec {
        /// The parsed header.
        header: RequestHeader,
        /// Exactly `header.len` payload bytes.
        source: Vec<u8>,
    },
    /// Finish.
    Exit,
    /// List the user's variables (`max_items`, `timeout_ms` of the header).
    Inspect {
        /// The parsed header.
        header: RequestHeader,
    },
    /// A `complete` or `help` (`header.op`) of `code` (see `sandcell_proto::query`).
    Query {
        /// The parsed header.
        header: RequestHeader,
        /// Exactly `header.len` payload bytes.
        code: Vec<u8>,
    },
}

/// Why no request could be read.
#[derive(Debug)]
pub enum ReadError {
    /// End of file before the first byte of a header: the daemon closed the pipe.
    Eof,
    /// The bytes are not a request (bad header, over-long line, short payload, payload over
    /// [`MAX_PAYLOAD`]); the worker writes nothing and exits with status 2.
    Malformed(String),
    /// Reading failed.
    Io(io::Error),
}

/// Reads the header line: at most [`MAX_HEADER_LINE`] bytes before the newline.
fn read_header<R: BufRead>(r: &mut R) -> Result<String, ReadError> {
    let mut line = Vec::with_capacity(64);
    loop {
        let buf = match r.fill_buf() {
            Ok(b) => b,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(ReadError::Io(e)),
        };
        if buf.is_empty() {
            return Err(if line.is_empty() {
                ReadError::Eof
            } else {
                ReadError::Malformed("end of file inside a header".into())
            });
        }
        if let Some(pos) = buf.iter().position(|&b| b == b'\n') {
            if line.len() + pos > MAX_HEADER_LINE {
                return Err(ReadError::Malformed("header line too long".into()));
            }
            line.extend_from_slice(&buf[..pos]);
            r.consume(pos + 1);
            break;
        }
        let n = buf.len();
        if line.len() + n > MAX_HEADER_LINE {
            return Err(ReadError::Malformed("header line too long".into()));
        }
        line.extend_from_slice(buf);
        r.consume(n);
    }
    String::from_utf8(line).map_err(|_| ReadError::Malformed("header is not UTF-8".into()))
}

/// Reads exactly `len` bytes.
fn read_payload<R: BufRead>(r: &mut R, len: u64) -> Result<Vec<u8>, ReadError> {
    if len > MAX_PAYLOAD {
        return Err(ReadError::Malformed(format!(
            "payload of {len} bytes exceeds {MAX_PAYLOAD}"
        )));
    }
    let mut payload = vec![0; len as usize];
    r.read_exact(&mut payload).map_err(|e| {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            ReadError::Malformed("end of file inside a payload".into())
        } else {
            ReadError::Io(e)
        }
    })?;
    Ok(payload)
}

/// Reads the next request.
///
/// Errors: see [`ReadError`].
/// A `host_reply` between requests answers a host call the worker no longer waits for, and a
/// `displayed` is never meant for this worker: both are skipped.
pub fn read_request<R: BufRead>(r: &mut R) -> Result<Request, ReadError> {
    loop {
        let line = read_header(r)?;
        let header = RequestHeader::parse(&line).map_err(ReadError::Malformed)?;
        let payload = read_payload(r, header.len)?;
        return match header.op {
            Op::Exec => Ok(Request::Exec {
                header,
                source: payload,
            }),
            Op::Exit => Ok(Request::Exit),
            Op::Inspect => Ok(Request::Inspect { header }),
            Op::Complete | Op::Help => Ok(Request::Query {
                header,
                code: payload,
            }),
            // Neither is sent to this worker between cells; skipped as stale if one is.
            Op::HostReply | Op::Displayed => continue,
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(bytes: &[u8]) -> Result<Request, ReadError> {
        read_request(&mut io::BufReader::new(bytes))
    }

    #[test]
    fn reads_exec_with_options() {
        let r = read(b"exec 7 9 timeout_ms=100 fuel=5 max_output=10\nprint(1)\n").unwrap();
        let Request::Exec { header, source } = r else {
            panic!("not exec")
        };
        assert_eq!(
            (
                header.cell,
                header.timeout_ms,
                header.fuel,
                header.max_output
            ),
            (7, Some(100), Some(5), Some(10))
        );
        assert_eq!(source, b"print(1)\n");
    }

    #[test]
    fn eof_and_malformed_are_told_apart() {
        assert!(matches!(read(b""), Err(ReadError::Eof)));
        assert!(matches!(read(b"exec 1"), Err(ReadError::Malformed(_))));
        assert!(matches!(
            read(b"exec 1 5\nab"),
            Err(ReadError::Malformed(_))
        ));
        assert!(matches!(read(b"bogus 1 0\n"), Err(ReadError::Malformed(_))));
        let long = format!("exec 1 0 {}\n", "x".repeat(MAX_HEADER_LINE));
        assert!(matches!(
            read(long.as_bytes()),
            Err(ReadError::Malformed(_))
        ));
        assert!(matches!(
            read(b"exec 1 99999999999\n"),
            Err(ReadError::Malformed(_))
        ));
    }

    #[test]
    fn exit_is_read() {
        assert_eq!(read(b"exit 0 0\n").unwrap(), Request::Exit);
    }
}
