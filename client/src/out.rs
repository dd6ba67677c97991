//! What sandcellctl writes: [`outln!`] and [`errln!`] (lines that never panic on a closed
//! pipe), JSON values on standard output, and the escaping of text a cell or the daemon chose
//! ([`for_terminal`] for a cell's own streams, [`escape_message`] for sandcellctl's messages,
//! [`escape_name`] for names on one line).

use std::borrow::Cow;

/// `println!` that never panics: when standard output is a closed pipe (`sandcellctl
/// environments --packages | head`), sandcellctl ends quietly with status 0 (the reader took
/// what it wanted); another write error is reported and ends it with status 2.
macro_rules! outln {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        if let Err(e) = writeln!(std::io::stdout(), $($t)*) {
            $crate::out::output_failed(e)
        }
    }};
}

/// `eprintln!` that never panics (a closed standard error is ignored).
macro_rules! errln {
    ($($t:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr(), $($t)*);
    }};
}

/// Ends sandcellctl after a failed write to standard output: quietly (status 0) for a closed
/// pipe, else with a message (status 2).
pub fn output_failed(e: std::io::Error) -> ! {
    if e.kind() != std::io::ErrorKind::BrokenPipe {
        errln!("sandcellctl: writing to standard output: {e}");
        std::process::exit(2);
    }
    std::process::exit(0);
}

/// Prints `value` as one line of JSON on standard output (`--json`).
pub fn json(value: &impl serde::Serialize) {
    outln!(
        "{}",
        serde_json::to_string(value).expect("plain data serialises")
    );
}

/// Output of untrusted cells, made safe for a terminal: control characters other than newline
/// and tab (escape sequences could retitle or clear the terminal, or worse) are shown as
/// `\xNN` / `\u{NNNN}`. Unchanged when the stream is not a terminal (pipes get exact text).
pub fn for_terminal(text: &str, tty: bool) -> Cow<'_, str> {
    let bad = |c: char| c.is_control() && c != '\n' && c != '\t';
    if !tty || !text.chars().any(bad) {
        return Cow::Borrowed(text);
    }
    let mut s = String::with_capacity(text.len() + 16);
    for c in text.chars() {
        if !bad(c) {
            s.push(c);
        } else if (c as u32) < 0x80 {
            s.push_str(&format!("\\x{:02x}", c as u32));
        } else {
            s.push_str(&format!("\\u{{{:04x}}}", c as u32));
        }
    }
    Cow::Owned(s)
}

/// A message of sandcellctl's own that carries text from the daemon or a cell: control
/// characters other than newline and tab shown as `\xNN` / `\u{NNNN}`, on a terminal or not.
pub fn escape_message(text: &str) -> String {
    for_terminal(text, true).into_owned()
}

/// A name a cell chose (a file name, a path under DIR), printable on one line whether or not
/// the stream is a terminal: every control character (tab and newline too) and every
/// invisible formatting character as `\xNN` / `\u{NNNN}`, and `\` as `\\`.
pub fn escape_name(name: &str) -> String {
    let mut s = String::with_capacity(name.len());
    for c in name.chars() {
        if c == '\\' {
            s.push_str("\\\\");
        } else if c.is_control() && (c as u32) < 0x80 {
            s.push_str(&format!("\\x{:02x}", c as u32));
        } else if c.is_control() || sandcell_proto::text::is_invisible_format(c) {
            s.push_str(&format!("\\u{{{:04x}}}", c as u32));
        } else {
            s.push(c);
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::{escape_name, for_terminal};

    #[test]
    fn names_print_on_one_line() {
        assert_eq!(escape_name("a\tb\nc"), "a\\x09b\\x0ac");
        assert_eq!(escape_name("a\\b"), "a\\\\b");
        assert_eq!(escape_name("\u{202e}x"), "\\u{202e}x");
        assert_eq!(escape_name("plain.png"), "plain.png");
    }

    #[test]
    fn control_characters_are_shown_not_obeyed() {
        assert_eq!(
            for_terminal("a\x1b]0;pwned\x07b\n", true),
            "a\\x1b]0;pwned\\x07b\n"
        );
        assert_eq!(for_terminal("a\x1b[2J", false), "a\x1b[2J");
        assert_eq!(for_terminal("tab\tok\n", true), "tab\tok\n");
    }
}
