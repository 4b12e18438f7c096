//! `floe kv bank`: transfers between accounts kept in the key-value store, each one
//! transaction over three keys (both accounts and the transfer counter), from several
//! clients at once. The balances always sum to accounts x 1000; every account holds
//! the id of the last transfer that touched it, and the ledger the balances each
//! acknowledged transfer left, so a checker can prove each acknowledged transfer
//! present and none partial.

use crate::kv::{append_line, retried, Isolated, BANK_INITIAL};
use floe_isotope::kv::Kv;
use floe_isotope::Transactions;
use std::path::Path;

const COUNT_KEY: &[u8] = b"bank/count";
/// Every transfer updates the counter, so any two that overlap conflict: with many
/// clients (several processes through a gateway) one commits per group while the
/// others try again, far more often than a command's retries allow.
const TRANSFER_RETRIES: usize = 1000;

fn account_key(account: u32) -> String {
    format!("acct/{account:03}")
}

/// `BALANCE LAST_TRANSFER`.
fn parse_account(value: &[u8]) -> (u64, u64) {
    let text = String::from_utf8_lossy(value);
    let mut fields = text
        .split(' ')
        .map(|f| f.parse::<u64>().expect("an account field"));
    (
        fields.next().expect("a balance"),
        fields.next().expect("a transfer id"),
    )
}

pub async fn run<V: Transactions>(
    volume: &Isolated<'_, V>,
    name: &str,
    accounts: u32,
    clients: u32,
    transfers: Option<u64>,
    ledger: &Path,
) -> Result<(), String> {
    if accounts < 2 {
        return Err("a bank needs two accounts or more".into());
    }
    let blocks = volume.data_blocks();
    retried(volume, name, TRANSFER_RETRIES, |mut tx| async move {
        let mut kv = Kv::attach(&mut tx, blocks).await?;
        if kv.get(COUNT_KEY).await?.is_none() {
            for a in 0..accounts {
                kv.put(
                    account_key(a).as_bytes(),
                    format!("{BANK_INITIAL} 0").as_bytes(),
                )
                .await?;
            }
            kv.put(COUNT_KEY, b"0").await?;
        }
        Ok((tx, ()))
    })
    .await?;
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(ledger)
        .map_err(|e| format!("cannot open the ledger {}: {e}", ledger.display()))?;
    let done = std::cell::Cell::new(0u64);
    let file = std::cell::RefCell::new(&mut file);
    let client = |seed: u64| {
        let (done, file) = (&done, &file);
        async move {
            let mut rng = seed;
            while transfers.is_none_or(|t| done.get() < t) {
                let (from, to) = pick(&mut rng, accounts);
                let amount_seed = next(&mut rng);
                let retries = TRANSFER_RETRIES;
                let (_, line) = retried(volume, name, retries, |mut tx| async move {
                    let mut kv = Kv::attach(&mut tx, blocks).await?;
                    let count = kv.get(COUNT_KEY).await?.expect("a bank has a counter");
                    let id = String::from_utf8_lossy(&count)
                        .parse::<u64>()
                        .expect("a count")
                        + 1;
                    let (from_balance, _) = parse_account(
                        &kv.get(account_key(from).as_bytes())
                            .await?
                            .expect("an account"),
                    );
                    let (to_balance, _) = parse_account(
                        &kv.get(account_key(to).as_bytes())
                            .await?
                            .expect("an account"),
                    );
                    let amount = amount_seed % (from_balance.min(100) + 1);
                    let (from_after, to_after) = (from_balance - amount, to_balance + amount);
                    kv.put(
                        account_key(from).as_bytes(),
                        format!("{from_after} {id}").as_bytes(),
                    )
                    .await?;
                    kv.put(
                        account_key(to).as_bytes(),
                        format!("{to_after} {id}").as_bytes(),
                    )
                    .await?;
                    kv.put(COUNT_KEY, id.to_string().as_bytes()).await?;
                    Ok((tx, format!("ok {id} {from} {from_after} {to} {to_after}")))
                })
                .await?;
                append_line(&mut file.borrow_mut(), &line)?;
                done.set(done.get() + 1);
            }
            Ok::<(), String>(())
        }
    };
    let runs = (0..clients.max(1) as u64).map(|c| client(c + seed_now()));
    for ran in futures::future::join_all(runs).await {
        ran?;
    }
    println!("{} transfers on {name}", done.get());
    Ok(())
}

pub fn seed_now() -> u64 {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    now.map_or(1, |t| t.as_nanos() as u64) | 1
}

/// splitmix64: enough randomness for picking accounts, no dependency.
pub fn next(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut x = *state;
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

fn pick(rng: &mut u64, accounts: u32) -> (u32, u32) {
    let from = (next(rng) % accounts as u64) as u32;
    let to = (from + 1 + (next(rng) % (accounts as u64 - 1)) as u32) % accounts;
    (from, to)
}
