//! What an NBD export name asks for: `VOLUME`, `VOLUME@SNAPSHOT` (a snapshot,
//! read-only) or `VOLUME~STALENESS` (a stale-read attach, read-only, e.g. `vm1~2s`).
//! Volume names hold neither `@` nor `~`, so the forms never collide.

use std::time::Duration;

#[derive(Debug, PartialEq, Eq)]
pub enum ExportName<'a> {
    Volume(&'a str),
    Snapshot {
        volume: &'a str,
        snapshot: &'a str,
    },
    Stale {
        volume: &'a str,
        staleness: Duration,
    },
}

impl<'a> ExportName<'a> {
    pub fn parse(name: &'a str) -> Result<ExportName<'a>, String> {
        if let Some((volume, snapshot)) = floe_protocol::snapshot::split_snapshot(name) {
            return Ok(ExportName::Snapshot { volume, snapshot });
        }
        let Some((volume, bound)) = name.split_once('~') else {
            return Ok(ExportName::Volume(name));
        };
        let staleness = humantime::parse_duration(bound).map_err(|e| {
            format!(
                "export {name:?}: staleness {bound:?} is not a duration such as 2s or 500ms: {e}"
            )
        })?;
        Ok(ExportName::Stale { volume, staleness })
    }

    /// The volume the export reads.
    pub fn volume(&self) -> &'a str {
        match self {
            ExportName::Volume(volume)
            | ExportName::Snapshot { volume, .. }
            | ExportName::Stale { volume, .. } => volume,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn export_names_parse_to_what_they_ask_for() {
        assert_eq!(ExportName::parse("vm1"), Ok(ExportName::Volume("vm1")));
        assert_eq!(
            ExportName::parse("vm1@nightly"),
            Ok(ExportName::Snapshot {
                volume: "vm1",
                snapshot: "nightly"
            })
        );
        assert_eq!(
            ExportName::parse("vm1~2s"),
            Ok(ExportName::Stale {
                volume: "vm1",
                staleness: Duration::from_secs(2)
            })
        );
        assert_eq!(
            ExportName::parse("vm1~250ms").map(|e| e.volume()),
            Ok("vm1")
        );
        let bad = ExportName::parse("vm1~soon").unwrap_err();
        assert!(bad.contains("not a duration"), "{bad}");
    }
}
