//! Isolation and API checks on a RAM device, with deterministic interleavings.

use bytes::Bytes;
use floe_blockdev::memory::MemoryDevice;
use floe_isotope::{layout, Isolation, Outcome, TxError, TxVolume, BLOCK_BYTES};
use std::sync::Arc;

async fn volume(isolation: Isolation) -> TxVolume {
    let device = Arc::new(MemoryDevice::new(layout::LOG_REGION_BYTES + (2 << 20)));
    TxVolume::open(device, isolation).await.unwrap()
}

fn block_of(value: u64) -> Bytes {
    let mut data = vec![0u8; BLOCK_BYTES];
    data[..8].copy_from_slice(&value.to_le_bytes());
    Bytes::from(data)
}

fn value_of(data: &[u8]) -> u64 {
    u64::from_le_bytes(data[..8].try_into().unwrap())
}

fn committed(outcome: Outcome) -> bool {
    matches!(outcome, Outcome::Committed { .. })
}

#[tokio::test]
async fn a_commit_is_seen_by_later_transactions_and_an_abort_by_none() {
    let v = volume(Isolation::StrictSerializable).await;
    let mut t = v.begin().unwrap();
    t.write(3, block_of(7)).unwrap();
    assert_eq!(
        value_of(&t.read(3).await.unwrap()),
        7,
        "reads its own write"
    );
    assert_eq!(t.commit().await.unwrap(), Outcome::Committed { version: 1 });
    let mut t = v.begin().unwrap();
    t.write(3, block_of(8)).unwrap();
    t.abort();
    let mut t = v.begin().unwrap();
    assert_eq!(value_of(&t.read(3).await.unwrap()), 7);
    assert_eq!(v.version(), 1);
}

#[tokio::test]
async fn a_transaction_reads_its_snapshot_while_others_commit() {
    let v = volume(Isolation::Snapshot).await;
    let mut old = v.begin().unwrap();
    let mut t = v.begin().unwrap();
    t.write(1, block_of(5)).unwrap();
    assert!(committed(t.commit().await.unwrap()));
    assert_eq!(value_of(&old.read(1).await.unwrap()), 0, "as of its start");
    let mut new = v.begin().unwrap();
    assert_eq!(value_of(&new.read(1).await.unwrap()), 5);
}

/// Two transactions read a counter and write it plus one.
async fn lost_update(isolation: Isolation) {
    let v = volume(isolation).await;
    let mut a = v.begin().unwrap();
    let mut b = v.begin().unwrap();
    let x = value_of(&a.read(0).await.unwrap());
    let y = value_of(&b.read(0).await.unwrap());
    a.write(0, block_of(x + 1)).unwrap();
    b.write(0, block_of(y + 1)).unwrap();
    assert!(committed(a.commit().await.unwrap()));
    assert_eq!(
        b.commit().await.unwrap(),
        Outcome::Conflict,
        "{isolation:?}"
    );
    let mut check = v.begin().unwrap();
    assert_eq!(value_of(&check.read(0).await.unwrap()), 1);
}

#[tokio::test]
async fn no_lost_update_under_either_isolation() {
    lost_update(Isolation::StrictSerializable).await;
    lost_update(Isolation::Snapshot).await;
}

/// Two doctors on call (blocks 0 and 1 hold 1 each); each goes off call if the other
/// is on: both read both, each writes its own. Returns how many went off.
async fn write_skew(isolation: Isolation) -> u64 {
    let v = volume(isolation).await;
    let mut setup = v.begin().unwrap();
    setup.write(0, block_of(1)).unwrap();
    setup.write(1, block_of(1)).unwrap();
    assert!(committed(setup.commit().await.unwrap()));
    let mut a = v.begin().unwrap();
    let mut b = v.begin().unwrap();
    for (t, mine) in [(&mut a, 0), (&mut b, 1)] {
        let on = value_of(&t.read(0).await.unwrap()) + value_of(&t.read(1).await.unwrap());
        assert_eq!(on, 2);
        t.write(mine, block_of(0)).unwrap();
    }
    let outcomes = [a.commit().await.unwrap(), b.commit().await.unwrap()];
    let mut check = v.begin().unwrap();
    let on = value_of(&check.read(0).await.unwrap()) + value_of(&check.read(1).await.unwrap());
    assert_eq!(
        2 - on,
        outcomes.iter().filter(|o| committed(**o)).count() as u64
    );
    2 - on
}

#[tokio::test]
async fn write_skew_only_under_snapshot_isolation() {
    assert_eq!(
        write_skew(Isolation::StrictSerializable).await,
        1,
        "SS forbids write skew"
    );
    assert_eq!(write_skew(Isolation::Snapshot).await, 2, "SI allows it");
}

#[tokio::test]
async fn isolation_can_be_chosen_per_transaction() {
    let v = volume(Isolation::StrictSerializable).await;
    let mut a = v.begin_with(Isolation::Snapshot).unwrap();
    let mut b = v.begin().unwrap();
    a.read(0).await.unwrap();
    a.write(1, block_of(1)).unwrap();
    b.read(1).await.unwrap();
    b.write(0, block_of(1)).unwrap();
    assert!(committed(b.commit().await.unwrap()));
    assert!(
        committed(a.commit().await.unwrap()),
        "SI ignores its read of block 0"
    );
}

#[tokio::test]
async fn marked_fragments_of_one_block_do_not_conflict_and_both_updates_are_kept() {
    let v = volume(Isolation::StrictSerializable).await;
    let mut a = v.begin().unwrap();
    let mut b = v.begin().unwrap();
    for (t, at) in [(&mut a, 0usize), (&mut b, 16)] {
        let mut data = t.read(9).await.unwrap().to_vec();
        data[at] = 0xaa;
        t.write(9, Bytes::from(data)).unwrap();
        t.mark_accessed(9, at, 16).unwrap();
    }
    assert!(committed(a.commit().await.unwrap()));
    assert!(committed(b.commit().await.unwrap()));
    let mut check = v.begin().unwrap();
    let data = check.read(9).await.unwrap();
    assert_eq!(
        (data[0], data[16]),
        (0xaa, 0xaa),
        "b's block merged onto a's"
    );

    // The same fragment marked by both: the second conflicts.
    let mut a = v.begin().unwrap();
    let mut b = v.begin().unwrap();
    for t in [&mut a, &mut b] {
        t.read(9).await.unwrap();
        t.write(9, block_of(1)).unwrap();
        t.mark_accessed(9, 8, 4).unwrap();
    }
    assert!(committed(a.commit().await.unwrap()));
    assert_eq!(b.commit().await.unwrap(), Outcome::Conflict);
}

#[tokio::test]
async fn bad_calls_get_clear_errors() {
    let v = volume(Isolation::StrictSerializable).await;
    let mut t = v.begin().unwrap();
    t.read(2).await.unwrap();
    for (offset, length) in [(4090, 7), (0, 0), (4096, 1), (usize::MAX, 2)] {
        assert_eq!(
            t.mark_accessed(2, offset, length),
            Err(TxError::MarkOutsideBlock { offset, length })
        );
    }
    assert_eq!(
        t.mark_accessed(3, 0, 16),
        Err(TxError::NotAccessed { block: 3 })
    );
    let blocks = v.data_blocks();
    let past = t.read(blocks).await.unwrap_err();
    assert_eq!(
        past,
        TxError::OutOfRange {
            block: blocks,
            blocks
        }
    );
    assert_eq!(
        t.write(0, Bytes::from(vec![0u8; 100])),
        Err(TxError::NotABlock { length: 100 })
    );
    for block in 0..layout::TX_BLOCKS_MAX as u64 {
        t.write(block, block_of(block)).unwrap();
    }
    let too_large = t
        .write(layout::TX_BLOCKS_MAX as u64, block_of(0))
        .unwrap_err();
    assert_eq!(
        too_large,
        TxError::TooLarge {
            blocks_max: layout::TX_BLOCKS_MAX
        }
    );
    assert!(
        too_large.to_string().starts_with("transaction too large"),
        "{too_large}"
    );
    // The blocks it could hold still commit, as one record.
    assert!(committed(t.commit().await.unwrap()));
    let mut check = v.begin().unwrap();
    assert_eq!(value_of(&check.read(255).await.unwrap()), 255);
}

#[tokio::test]
async fn a_released_transaction_is_taken_over_by_another_task() {
    let v = volume(Isolation::StrictSerializable).await;
    let mut t = v.begin().unwrap();
    t.write(4, block_of(44)).unwrap();
    let handle = t.release();
    let other = v.clone();
    let outcome = tokio::spawn(async move {
        let mut t = other.take_over(handle).unwrap();
        assert_eq!(
            value_of(&t.read(4).await.unwrap()),
            44,
            "its writes came along"
        );
        t.commit().await.unwrap()
    })
    .await
    .unwrap();
    assert!(committed(outcome));
    assert_eq!(
        v.take_over(handle).err(),
        Some(TxError::UnknownHandle(handle))
    );
}

#[tokio::test]
async fn a_transaction_left_open_is_preempted_once_the_window_is_full() {
    let device = Arc::new(MemoryDevice::new(layout::LOG_REGION_BYTES + (64 << 20)));
    let v = TxVolume::open(device, Isolation::Snapshot).await.unwrap();
    let mut idle = v.begin().unwrap();
    idle.read(0).await.unwrap();
    let commits = floe_isotope::volume::WINDOW_BLOCKS_MAX / layout::TX_BLOCKS_MAX + 1;
    for c in 0..commits as u64 {
        let mut t = v.begin().unwrap();
        for block in 0..layout::TX_BLOCKS_MAX as u64 {
            t.write(block, block_of(c)).unwrap();
        }
        assert!(committed(t.commit().await.unwrap()));
    }
    let preempted = idle.read(1).await.unwrap_err();
    assert!(
        matches!(preempted, TxError::Preempted { .. }),
        "{preempted}"
    );
    idle.write(1, block_of(1)).unwrap();
    assert_eq!(idle.commit().await.unwrap(), Outcome::Conflict);
    // Younger transactions still read their snapshots.
    let mut t = v.begin().unwrap();
    assert_eq!(value_of(&t.read(0).await.unwrap()), commits as u64 - 1);
}
