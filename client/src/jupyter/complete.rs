//! `is_complete_request`, decided locally (no session, no cell): whether a console should
//! run the code it has or wait for more lines
//! (<https://jupyter-client.readthedocs.io/en/stable/messaging.html#code-completeness>).
//!
//! Both languages are judged by a scanner over the code's tokens, not the interpreter's
//! parser (the kernel runs no interpreter of its own, and the session's interpreter may be
//! busy with a cell): a bracket, triple-quoted string or block left open, a trailing
//! backslash or (R) a trailing binary operator makes the code `incomplete`; a closing
//! bracket without its opening one, a string left open at the end of a line (Python), two
//! binary operators in a row, a malformed number (`7q`) or `import` followed by an
//! operator makes it `invalid`. When unsure the answer is `complete`: the cell then runs and
//! the interpreter reports the real syntax error. Python follows `codeop` and IPython's
//! rule that an indented last line keeps a block open until a blank line.

use serde_json::{Value, json};

/// The `is_complete_reply` content for `code` in `language` (`python` or `r`).
pub fn is_complete(language: &str, code: &str) -> Value {
    let (status, indent) = if language == "r" {
        r_is_complete(code)
    } else {
        python_is_complete(code)
    };
    match indent {
        Some(i) => json!({"status": status, "indent": i}),
        None => json!({"status": status}),
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Tok<'a> {
    Name(&'a str),
    Number,
    BadNumber,
    Str,
    Op(&'a str),
    Open(u8),
    Close,
    Newline,
}

/// Operators that take a left operand (cannot follow another operator).
fn binary_only(op: &str) -> bool {
    !matches!(op, "+" | "-" | "~" | "*" | "**" | "." | "...")
}

fn leading_indent(line: &str) -> String {
    line.chars()
        .take_while(|c| *c == ' ' || *c == '\t')
        .collect()
}

fn valid_number(t: &str) -> bool {
    let t = t.replace('_', "");
    let l = t.to_ascii_lowercase();
    if let Some(h) = l.strip_prefix("0x") {
        return !h.is_empty() && h.chars().all(|c| c.is_ascii_hexdigit());
    }
    if let Some(o) = l.strip_prefix("0o") {
        return !o.is_empty() && o.chars().all(|c| ('0'..='7').contains(&c));
    }
    if let Some(b) = l.strip_prefix("0b") {
        return !b.is_empty() && b.chars().all(|c| c == '0' || c == '1');
    }
    let l = l.strip_suffix('j').unwrap_or(&l);
    let (mant, exp) = match l.split_once('e') {
        Some((m, e)) => (m, Some(e.trim_start_matches(['+', '-']))),
        None => (l, None),
    };
    let mant_ok = !mant.is_empty()
        && mant != "."
        && mant.chars().filter(|c| *c == '.').count() <= 1
        && mant.chars().all(|c| c.is_ascii_digit() || c == '.');
    mant_ok && exp.is_none_or(|e| !e.is_empty() && e.chars().all(|c| c.is_ascii_digit()))
}

/// Python: `(status, indent)`.
fn python_is_complete(code: &str) -> (&'static str, Option<String>) {
    let b = code.as_bytes();
    let mut toks: Vec<Tok> = Vec::new();
    let mut stack: Vec<u8> = Vec::new();
    let mut i = 0;
    let mut continued = false;
    // Brackets open where the last line starts (an indented line inside brackets does not
    // open a block).
    let mut depth_at_line = 0;
    while i < b.len() {
        let c = b[i];
        continued = false;
        match c {
            b'#' => {
                while i < b.len() && b[i] != b'\n' {
                    i += 1;
                }
                continue;
            }
            b'\\' if b.get(i + 1) == Some(&b'\n') || i + 1 == b.len() => {
                continued = true;
                i += 2;
                continue;
            }
            b'\n' => {
                depth_at_line = stack.len();
                if stack.is_empty() {
                    toks.push(Tok::Newline);
                }
            }
            b' ' | b'\t' | b'\r' | b'\x0c' => {}
            b'\'' | b'"' => {
                let triple = b.get(i + 1) == Some(&c) && b.get(i + 2) == Some(&c);
                let q = if triple { 3 } else { 1 };
                let mut j = i + q;
                let mut closed = false;
                while j < b.len() {
                    if b[j] == b'\\' {
                        j += 2;
                        continue;
                    }
                    if !triple && b[j] == b'\n' {
                        return ("invalid", None);
                    }
                    if b[j] == c
                        && (!triple || (b.get(j + 1) == Some(&c) && b.get(j + 2) == Some(&c)))
                    {
                        closed = true;
                        j += q;
                        break;
                    }
                    j += 1;
                }
                if !closed {
                    if triple {
                        return ("incomplete", Some(String::new()));
                    }
                    return ("invalid", None);
                }
                // A string prefix (r, b, f, u, rb, ...) was taken as a name: drop it.
                if let Some(Tok::Name(n)) = toks.last()
                    && n.len() <= 2
                    && n.chars().all(|c| "rRbBuUfF".contains(c))
                {
                    // An f-string whose replacement field is left open (`f'{x'`) cannot
                    // be completed by more lines. A brace inside a nested string may
                    // close more than it opens: then it is not judged.
                    if n.contains(['f', 'F']) && fstring_left_open(&b[i + q..j - q]) {
                        return ("invalid", None);
                    }
                    toks.pop();
                }
                toks.push(Tok::Str);
                i = j;
                continue;
            }
            b'(' | b'[' | b'{' => {
                stack.push(c);
                toks.push(Tok::Open(c));
            }
            b')' | b']' | b'}' => {
                let want = match c {
                    b')' => b'(',
                    b']' => b'[',
                    _ => b'{',
                };
                if stack.pop() != Some(want) {
                    return ("invalid", None);
                }
                toks.push(Tok::Close);
            }
            b'0'..=b'9' => {
                let mut j = i;
                while j < b.len()
                    && (b[j].is_ascii_alphanumeric()
                        || b[j] == b'_'
                        || b[j] == b'.'
                        || ((b[j] == b'+' || b[j] == b'-')
                            && matches!(b[j - 1], b'e' | b'E')
                            && !code[i..j].to_ascii_lowercase().starts_with("0x")))
                {
                    j += 1;
                }
                toks.push(if valid_number(&code[i..j]) {
                    Tok::Number
                } else {
                    Tok::BadNumber
                });
                i = j;
                continue;
            }
            _ if c.is_ascii_alphabetic() || c == b'_' || c >= 0x80 => {
                let mut j = i;
                while j < b.len() && (b[j].is_ascii_alphanumeric() || b[j] == b'_' || b[j] >= 0x80)
                {
                    j += 1;
                }
                toks.push(Tok::Name(&code[i..j]));
                i = j;
                continue;
            }
            b'.' if b.get(i + 1).is_some_and(u8::is_ascii_digit) => {
                let mut j = i + 1;
                while j < b.len() && (b[j].is_ascii_alphanumeric() || b[j] == b'_') {
                    j += 1;
                }
                toks.push(if valid_number(&code[i..j]) {
                    Tok::Number
                } else {
                    Tok::BadNumber
                });
                i = j;
                continue;
            }
            _ => {
                const OPS: [&str; 42] = [
                    "**=", "//=", ">>=", "<<=", "...", "**", "//", "==", "!=", "<=", ">=", "<<",
                    ">>", "+=", "-=", "*=", "/=", "%=", "&=", "|=", "^=", "@=", "->", ":=", "+",
                    "-", "*", "/", "%", "@", "<", ">", "=", "|", "&", "^", "~", ".", ",", ":", ";",
                    "!",
                ];
                let op = OPS
                    .iter()
                    .find(|o| code[i..].starts_with(**o))
                    .copied()
                    .unwrap_or("?");
                toks.push(Tok::Op(op));
                i += op.len().max(1);
                continue;
            }
        }
        i += 1;
    }
    // Token rules that make the code invalid.
    let mut prev: Option<Tok> = None;
    for t in &toks {
        match (prev, *t) {
            (_, Tok::BadNumber) => return ("invalid", None),
            (Some(Tok::Op(a)), Tok::Op(b))
                if !matches!(a, "," | ":" | ";" | "=" | "->" | ":=" | "." | "...")
                    && (binary_only(b) || b == "*" || b == "**")
                    && !matches!(b, "," | ":" | ";") =>
            {
                return ("invalid", None);
            }
            (None | Some(Tok::Newline | Tok::Open(_)), Tok::Op(b))
                if binary_only(b) && b != "..." && b != "@" =>
            {
                return ("invalid", None);
            }
            (Some(Tok::Name("import" | "def" | "class")), Tok::Op(b)) if b != "." => {
                return ("invalid", None);
            }
            (Some(Tok::Number | Tok::Str | Tok::Close), Tok::Number) => return ("invalid", None),
            _ => {}
        }
        prev = Some(*t);
    }
    if !stack.is_empty() || continued {
        let last = code.rsplit('\n').next().unwrap_or("");
        return ("incomplete", Some(leading_indent(last)));
    }
    let trimmed = code.trim_end_matches('\n');
    let lines: Vec<&str> = trimmed.split('\n').collect();
    let last = lines.last().copied().unwrap_or("");
    let last_code = last.split('#').next().unwrap_or("").trim_end();
    if let Some(Tok::Op(o)) = toks.iter().rev().find(|t| **t != Tok::Newline)
        && !matches!(*o, ":" | "," | ";" | "...")
    {
        return ("invalid", None);
    }
    if last_code.ends_with(':') {
        return ("incomplete", Some(leading_indent(last) + "    "));
    }
    // A decorator waits for the definition it decorates (`@` cannot start an expression).
    if last_code.trim_start().starts_with('@') {
        return ("incomplete", Some(leading_indent(last)));
    }
    if lines.len() > 1
        && depth_at_line == 0
        && last.starts_with([' ', '\t'])
        && !code.ends_with("\n\n")
    {
        return ("incomplete", Some(leading_indent(last)));
    }
    ("complete", None)
}

/// Whether the text of an f-string opens a replacement field it does not close: `{{` and
/// `}}` are literal braces; a `}` with no field open means a nested string held a brace, and
/// the string is not judged (false).
fn fstring_left_open(body: &[u8]) -> bool {
    let mut open = 0usize;
    let mut k = 0;
    while k < body.len() {
        match body[k] {
            b'{' if open == 0 && body.get(k + 1) == Some(&b'{') => k += 1,
            b'}' if open == 0 && body.get(k + 1) == Some(&b'}') => k += 1,
            b'{' => open += 1,
            b'}' if open == 0 => return false,
            b'}' => open -= 1,
            _ => {}
        }
        k += 1;
    }
    open > 0
}

/// R: `(status, indent)`: brackets and strings left open or a trailing binary operator make
/// it incomplete, a closing bracket without its opening one invalid.
fn r_is_complete(code: &str) -> (&'static str, Option<String>) {
    let b = code.as_bytes();
    // Open brackets, each with whether it is the head of `function`, `\`, `if`, `for` or
    // `while`, whose body is still to come when it closes.
    let mut depth: Vec<(u8, bool)> = Vec::new();
    let mut quote: Option<u8> = None;
    // The last thing in the code closed such a head: `function(x)` waits for its body.
    let mut head_closed = false;
    // The last token was an operator, or there was none yet: a binary operator cannot come
    // now (`1 +* 2`, `x <- * 1`).
    let mut after_op = true;
    let mut i = 0;
    while i < b.len() {
        let c = b[i];
        if quote.is_none() && R_OP_CHARS.contains(&c) {
            let op = r_operator(&b[i..]);
            if after_op && r_binary_only(op) {
                return ("invalid", None);
            }
            after_op = true;
            head_closed = false;
            i += op.len().max(1);
            continue;
        }
        if quote.is_none() && (c.is_ascii_alphanumeric() || c == b'.' || c == b'_') {
            // A name or a number, with a decimal exponent's sign (`1e-5`).
            let start = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'.' || b[i] == b'_') {
                i += 1;
                let word = &b[start..i];
                let decimal = word[0].is_ascii_digit()
                    && !word.starts_with(b"0x")
                    && !word.starts_with(b"0X");
                if decimal
                    && matches!(b[i - 1], b'e' | b'E')
                    && i < b.len()
                    && matches!(b[i], b'+' | b'-')
                {
                    i += 1;
                }
            }
            after_op = false;
            head_closed = false;
            continue;
        }
        if !c.is_ascii_whitespace() && c != b'#' {
            after_op = matches!(c, b'(' | b'[' | b'{' | b',' | b';') && quote.is_none();
        }
        if let Some(q) = quote {
            if c == b'\\' {
                i += 2;
                continue;
            }
            if c == q {
                quote = None;
            }
        } else if c == b'#' {
            while i < b.len() && b[i] != b'\n' {
                i += 1;
            }
            continue;
        } else if c.is_ascii_whitespace() {
            i += 1;
            continue;
        } else if matches!(c, b'\'' | b'"' | b'`') {
            quote = Some(c);
        } else if matches!(c, b'(' | b'[' | b'{') {
            depth.push((c, c == b'(' && r_head_before(&code[..i])));
        } else if matches!(c, b')' | b']' | b'}') {
            let want = match c {
                b')' => b'(',
                b']' => b'[',
                _ => b'{',
            };
            match depth.pop() {
                Some((open, head)) if open == want => {
                    head_closed = head;
                    i += 1;
                    continue;
                }
                _ => return ("invalid", None),
            }
        }
        head_closed = false;
        i += 1;
    }
    if quote.is_some() || !depth.is_empty() {
        return ("incomplete", Some("  ".repeat(depth.len())));
    }
    if head_closed {
        return ("incomplete", Some("  ".into()));
    }
    let last = code.trim_end().rsplit('\n').next().unwrap_or("");
    let stripped = strip_r_comment(last).trim_end();
    const TRAILING: [&str; 18] = [
        "+", "-", "*", "/", "^", "|", "&", ",", "<-", "<<-", "=", "~", "|>", "!", "$", "@", ":",
        "%",
    ];
    if TRAILING.iter().any(|t| stripped.ends_with(t)) || ends_with_word(stripped, "else") {
        return ("incomplete", Some(String::new()));
    }
    ("complete", None)
}

/// The characters R operators are made of.
const R_OP_CHARS: &[u8] = b"+-*/^|&<>=!~$@:?%";

/// The R operator at the start of `b` (which starts with one of [`R_OP_CHARS`]): the longest
/// of R's operators, or `%...%` up to its closing `%` on the line (all of the line when
/// none: the code is then incomplete or invalid either way).
fn r_operator(b: &[u8]) -> &str {
    if b[0] == b'%' {
        let end = b[1..]
            .iter()
            .position(|c| *c == b'%' || *c == b'\n')
            .map_or(b.len(), |p| p + 2);
        return std::str::from_utf8(&b[..end.min(b.len())]).unwrap_or("%");
    }
    const OPS: [&str; 21] = [
        ":::", "<<-", "->>", "::", "<-", "->", "<=", ">=", "==", "!=", "&&", "||", "|>", "+", "-",
        "*", "/", "^", "<", ">", "=",
    ];
    for op in OPS {
        if b.starts_with(op.as_bytes()) {
            return op;
        }
    }
    // `!`, `~`, `?`, `|`, `&`, `$`, `@`, `:` alone.
    std::str::from_utf8(&b[..1]).unwrap_or("?")
}

/// Whether R's operator `op` needs a left operand (`-`, `+`, `!`, `~` and `?` are also
/// unary).
fn r_binary_only(op: &str) -> bool {
    !matches!(op, "-" | "+" | "!" | "~" | "?")
}

/// Whether `s` ends with the word `w` (not the tail of a longer name).
fn ends_with_word(s: &str, w: &str) -> bool {
    s.strip_suffix(w).is_some_and(|rest| {
        !rest
            .bytes()
            .last()
            .is_some_and(|c| c.is_ascii_alphanumeric() || c == b'_' || c == b'.')
    })
}

/// Whether the code before an R `(` ends with `function`, `\\` (R 4.1's short form of
/// function), `if`, `for` or `while`: the bracket holds a head whose body follows it.
fn r_head_before(before: &str) -> bool {
    let t = before.trim_end();
    t.ends_with('\\')
        || ["function", "if", "for", "while"]
            .iter()
            .any(|w| ends_with_word(t, w))
}

/// `line` without a trailing `#` comment (a `#` inside a string is kept).
fn strip_r_comment(line: &str) -> &str {
    let mut quote: Option<char> = None;
    let mut esc = false;
    for (i, c) in line.char_indices() {
        if esc {
            esc = false;
            continue;
        }
        match quote {
            Some(q) if c == q => quote = None,
            Some(_) if c == '\\' => esc = true,
            Some(_) => {}
            None if c == '#' => return &line[..i],
            None if matches!(c, '\'' | '"' | '`') => quote = Some(c),
            None => {}
        }
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    fn status(language: &str, code: &str) -> String {
        is_complete(language, code)["status"]
            .as_str()
            .unwrap()
            .to_owned()
    }

    #[test]
    fn python_samples() {
        // jupyter_kernel_test's samples as the sandcell kernels' tests set them.
        for c in [
            "1",
            "print('hello, world')",
            "def f(x):\n  return x*2\n\n\n",
            "x = [1, 2,\n  3]",
            "s = '''a\nb'''",
            "f(*args, **kw)",
            "a = -1 ** -2",
            "x = 1e-5 + 0x1F + 1_000 + 2j + .5",
            "from . import x",
            "@decorator\ndef f():\n    pass\n\n",
            "print(r'\\d', b'x', f'{x}')",
            "lambda *a: a",
            "x[1:]",
            "# only a comment",
            "a = b if c else d",
            "async def f():\n    await g()\n\n",
            "f'{{x'",
            "f'{x:{w}}' + f\"{'}'}\"",
            "a @ b",
        ] {
            assert_eq!(status("python", c), "complete", "{c:?}");
        }
        for c in [
            "print('''hello",
            "def f(x):\n  x*2",
            "for i in range(3):",
            "x = (1,",
            "x = 1 + \\",
            "class A:\n    def f(self):",
            "@dec",
            "@dec(1)\n@other",
            "class A:\n    @property",
        ] {
            assert_eq!(status("python", c), "incomplete", "{c:?}");
        }
        for c in [
            "import = 7q",
            "1 +* 2",
            "x = 1)",
            "print('abc",
            "x = 7q",
            "1 +",
            "1 2",
            "f'{x'",
            "f'{x:{w}'",
            "rf\"{a\"",
            "f'{x",
        ] {
            assert_eq!(status("python", c), "invalid", "{c:?}");
        }
        assert_eq!(
            is_complete("python", "for i in range(3):")["indent"],
            "    "
        );
        assert_eq!(is_complete("python", "def f(x):\n  x*2")["indent"], "  ");
    }

    #[test]
    fn r_samples() {
        for c in [
            "1",
            "x <- 2",
            "f <- function(x) {\n  x\n}",
            "x <- '#'  # c",
            "f <- function(x) x + 1",
            "sq <- \\(x) x^2",
            "if (x) 1 else 2",
            "print(x)",
            "g(function(x) x)",
            "elsewhere <- 1\nelsewhere",
        ] {
            assert_eq!(status("r", c), "complete", "{c:?}");
        }
        for c in [
            "f <- function(x) {",
            "1 +",
            "'abc",
            "x %in%",
            "df |>",
            "function(x)",
            "f <- function(x, y = c(1, 2))  # body next",
            "sq <- \\(x)",
            "if (x > 1)",
            "for (i in 1:3)",
            "while (TRUE)",
            "if (x) 1 else",
        ] {
            assert_eq!(status("r", c), "incomplete", "{c:?}");
        }
        for c in [
            "x <- 1)",
            "}",
            "1 +* 2",
            "x <- * 1",
            "* 2",
            "a == == b",
            "1 %in% * 2",
            "f(, * 2)",
            "1 +\n* 2",
        ] {
            assert_eq!(status("r", c), "invalid", "{c:?}");
        }
        for c in [
            "x <- -1",
            "a & !b",
            "y ~ -x",
            "~ x",
            "1 + + 2",
            "x<-1",
            "base::mean(1)",
            "x %in% y",
            "5 %% 2",
            "-1",
            "!TRUE",
            "?mean",
            "a |> f()",
            "x[, -1]",
            "f(a = -1)",
            "x <- y <- 2",
            "2 ^ -1",
            "1e-5 * 2",
            "x$y@z",
            "'*' * 2",
        ] {
            assert_eq!(status("r", c), "complete", "{c:?}");
        }
    }
}
