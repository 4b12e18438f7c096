//! The B-tree against a `BTreeMap` model, on a RAM device.

use floe_blockdev::memory::MemoryDevice;
use floe_isotope::btree::{Tree, TreeError};
use floe_isotope::{layout, Isolation, Outcome, TxVolume};
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;
use std::sync::Arc;

async fn volume() -> TxVolume {
    let device = Arc::new(MemoryDevice::new(layout::LOG_REGION_BYTES + (4 << 20)));
    TxVolume::open(device, Isolation::StrictSerializable)
        .await
        .unwrap()
}

#[tokio::test]
async fn random_puts_deletes_and_ranges_match_a_model_across_transactions() {
    let v = volume().await;
    let end = v.data_blocks();
    let mut model = BTreeMap::new();
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    for _ in 0..300 {
        let mut t = v.begin().unwrap();
        let mut tree = Tree::attach(&mut t, 0, end).await.unwrap();
        let mut changes = Vec::new();
        for _ in 0..10 {
            let key = format!("k{:05}", rng.gen_range(0..4000)).into_bytes();
            if rng.gen_bool(0.15) {
                let existed = tree.delete(&key).await.unwrap();
                changes.push((key, None, existed));
            } else {
                let value = format!("v{}", rng.gen::<u32>()).into_bytes();
                tree.put(&key, &value).await.unwrap();
                changes.push((key, Some(value), true));
            }
        }
        // Some transactions abort: nothing of them may show.
        if rng.gen_bool(0.1) {
            t.abort();
            continue;
        }
        assert!(matches!(
            t.commit().await.unwrap(),
            Outcome::Committed { .. }
        ));
        for (key, value, existed) in changes {
            match value {
                Some(value) => {
                    model.insert(key, value);
                }
                None => assert_eq!(model.remove(&key).is_some(), existed),
            }
        }
    }
    let mut t = v.begin().unwrap();
    let mut tree = Tree::attach(&mut t, 0, end).await.unwrap();
    for (key, value) in model.iter().step_by(7) {
        assert_eq!(tree.get(key).await.unwrap().as_ref(), Some(value));
    }
    assert_eq!(tree.get(b"absent").await.unwrap(), None);
    let all = tree.range(b"", b"", usize::MAX).await.unwrap();
    assert_eq!(all, model.clone().into_iter().collect::<Vec<_>>());
    let some = tree.range(b"k01000", b"k02000", 50).await.unwrap();
    let expected: Vec<_> = model
        .range(b"k01000".to_vec()..b"k02000".to_vec())
        .take(50)
        .map(|(k, v)| (k.clone(), v.clone()))
        .collect();
    assert_eq!(some, expected);
    assert!(
        model.len() > 1000,
        "deep enough to split internal nodes: {}",
        model.len()
    );
    assert_eq!(
        tree.put(&[b'k'; 33], b"").await,
        Err(TreeError::KeyLength(33))
    );
}

#[tokio::test]
async fn concurrent_inserts_conflict_only_where_they_share_a_node() {
    let v = volume().await;
    let end = v.data_blocks();
    // Enough keys for several leaves.
    let mut t = v.begin().unwrap();
    let mut tree = Tree::attach(&mut t, 0, end).await.unwrap();
    for i in 0..200 {
        tree.put(format!("k{i:03}").as_bytes(), b"0").await.unwrap();
    }
    t.commit().await.unwrap();
    let mut a = v.begin().unwrap();
    let mut b = v.begin().unwrap();
    Tree::attach(&mut a, 0, end)
        .await
        .unwrap()
        .put(b"k000", b"a")
        .await
        .unwrap();
    Tree::attach(&mut b, 0, end)
        .await
        .unwrap()
        .put(b"k199", b"b")
        .await
        .unwrap();
    assert!(matches!(
        a.commit().await.unwrap(),
        Outcome::Committed { .. }
    ));
    assert!(
        matches!(b.commit().await.unwrap(), Outcome::Committed { .. }),
        "other leaves"
    );
    let mut a = v.begin().unwrap();
    let mut b = v.begin().unwrap();
    Tree::attach(&mut a, 0, end)
        .await
        .unwrap()
        .put(b"k001", b"a")
        .await
        .unwrap();
    Tree::attach(&mut b, 0, end)
        .await
        .unwrap()
        .put(b"k002", b"b")
        .await
        .unwrap();
    assert!(matches!(
        a.commit().await.unwrap(),
        Outcome::Committed { .. }
    ));
    assert_eq!(b.commit().await.unwrap(), Outcome::Conflict, "one leaf");
}
