//! A cluster as `floe demo` runs it, TLS between its processes: the data path works
//! through it (and through a chunk server's kill -9), and strangers are refused: no
//! certificate, one from another CA, or one whose role does not allow the request.
//! Nothing they asked changes anything, and every server stays up.

use crate::cluster::{ok, output, random_file, Cluster, TestDir, FLOE};
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
        catch_up: false,
        unsynced: false,
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
    read_back(&cluster, &back, 48 << 20);
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
    read_back(&cluster, &again, 48 << 20);
    compare(&image, &again);
}

/// The first `bytes` of the demo volume into `path`.
fn read_back(cluster: &Cluster, path: &Path, bytes: u64) {
    ok(Command::new("nbdcopy").arg(cluster.uri()).arg(path));
    let file = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    file.set_len(bytes).unwrap();
}
