//! Ceph's rjenkins1 hash (`src/crush/hash.c`): every CRUSH draw goes through it, so it
//! has to match bit for bit.

const SEED: u32 = 1_315_423_911;
const X: u32 = 231_232;
const Y: u32 = 1232;

/// Robert Jenkins' 96-bit mix; `c` carries the result.
fn mix(a: &mut u32, b: &mut u32, c: &mut u32) {
    macro_rules! step {
        ($a:ident, $b:ident, $c:ident, $op:tt, $s:expr) => {
            *$a = $a.wrapping_sub(*$b).wrapping_sub(*$c) ^ (*$c $op $s);
        };
    }
    step!(a, b, c, >>, 13);
    step!(b, c, a, <<, 8);
    step!(c, a, b, >>, 13);
    step!(a, b, c, >>, 12);
    step!(b, c, a, <<, 16);
    step!(c, a, b, >>, 5);
    step!(a, b, c, >>, 3);
    step!(b, c, a, <<, 10);
    step!(c, a, b, >>, 15);
}

/// `crush_hash32_2`.
pub fn hash2(a: u32, b: u32) -> u32 {
    let (mut a, mut b) = (a, b);
    let mut hash = SEED ^ a ^ b;
    let (mut x, mut y) = (X, Y);
    mix(&mut a, &mut b, &mut hash);
    mix(&mut x, &mut a, &mut hash);
    mix(&mut b, &mut y, &mut hash);
    hash
}

/// `crush_hash32_3`.
pub fn hash3(a: u32, b: u32, c: u32) -> u32 {
    let (mut a, mut b, mut c) = (a, b, c);
    let mut hash = SEED ^ a ^ b ^ c;
    let (mut x, mut y) = (X, Y);
    mix(&mut a, &mut b, &mut hash);
    mix(&mut c, &mut x, &mut hash);
    mix(&mut y, &mut a, &mut hash);
    mix(&mut b, &mut x, &mut hash);
    mix(&mut y, &mut c, &mut hash);
    hash
}

/// `crush_hash32_4`.
pub fn hash4(a: u32, b: u32, c: u32, d: u32) -> u32 {
    let (mut a, mut b, mut c, mut d) = (a, b, c, d);
    let mut hash = SEED ^ a ^ b ^ c ^ d;
    let (mut x, mut y) = (X, Y);
    mix(&mut a, &mut b, &mut hash);
    mix(&mut c, &mut d, &mut hash);
    mix(&mut a, &mut x, &mut hash);
    mix(&mut y, &mut b, &mut hash);
    mix(&mut c, &mut x, &mut hash);
    mix(&mut y, &mut d, &mut hash);
    hash
}
