//! The demo volume through each real client, and a whole-cluster restart.

use crate::cluster::{nbdsh, ok, output, random_file, Cluster};
use crate::io_helpers::qemu_io;
use std::process::Command;

#[test]
fn qemu_img_nbdinfo_nbdcopy_and_restart() {
    let dir = tempfile::tempdir().unwrap();
    let mut cluster = Cluster::start(dir.path());
    let uri = cluster.uri().to_string();
    let work = tempfile::tempdir().unwrap();
    let image = work.path().join("random.img");
    random_file(&image, 200 << 20);

    // Fresh volume: all hole.
    let map = ok(Command::new("nbdinfo").args(["--map", &uri]));
    assert!(map.contains("hole,zero") && !map.contains("data"), "{map}");
    let size = ok(Command::new("nbdinfo").args(["--size", &uri]));
    assert_eq!(size.trim(), (1u64 << 30).to_string());

    ok(Command::new("qemu-img")
        .args(["convert", "-n", "-f", "raw", "-O", "raw"])
        .arg(&image)
        .arg(&uri));
    let back = work.path().join("back.img");
    ok(Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "raw", &uri])
        .arg(&back));
    // The volume is larger than the image; compare the image-sized prefix, the rest
    // must be zeroes (qemu-img compare treats a longer all-zero tail as equal).
    ok(Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw"])
        .arg(&image)
        .arg(&back));

    // Written chunks are data, the rest holes: 200 MiB in 256 MiB object sets.
    let map = ok(Command::new("nbdinfo").args(["--map", &uri]));
    let first = map.lines().next().unwrap().to_string();
    assert!(
        first.contains("data") && first.trim_start().starts_with('0'),
        "{map}"
    );
    assert!(map.contains("hole,zero"), "{map}");

    // nbdcopy round trip.
    let copied = work.path().join("copied.img");
    ok(Command::new("nbdcopy").arg(&uri).arg(&copied));
    let cmp = output(
        Command::new("cmp")
            .args(["-n", &(200u64 << 20).to_string()])
            .arg(&image)
            .arg(&copied),
    );
    assert!(cmp.status.success(), "nbdcopy read differs");

    cluster.restart();
    let after = work.path().join("after.img");
    ok(Command::new("qemu-img")
        .args(["convert", "-f", "raw", "-O", "raw", cluster.uri()])
        .arg(&after));
    ok(Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw"])
        .arg(&image)
        .arg(&after));
}

#[test]
fn qemu_io_patterns_discard_and_zero() {
    let dir = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(dir.path());
    let uri = cluster.uri();
    let io = |commands: &[&str]| qemu_io(uri, commands);
    // Across a stripe-unit and a chunk boundary (64 KiB units, 64 MiB chunks).
    io(&[
        "write -P 0xab 0 1M",
        "write -P 0xcd 67043328 2M",
        "write -P 0x11 300M 4k",
    ]);
    io(&[
        "read -P 0xab 0 1M",
        "read -P 0xcd 67043328 2M",
        "read -P 0x11 300M 4k",
    ]);
    io(&[
        "discard 0 512k",
        "read -P 0 0 512k",
        "read -P 0xab 512k 512k",
    ]);
    io(&[
        "write -z 67043328 1M",
        "read -P 0 67043328 1M",
        "read -P 0xcd 68091904 1M",
    ]);
    // Reads past the end fail cleanly and the export keeps working.
    let past = output(Command::new("qemu-io").args(["-f", "raw", "-c", "read 1G 4k", uri]));
    let text =
        String::from_utf8_lossy(&past.stdout).to_string() + &String::from_utf8_lossy(&past.stderr);
    assert!(
        text.contains("error") || text.contains("Input/output") || text.contains("out of"),
        "{text}"
    );
    io(&["read -P 0x11 300M 4k"]);
    // nbdsh: an unknown export name is refused with a message.
    let unknown = uri.replace("/demo", "/nonexistent");
    let out = output(nbdsh().args(["-u", &unknown, "-c", "print(h.get_size())"]));
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("nonexistent") || err.contains("unknown"),
        "{err}"
    );
}
