//! Real NBD clients against the in-process server.

use crate::common::*;
use rand::{Rng, SeedableRng};

#[test]
fn qemu_io_patterns_discard_and_write_zeroes() {
    let server = Server::start();
    let out = succeed(
        tool("qemu-io")
            .args(["-f", "raw", &server.uri("disk")])
            .args([
                "-c",
                "write -P 0xab 0 1M",
                "-c",
                "read -P 0xab 0 1M",
                "-c",
                "discard 0 64k",
                "-c",
                "read -P 0 0 64k",
                "-c",
                "write -P 0xcd 2M 128k",
                "-c",
                "write -z 2M 64k",
                "-c",
                "write -z -u 2112k 64k",
                "-c",
                "read -P 0 2M 128k",
                "-c",
                "aio_write -P 0x11 8M 64k",
                "-c",
                "aio_write -P 0x22 9M 64k",
                "-c",
                "aio_flush",
                "-c",
                "read -P 0x11 8M 64k",
                "-c",
                "read -P 0x22 9M 64k",
                "-c",
                "flush",
            ]),
    );
    assert!(!out.contains("verification failed"), "{out}");

    // The bytes really are on the device, and each operation left the expected kind
    // of allocation behind.
    assert_eq!(server.disk_read(0, 65536), vec![0; 65536]);
    assert_eq!(
        server.disk_read(65536, (1 << 20) - 65536),
        vec![0xab; (1 << 20) - 65536]
    );
    assert!(
        server.disk_extents(0, 65536).iter().all(|e| e.hole),
        "discard punches"
    );
    // write -z without -u sets NO_HOLE: zeroes are written, space stays allocated...
    assert!(server.disk_extents(2 * MIB, 65536).iter().all(|e| !e.hole));
    // ...and with -u (may unmap) the range is punched.
    assert!(server
        .disk_extents(2 * MIB + 65536, 65536)
        .iter()
        .all(|e| e.hole));
    assert_eq!(server.disk_read(8 * MIB, 65536), vec![0x11; 65536]);
}

#[test]
fn qemu_io_sees_mismatches_and_device_errors() {
    let server = Server::start();
    // The pattern check does detect wrong data (so the test above can fail).
    let out =
        fail(tool("qemu-io").args(["-f", "raw", &server.uri("disk"), "-c", "read -P 0xcd 0 4k"]));
    assert!(out.contains("Pattern verification failed"), "{out}");

    let out = fail(tool("qemu-io").args(["-f", "raw", &server.uri("ro"), "-c", "write 0 4k"]));
    assert!(
        out.contains("Operation not permitted"),
        "read-only must map to EPERM: {out}"
    );
    let out = fail(tool("qemu-io").args(["-f", "raw", &server.uri("full"), "-c", "write 0 4k"]));
    assert!(
        out.contains("No space left on device"),
        "NoSpace must map to ENOSPC: {out}"
    );

    let out = fail(tool("qemu-io").args(["-f", "raw", &server.uri("nope"), "-c", "read 0 1"]));
    assert!(
        out.contains(r#"no volume named "nope" here"#),
        "message from Exports::open: {out}"
    );
}

#[test]
fn qemu_img_convert_compare_and_map() {
    let server = Server::start();
    let dir = tempfile::tempdir().unwrap();
    let source = dir.path().join("source.img");
    let mut data = vec![0u8; 8 << 20];
    rand::rngs::StdRng::seed_from_u64(1).fill(&mut data[MIB as usize..3 << 20]);
    std::fs::write(&source, &data).unwrap();
    let source = source.to_str().unwrap();

    let info = succeed(tool("qemu-img").args(["info", &server.uri("disk")]));
    assert!(
        info.contains("virtual size: 64 MiB (67108864 bytes)"),
        "{info}"
    );

    succeed(tool("qemu-img").args([
        "convert",
        "-n",
        "-f",
        "raw",
        "-O",
        "raw",
        source,
        &server.uri("disk"),
    ]));
    let same = succeed(tool("qemu-img").args([
        "compare",
        "-f",
        "raw",
        "-F",
        "raw",
        source,
        &server.uri("disk"),
    ]));
    assert!(same.contains("Images are identical"), "{same}");
    assert_eq!(server.disk_read(0, 8 << 20), data);

    let map = succeed(tool("qemu-img").args(["map", "--output=json", &server.uri("disk")]));
    let data_extents: Vec<&str> = map
        .lines()
        .filter(|l| l.contains(r#""data": true"#))
        .collect();
    assert_eq!(data_extents.len(), 1, "{map}");
    assert!(
        data_extents[0].contains(r#""start": 1048576, "length": 2097152"#),
        "{map}"
    );

    // And a difference is noticed.
    server.disk_write(5 * MIB, b"x");
    let differ = fail(tool("qemu-img").args([
        "compare",
        "-f",
        "raw",
        "-F",
        "raw",
        source,
        &server.uri("disk"),
    ]));
    assert!(
        differ.contains("Content mismatch at offset 5242880"),
        "{differ}"
    );
}

#[test]
fn nbdinfo_size_list_map_and_errors() {
    let server = Server::start();
    let size = succeed(tool("nbdinfo").args(["--size", &server.uri("disk")]));
    assert_eq!(size.trim(), DISK_SIZE.to_string());
    let size = succeed(tool("nbdinfo").args(["--size", &server.uri("")]));
    assert_eq!(size.trim(), DEFAULT_SIZE.to_string(), "the default export");

    let list =
        succeed(tool("nbdinfo").args(["--list", &format!("nbd://127.0.0.1:{}", server.port)]));
    for export in [r#"export="":"#, r#"export="disk":"#, r#"export="ro":"#] {
        assert!(list.contains(export), "{export} missing from\n{list}");
    }

    let json = succeed(tool("nbdinfo").args(["--json", &server.uri("disk")]));
    for fact in [
        r#""structured": true"#,
        r#""base:allocation""#,
        r#""can_multi_conn": true"#,
        r#""can_df": true"#,
        r#""can_fua": true"#,
        r#""can_flush": true"#,
        r#""can_trim": true"#,
        r#""can_zero": true"#,
        r#""can_cache": true"#,
        r#""is_read_only": false"#,
        r#""block_size_minimum": 1,"#,
        r#""block_size_preferred": 4096,"#,
        r#""block_size_maximum": 33554432,"#,
    ] {
        assert!(json.contains(fact), "{fact} missing from\n{json}");
    }

    server.disk_write(4 * MIB, &vec![0x5a; 3 << 20]);
    let map = succeed(tool("nbdinfo").args(["--map", &server.uri("disk")]));
    let rows: Vec<Vec<String>> = map
        .lines()
        .map(|l| l.split_whitespace().map(str::to_owned).collect())
        .collect();
    let expected = [
        ["0", "4194304", "3", "hole,zero"],
        ["4194304", "3145728", "0", "data"],
        ["7340032", "59768832", "3", "hole,zero"],
    ];
    assert_eq!(
        rows,
        expected.map(|r| r.map(str::to_owned).to_vec()).to_vec(),
        "{map}"
    );

    let out = fail(tool("nbdinfo").args([&server.uri("nope")]));
    assert!(out.contains("server replied with error to opt_go"), "{out}");
}

#[test]
fn nbdcopy_round_trip() {
    let server = Server::start();
    let dir = tempfile::tempdir().unwrap();
    let (source, copy) = (dir.path().join("in.img"), dir.path().join("out.img"));
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let mut data = vec![0u8; DISK_SIZE as usize];
    rng.fill(&mut data[..]);
    // Zero runs, so the copy goes through the zero/hole paths as well.
    for mib in (0..64).step_by(4) {
        data[mib << 20..(mib + 1) << 20].fill(0);
    }
    std::fs::write(&source, &data).unwrap();

    // nbdcopy uses several connections (CAN_MULTI_CONN) with many requests each.
    succeed(tool("nbdcopy").arg(&source).arg(server.uri("disk")));
    assert!(
        server.disk_read(0, DISK_SIZE as u32) == data,
        "device differs from the source"
    );
    succeed(tool("nbdcopy").arg(server.uri("disk")).arg(&copy));
    succeed(tool("cmp").arg(&source).arg(&copy));
}

#[test]
fn fio_random_io_verifies() {
    let server = Server::start();
    // fio leaves a verify state file in its working directory.
    let work = tempfile::tempdir().unwrap();
    let out = succeed(tool("fio").current_dir(work.path()).args([
        "--name=verify",
        "--ioengine=nbd",
        &format!("--uri={}", server.uri("disk")),
        "--rw=randwrite",
        "--bsrange=512-256k",
        "--iodepth=64",
        "--size=32M",
        "--verify=crc32c",
        "--do_verify=1",
        "--verify_fatal=1",
    ]));
    assert!(out.contains("err= 0"), "{out}");
}

#[test]
fn nbdsh_structured_and_simple_replies() {
    let server = Server::start();
    let script = NBDSH_SCRIPT.replace("@URI@", &server.uri("disk"));
    let out = succeed(tool("nbdsh").args(["-c", &script]));
    assert_eq!(
        out.trim(),
        "checked structured=True\nchecked structured=False",
        "{out}"
    );
}

/// Runs once with structured replies and once without. Strict mode is off so libnbd
/// sends the invalid requests instead of refusing them itself.
const NBDSH_SCRIPT: &str = r#"
import os
MIB = 1 << 20

def expect(errno, call):
    try:
        call()
    except nbd.Error as e:
        assert e.errno == errno, (errno, e)
        return
    raise AssertionError("expected " + errno)

for structured in (True, False):
    h = nbd.NBD()
    h.set_request_structured_replies(structured)
    h.add_meta_context("base:allocation")
    h.set_strict_mode(0)
    h.connect_uri("@URI@")
    assert h.get_structured_replies_negotiated() == structured
    assert h.can_df() == structured
    assert h.can_meta_context("base:allocation") == structured
    assert h.can_flush() and h.can_fua() and h.can_trim() and h.can_zero() and h.can_cache()
    assert h.can_multi_conn() and not h.is_read_only()
    size = h.get_size()
    assert size == 64 * MIB
    assert h.get_block_size(nbd.SIZE_MAXIMUM) == 32 * MIB

    base = 8 * MIB if structured else 16 * MIB
    data = os.urandom(300000)
    h.pwrite(data, base, nbd.CMD_FLAG_FUA)
    assert h.pread(len(data), base) == data
    h.flush()
    h.cache(len(data), base)
    h.zero(4096, base, nbd.CMD_FLAG_NO_HOLE)
    h.trim(8192, base + 4096)
    assert h.pread(12288, base) == bytes(12288)
    assert h.pread(len(data) - 12288, base + 12288) == data[12288:]
    # FAST_ZERO is advertised and honoured, inside one block too.
    assert h.can_fast_zero()
    h.zero(100, base + 20000, nbd.CMD_FLAG_FAST_ZERO)
    assert h.pread(200, base + 19950) == data[19950:20000] + bytes(100) + data[20100:20150]
    h.pwrite(data[20000:20100], base + 20000)
    big = os.urandom(32 * MIB)
    h.pwrite(big, 32 * MIB)
    assert h.pread(32 * MIB, 32 * MIB) == big

    expect("EINVAL", lambda: h.pread(4096, size - 1024))
    expect("ENOSPC", lambda: h.pwrite(b"x" * 4096, size - 1024))
    expect("ENOSPC", lambda: h.zero(4096, size))
    expect("ENOSPC", lambda: h.trim(4096, size))
    expect("EINVAL", lambda: h.cache(4096, size))
    expect("EINVAL", lambda: h.pread(32 * MIB + 1, 0))
    expect("EINVAL", lambda: h.pwrite(bytes(32 * MIB + 1), 0))
    expect("EINVAL", lambda: h.pread(4096, 0, nbd.CMD_FLAG_REQ_ONE))
    # Every error left the connection usable, and the oversized write changed nothing.
    assert h.pread(len(data) - 12288, base + 12288) == data[12288:]
    assert h.pread(4096, 32 * MIB) == big[:4096]

    if structured:
        assert h.pread(65536, base + 12288, nbd.CMD_FLAG_DF) == data[12288:12288 + 65536]
        seen = []
        collect = lambda context, offset, entries, err: seen.append((context, offset, list(entries)))
        h.block_status(MIB, base, collect)
        tail = 303104  # the data, rounded up to the device's 4 KiB blocks
        expected = [4096, 0, 8192, 3, tail - 12288, 0, MIB - tail, 3]
        assert seen == [("base:allocation", base, expected)], seen
        seen.clear()
        h.block_status(MIB, base, collect, nbd.CMD_FLAG_REQ_ONE)
        assert seen == [("base:allocation", base, [4096, 0])], seen
        expect("EINVAL", lambda: h.block_status(4096, size - 1024, collect))
    h.shutdown()
    print("checked structured=%s" % structured)
"#;
