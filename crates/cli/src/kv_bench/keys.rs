//! Which keys a benchmark transaction updates: uniform, or Zipf-distributed (the
//! thesis's contention workload: a few hot keys take most updates).

use crate::bank::next;

pub struct Picker {
    /// Cumulative probability of key ranks 0..=i, ascending to 1.
    cumulative: Vec<f64>,
}

impl Picker {
    /// `keys` keys (at least 2), key `i` drawn with weight 1 / (i + 1)^`skew`; a
    /// skew of 0 is uniform.
    pub fn new(keys: u32, skew: f64) -> Picker {
        assert!(keys >= 2, "two distinct keys per transaction need two keys");
        assert!(skew >= 0.0, "a Zipf skew of {skew}");
        let weights = (1..=keys as u64).map(|rank| (rank as f64).powf(-skew));
        let mut total = 0.0;
        let mut cumulative: Vec<f64> = weights
            .map(|w| {
                total += w;
                total
            })
            .collect();
        cumulative.iter_mut().for_each(|c| *c /= total);
        Picker { cumulative }
    }

    fn one(&self, rng: &mut u64) -> u64 {
        // 53 random bits: a uniform double in [0, 1).
        let u = (next(rng) >> 11) as f64 / (1u64 << 53) as f64;
        let rank = self.cumulative.partition_point(|c| *c <= u);
        rank.min(self.cumulative.len() - 1) as u64
    }

    /// Two distinct keys.
    pub fn pair(&self, rng: &mut u64) -> (u64, u64) {
        let a = self.one(rng);
        loop {
            let b = self.one(rng);
            if b != a {
                return (a, b);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(skew: f64) -> Vec<u64> {
        let picker = Picker::new(100, skew);
        let mut rng = 7;
        let mut counts = vec![0u64; 100];
        for _ in 0..20_000 {
            let (a, b) = picker.pair(&mut rng);
            assert_ne!(a, b);
            counts[a as usize] += 1;
            counts[b as usize] += 1;
        }
        counts
    }

    #[test]
    fn zipf_keys_are_skewed_and_uniform_ones_are_not() {
        let uniform = counts(0.0);
        assert!(
            uniform.iter().all(|c| (250..550).contains(c)),
            "{uniform:?}"
        );
        let zipf = counts(0.99);
        // Rank 1 takes about 1/H(100) ~ 19% of draws, rank 100 about 0.2%.
        assert!(zipf[0] > 5000 && zipf[99] < 200, "{zipf:?}");
    }
}
