//! Bit-exactness against Ceph: every map shape here is compiled with `crushtool -c`
//! and mapped with `crushtool --test --show-mappings` for 10,000 inputs; our lines must
//! equal crushtool's, for the map as written and for crushtool's decompiled form of it.
//! crushtool comes from Debian's ceph-base (scripts/install-deps.sh --test); without it
//! these tests fail rather than skip.

use floe_placement::crush::{self, reweight_from_f32};
use std::fmt::Write;
use std::path::Path;
use std::process::Command;

const X_MAX: u32 = 9999;

const JEWEL: &str = "tunable choose_local_tries 0
tunable choose_local_fallback_tries 0
tunable choose_total_tries 50
tunable chooseleaf_descend_once 1
tunable chooseleaf_vary_r 1
tunable chooseleaf_stable 1
tunable straw_calc_version 1
tunable allowed_bucket_algs 54
";

fn crushtool(args: &[&str]) -> String {
    let output = Command::new("crushtool").args(args).output().expect(
        "crushtool runs: install it with scripts/install-deps.sh --test (Debian ceph-base)",
    );
    assert!(
        output.status.success(),
        "crushtool {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8(output.stdout).expect("crushtool prints text")
}

/// One crushtool run (rule, replica count, reweights) compared with ours; returns
/// the number of lines compared.
fn compare(
    dir: &Path,
    shape: &str,
    text: &str,
    rule: u32,
    num_rep: usize,
    reweights: &[(i32, f32)],
) -> usize {
    let source = dir.join(format!("{shape}.txt"));
    let compiled = dir.join(format!("{shape}.bin"));
    std::fs::write(&source, text).unwrap();
    crushtool(&[
        "-c",
        source.to_str().unwrap(),
        "-o",
        compiled.to_str().unwrap(),
    ]);
    let decompiled = crushtool(&["-d", compiled.to_str().unwrap()]);

    let (rule_arg, rep_arg, max_arg) = (rule.to_string(), num_rep.to_string(), X_MAX.to_string());
    let mut args = vec![
        "-i",
        compiled.to_str().unwrap(),
        "--test",
        "--rule",
        &rule_arg,
        "--num-rep",
        &rep_arg,
        "--min-x",
        "0",
        "--max-x",
        &max_arg,
        "--show-mappings",
    ];
    let weight_args: Vec<(String, String)> = reweights
        .iter()
        .map(|(d, w)| (d.to_string(), w.to_string()))
        .collect();
    for (device, weight) in &weight_args {
        args.extend(["--weight", device, weight]);
    }
    let expected: Vec<String> = crushtool(&args).lines().map(str::to_string).collect();
    assert_eq!(
        expected.len(),
        X_MAX as usize + 1,
        "{shape}: crushtool printed {expected:?}"
    );

    for (form, text) in [("as written", text), ("decompiled", decompiled.as_str())] {
        let map = crush::parse(text).unwrap_or_else(|e| panic!("{shape} {form}: {e}"));
        let mut weights = map.default_reweights();
        for (device, weight) in reweights {
            weights[*device as usize] = reweight_from_f32(*weight);
        }
        let ours: Vec<String> = map
            .show_mappings(rule, num_rep, 0..=X_MAX, &weights)
            .collect();
        let differing: Vec<(&String, &String)> =
            expected.iter().zip(&ours).filter(|(a, b)| a != b).collect();
        eprintln!(
            "{shape} ({form}) rule {rule} num-rep {num_rep}: {} inputs, {} differing lines",
            expected.len(),
            differing.len()
        );
        assert_eq!(ours.len(), expected.len(), "{shape} {form}");
        assert!(
            differing.is_empty(),
            "{shape} {form} rule {rule} num-rep {num_rep}: {} of {} lines differ, first: crushtool {:?} ours {:?}",
            differing.len(),
            expected.len(),
            differing[0].0,
            differing[0].1
        );
    }
    expected.len()
}

/// Types osd/host/rack/root and a `root default` over `racks` racks of `hosts` hosts
/// of `osds` devices; `weight(device)` and `class(device)` shape each device.
fn tree(
    tunables: &str,
    racks: u32,
    hosts: u32,
    osds: u32,
    weight: impl Fn(u32) -> f32,
    class: impl Fn(u32) -> Option<&'static str>,
) -> String {
    let mut text = String::from(tunables);
    let devices = racks * hosts * osds;
    for d in 0..devices {
        write!(text, "device {d} osd.{d}").unwrap();
        if let Some(c) = class(d) {
            write!(text, " class {c}").unwrap();
        }
        text.push('\n');
    }
    text.push_str("type 0 osd\ntype 1 host\ntype 2 rack\ntype 3 root\n");
    let mut next_id = -2;
    let mut rack_items = String::new();
    for r in 0..racks {
        let mut host_items = String::new();
        for h in 0..hosts {
            let host = r * hosts + h;
            writeln!(
                text,
                "host host{host} {{\n\tid {next_id}\n\talg straw2\n\thash 0"
            )
            .unwrap();
            next_id -= 1;
            let mut host_weight = 0.0;
            for o in 0..osds {
                let d = host * osds + o;
                writeln!(text, "\titem osd.{d} weight {:.3}", weight(d)).unwrap();
                host_weight += weight(d);
            }
            text.push_str("}\n");
            writeln!(host_items, "\titem host{host} weight {host_weight:.3}").unwrap();
        }
        writeln!(
            text,
            "rack rack{r} {{\n\tid {next_id}\n\talg straw2\n\thash 0\n{host_items}}}"
        )
        .unwrap();
        next_id -= 1;
        writeln!(rack_items, "\titem rack{r}").unwrap();
    }
    writeln!(
        text,
        "root default {{\n\tid -1\n\talg straw2\n\thash 0\n{rack_items}}}"
    )
    .unwrap();
    text
}

fn rule(id: u32, kind: &str, steps: &[&str]) -> String {
    let mut text =
        format!("rule r{id} {{\n\tid {id}\n\ttype {kind}\n\tmin_size 1\n\tmax_size 10\n");
    for step in steps {
        writeln!(text, "\tstep {step}").unwrap();
    }
    text.push_str("}\n");
    text
}

/// Device reweights given to `crushtool --weight`.
type Reweights<'a> = &'a [(i32, f32)];

fn run(shape: &str, text: &str, cases: &[(u32, usize, Reweights)]) {
    let dir = tempfile::tempdir().unwrap();
    let total: usize = cases
        .iter()
        .map(|(rule, reps, weights)| compare(dir.path(), shape, text, *rule, *reps, weights))
        .sum();
    eprintln!("{shape}: {total} mappings equal to crushtool's");
}

#[test]
fn flat() {
    let mut text = String::from(JEWEL);
    text.push_str("type 0 osd\ntype 1 root\n");
    for d in 0..12 {
        writeln!(text, "device {d} osd.{d}").unwrap();
    }
    text.push_str("root default {\n\tid -1\n\talg straw2\n\thash 0\n");
    for d in 0..12 {
        writeln!(text, "\titem osd.{d} weight {:.3}", 1.0 + d as f32 * 0.25).unwrap();
    }
    text.push_str("}\n");
    text += &rule(
        0,
        "replicated",
        &["take default", "choose firstn 0 type osd", "emit"],
    );
    text += &rule(
        1,
        "erasure",
        &["take default", "choose indep 0 type osd", "emit"],
    );
    run(
        "flat",
        &text,
        &[(0, 3, &[]), (1, 5, &[]), (0, 12, &[]), (1, 14, &[])],
    );
}

#[test]
fn host_and_rack_trees() {
    let mut text = tree(JEWEL, 3, 4, 3, |_| 1.0, |_| None);
    text += &rule(
        0,
        "replicated",
        &["take default", "chooseleaf firstn 0 type host", "emit"],
    );
    text += &rule(
        1,
        "replicated",
        &["take default", "chooseleaf firstn 0 type rack", "emit"],
    );
    text += &rule(
        2,
        "replicated",
        &[
            "take default",
            "choose firstn 2 type rack",
            "chooseleaf firstn 2 type host",
            "emit",
        ],
    );
    text += &rule(
        3,
        "erasure",
        &[
            "set_chooseleaf_tries 5",
            "set_choose_tries 100",
            "take default",
            "chooseleaf indep 0 type host",
            "emit",
        ],
    );
    run(
        "trees",
        &text,
        &[(0, 3, &[]), (1, 3, &[]), (2, 4, &[]), (3, 6, &[])],
    );
}

#[test]
fn uneven_weights() {
    let weight = |d: u32| [0.5, 1.0, 3.7, 0.01, 2.25, 8.0, 0.0][d as usize % 7];
    let mut text = tree(JEWEL, 4, 3, 4, weight, |_| None);
    text += &rule(
        0,
        "replicated",
        &["take default", "chooseleaf firstn 0 type host", "emit"],
    );
    text += &rule(
        1,
        "replicated",
        &["take default", "chooseleaf firstn 0 type rack", "emit"],
    );
    text += &rule(
        2,
        "erasure",
        &["take default", "chooseleaf indep 0 type rack", "emit"],
    );
    run("uneven", &text, &[(0, 3, &[]), (1, 3, &[]), (2, 4, &[])]);
}

#[test]
fn reweighted_and_out_devices() {
    let mut text = tree(JEWEL, 2, 4, 3, |d| 1.0 + (d % 3) as f32, |_| None);
    text += &rule(
        0,
        "replicated",
        &["take default", "chooseleaf firstn 0 type host", "emit"],
    );
    text += &rule(
        1,
        "erasure",
        &["take default", "chooseleaf indep 0 type host", "emit"],
    );
    let reweights: &[(i32, f32)] = &[
        (0, 0.0),
        (4, 0.5),
        (5, 0.0),
        (7, 0.9),
        (13, 0.25),
        (20, 0.0),
        (21, 0.0),
        (22, 0.0),
        (23, 0.0),
    ];
    run(
        "reweighted",
        &text,
        &[(0, 3, reweights), (1, 5, reweights), (0, 8, reweights)],
    );
}

#[test]
fn device_classes() {
    let class = |d: u32| Some(if d.is_multiple_of(3) { "ssd" } else { "hdd" });
    let mut text = tree(JEWEL, 3, 3, 3, |d| 1.0 + (d % 4) as f32 * 0.5, class);
    text += &rule(
        0,
        "replicated",
        &[
            "take default class ssd",
            "chooseleaf firstn 0 type host",
            "emit",
        ],
    );
    text += &rule(
        1,
        "erasure",
        &[
            "take default class hdd",
            "chooseleaf indep 0 type rack",
            "emit",
        ],
    );
    text += &rule(
        2,
        "replicated",
        &[
            "take rack1 class hdd",
            "chooseleaf firstn 0 type host",
            "emit",
        ],
    );
    text += &rule(
        3,
        "replicated",
        &[
            "take default class ssd",
            "chooseleaf firstn 1 type host",
            "emit",
            "take default class hdd",
            "chooseleaf firstn -1 type rack",
            "emit",
        ],
    );
    run(
        "classes",
        &text,
        &[(0, 3, &[]), (1, 4, &[]), (2, 3, &[]), (3, 3, &[])],
    );
}

#[test]
fn device_classes_with_written_shadow_ids() {
    // Shadow ids written for some buckets only, out of order, and a class with no
    // device: crushtool keeps the written ones and numbers the rest around them.
    let class = |d: u32| Some(["ssd", "hdd", "nvme"][d as usize % 3]);
    let mut text = tree(JEWEL, 2, 3, 2, |_| 1.0, class);
    text = text.replace(
        "\tid -2\n",
        "\tid -2\n\tid -40 class hdd\n\tid -3 class ssd\n",
    );
    text = text.replace(
        "\tid -1\n",
        "\tid -1\n\tid -30 class ssd\n\tid -31 class empty\n",
    );
    text = text.replace("\tid -3\n\talg", "\tid -33\n\talg");
    text += &rule(
        0,
        "replicated",
        &[
            "take default class ssd",
            "chooseleaf firstn 0 type host",
            "emit",
        ],
    );
    text += &rule(
        5,
        "erasure",
        &[
            "take default class nvme",
            "chooseleaf indep 0 type host",
            "emit",
        ],
    );
    text += &rule(
        6,
        "replicated",
        &[
            "take default class hdd",
            "chooseleaf firstn 0 type rack",
            "emit",
        ],
    );
    run(
        "shadow-ids",
        &text,
        &[(0, 3, &[]), (5, 4, &[]), (6, 3, &[])],
    );
}

#[test]
fn more_replicas_than_failure_domains() {
    let mut text = tree(JEWEL, 3, 2, 2, |_| 1.0, |_| None);
    text += &rule(
        0,
        "replicated",
        &["take default", "chooseleaf firstn 0 type rack", "emit"],
    );
    text += &rule(
        1,
        "erasure",
        &["take default", "chooseleaf indep 0 type rack", "emit"],
    );
    // crushtool's tester only handles devices in results, hence the second choose.
    text += &rule(
        2,
        "replicated",
        &[
            "take default",
            "choose firstn 0 type host",
            "choose firstn 1 type osd",
            "emit",
        ],
    );
    run(
        "too-few-domains",
        &text,
        &[(0, 5, &[]), (1, 5, &[]), (2, 8, &[])],
    );
}

#[test]
fn legacy_tunables() {
    // No tunable lines: crushtool's legacy defaults, with local retries and the
    // permutation fallback.
    let mut text = tree("", 3, 3, 2, |d| 0.5 + (d % 5) as f32, |_| None);
    text += &rule(
        0,
        "replicated",
        &["take default", "chooseleaf firstn 0 type host", "emit"],
    );
    text += &rule(
        1,
        "replicated",
        &[
            "take default",
            "choose firstn 0 type rack",
            "choose firstn 1 type osd",
            "emit",
        ],
    );
    text += &rule(
        2,
        "erasure",
        &["take default", "chooseleaf indep 0 type host", "emit"],
    );
    let out: &[(i32, f32)] = &[(1, 0.0), (2, 0.3), (9, 0.0)];
    run(
        "legacy",
        &text,
        &[(0, 3, out), (1, 3, out), (2, 6, out), (0, 7, &[])],
    );
}

#[test]
fn bobtail_and_firefly_tunables() {
    let bobtail = "tunable choose_local_tries 0\ntunable choose_local_fallback_tries 0\ntunable choose_total_tries 50\ntunable chooseleaf_descend_once 1\n";
    let firefly = "tunable choose_local_tries 0\ntunable choose_local_fallback_tries 0\ntunable choose_total_tries 50\ntunable chooseleaf_descend_once 1\ntunable chooseleaf_vary_r 1\n";
    for (name, tunables) in [("bobtail", bobtail), ("firefly", firefly)] {
        let mut text = tree(tunables, 2, 4, 2, |d| 1.0 + (d % 2) as f32, |_| None);
        text += &rule(
            0,
            "replicated",
            &["take default", "chooseleaf firstn 0 type host", "emit"],
        );
        text += &rule(
            1,
            "replicated",
            &[
                "set_chooseleaf_vary_r 2",
                "set_chooseleaf_stable 1",
                "take default",
                "chooseleaf firstn 0 type host",
                "emit",
            ],
        );
        run(name, &text, &[(0, 4, &[(3, 0.0)]), (1, 4, &[(3, 0.0)])]);
    }
}
