//! A cluster as `floe demo` runs it, TLS between its processes: the data path works
//! through it (and through a chunk server's kill -9), and strangers are refused: no
//! certificate, one from another CA, or one whose role does not allow the request.
//! Nothing they asked changes anything, and every server stays up.

use crate::cluster::{ok, output, random_file, Cluster, Spawned, TestDir, FLOE};
use crate::io_helpers::text;
use floe_protocol::connection::{CallError, Connection};
use floe_protocol::tls::Tls;
use floe_protocol::{ChunkId, DeviceClass, MasterRequest, Registration, Request, Stamp, Status};
use std::path::Path;
use std::process::Command;

/// Calls `address` once as the holder of `tls` (plain TCP if `None`).
fn call_as(tls: Option<&Tls>, address: &str, request: Request) -> Result<String, String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let connection = Connection::connect_with(address, tls)
            .await
            .map_err(|e| e.to_string())?;
        match connection.call(request).await {
            Ok(reply) => Ok(format!("{reply:?}")),
            Err(CallError::Remote {
                status: Status::Forbidden,
                message,
            }) => Err(format!("forbidden: {message}")),
            Err(e) => Err(e.to_string()),
        }
    })
}

fn load(certs: &Path, name: &str) -> Tls {
    Tls::load(&certs.join("ca.pem"), &certs.join(format!("{name}.pem"))).unwrap()
}

fn compare(a: &Path, b: &Path) {
    ok(Command::new("qemu-img")
        .args(["compare", "-f", "raw", "-F", "raw"])
        .arg(a)
        .arg(b));
}

#[test]
fn a_tls_cluster_serves_its_clients_and_refuses_strangers() {
    let dir = TestDir::new();
    let cluster = Cluster::start_tls(dir.path());
    let certs = cluster.info.certs.clone().expect("the demo runs TLS");
    let work = TestDir::new();
    let image = work.path().join("random.img");
    random_file(&image, 48 << 20);
    ok(Command::new("qemu-img")
        .args(["convert", "-n", "-f", "raw", "-O", "raw"])
        .arg(&image)
        .arg(cluster.uri()));

    // The operator's certificate runs admin commands.
    cluster.floe(&["volume", "create", "spare", "--size", "64M"]);
    assert!(cluster.floe(&["volume", "list"]).contains("spare"));

    // No certificate: one line that says what is missing; the master logs the peer.
    let plain =
        output(Command::new(FLOE).args(["--master", &cluster.info.master, "volume", "list"]));
    assert!(!plain.status.success());
    let said = text(&plain);
    assert!(said.contains("give --ca and --cert"), "{said}");
    assert_eq!(said.trim().lines().count(), 1, "{said}");

    // Another CA's operator certificate: refused at the handshake, nothing deleted.
    let foreign = work.path().join("foreign");
    ok(Command::new(FLOE).args(["cert", "init"]).arg(&foreign));
    ok(Command::new(FLOE)
        .args(["cert", "issue"])
        .arg(&foreign)
        .args(["admin", "--role", "admin"]));
    let stranger = output(
        Command::new(FLOE)
            .args([
                "--master",
                &cluster.info.master,
                "volume",
                "delete",
                "spare",
            ])
            .env("FLOE_CA", foreign.join("ca.pem"))
            .env("FLOE_CERT", foreign.join("admin.pem")),
    );
    assert!(!stranger.status.success());
    let said = text(&stranger);
    assert!(said.contains("cannot connect"), "{said}");

    // The stranger's own calls: a chunk write, a lease grab; refused before a frame.
    let foreign_tls = load(&foreign, "admin");
    let chunkserver = format!("127.0.0.1:{}", cluster.port + 1);
    let write = Request::Write {
        chunk: ChunkId {
            volume_id: 1,
            index: 0,
        },
        stamp: Stamp::default(),
        offset: 0,
        epoch: 0,
        catch_up: false,
        unsynced: false,
        retain: false,
        forward: Vec::new(),
        data: vec![0xee; 4096].into(),
    };
    let grab = Request::Master(MasterRequest::AcquireLease {
        name: "demo".into(),
        holder: "stranger".into(),
        attempt: 0,
    });
    for (address, request) in [(&chunkserver, write.clone()), (&cluster.info.master, grab)] {
        let refused = call_as(Some(&foreign_tls), address, request.clone());
        assert!(refused.is_err(), "{refused:?}");
        let refused = call_as(None, address, request);
        assert!(refused.is_err(), "{refused:?}");
    }

    // Certificates of the cluster, for the wrong roles: a gateway may not delete a
    // volume, nor heartbeat as a chunk server.
    let gateway = cluster
        .command_as("gateway")
        .args(["volume", "delete", "spare"])
        .output()
        .unwrap();
    let said = text(&gateway);
    assert!(
        !gateway.status.success() && said.contains("role admin"),
        "{said}"
    );
    let fake_server = Request::Master(MasterRequest::Register(Registration {
        uuid: "fake".into(),
        address: "127.0.0.1:9".into(),
        host: "fake".into(),
        class: DeviceClass::Ssd,
        emulated: false,
        capacity_bytes: 1 << 40,
    }));
    let refused = call_as(
        Some(&load(&certs, "gateway")),
        &cluster.info.master,
        fake_server,
    );
    assert!(
        refused.as_ref().is_err_and(|e| e.starts_with("forbidden")),
        "{refused:?}"
    );

    // Nothing changed, every server is up, the data is intact.
    assert!(cluster.floe(&["volume", "list"]).contains("spare"));
    let status = cluster.floe(&["status"]);
    assert!(status.contains("6/6 chunk servers up"), "{status}");
    let back = work.path().join("back.img");
    copy_from(cluster.uri(), &back, 48 << 20);
    compare(&image, &back);

    // A chunk server killed with -9: the volume goes on over TLS with the others.
    let victim = cluster.info.chunkserver_pids[0];
    // SAFETY: kill(2) on a chunk server this test's cluster started.
    unsafe { libc::kill(victim as i32, libc::SIGKILL) };
    ok(Command::new("qemu-img")
        .args(["convert", "-n", "-f", "raw", "-O", "raw"])
        .arg(&back)
        .arg(cluster.uri()));
    let again = work.path().join("again.img");
    copy_from(cluster.uri(), &again, 48 << 20);
    compare(&image, &again);
}

/// `nbd` as written back in full: nbdcopy writes a file only as far as its last data.
fn copy_from(nbd: &str, path: &Path, bytes: u64) {
    ok(Command::new("nbdcopy").arg(nbd).arg(path));
    let file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    file.set_len(bytes).unwrap();
}

/// A gateway of the test's own (a TLS cluster's certificate), with an access list.
struct Gateway {
    _child: Spawned,
    address: String,
}

/// `extra`: more of the gateway's arguments.
fn gateway_with_access(cluster: &Cluster, rules: &str, work: &Path, extra: &[&Path]) -> Gateway {
    let access = work.join("access");
    std::fs::write(&access, rules).unwrap();
    let address = format!("127.0.0.1:{}", crate::cluster::free_ports());
    let log = std::fs::File::create(work.join("gateway.log")).unwrap();
    let child = cluster
        .command_as("gateway")
        .args(["gateway", "--listen", &address, "--nbd-access"])
        .arg(&access)
        .args(extra)
        .stderr(log)
        .spawn()
        .unwrap();
    crate::io_helpers::wait_until(
        "the gateway listens",
        std::time::Duration::from_secs(30),
        || std::net::TcpStream::connect(&address).is_ok(),
    );
    Gateway {
        _child: Spawned(child),
        address,
    }
}

/// HOST:PORT of the demo's gateway.
fn nbd_address(cluster: &Cluster) -> String {
    let uri = cluster.uri().trim_start_matches("nbd://");
    uri.trim_end_matches("/demo").to_string()
}

#[test]
fn nbd_over_tls_with_client_certificates_and_an_access_list() {
    let dir = TestDir::new();
    let cluster = Cluster::start_tls(dir.path());
    let certs = cluster.info.certs.clone().expect("the demo runs TLS");
    let client = certs.join("client");
    let work = TestDir::new();
    let nbd = nbd_address(&cluster);
    let nbds = |address: &str, export: &str| {
        format!(
            "nbds://{address}/{export}?tls-certificates={}",
            client.display()
        )
    };

    // libnbd over TLS with the demo's client certificate: write, read back.
    let image = work.path().join("random.img");
    random_file(&image, 8 << 20);
    ok(Command::new("nbdcopy").arg(&image).arg(nbds(&nbd, "demo")));
    let info = ok(Command::new("nbdinfo").arg(nbds(&nbd, "demo")));
    assert!(info.contains("with TLS"), "{info}");
    let back = work.path().join("back.img");
    copy_from(&nbds(&nbd, "demo"), &back, 8 << 20);
    compare(&image, &back);

    // QEMU's tls-creds-x509 reads the same directory.
    let (host, port) = nbd.split_once(':').unwrap();
    let qemu = ok(Command::new("qemu-img")
        .args(["info", "--object"])
        .arg(format!("tls-creds-x509,id=tls0,dir={},endpoint=client", client.display()))
        .args(["--image-opts"])
        .arg(format!(
            "driver=nbd,server.type=inet,server.host={host},server.port={port},export=demo,tls-creds=tls0"
        )));
    assert!(qemu.contains("1 GiB"), "{qemu}");

    // A client certificate is not a key to the cluster's own processes.
    let refused = call_as(
        Some(&load(&certs, "client")),
        &cluster.info.master,
        Request::Master(MasterRequest::ListVolumes),
    );
    assert!(
        refused.as_ref().is_err_and(|e| e.starts_with("forbidden")),
        "{refused:?}"
    );

    // The access list: the client certificate reads demo but may not write it;
    // anyone writes spare; no one else opens demo.
    cluster.floe(&["volume", "create", "spare", "--size", "64M"]);
    let gateway = gateway_with_access(&cluster, "client demo ro\n* spare rw\n", work.path(), &[]);
    let read = ok(Command::new("nbdinfo").arg(nbds(&gateway.address, "demo")));
    assert!(read.contains("export-size: 1073741824"), "{read}");
    let write = output(
        Command::new("nbdcopy")
            .arg(&image)
            .arg(nbds(&gateway.address, "demo")),
    );
    assert!(!write.status.success(), "a read-only grant wrote");
    ok(Command::new("nbdcopy")
        .arg(&image)
        .arg(format!("nbd://{}/spare", gateway.address)));
    let stranger = output(Command::new("nbdinfo").arg(format!("nbd://{}/demo", gateway.address)));
    assert!(!stranger.status.success());
    // libnbd names only the kind of refusal (NBD_REP_ERR_POLICY); QEMU its text.
    let qemu =
        output(Command::new("qemu-img").args(["info", &format!("nbd://{}/demo", gateway.address)]));
    let said = text(&qemu);
    assert!(
        said.contains("a client without a certificate or key may not open demo"),
        "{said}"
    );
    let copied = work.path().join("through-acl.img");
    copy_from(&nbds(&gateway.address, "demo"), &copied, 8 << 20);
    compare(&image, &copied);
}

#[test]
fn nbd_over_tls_with_pre_shared_keys_and_an_access_list() {
    let dir = TestDir::new();
    let cluster = Cluster::start_tls(dir.path());
    let certs = cluster.info.certs.clone().expect("the demo runs TLS");
    // The demo's key file: QEMU reads DIR/keys.psk, libnbd the file.
    let psk_dir = certs.join("psk");
    let keys = psk_dir.join("keys.psk");
    let work = TestDir::new();
    let nbd = nbd_address(&cluster);
    let nbds = |who: &str, address: &str, export: &str, keys: &Path| {
        format!(
            "nbds://{who}@{address}/{export}?tls-psk-file={}",
            keys.display()
        )
    };

    // libnbd over TLS-PSK: write, read back.
    let image = work.path().join("random.img");
    random_file(&image, 8 << 20);
    ok(Command::new("nbdcopy")
        .arg(&image)
        .arg(nbds("client", &nbd, "demo", &keys)));
    let info = ok(Command::new("nbdinfo").arg(nbds("client", &nbd, "demo", &keys)));
    assert!(info.contains("with TLS"), "{info}");
    let back = work.path().join("back.img");
    copy_from(&nbds("client", &nbd, "demo", &keys), &back, 8 << 20);
    compare(&image, &back);

    // QEMU's tls-creds-psk: read the same bytes.
    let qemu_image = |who: &str, dir: &Path, at: &str, export: &str| {
        let (host, port) = at.split_once(':').unwrap();
        [
            "--object".to_string(),
            format!(
                "tls-creds-psk,id=tls0,endpoint=client,dir={},username={who}",
                dir.display()
            ),
            "--image-opts".to_string(),
            format!(
                "driver=nbd,server.type=inet,server.host={host},server.port={port},export={export},tls-creds=tls0"
            ),
        ]
    };
    let through_qemu = work.path().join("qemu.img");
    let mut convert = Command::new("qemu-img");
    convert
        .args(["convert", "-O", "raw"])
        .args(qemu_image("client", &psk_dir, &nbd, "demo"));
    ok(convert.arg(&through_qemu));
    compare(&image, &through_qemu);

    // The right name with the wrong key, or a name the gateway does not know:
    // refused at the handshake, and the gateway serves the next client.
    let forged = work.path().join("forged");
    std::fs::create_dir(&forged).unwrap();
    let forged_keys = forged.join("keys.psk");
    ok(Command::new(FLOE)
        .args(["cert", "psk"])
        .arg(&forged_keys)
        .arg("client"));
    ok(Command::new(FLOE)
        .args(["cert", "psk"])
        .arg(&forged_keys)
        .arg("mallory"));
    for who in ["client", "mallory"] {
        let refused = output(Command::new("nbdinfo").arg(nbds(who, &nbd, "demo", &forged_keys)));
        assert!(
            !refused.status.success(),
            "{who} with a forged key was served"
        );
    }
    let mut forged_qemu = Command::new("qemu-img");
    forged_qemu
        .arg("info")
        .args(qemu_image("client", &forged, &nbd, "demo"));
    assert!(!output(&mut forged_qemu).status.success());
    ok(Command::new("nbdinfo").arg(nbds("client", &nbd, "demo", &keys)));

    // The access list names key identities as it names certificates: client reads
    // demo only; bob writes spare and may not open demo.
    ok(Command::new(FLOE)
        .args(["cert", "psk"])
        .arg(&keys)
        .arg("bob"));
    cluster.floe(&["volume", "create", "spare", "--size", "64M"]);
    let gateway = gateway_with_access(
        &cluster,
        "client demo ro\nbob spare rw\n",
        work.path(),
        &[Path::new("--nbd-psk"), &keys],
    );
    let at = &gateway.address;
    copy_from(&nbds("client", at, "demo", &keys), &back, 8 << 20);
    compare(&image, &back);
    let write = output(
        Command::new("nbdcopy")
            .arg(&image)
            .arg(nbds("client", at, "demo", &keys)),
    );
    assert!(!write.status.success(), "a read-only grant wrote");
    ok(Command::new("nbdcopy")
        .arg(&image)
        .arg(nbds("bob", at, "spare", &keys)));
    let spare = work.path().join("spare.img");
    copy_from(&nbds("bob", at, "spare", &keys), &spare, 8 << 20);
    compare(&image, &spare);
    let mut bob_qemu = Command::new("qemu-img");
    bob_qemu
        .arg("info")
        .args(qemu_image("bob", &psk_dir, at, "demo"));
    let refused = output(&mut bob_qemu);
    let said = text(&refused);
    assert!(!refused.status.success());
    assert!(said.contains("client bob may not open demo"), "{said}");
}

#[test]
fn revoked_certificates_are_refused_from_the_next_connection_without_a_restart() {
    let dir = TestDir::new();
    let cluster = Cluster::start_tls(dir.path());
    let certs = cluster.info.certs.clone().expect("the demo runs TLS");
    let nbd = nbd_address(&cluster);
    for (name, role) in [("eve", "client"), ("ops", "admin")] {
        ok(Command::new(FLOE)
            .args(["cert", "issue"])
            .arg(&certs)
            .args([name, "--role", role]));
    }
    let nbdinfo = |client: &str| {
        output(Command::new("nbdinfo").arg(format!(
            "nbds://{nbd}/demo?tls-certificates={}",
            certs.join(client).display()
        )))
    };
    assert!(nbdinfo("eve").status.success());
    ok(cluster.command_as("ops").args(["volume", "list"]));

    for name in ["eve", "ops"] {
        let said = ok(Command::new(FLOE)
            .args(["cert", "revoke"])
            .arg(&certs)
            .arg(name));
        assert!(said.contains(&format!("revoked {name}")), "{said}");
    }
    let again = output(
        Command::new(FLOE)
            .args(["cert", "revoke"])
            .arg(&certs)
            .arg("eve"),
    );
    assert!(!again.status.success());
    assert!(text(&again).contains("revoked already"), "{}", text(&again));

    // The gateway and the master read the new list at the next handshake.
    let refused = nbdinfo("eve");
    assert!(!refused.status.success(), "a revoked client was served");
    let admin = output(cluster.command_as("ops").args(["volume", "list"]));
    assert!(!admin.status.success(), "a revoked operator was served");
    let said = text(&admin);
    assert!(said.to_lowercase().contains("revoked"), "{said}");
    assert_eq!(said.trim().lines().count(), 1, "{said}");

    // Everyone else is served as before, by processes that never restarted.
    assert!(nbdinfo("client").status.success());
    let status = cluster.floe(&["status"]);
    assert!(status.contains("6/6 chunk servers up"), "{status}");
}
