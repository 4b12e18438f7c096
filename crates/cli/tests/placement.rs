//! `floe placement test` prints byte for byte what `crushtool --test --show-mappings`
//! prints (crushtool: Debian ceph-base, installed by scripts/install-deps.sh --test;
//! the test fails without it). The placement crate's tests cover many map shapes
//! through the library; this one covers the command line around it.

use std::process::Command;

const MAP: &str = "tunable choose_local_tries 0
tunable choose_local_fallback_tries 0
tunable choose_total_tries 50
tunable chooseleaf_descend_once 1
tunable chooseleaf_vary_r 1
tunable chooseleaf_stable 1
tunable straw_calc_version 1
tunable allowed_bucket_algs 54
device 0 osd.0 class ssd
device 1 osd.1 class hdd
device 2 osd.2 class ssd
device 3 osd.3 class hdd
device 4 osd.4 class hdd
device 5 osd.5 class ssd
device 6 osd.6 class hdd
type 0 osd
type 1 host
type 2 root
host a {
	id -2
	alg straw2
	hash 0
	item osd.0 weight 1.000
	item osd.1 weight 2.500
}
host b {
	id -3
	alg straw2
	hash 0
	item osd.2 weight 1.000
	item osd.3 weight 1.000
	item osd.6 weight 0.700
}
host c {
	id -4
	alg straw2
	hash 0
	item osd.4 weight 1.000
	item osd.5 weight 0.300
}
root default {
	id -1
	alg straw2
	hash 0
	item a weight 3.500
	item b weight 7.000
	item c weight 1.300
}
rule fast {
	id 0
	type replicated
	min_size 1
	max_size 10
	step take default class ssd
	step chooseleaf firstn 0 type host
	step emit
}
rule wide {
	id 1
	type erasure
	min_size 1
	max_size 10
	step take default
	step chooseleaf indep 0 type host
	step emit
}
";

fn stdout(command: &mut Command) -> String {
    let output = command
        .output()
        .expect("runs (crushtool: scripts/install-deps.sh --test)");
    assert!(
        output.status.success(),
        "{command:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).unwrap()
}

#[test]
fn placement_test_prints_what_crushtool_prints() {
    let dir = tempfile::tempdir().unwrap();
    let text = dir.path().join("map.txt");
    let compiled = dir.path().join("map.bin");
    std::fs::write(&text, MAP).unwrap();
    stdout(
        Command::new("crushtool")
            .arg("-c")
            .arg(&text)
            .arg("-o")
            .arg(&compiled),
    );
    for (rule, num_rep) in [("0", "3"), ("1", "4")] {
        let args = [
            "--rule",
            rule,
            "--num-rep",
            num_rep,
            "--min-x",
            "0",
            "--max-x",
            "9999",
            "--show-mappings",
            "--weight",
            "4",
            "0.5",
            "--weight",
            "2",
            "0",
        ];
        let expected = stdout(
            Command::new("crushtool")
                .arg("-i")
                .arg(&compiled)
                .arg("--test")
                .args(args),
        );
        let ours = stdout(
            Command::new(env!("CARGO_BIN_EXE_floe"))
                .args(["placement", "test", "--crushmap"])
                .arg(&text)
                .args(args),
        );
        assert_eq!(expected.lines().count(), 10_000);
        let differing = expected
            .lines()
            .zip(ours.lines())
            .filter(|(a, b)| a != b)
            .count();
        assert_eq!(differing, 0, "rule {rule}: {differing} lines differ");
        assert_eq!(ours, expected);
    }
}
