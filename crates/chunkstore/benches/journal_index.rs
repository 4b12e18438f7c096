//! The journal-index experiment of URSA §6.2 (Fig. 10): insert 700,000 random ranges
//! (start in [0, 2^20), length in [1, 2^6] sectors), then run 100,000 random range
//! queries, against
//! - `JournalIndex` (composite keys, tree + packed array) with automatic merges,
//! - `JournalIndex` split as in the paper: 600,000 inserts merged into the array, the
//!   last 100,000 left in the tree (no automatic merge),
//! - a `BTreeMap` with one entry per sector (offset -> journal position),
//! - redb with one key per sector, standing in for the paper's PebblesDB.
//!
//! Every structure returns the same journal pieces and holes for each query (checked).
//! Prints a table with ratios (time per operation over the automatically merged index's
//! on the same operations) and writes JSON to `target/journal_index_bench.json`.
//!
//! Environment: `JI_INSERTS`, `JI_QUERIES` override the operation counts;
//! `JI_KV_FRACTION` (default 10) runs redb on the first 1/N of both: at one write
//! transaction per range it needs about 0.2 ms per insert, minutes for the full run.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use floe_chunkstore::journal_index::{JournalIndex, Piece, DEFAULT_MERGE_THRESHOLD};
use rand::{rngs::StdRng, Rng, SeedableRng};
use redb::{Database, Durability, TableDefinition};

const SPACE: u64 = 1 << 20;
const MAX_LEN: u64 = 1 << 6;
const TABLE: TableDefinition<u64, u64> = TableDefinition::new("journal_index");

fn env_or(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .map(|v| v.parse().expect(name))
        .unwrap_or(default)
}

fn ranges(rng: &mut StdRng, n: usize) -> Vec<(u64, u64)> {
    (0..n)
        .map(|_| (rng.gen_range(0..SPACE), rng.gen_range(1..=MAX_LEN)))
        .collect()
}

/// Builds query pieces from per-sector `(offset, journal)` pairs in offset order,
/// joining neighbours whose journal positions are contiguous, as the index does.
fn pieces_from_sectors(
    offset: u64,
    len: u64,
    sectors: impl Iterator<Item = (u64, u64)>,
) -> Vec<Piece> {
    let mut pieces: Vec<Piece> = Vec::new();
    let mut at = offset;
    for (s, j) in sectors {
        if s > at {
            pieces.push(Piece::Hole {
                offset: at,
                len: s - at,
            });
        }
        match pieces.last_mut() {
            Some(Piece::Journal {
                offset: o,
                len: l,
                journal,
            }) if *o + *l == s && *journal + *l == j => *l += 1,
            _ => pieces.push(Piece::Journal {
                offset: s,
                len: 1,
                journal: j,
            }),
        }
        at = s + 1;
    }
    if at < offset + len {
        pieces.push(Piece::Hole {
            offset: at,
            len: offset + len - at,
        });
    }
    pieces
}

/// Joins contiguous journal pieces: the index may keep adjacent entries separate.
fn normalise(pieces: Vec<Piece>) -> Vec<Piece> {
    let mut out: Vec<Piece> = Vec::with_capacity(pieces.len());
    for p in pieces {
        if let (
            Some(Piece::Journal {
                offset: o,
                len: l,
                journal: j,
            }),
            Piece::Journal {
                offset: po,
                len: pl,
                journal: pj,
            },
        ) = (out.last_mut(), p)
        {
            if *o + *l == po && *j + *l == pj {
                *l += pl;
                continue;
            }
        }
        out.push(p);
    }
    out
}

struct Run {
    name: &'static str,
    /// Name of the run that ratios are relative to: the index on the same operations.
    baseline: &'static str,
    inserts: usize,
    queries: usize,
    insert: Duration,
    query: Duration,
    /// Query results, kept to check that every structure answers alike.
    answers: Vec<Vec<Piece>>,
}

impl Run {
    fn insert_ns(&self) -> f64 {
        self.insert.as_nanos() as f64 / self.inserts as f64
    }

    fn query_ns(&self) -> f64 {
        self.query.as_nanos() as f64 / self.queries as f64
    }
}

/// Runs the index; with `merge_at`, automatic merges are off and one merge runs
/// after that many inserts instead.
fn run_index(
    name: &'static str,
    inserts: &[(u64, u64)],
    queries: &[(u64, u64)],
    merge_at: Option<usize>,
) -> (Run, JournalIndex) {
    let mut index = JournalIndex::new(SPACE + MAX_LEN).unwrap();
    if merge_at.is_some() {
        index = index.with_merge_threshold(usize::MAX);
    }
    let start = Instant::now();
    let mut journal = 0;
    for (n, &(o, l)) in inserts.iter().enumerate() {
        if merge_at == Some(n) {
            index.merge();
        }
        index.insert(o, l, journal).unwrap();
        journal += l;
    }
    let insert = start.elapsed();
    let start = Instant::now();
    let answers: Vec<_> = queries
        .iter()
        .map(|&(o, l)| index.query(o, l).unwrap())
        .collect();
    let query = start.elapsed();
    let run = Run {
        name,
        baseline: "journal_index",
        inserts: inserts.len(),
        queries: queries.len(),
        insert,
        query,
        answers,
    };
    (run, index)
}

fn run_btree(inserts: &[(u64, u64)], queries: &[(u64, u64)]) -> Run {
    let mut map = BTreeMap::new();
    let start = Instant::now();
    let mut journal = 0;
    for &(o, l) in inserts {
        for i in 0..l {
            map.insert(o + i, journal + i);
        }
        journal += l;
    }
    let insert = start.elapsed();
    let start = Instant::now();
    let answers: Vec<_> = queries
        .iter()
        .map(|&(o, l)| pieces_from_sectors(o, l, map.range(o..o + l).map(|(&s, &j)| (s, j))))
        .collect();
    let query = start.elapsed();
    Run {
        name: "btreemap_per_sector",
        baseline: "journal_index",
        inserts: inserts.len(),
        queries: queries.len(),
        insert,
        query,
        answers,
    }
}

/// One non-durable write transaction per inserted range, like an unsynced put batch.
fn run_redb(inserts: &[(u64, u64)], queries: &[(u64, u64)]) -> Run {
    let file = tempfile::NamedTempFile::new().unwrap();
    let db = Database::create(file.path()).unwrap();
    let start = Instant::now();
    let mut journal = 0;
    for &(o, l) in inserts {
        let mut tx = db.begin_write().unwrap();
        tx.set_durability(Durability::None);
        {
            let mut table = tx.open_table(TABLE).unwrap();
            for i in 0..l {
                table.insert(o + i, journal + i).unwrap();
            }
        }
        tx.commit().unwrap();
        journal += l;
    }
    let insert = start.elapsed();
    let start = Instant::now();
    let tx = db.begin_read().unwrap();
    let table = tx.open_table(TABLE).unwrap();
    let answers: Vec<_> = queries
        .iter()
        .map(|&(o, l)| {
            let sectors = table.range(o..o + l).unwrap().map(|r| {
                let (k, v) = r.unwrap();
                (k.value(), v.value())
            });
            pieces_from_sectors(o, l, sectors)
        })
        .collect();
    let query = start.elapsed();
    Run {
        name: "redb_per_sector",
        baseline: "journal_index_redb_prefix",
        inserts: inserts.len(),
        queries: queries.len(),
        insert,
        query,
        answers,
    }
}

fn main() {
    let n_inserts = env_or("JI_INSERTS", 700_000);
    let n_queries = env_or("JI_QUERIES", 100_000);
    let kv_fraction = env_or("JI_KV_FRACTION", 10).max(1);
    let mut rng = StdRng::seed_from_u64(0x0a5a);
    let inserts = ranges(&mut rng, n_inserts);
    let queries = ranges(&mut rng, n_queries);

    let (index_run, index) = run_index("journal_index", &inserts, &queries, None);
    let paper_at = n_inserts.saturating_sub(n_inserts / 7);
    let (paper, paper_index) = run_index(
        "journal_index_paper_split",
        &inserts,
        &queries,
        Some(paper_at),
    );
    let btree = run_btree(&inserts, &queries);
    let kv_inserts = &inserts[..n_inserts / kv_fraction];
    let kv_queries = &queries[..n_queries / kv_fraction];
    let (mut prefix, _) = run_index("journal_index_redb_prefix", kv_inserts, kv_queries, None);
    // The prefix is redb's baseline, not a variant of the full run.
    prefix.baseline = prefix.name;
    let redb = run_redb(kv_inserts, kv_queries);

    // Same answers everywhere (the index may leave neighbouring entries unjoined).
    let same = |a: &Run, b: &Run| {
        let norm = |r: &Run| -> Vec<_> { r.answers.iter().cloned().map(normalise).collect() };
        assert_eq!(norm(a), norm(b), "{} disagrees with {}", b.name, a.name);
    };
    same(&index_run, &paper);
    same(&index_run, &btree);
    same(&prefix, &redb);

    println!(
        "journal index bench: {n_inserts} inserts, {n_queries} queries (redb: 1/{kv_fraction}); \
         merge threshold {DEFAULT_MERGE_THRESHOLD} ends with {} tree + {} array entries, \
         paper split with {} tree + {} array entries",
        index.tree_len(),
        index.array_len(),
        paper_index.tree_len(),
        paper_index.array_len()
    );
    println!(
        "{:<26} {:>10} {:>10} {:>10} {:>10} {:>10} {:>10}",
        "structure", "insert s", "ns/insert", "query s", "ns/query", "ins ratio", "qry ratio"
    );
    let runs = [&index_run, &paper, &btree, &prefix, &redb];
    let mut json = Vec::new();
    for r in runs {
        let base = runs.iter().find(|b| b.name == r.baseline).unwrap();
        let insert_ratio = r.insert_ns() / base.insert_ns();
        let query_ratio = r.query_ns() / base.query_ns();
        println!(
            "{:<26} {:>10.3} {:>10.1} {:>10.3} {:>10.1} {:>10.1} {:>10.1}",
            r.name,
            r.insert.as_secs_f64(),
            r.insert_ns(),
            r.query.as_secs_f64(),
            r.query_ns(),
            insert_ratio,
            query_ratio
        );
        json.push(format!(
            "{{\"structure\":\"{}\",\"baseline\":\"{}\",\"inserts\":{},\"queries\":{},\"insert_s\":{:.6},\
             \"query_s\":{:.6},\"ns_per_insert\":{:.1},\"ns_per_query\":{:.1},\
             \"insert_ratio\":{:.2},\"query_ratio\":{:.2}}}",
            r.name,
            r.baseline,
            r.inserts,
            r.queries,
            r.insert.as_secs_f64(),
            r.query.as_secs_f64(),
            r.insert_ns(),
            r.query_ns(),
            insert_ratio,
            query_ratio
        ));
    }
    println!("(ratios: time per operation over the baseline index run; > 1 means slower)");
    let json = format!("[{}]\n", json.join(","));
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target");
    let path = std::env::var_os("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .unwrap_or(dir)
        .join("journal_index_bench.json");
    std::fs::write(&path, &json).unwrap();
    print!("{json}");
    println!("written to {}", path.canonicalize().unwrap().display());
}
