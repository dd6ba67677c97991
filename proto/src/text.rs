//! Output bytes to UTF-8 text.
//!
//! Cells print arbitrary bytes; both wires carry JSON strings. Valid UTF-8 passes through
//! unchanged; every byte of an invalid sequence becomes the four characters `\xNN` (so the
//! text stays printable and the original bytes can be told apart from a U+FFFD the cell printed
//! itself). Byte counts reported to clients (`seen`, `kept`) are always counts of the original
//! bytes, never of the escaped text.

/// Converts `bytes` to text, escaping each byte of an invalid UTF-8 sequence as `\xNN`.
///
/// A valid multi-byte sequence cut at the end of `bytes` is escaped too; callers that split a
/// stream into chunks use [`split_incomplete_tail`] first so that a character is never split.
pub fn escape_lossy(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len());
    for chunk in bytes.utf8_chunks() {
        out.push_str(chunk.valid());
        for b in chunk.invalid() {
            out.push_str(&format!("\\x{b:02x}"));
        }
    }
    out
}

/// Splits `bytes` into (complete part, trailing bytes of an unfinished UTF-8 character).
///
/// The tail is at most 3 bytes long and is non-empty only when those bytes are a valid prefix
/// of a multi-byte character; a stream reader keeps it and prepends it to the next chunk.
pub fn split_incomplete_tail(bytes: &[u8]) -> (&[u8], &[u8]) {
    let n = bytes.len();
    // A UTF-8 character is at most 4 bytes: look back at most 3 bytes for a lead byte.
    for back in 1..=3.min(n) {
        let b = bytes[n - back];
        if b & 0b1100_0000 == 0b1000_0000 {
            continue; // continuation byte: keep looking for the lead byte
        }
        let need = match b {
            0xc2..=0xdf => 2,
            0xe0..=0xef => 3,
            0xf0..=0xf4 => 4,
            _ => return (bytes, &[]),
        };
        if need > back && std::str::from_utf8(&bytes[n - back..]).is_err() {
            return bytes.split_at(n - back);
        }
        return (bytes, &[]);
    }
    (bytes, &[])
}

/// Whether `c` is an invisible formatting character, one that makes text display differently
/// from what it is: the Unicode bidirectional controls (U+061C, U+200E-U+200F, U+202A-U+202E,
/// U+2066-U+2069, the "Trojan Source" characters of CVE-2021-42574), zero-width characters
/// (U+200B-U+200D, U+2060-U+2065) and the byte order mark (U+FEFF).
///
/// The daemon refuses such characters in names a client creates; `sandcellctl` escapes them
/// wherever it prints a name a cell chose.
pub fn is_invisible_format(c: char) -> bool {
    matches!(c, '\u{061c}' | '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2060}'..='\u{2069}' | '\u{feff}')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn valid_text_is_unchanged() {
        assert_eq!(escape_lossy("héllo ✓".as_bytes()), "héllo ✓");
    }

    #[test]
    fn invalid_bytes_are_escaped_one_by_one() {
        assert_eq!(escape_lossy(b"a\xffb\xc3"), "a\\xffb\\xc3");
    }

    #[test]
    fn unfinished_character_is_split_off() {
        let s = "a✓".as_bytes(); // ✓ is 3 bytes
        assert_eq!(split_incomplete_tail(&s[..3]), (&s[..1], &s[1..3]));
        assert_eq!(split_incomplete_tail(s), (s, &[][..]));
        assert_eq!(split_incomplete_tail(b"ab\xff"), (&b"ab\xff"[..], &[][..]));
    }

    #[test]
    fn invisible_formatting_characters_are_named() {
        for c in [
            '\u{061c}', '\u{200b}', '\u{200e}', '\u{202e}', '\u{2066}', '\u{feff}',
        ] {
            assert!(is_invisible_format(c), "{c:?}");
        }
        for c in ['a', 'é', '✓', '\u{00a0}', '\u{2070}'] {
            assert!(!is_invisible_format(c), "{c:?}");
        }
    }
}
