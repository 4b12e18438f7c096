//! Which NBD client may open which volume (`floe gateway --nbd-access FILE`).
//!
//! One rule a line, `IDENTITY VOLUME ACCESS`: IDENTITY is the name (CN) of the
//! certificate a client presented over TLS, or the identity of its pre-shared key
//! (TLS-PSK), or `*` for any client, with credentials or without; VOLUME is a volume's name or `*`; ACCESS is `rw` or `ro`. The first
//! rule that matches decides; a client no rule matches is refused. `#` starts a
//! comment. Without a list, every client the transport lets in opens every volume.

use std::path::Path;

#[derive(Debug, Clone, PartialEq, Eq)]
struct Rule {
    /// `None`: any client.
    identity: Option<String>,
    /// `None`: any volume.
    volume: Option<String>,
    writable: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccessList {
    rules: Vec<Rule>,
}

impl AccessList {
    pub fn load(path: &Path) -> Result<AccessList, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        AccessList::parse(&text).map_err(|e| format!("{}: {e}", path.display()))
    }

    pub fn parse(text: &str) -> Result<AccessList, String> {
        let any = |word: &str| (word != "*").then(|| word.to_string());
        let mut rules = Vec::new();
        for (number, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or_default();
            let words: Vec<&str> = line.split_whitespace().collect();
            let rule = match words[..] {
                [] => continue,
                [identity, volume, access @ ("rw" | "ro")] => Rule {
                    identity: any(identity),
                    volume: any(volume),
                    writable: access == "rw",
                },
                _ => {
                    return Err(format!(
                        "line {}: expected `IDENTITY VOLUME rw|ro`, found {:?}",
                        number + 1,
                        line.trim()
                    ))
                }
            };
            rules.push(rule);
        }
        Ok(AccessList { rules })
    }

    /// Whether the client named `identity` (`None`: it presented no certificate) may
    /// open `volume`: `Some(writable)`, or `None` if not at all.
    pub fn grant(&self, identity: Option<&str>, volume: &str) -> Option<bool> {
        self.rules
            .iter()
            .find(|rule| {
                rule.identity
                    .as_deref()
                    .is_none_or(|wanted| Some(wanted) == identity)
                    && rule.volume.as_deref().is_none_or(|v| v == volume)
            })
            .map(|rule| rule.writable)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_matching_rule_decides() {
        let list = AccessList::parse(
            "# who   what   how\n\
             vm1    demo   rw\n\
             backup *      ro   # reads everything\n\
             *      public ro\n",
        )
        .unwrap();
        assert_eq!(list.grant(Some("vm1"), "demo"), Some(true));
        assert_eq!(list.grant(Some("vm1"), "other"), None);
        assert_eq!(list.grant(Some("backup"), "demo"), Some(false));
        assert_eq!(list.grant(None, "public"), Some(false));
        assert_eq!(list.grant(None, "demo"), None);
        assert_eq!(list.grant(Some("vm2"), "public"), Some(false));
    }

    #[test]
    fn a_malformed_line_is_named() {
        let error = AccessList::parse("vm1 demo rw\nvm2 demo write\n").unwrap_err();
        assert!(error.starts_with("line 2:"), "{error}");
        assert!(AccessList::parse("vm1 demo\n").is_err());
    }
}
