//! Small integer helpers shared by the KV manager and planners.
//!
//! `cdiv` mirrors `vllm.utils.math_utils.cdiv` (ceil division for positive
//! divisors); invariant: callers never pass a zero divisor (layouts are
//! validated before any manager is built).

/// Ceil division, `cdiv(a, b) = -(-a // b)` as in vLLM.
#[inline]
pub fn cdiv(a: u64, b: u64) -> u64 {
    debug_assert!(b > 0);
    a.div_ceil(b)
}

/// Greatest common divisor.
pub fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        let t = a % b;
        a = b;
        b = t;
    }
    a
}

/// Least common multiple (saturating).
pub fn lcm(a: u64, b: u64) -> u64 {
    if a == 0 || b == 0 {
        return 0;
    }
    (a / gcd(a, b)).saturating_mul(b)
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn cdiv_matches_python() {
        assert_eq!(cdiv(0, 16), 0);
        assert_eq!(cdiv(1, 16), 1);
        assert_eq!(cdiv(16, 16), 1);
        assert_eq!(cdiv(17, 16), 2);
        assert_eq!(cdiv(15523, 16), 971);
        assert_eq!(lcm(2304, 16), 2304);
        assert_eq!(lcm(6, 4), 12);
    }
}
