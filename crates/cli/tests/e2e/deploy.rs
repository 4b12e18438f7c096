//! The systemd units in deploy/systemd (docs/deploy.md) stay in step with the CLI:
//! every flag a unit passes is one its subcommand takes, and systemd parses every unit.

use crate::cluster::{ok, output, FLOE};
use std::path::Path;
use std::process::Command;

const UNITS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../../deploy/systemd");

#[test]
fn the_systemd_units_pass_only_flags_the_cli_takes() {
    let mut checked = 0;
    for entry in std::fs::read_dir(UNITS).unwrap() {
        let path = entry.unwrap().path();
        let unit = std::fs::read_to_string(&path).unwrap();
        let start = unit
            .lines()
            .find_map(|l| l.strip_prefix("ExecStart="))
            .unwrap_or_else(|| panic!("{} has no ExecStart", path.display()));
        let words: Vec<&str> = start.split_whitespace().collect();
        assert_eq!(words[0], "/usr/local/bin/floe", "{start}");
        let help = ok(Command::new(FLOE).args([words[1], "--help"]));
        for flag in words.iter().filter(|w| w.starts_with("--")) {
            assert!(
                help.contains(&format!("{flag} ")) || help.contains(&format!("{flag}\n")),
                "{}: `floe {}` takes no {flag}",
                path.display(),
                words[1]
            );
            checked += 1;
        }
        systemd_parses(&path, &unit);
    }
    assert!(checked >= 8, "only {checked} flags found in {UNITS}");
}

/// `systemd-analyze verify` on a copy whose binary exists here.
fn systemd_parses(path: &Path, unit: &str) {
    let dir = tempfile::tempdir().unwrap();
    let name = path
        .file_name()
        .unwrap()
        .to_str()
        .unwrap()
        .replace("@.", "@sdb.");
    let copy = dir.path().join(&name);
    std::fs::write(&copy, unit.replace("/usr/local/bin/floe", "/bin/true")).unwrap();
    let verified = output(
        Command::new("systemd-analyze")
            .args(["verify", "--man=no"])
            .arg(&copy),
    );
    let said = String::from_utf8_lossy(&verified.stderr);
    assert!(
        verified.status.success() && said.trim().is_empty(),
        "{name}: {said}"
    );
}
