//! A master over the in-memory metadata store, for the tests beside this folder.

use floe_master::{Master, Settings};
use floe_metadata::memory::MemoryStore;
use floe_protocol::server::Handler;
use floe_protocol::{
    ConnectionPool, DeviceClass, MasterRequest, Registration, Request, Response, VolumeMode,
    VolumeSpec,
};
use std::sync::Arc;

pub async fn call(master: &Arc<Master>, request: MasterRequest) -> Response {
    master.clone().handle(Request::Master(request)).await
}

/// A master with `replicas` servers and volume `demo` (that many replicas).
pub async fn master_with_a_volume(replicas: u32) -> Arc<Master> {
    let master = Arc::new(
        Master::load(
            Box::new(MemoryStore::default()),
            Settings::default(),
            ConnectionPool::default(),
        )
        .await
        .unwrap(),
    );
    for n in 0..replicas {
        let register = MasterRequest::Register(Registration {
            uuid: format!("server-{n}"),
            address: format!("127.0.0.1:{}", n + 1),
            host: format!("host-{n}"),
            class: DeviceClass::Ssd,
            emulated: false,
            capacity_bytes: 1 << 30,
        });
        call(&master, register).await;
    }
    let spec = VolumeSpec {
        name: "demo".into(),
        size_bytes: 1 << 30,
        replicas,
        chunk_bytes: 64 << 20,
        stripe_unit_bytes: 64 << 10,
        stripe_count: 1,
        mode: VolumeMode::Ssd,
        write_mode: Default::default(),
    };
    let created = call(&master, MasterRequest::CreateVolume(spec)).await;
    assert!(matches!(created, Response::Master(_)), "{created:?}");
    master
}
