//! The key-value store on a RAM device.

use floe_blockdev::memory::MemoryDevice;
use floe_isotope::kv::{Kv, KvError};
use floe_isotope::{layout, Isolation, Outcome, TxVolume};
use std::sync::Arc;

async fn volume() -> TxVolume {
    let device = Arc::new(MemoryDevice::new(layout::LOG_REGION_BYTES + (1 << 20)));
    TxVolume::open(device, Isolation::StrictSerializable)
        .await
        .unwrap()
}

async fn put(v: &TxVolume, key: &str, value: &str) {
    let mut t = v.begin().unwrap();
    Kv::attach(&mut t, v.data_blocks())
        .await
        .unwrap()
        .put(key.as_bytes(), value.as_bytes())
        .await
        .unwrap();
    assert!(matches!(
        t.commit().await.unwrap(),
        Outcome::Committed { .. }
    ));
}

async fn get(v: &TxVolume, key: &str) -> Option<String> {
    let mut t = v.begin().unwrap();
    let mut kv = Kv::attach(&mut t, v.data_blocks()).await.unwrap();
    let value = kv.get(key.as_bytes()).await.unwrap();
    value.map(|v| String::from_utf8(v.to_vec()).unwrap())
}

#[tokio::test]
async fn put_get_delete_scan() {
    let v = volume().await;
    assert_eq!(get(&v, "a").await, None);
    put(&v, "a", "1").await;
    put(&v, "b", "2").await;
    put(&v, "a", "3").await;
    assert_eq!(get(&v, "a").await.as_deref(), Some("3"));
    let mut t = v.begin().unwrap();
    let mut kv = Kv::attach(&mut t, v.data_blocks()).await.unwrap();
    assert!(kv.delete(b"b").await.unwrap());
    assert!(!kv.delete(b"zz").await.unwrap());
    kv.put(b"c/1", b"x").await.unwrap();
    kv.put(b"c/2", b"y").await.unwrap();
    let scanned = kv.scan(b"c/").await.unwrap();
    assert_eq!(
        scanned.iter().map(|(k, _)| &k[..]).collect::<Vec<_>>(),
        [&b"c/1"[..], b"c/2"]
    );
    assert_eq!(kv.put(&[b'k'; 61], b"").await, Err(KvError::KeyLength(61)));
    assert_eq!(
        kv.put(b"k", &[0; 193]).await,
        Err(KvError::ValueTooLong(193))
    );
    t.commit().await.unwrap();
    assert_eq!(get(&v, "b").await, None);
    let mut t = v.begin().unwrap();
    let all = Kv::attach(&mut t, v.data_blocks())
        .await
        .unwrap()
        .scan(b"")
        .await
        .unwrap();
    assert_eq!(all.len(), 3);
}

/// Two keys whose probe sequences start at the same block.
fn same_block_keys() -> (String, String) {
    let table_blocks = (layout::data_blocks(layout::LOG_REGION_BYTES + (1 << 20)) - 1)
        .min(floe_isotope::kv::TABLE_BLOCKS_MAX);
    let first = |k: &str| crc32c::crc32c(k.as_bytes()) as u64 % table_blocks;
    let a = "key-0".to_string();
    let b = (1..)
        .map(|i| format!("key-{i}"))
        .find(|k| first(k) == first(&a))
        .unwrap();
    (a, b)
}

#[tokio::test]
async fn updates_of_different_keys_in_one_block_commit_together_and_of_one_key_conflict() {
    let v = volume().await;
    let (a, b) = same_block_keys();
    put(&v, &a, "0").await;
    put(&v, &b, "0").await;
    let mut t1 = v.begin().unwrap();
    let mut t2 = v.begin().unwrap();
    for (t, key) in [(&mut t1, &a), (&mut t2, &b)] {
        let mut kv = Kv::attach(t, v.data_blocks()).await.unwrap();
        kv.put(key.as_bytes(), b"1").await.unwrap();
    }
    assert!(matches!(
        t1.commit().await.unwrap(),
        Outcome::Committed { .. }
    ));
    assert!(
        matches!(t2.commit().await.unwrap(), Outcome::Committed { .. }),
        "other slots"
    );
    assert_eq!(
        (get(&v, &a).await.as_deref(), get(&v, &b).await.as_deref()),
        (Some("1"), Some("1"))
    );

    let mut t1 = v.begin().unwrap();
    let mut t2 = v.begin().unwrap();
    for (t, value) in [(&mut t1, "x"), (&mut t2, "y")] {
        let mut kv = Kv::attach(t, v.data_blocks()).await.unwrap();
        kv.put(a.as_bytes(), value.as_bytes()).await.unwrap();
    }
    assert!(matches!(
        t1.commit().await.unwrap(),
        Outcome::Committed { .. }
    ));
    assert_eq!(t2.commit().await.unwrap(), Outcome::Conflict);
    assert_eq!(get(&v, &a).await.as_deref(), Some("x"));
}
