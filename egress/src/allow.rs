//! Host allowlists: lowercase DNS names and leading-`*.` wildcards.
//!
//! A pattern `example.org` matches exactly that name; `*.example.org` matches one or more
//! labels below it (`a.example.org`, `a.b.example.org`), never the apex `example.org`. Names
//! are compared after lowercasing and removing one trailing dot. Syntax: RFC 1123 host names
//! (labels of 1-63 letters, digits and hyphens, not starting or ending with a hyphen, at most
//! 253 characters in all); an IP literal is not a host name and never matches.

/// Why a host name or pattern is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    /// Empty, longer than 253 characters, or a label that is not 1-63 of `[a-z0-9-]` without a
    /// leading or trailing hyphen.
    #[error("not a DNS host name: {0:?}")]
    Syntax(String),
    /// A wildcard anywhere but as the whole first label, or `*.` over a single label (`*.org`).
    #[error("a wildcard is only a leading \"*.\" over a name of two labels or more: {0:?}")]
    Wildcard(String),
}

/// The longest host name accepted, in characters (RFC 1035 section 2.3.4, without the dot).
pub const MAX_NAME: usize = 253;

/// `name` lowercased without one trailing dot, if it is a syntactically valid host name.
///
/// Errors: [`NameError::Syntax`].
pub fn normalize(name: &str) -> Result<String, NameError> {
    let n = name.strip_suffix('.').unwrap_or(name).to_ascii_lowercase();
    let bad = || NameError::Syntax(name.chars().take(80).collect());
    if n.is_empty() || n.len() > MAX_NAME {
        return Err(bad());
    }
    for label in n.split('.') {
        let ok = !label.is_empty()
            && label.len() <= 63
            && !label.starts_with('-')
            && !label.ends_with('-')
            && label
                .bytes()
                .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-');
        if !ok {
            return Err(bad());
        }
    }
    // All-numeric last label: an IPv4 literal or something that reads like one.
    if n.rsplit('.')
        .next()
        .is_some_and(|l| l.bytes().all(|b| b.is_ascii_digit()))
    {
        return Err(bad());
    }
    Ok(n)
}

/// One allowlist entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Pattern {
    /// Exactly this name.
    Exact(String),
    /// Any name strictly below this one (`*.suffix`).
    Below(String),
}

impl Pattern {
    /// Parses `example.org` or `*.example.org`.
    ///
    /// Errors: [`NameError`].
    pub fn parse(s: &str) -> Result<Pattern, NameError> {
        if let Some(rest) = s.strip_prefix("*.") {
            let n = normalize(rest)?;
            if !n.contains('.') {
                return Err(NameError::Wildcard(s.into()));
            }
            return Ok(Pattern::Below(n));
        }
        if s.contains('*') {
            return Err(NameError::Wildcard(s.into()));
        }
        Ok(Pattern::Exact(normalize(s)?))
    }

    /// Whether the normalized `host` matches.
    pub fn matches(&self, host: &str) -> bool {
        match self {
            Pattern::Exact(n) => host == n,
            Pattern::Below(suffix) => host
                .strip_suffix(suffix.as_str())
                .is_some_and(|head| head.len() > 1 && head.ends_with('.')),
        }
    }

    /// Whether every name this pattern matches is matched by `wider` (a session's subset
    /// must be covered by the environment's list).
    pub fn within(&self, wider: &Pattern) -> bool {
        match (self, wider) {
            (Pattern::Exact(n), w) => w.matches(n),
            (Pattern::Below(a), Pattern::Below(b)) => {
                a == b || Pattern::Below(b.clone()).matches(a)
            }
            (Pattern::Below(_), Pattern::Exact(_)) => false,
        }
    }
}

impl std::fmt::Display for Pattern {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Pattern::Exact(n) => f.write_str(n),
            Pattern::Below(n) => write!(f, "*.{n}"),
        }
    }
}

/// A session's allowlist.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Allowlist {
    patterns: Vec<Pattern>,
}

impl Allowlist {
    /// Parses every entry.
    ///
    /// Errors: the first entry refused.
    pub fn parse<S: AsRef<str>>(entries: &[S]) -> Result<Allowlist, NameError> {
        Ok(Allowlist {
            patterns: entries
                .iter()
                .map(|e| Pattern::parse(e.as_ref()))
                .collect::<Result<_, _>>()?,
        })
    }

    /// Whether `host` (any case, optional trailing dot) is allowed; a name that is not a
    /// valid host name never is.
    pub fn allows(&self, host: &str) -> bool {
        normalize(host).is_ok_and(|h| self.patterns.iter().any(|p| p.matches(&h)))
    }

    /// The entries of `subset` not covered by this list (empty: `subset` is a subset).
    pub fn outside<'a>(&self, subset: &'a Allowlist) -> Vec<&'a Pattern> {
        subset
            .patterns
            .iter()
            .filter(|p| !self.patterns.iter().any(|w| p.within(w)))
            .collect()
    }

    /// The patterns, in the order given.
    pub fn patterns(&self) -> &[Pattern] {
        &self.patterns
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_and_wildcard() {
        let a = Allowlist::parse(&["pypi.org", "*.pythonhosted.org"]).unwrap();
        assert!(a.allows("pypi.org"));
        assert!(a.allows("PyPI.org."));
        assert!(!a.allows("www.pypi.org"));
        assert!(!a.allows("pypi.org.evil.com"));
        assert!(a.allows("files.pythonhosted.org"));
        assert!(a.allows("a.b.pythonhosted.org"));
        assert!(
            !a.allows("pythonhosted.org"),
            "a wildcard never matches the apex"
        );
        assert!(!a.allows("evilpythonhosted.org"));
        assert!(!a.allows(".pythonhosted.org"));
        assert!(!a.allows("files.pythonhosted.org.evil"));
    }

    #[test]
    fn bad_names_never_match() {
        let a = Allowlist::parse(&["*.example.org"]).unwrap();
        for h in [
            "",
            ".",
            "a..example.org",
            "-a.example.org",
            "a_b.example.org",
            "a.example.org\0",
            "a example.org",
            "127.0.0.1",
            "a.example.org:80",
        ] {
            assert!(!a.allows(h), "{h:?}");
        }
        assert!(!a.allows(&format!("{}.example.org", "a".repeat(64))));
        let long = format!("{}example.org", "abcdefghi.".repeat(25));
        assert!(long.len() > MAX_NAME);
        assert!(!a.allows(&long));
    }

    #[test]
    fn pattern_syntax() {
        assert_eq!(
            Pattern::parse("*.org"),
            Err(NameError::Wildcard("*.org".into()))
        );
        assert!(matches!(
            Pattern::parse("a.*.org"),
            Err(NameError::Wildcard(_))
        ));
        assert!(matches!(Pattern::parse("*"), Err(NameError::Wildcard(_))));
        assert!(matches!(
            Pattern::parse("10.0.0.1"),
            Err(NameError::Syntax(_))
        ));
        assert_eq!(
            Pattern::parse("Example.ORG.").unwrap().to_string(),
            "example.org"
        );
    }

    #[test]
    fn subsets() {
        let env = Allowlist::parse(&["pypi.org", "*.example.org"]).unwrap();
        let ok = Allowlist::parse(&["pypi.org", "a.example.org", "*.b.example.org"]).unwrap();
        assert!(env.outside(&ok).is_empty());
        let bad =
            Allowlist::parse(&["example.org", "*.example.org", "*.pypi.org", "x.org"]).unwrap();
        let out: Vec<String> = env.outside(&bad).iter().map(|p| p.to_string()).collect();
        assert_eq!(out, ["example.org", "*.pypi.org", "x.org"]);
    }
}
