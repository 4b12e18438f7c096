//! The CLI as a script and a new user meet it: `--json` documents, a pipe closed
//! early, help for every argument, sizes in errors, logs without colour, a file
//! system shared by servers counted once, and NBD fast zero.

use crate::cluster::{ids, nbdsh, ok, output, volume, Cluster, FLOE};
use crate::io_helpers::{floe_output, text, wait_until};
use std::process::Command;
use std::time::Duration;

#[test]
fn json_output_and_first_steps() {
    let dir = tempfile::tempdir().unwrap();
    let mut cluster = Cluster::start(dir.path());
    let uri = cluster.uri();

    // Six demo servers, three emulated hosts, one file system: counted once.
    let mut status = serde_json::Value::Null;
    wait_until(
        "every server reports its file system",
        Duration::from_secs(10),
        || {
            status = cluster.floe_json(&["status"]);
            let servers = status["servers"].as_array().expect("servers");
            servers.len() == 6 && servers.iter().all(|s| s["file_system"].is_object())
        },
    );
    let totals = &status["cluster"];
    assert_eq!(totals["file_systems"], 1, "{status}");
    assert_eq!(totals["hosts"], 3, "{status}");
    assert_eq!(totals["servers_up"], 6, "{status}");
    let disk = &status["servers"][0]["file_system"]["total_bytes"];
    assert_eq!(&totals["capacity_bytes"], disk, "{status}");
    assert!(cluster.floe(&["status"]).contains("on 1 file system\n"));

    // NBD fast zero: advertised, and honoured over whole and partial blocks.
    let info = ok(Command::new("nbdinfo").args(["--json", uri]));
    assert!(info.contains("\"can_fast_zero\": true"), "{info}");
    let zeroes = ok(nbdsh().args([
        "-u",
        uri,
        "-c",
        "import nbd
h.pwrite(b'\\xaa' * (1 << 20), 0)
h.zero(50, 12388, flags=nbd.CMD_FLAG_FAST_ZERO)
h.zero(8 << 20, 1 << 20, flags=nbd.CMD_FLAG_FAST_ZERO | nbd.CMD_FLAG_NO_HOLE)
d = h.pread(1 << 20, 0)
assert d == b'\\xaa' * 12388 + bytes(50) + b'\\xaa' * ((1 << 20) - 12438)
assert h.pread(8 << 20, 1 << 20) == bytes(8 << 20)
print('zeroed')",
    ]));
    assert_eq!(zeroes.trim(), "zeroed");

    let list = cluster.floe_json(&["volume", "list"]);
    let demo = volume(&list, "demo").unwrap_or_else(|| panic!("{list}"));
    assert_eq!(demo["size_bytes"], 1u64 << 30, "{list}");
    assert_eq!(demo["replicas"], 3, "{list}");
    let info = cluster.floe_json(&["volume", "info", "demo"]);
    let chunks = info["chunks"].as_array().expect("chunks");
    assert!(!chunks.is_empty(), "{info}");
    assert!(
        chunks.iter().all(|c| ids(&c["servers"]).len() == 3),
        "{info}"
    );
    assert_eq!(info["chunks_allocated"], chunks.len(), "{info}");

    cluster.floe(&["snapshot", "create", "demo@first"]);
    let snapshots = cluster.floe_json(&["snapshot", "list", "demo"]);
    assert_eq!(snapshots["snapshots"][0]["name"], "first", "{snapshots}");
    assert_eq!(snapshots["snapshots"][0]["ready"], true, "{snapshots}");

    let map = cluster.floe_json(&["cluster", "map"]);
    assert_eq!(map["layers"].as_array().map(Vec::len), Some(1), "{map}");
    assert_eq!(ids(&map["layers"][0]["servers"]).len(), 6, "{map}");

    let scrub = cluster.floe_json(&["scrub", "demo"]);
    assert_eq!(scrub["clean"], true, "{scrub}");
    assert_eq!(&scrub["chunks"], &info["chunks_allocated"], "{scrub}");

    // A reader that goes away at once: floe ends quietly.
    let master = &cluster.info.master;
    for command in ["status", "volume info demo", "status --json"] {
        let line = format!("{FLOE} --master {master} {command} | true");
        let out = output(Command::new("sh").args(["-c", &line]));
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.is_empty(), "`{line}`: {stderr}");
    }

    // Sizes as a person reads them.
    let shrink = floe_output(&cluster, &["volume", "resize", "demo", "--size", "512M"]);
    let message = text(&shrink);
    assert!(!shrink.status.success());
    assert!(
        message.contains("1.0 GiB") && message.contains("512.0 MiB"),
        "{message}"
    );
    assert!(!message.contains("1073741824"), "{message}");

    // Progress of a delete goes to stderr as plain lines; the result to stdout.
    cluster.floe(&["volume", "create", "spare", "--size", "256M"]);
    let spare = uri.replace("/demo", "/spare");
    ok(nbdsh().args(["-u", &spare, "-c", "h.pwrite(b'\\x01' * (4 << 20), 0)"]));
    let deleted = floe_output(&cluster, &["volume", "delete", "spare", "--wait"]);
    assert!(deleted.status.success(), "{}", text(&deleted));
    let stdout = String::from_utf8_lossy(&deleted.stdout);
    assert!(stdout.contains("deleted volume spare;"), "{stdout}");
    assert!(!text(&deleted).contains('\x1b'), "{}", text(&deleted));

    // Logs written to files carry no colour codes.
    for entry in std::fs::read_dir(dir.path().join("logs")).unwrap() {
        let path = entry.unwrap().path();
        let log = std::fs::read_to_string(&path).unwrap();
        assert!(!log.contains('\x1b'), "escape codes in {}", path.display());
    }

    // `floe demo | head`: once its reader is gone the demo stops reporting, not
    // running; it stops cleanly later (its "stopping..." line goes nowhere).
    cluster.close_demo_stdout();
    cluster.stop();
}

/// Every argument of every subcommand says what it is, and no usage line asks for
/// `--master`, which has a default.
#[test]
fn every_argument_is_described() {
    let mut missing = Vec::new();
    let mut commands = vec![Vec::<String>::new()];
    while let Some(command) = commands.pop() {
        let help = ok(Command::new(FLOE).args(&command).arg("--help"));
        let usage = help.split_once("Usage:").map_or("", |(_, rest)| rest);
        let usage = usage.split_once("\n\n").map_or(usage, |(lines, _)| lines);
        assert!(!usage.contains("--master"), "floe {command:?}: {usage}");
        missing.extend(
            undescribed(&help)
                .into_iter()
                .map(|arg| format!("floe {}: {arg}", command.join(" "))),
        );
        let listed = help
            .split_once("\nCommands:\n")
            .map_or("", |(_, rest)| rest);
        for line in listed.lines().take_while(|l| l.starts_with("  ")) {
            let name = line.split_whitespace().next().unwrap();
            if name != "help" {
                commands.push([command.clone(), vec![name.to_string()]].concat());
            }
        }
    }
    assert!(missing.is_empty(), "undescribed:\n{}", missing.join("\n"));
}

/// The argument lines of a help text with no description, on the line or below it.
fn undescribed(help: &str) -> Vec<String> {
    let lines: Vec<&str> = help.lines().collect();
    let mut out = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        let trimmed = line.trim_start();
        // "- NAME: ..." lines list an argument's possible values.
        let argument = trimmed.starts_with('-') && !trimmed.starts_with("- ");
        if !line.starts_with("  ") || !(argument || trimmed.starts_with('<')) {
            continue;
        }
        let rest = trimmed.split_once("  ").map_or("", |(_, rest)| rest.trim());
        let described = !rest.is_empty() && !rest.starts_with('[')
            || lines.get(i + 1).is_some_and(|next| {
                // Long help puts the description on the next line, indented more.
                let text = next.trim_start();
                next.len() - text.len() > line.len() - trimmed.len()
                    && !text.starts_with(['[', '-', '<'])
            });
        if !described {
            out.push(trimmed.to_string());
        }
    }
    out
}
