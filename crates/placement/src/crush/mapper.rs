//! `crush_do_rule` and its choose loops, following Ceph's `mapper.c` statement by
//! statement: which retry counter moves when, and which `r` each draw hashes, decide
//! the result, so the control flow is deliberately the same rather than idiomatic.

use super::hash::{hash2, hash3};
use super::ln::crush_ln;
use super::{Bucket, CrushMap, Mode, Rule, Step, ITEM_NONE, ITEM_UNDEF, WEIGHT_ONE};

/// The retry budgets in force at a choose step: the map's tunables, overridden by the
/// rule's earlier `set_*` steps.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Params {
    choose_tries: u32,
    choose_leaf_tries: u32,
    local_retries: u32,
    local_fallback_retries: u32,
    vary_r: u32,
    stable: u32,
    descend_once: bool,
}

impl Params {
    pub(crate) fn new(map: &CrushMap) -> Self {
        let t = &map.tunables;
        Params {
            // Ceph's choose_total_tries counted retries, not tries.
            choose_tries: t.choose_total_tries + 1,
            choose_leaf_tries: 0,
            local_retries: t.choose_local_tries,
            local_fallback_retries: t.choose_local_fallback_tries,
            vary_r: t.chooseleaf_vary_r,
            stable: t.chooseleaf_stable,
            descend_once: t.chooseleaf_descend_once != 0,
        }
    }

    /// Applies a `set_*` step; false for any other step.
    pub(crate) fn apply(&mut self, step: &Step) -> bool {
        let (target, value, min) = match *step {
            Step::SetChooseTries(v) => (&mut self.choose_tries, v, 1),
            Step::SetChooseleafTries(v) => (&mut self.choose_leaf_tries, v, 1),
            Step::SetChooseLocalTries(v) => (&mut self.local_retries, v, 0),
            Step::SetChooseLocalFallbackTries(v) => (&mut self.local_fallback_retries, v, 0),
            Step::SetChooseleafVaryR(v) => (&mut self.vary_r, v, 0),
            Step::SetChooseleafStable(v) => (&mut self.stable, v, 0),
            _ => return false,
        };
        if value >= min {
            *target = value as u32;
        }
        true
    }

    fn firstn_recurse_tries(&self) -> u32 {
        if self.choose_leaf_tries != 0 {
            self.choose_leaf_tries
        } else if self.descend_once {
            1
        } else {
            self.choose_tries
        }
    }
}

/// Per-bucket permutation state of `bucket_perm_choose`, fresh for every mapping.
#[derive(Default, Clone)]
struct PermWork {
    x: u32,
    n: u32,
    perm: Vec<u32>,
}

/// One mapping in progress: input `x`, device reweights and the scratch state.
pub(crate) struct Mapper<'a> {
    map: &'a CrushMap,
    reweights: &'a [u32],
    x: i32,
    work: Vec<PermWork>,
}

impl<'a> Mapper<'a> {
    pub(crate) fn new(map: &'a CrushMap, x: i32, reweights: &'a [u32]) -> Self {
        Mapper {
            map,
            reweights,
            x,
            work: Vec::new(),
        }
    }

    fn bucket(&self, id: i32) -> Option<&'a Bucket> {
        self.map.bucket(id)
    }

    fn item_type(&self, item: i32) -> Option<i32> {
        if item >= 0 {
            Some(0)
        } else {
            self.bucket(item).map(|b| b.type_id)
        }
    }

    fn straw2_choose(&self, bucket: &Bucket, r: i32) -> i32 {
        let mut high = 0;
        let mut high_draw = 0i64;
        for (i, (&item, &weight)) in bucket.items.iter().zip(&bucket.weights).enumerate() {
            let draw = if weight != 0 {
                let u = hash3(self.x as u32, item as u32, r as u32) & 0xffff;
                // ln(u / 0x10000) in 2^44 fixed point: negative, so a heavier item's
                // quotient is closer to zero and more likely the largest.
                let ln = crush_ln(u) as i64 - 0x1_0000_0000_0000;
                ln / weight as i64
            } else {
                i64::MIN
            };
            if i == 0 || draw > high_draw {
                high = i;
                high_draw = draw;
            }
        }
        bucket.items[high]
    }

    /// `bucket_perm_choose`: the exhaustive fallback of the legacy local retries.
    fn perm_choose(&mut self, bucket: &Bucket, r: i32) -> i32 {
        let size = bucket.items.len() as u32;
        let index = (-1 - bucket.id) as usize;
        if self.work.len() <= index {
            self.work.resize(index + 1, PermWork::default());
        }
        let x = self.x as u32;
        let work = &mut self.work[index];
        work.perm.resize(size as usize, 0);
        let pr = (r as u32) % size;
        if work.x != x || work.n == 0 {
            work.x = x;
            if pr == 0 {
                // The common r = 0 case skips building the permutation.
                let s = hash3(x, bucket.id as u32, 0) % size;
                work.perm[0] = s;
                work.n = 0xffff;
                return bucket.items[s as usize];
            }
            for (i, p) in work.perm.iter_mut().enumerate() {
                *p = i as u32;
            }
            work.n = 0;
        } else if work.n == 0xffff {
            for i in 1..size {
                work.perm[i as usize] = i;
            }
            let first = work.perm[0] as usize;
            work.perm[first] = 0;
            work.n = 1;
        }
        while work.n <= pr {
            let p = work.n;
            if p < size - 1 {
                let i = hash3(x, bucket.id as u32, p) % (size - p);
                if i != 0 {
                    work.perm.swap((p + i) as usize, p as usize);
                }
            }
            work.n += 1;
        }
        bucket.items[work.perm[pr as usize] as usize]
    }

    fn is_out(&self, item: i32) -> bool {
        let Some(&weight) = self.reweights.get(item as usize) else {
            return true;
        };
        if weight >= WEIGHT_ONE {
            return false;
        }
        if weight == 0 {
            return true;
        }
        (hash2(self.x as u32, item as u32) & 0xffff) >= weight
    }

    /// `crush_choose_firstn`: items go to `out[outpos..]`, their leaves (chooseleaf) to
    /// `leaves[outpos..]`; returns the new outpos. `out[..outpos]` are the items to
    /// avoid.
    #[allow(clippy::too_many_arguments)]
    fn choose_firstn(
        &mut self,
        params: &Params,
        bucket_id: i32,
        numrep: i32,
        type_id: i32,
        out: &mut [i32],
        mut outpos: usize,
        out_size: usize,
        tries: u32,
        recurse_tries: u32,
        recurse_to_leaf: bool,
        mut leaves: Option<&mut [i32]>,
        parent_r: i32,
    ) -> usize {
        let mut count = out_size;
        let mut rep = if params.stable != 0 { 0 } else { outpos as i32 };
        while rep < numrep && count > 0 {
            let mut ftotal: u32 = 0;
            let mut skip_rep = false;
            let mut item = 0;
            loop {
                let mut retry_descent = false;
                let mut current = bucket_id;
                let mut flocal: u32 = 0;
                loop {
                    let mut retry_bucket = false;
                    let r = rep + parent_r + ftotal as i32;
                    let Some(bucket) = self.bucket(current) else {
                        skip_rep = true;
                        break;
                    };
                    let size = bucket.items.len() as u32;
                    let mut collide = false;
                    let reject = if size == 0 {
                        true
                    } else {
                        item = if params.local_fallback_retries > 0
                            && flocal >= size >> 1
                            && flocal > params.local_fallback_retries
                        {
                            self.perm_choose(bucket, r)
                        } else {
                            self.straw2_choose(bucket, r)
                        };
                        if item >= self.map.max_devices {
                            skip_rep = true;
                            break;
                        }
                        let Some(item_type) = self.item_type(item) else {
                            skip_rep = true;
                            break;
                        };
                        if item_type != type_id {
                            if item >= 0 {
                                skip_rep = true;
                                break;
                            }
                            current = item;
                            continue;
                        }
                        collide = out[..outpos].contains(&item);
                        let mut reject = false;
                        if !collide && recurse_to_leaf {
                            let leaves = leaves.as_deref_mut().expect("chooseleaf has leaves");
                            if item < 0 {
                                let sub_r = if params.vary_r != 0 {
                                    r >> (params.vary_r - 1)
                                } else {
                                    0
                                };
                                let numrep = if params.stable != 0 {
                                    1
                                } else {
                                    outpos as i32 + 1
                                };
                                let got = self.choose_firstn(
                                    params,
                                    item,
                                    numrep,
                                    0,
                                    leaves,
                                    outpos,
                                    count,
                                    recurse_tries,
                                    0,
                                    false,
                                    None,
                                    sub_r,
                                );
                                reject = got <= outpos;
                            } else {
                                leaves[outpos] = item;
                            }
                        }
                        if !reject && !collide && item_type == 0 {
                            reject = self.is_out(item);
                        }
                        reject
                    };
                    if reject || collide {
                        ftotal += 1;
                        flocal += 1;
                        // Retry in this bucket (locally a few times after a
                        // collision, exhaustively with the fallback), else descend
                        // again from the top, else give up on this replica.
                        let retry_local = collide && flocal <= params.local_retries;
                        let retry_fallback = params.local_fallback_retries > 0
                            && flocal <= size + params.local_fallback_retries;
                        if retry_local || retry_fallback {
                            retry_bucket = true;
                        } else if ftotal < tries {
                            retry_descent = true;
                        } else {
                            skip_rep = true;
                        }
                    }
                    if !retry_bucket {
                        break;
                    }
                }
                if !retry_descent {
                    break;
                }
            }
            if !skip_rep {
                out[outpos] = item;
                outpos += 1;
                count -= 1;
            }
            rep += 1;
        }
        outpos
    }

    /// A `chooseleaf firstn` (or `choose firstn` without `leaf`) of `numrep` items
    /// from `bucket_id`, continuing after the `outpos` items already in `out` and
    /// `leaves`, which it avoids as if an earlier pass of the same step had chosen them.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn firstn_after(
        &mut self,
        params: &Params,
        bucket_id: i32,
        numrep: usize,
        type_id: i32,
        leaf: bool,
        out: &mut [i32],
        leaves: &mut [i32],
        outpos: usize,
    ) -> usize {
        self.choose_firstn(
            params,
            bucket_id,
            numrep as i32,
            type_id,
            out,
            outpos,
            numrep - outpos,
            params.choose_tries,
            params.firstn_recurse_tries(),
            leaf,
            Some(leaves),
            0,
        )
    }

    /// `crush_choose_indep`: fills exactly `left` positions from `outpos`, each either
    /// an item or `ITEM_NONE`, keeping every item at its position across retries.
    #[allow(clippy::too_many_arguments)]
    fn choose_indep(
        &mut self,
        bucket_id: i32,
        left: usize,
        numrep: i32,
        type_id: i32,
        out: &mut [i32],
        outpos: usize,
        tries: u32,
        recurse_tries: u32,
        recurse_to_leaf: bool,
        mut leaves: Option<&mut [i32]>,
        parent_r: i32,
    ) {
        let endpos = outpos + left;
        let mut left = left;
        out[outpos..endpos].fill(ITEM_UNDEF);
        if let Some(leaves) = leaves.as_deref_mut() {
            leaves[outpos..endpos].fill(ITEM_UNDEF);
        }
        let mut ftotal: u32 = 0;
        while left > 0 && ftotal < tries {
            for rep in outpos..endpos {
                if out[rep] != ITEM_UNDEF {
                    continue;
                }
                let mut current = bucket_id;
                loop {
                    // Straw2 only, so never Ceph's uniform-bucket variant of r.
                    let r = rep as i32 + parent_r + numrep * ftotal as i32;
                    let Some(bucket) = self.bucket(current) else {
                        break;
                    };
                    if bucket.items.is_empty() {
                        break;
                    }
                    let item = self.straw2_choose(bucket, r);
                    let item_type = if item >= self.map.max_devices {
                        None
                    } else {
                        self.item_type(item)
                    };
                    let Some(item_type) = item_type.filter(|t| *t == type_id || item < 0) else {
                        out[rep] = ITEM_NONE;
                        if let Some(leaves) = leaves.as_deref_mut() {
                            leaves[rep] = ITEM_NONE;
                        }
                        left -= 1;
                        break;
                    };
                    if item_type != type_id {
                        current = item;
                        continue;
                    }
                    if out[outpos..endpos].contains(&item) {
                        break;
                    }
                    if recurse_to_leaf {
                        let leaves = leaves.as_deref_mut().expect("chooseleaf has leaves");
                        if item < 0 {
                            self.choose_indep(
                                item,
                                1,
                                numrep,
                                0,
                                leaves,
                                rep,
                                recurse_tries,
                                0,
                                false,
                                None,
                                r,
                            );
                            if leaves[rep] == ITEM_NONE {
                                break;
                            }
                        } else {
                            leaves[rep] = item;
                        }
                    }
                    if item_type == 0 && self.is_out(item) {
                        break;
                    }
                    out[rep] = item;
                    left -= 1;
                    break;
                }
            }
            ftotal += 1;
        }
        for slot in &mut out[outpos..endpos] {
            if *slot == ITEM_UNDEF {
                *slot = ITEM_NONE;
            }
        }
        if let Some(leaves) = leaves {
            for slot in &mut leaves[outpos..endpos] {
                if *slot == ITEM_UNDEF {
                    *slot = ITEM_NONE;
                }
            }
        }
    }

    /// One choose or chooseleaf step from `bucket_id` into `out[osize..]` (and
    /// `leaves[osize..]`); returns how many positions it filled.
    #[allow(clippy::too_many_arguments)]
    fn choose_step(
        &mut self,
        params: &Params,
        bucket_id: i32,
        mode: Mode,
        numrep: i32,
        type_id: i32,
        leaf: bool,
        out: &mut [i32],
        leaves: &mut [i32],
    ) -> usize {
        let room = out.len();
        match mode {
            Mode::Firstn => self.choose_firstn(
                params,
                bucket_id,
                numrep,
                type_id,
                out,
                0,
                room,
                params.choose_tries,
                params.firstn_recurse_tries(),
                leaf,
                Some(leaves),
                0,
            ),
            Mode::Indep => {
                let filled = (numrep as usize).min(room);
                let recurse_tries = match params.choose_leaf_tries {
                    0 => 1,
                    n => n,
                };
                self.choose_indep(
                    bucket_id,
                    filled,
                    numrep,
                    type_id,
                    out,
                    0,
                    params.choose_tries,
                    recurse_tries,
                    leaf,
                    Some(leaves),
                    0,
                );
                filled
            }
        }
    }
}

/// `crush_do_rule`.
pub(crate) fn do_rule(
    map: &CrushMap,
    rule: &Rule,
    x: i32,
    result_max: usize,
    reweights: &[u32],
) -> Vec<i32> {
    let mut mapper = Mapper::new(map, x, reweights);
    let mut params = Params::new(map);
    let mut result = Vec::with_capacity(result_max);
    let mut working: Vec<i32> = Vec::with_capacity(result_max);
    for step in &rule.steps {
        if params.apply(step) {
            continue;
        }
        match *step {
            Step::Take(item) => {
                if (0..map.max_devices).contains(&item) || map.bucket(item).is_some() {
                    working = vec![item];
                }
            }
            Step::Choose {
                leaf,
                mode,
                count,
                type_id,
            } => {
                if working.is_empty() {
                    continue;
                }
                let mut out = vec![0; result_max];
                let mut leaves = vec![0; result_max];
                let mut osize = 0;
                for &bucket_id in &working {
                    let mut numrep = count;
                    if numrep <= 0 {
                        numrep += result_max as i32;
                        if numrep <= 0 {
                            continue;
                        }
                    }
                    if map.bucket(bucket_id).is_none() {
                        // A device or a hole left by an earlier indep step.
                        continue;
                    }
                    osize += mapper.choose_step(
                        &params,
                        bucket_id,
                        mode,
                        numrep,
                        type_id,
                        leaf,
                        &mut out[osize..],
                        &mut leaves[osize..],
                    );
                }
                working = if leaf { leaves } else { out };
                working.truncate(osize);
            }
            Step::Emit => {
                let room = result_max - result.len();
                result.extend(working.drain(..).take(room));
            }
            _ => unreachable!("set steps are applied above"),
        }
    }
    result
}
