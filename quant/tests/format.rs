//! W4A16 format and RTN tests: pack/unpack round trip (proptest), the bit layout of
//! docs/model.md §8 on a hand example, dequantization, RTN's rounding/clamping/zero-group rules.

use half::bf16;
use proptest::prelude::*;
use speclab_quant::{dequantize, pack_int4, quantize_rtn, unpack_int4, QuantError, W4A16Tensor};

proptest! {
    #[test]
    fn pack_unpack_round_trip(n in 0usize..4, groups in 1usize..3, seed in any::<u64>()) {
        let k = 128 * groups;
        // xorshift values in [-8, 7]
        let mut s = seed | 1;
        let q: Vec<i8> = (0..n * k).map(|_| {
            s ^= s << 13; s ^= s >> 7; s ^= s << 17;
            (s % 16) as i8 - 8
        }).collect();
        let packed = pack_int4(&q, n, k).unwrap();
        prop_assert_eq!(packed.len(), n * k / 8);
        prop_assert_eq!(unpack_int4(&packed, n, k).unwrap(), q);
    }

    #[test]
    fn unpack_pack_round_trip(words in proptest::collection::vec(any::<i32>(), 16)) {
        // every int32 bit pattern is a valid packed word
        let q = unpack_int4(&words, 1, 128).unwrap();
        prop_assert!(q.iter().all(|v| (-8..=7).contains(v)));
        prop_assert_eq!(pack_int4(&q, 1, 128).unwrap(), words);
    }
}

#[test]
fn bit_layout_matches_doc() {
    // Row 0: q[k] = k - 8 for k in 0..16 (then zeros): stored nibbles 0..15.
    let k = 128;
    let mut q = vec![0i8; 2 * k];
    for (i, v) in q.iter_mut().take(16).enumerate() {
        *v = i as i8 - 8;
    }
    q[k] = 7; // row 1, element 0 -> lowest nibble 0xF
    q[k + 7] = -8; // row 1, element 7 -> highest nibble 0x0
    q[k + 9] = -1; // row 1, element 9 -> word 1, bits 4..7 = 7
    let p = pack_int4(&q, 2, k).unwrap();
    // element 0 in the lowest nibble, stored as q + 8
    assert_eq!(p[0] as u32, 0x7654_3210);
    assert_eq!(p[1] as u32, 0xFEDC_BA98); // negative as i32: the int32 is a bit container
    assert!(p[1] < 0);
    assert_eq!(p[2] as u32, 0x8888_8888); // q = 0 everywhere -> 8 in every nibble
    assert_eq!(p[16] as u32, 0x0888_888F);
    assert_eq!(p[17] as u32, 0x8888_8878);
    // decode rule of the doc: q = ((word >> (4*(k%8))) & 0xF) - 8 on the u32 pattern
    let u = p[1] as u32;
    for j in 0..8 {
        assert_eq!(((u >> (4 * j)) & 0xF) as i8 - 8, q[8 + j]);
    }
}

#[test]
fn dequantize_is_q_times_scale_per_group() {
    let (n, k) = (2, 256);
    let q: Vec<i8> = (0..n * k).map(|i| (i % 16) as i8 - 8).collect();
    let scale: Vec<bf16> = [0.5f32, 0.125, 3.0, -0.0078125]
        .iter()
        .map(|&s| bf16::from_f32(s))
        .collect();
    let t = W4A16Tensor::from_q(&q, scale.clone(), n, k).unwrap();
    let w = t.dequantize().unwrap();
    assert_eq!(w, dequantize(&t.packed, &t.scale, n, k).unwrap());
    for r in 0..n {
        for c in 0..k {
            let want = q[r * k + c] as f32 * scale[r * 2 + c / 128].to_f32();
            assert_eq!(w[r * k + c], want);
        }
    }
    assert_eq!(t.unpack().unwrap(), q);
}

#[test]
fn format_errors_not_panics() {
    assert!(matches!(
        pack_int4(&[0; 64], 1, 64),
        Err(QuantError::GroupMisaligned { k: 64 })
    ));
    assert!(matches!(
        pack_int4(&[0; 127], 1, 128),
        Err(QuantError::Shape(_))
    ));
    let mut q = vec![0i8; 128];
    q[5] = 8;
    assert!(matches!(
        pack_int4(&q, 1, 128),
        Err(QuantError::OutOfRange { index: 5, value: 8 })
    ));
    q[5] = -9;
    assert!(matches!(
        pack_int4(&q, 1, 128),
        Err(QuantError::OutOfRange {
            index: 5,
            value: -9
        })
    ));
    assert!(unpack_int4(&[0; 15], 1, 128).is_err());
    assert!(dequantize(&[0; 16], &[], 1, 128).is_err());
    assert!(W4A16Tensor::new(vec![0; 16], vec![bf16::ONE; 2], [1, 128]).is_err());
    assert!(pack_int4(&[], usize::MAX, 256).is_err()); // overflow
    assert!(quantize_rtn(&[0.0; 100], 1, 100).is_err());
    let mut w = vec![0.0f32; 128];
    w[3] = f32::NAN;
    assert!(matches!(
        quantize_rtn(&w, 1, 128),
        Err(QuantError::NonFinite { index: 3, .. })
    ));
}

/// One RTN group with the given leading values (rest zero).
fn rtn_group(head: &[f32]) -> (Vec<i8>, f32) {
    let mut w = vec![0.0f32; 128];
    w[..head.len()].copy_from_slice(head);
    let t = quantize_rtn(&w, 1, 128).unwrap();
    (t.unpack().unwrap(), t.scale[0].to_f32())
}

#[test]
fn rtn_scale_is_bf16_of_amax_over_7() {
    // amax 7 -> scale exactly 1
    let (q, s) = rtn_group(&[7.0, -3.0]);
    assert_eq!(s, 1.0);
    assert_eq!(&q[..2], &[7, -3]);
    // amax 1 -> 1/7 = 0.142857.. -> bf16 0.142578125 (round to nearest even)
    let (_, s) = rtn_group(&[1.0]);
    assert_eq!(s, bf16::from_f32(1.0 / 7.0).to_f32());
    assert_eq!(s, 73.0 / 512.0); // 0.142578125
                                 // negative amax counts by magnitude
    let (q, s) = rtn_group(&[-14.0, 2.0]);
    assert_eq!(s, 2.0);
    assert_eq!(&q[..2], &[-7, 1]);
}

#[test]
fn rtn_ties_to_even() {
    // scale 1 (amax 7): halves round to even
    let (q, _) = rtn_group(&[7.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5, -3.5]);
    assert_eq!(&q[..9], &[7, 0, 2, 2, 0, -2, -2, 4, -4]);
}

#[test]
fn rtn_clamps_at_minus8_and_7() {
    // From amax alone RTN never reaches the clamp: s = bf16(amax / 7) is within 2^-9
    // relative of amax / 7, so |w| / s <= 7.03 < 7.5 and the extremes map to +-7 (q = -8 is
    // never produced by RTN). amax = 7.5: 7.5 / 7 = 1.0714 -> bf16 1.0703125 (rounds down),
    // 7.5 / 1.0703125 = 7.007 -> 7, and -7.5 -> -7.
    let (q, s) = rtn_group(&[7.5, -7.5]);
    assert_eq!(s, 1.0703125);
    assert_eq!(&q[..2], &[7, -7]);
    // amax = 7.02: bf16(1.00286) = 1.0, 7.02 -> 7.
    let (q, s) = rtn_group(&[7.02, -7.02]);
    assert_eq!(s, 1.0);
    assert_eq!(&q[..2], &[7, -7]);
    // The rule itself: q = clamp(round_half_even(w / s), -8, 7).
    use speclab_quant::rtn::quantize_value;
    assert_eq!(quantize_value(100.0, 1.0), 7);
    assert_eq!(quantize_value(-100.0, 1.0), -8);
    assert_eq!(quantize_value(-8.4, 1.0), -8);
    assert_eq!(quantize_value(7.5, 1.0), 7); // ties-to-even gives 8, clamped to 7
    assert_eq!(quantize_value(-7.5, 1.0), -8); // ties-to-even gives -8, in range
    assert_eq!(quantize_value(-8.5, 1.0), -8);
    assert_eq!(quantize_value(6.5, 1.0), 6);
}

#[test]
fn rtn_zero_group_has_scale_one() {
    let (n, k) = (2, 256);
    let mut w = vec![0.0f32; n * k];
    w[130] = 3.5; // row 0, group 1
    let t = quantize_rtn(&w, n, k).unwrap();
    let s: Vec<f32> = t.scale.iter().map(|s| s.to_f32()).collect();
    assert_eq!(s, vec![1.0, 0.5, 1.0, 1.0]);
    let q = t.unpack().unwrap();
    assert_eq!(q[130], 7);
    assert!(q.iter().enumerate().all(|(i, &v)| i == 130 || v == 0));
    // -0.0 is zero too
    let t = quantize_rtn(&vec![-0.0f32; 128], 1, 128).unwrap();
    assert_eq!(t.scale[0], bf16::ONE);
}

#[test]
fn rtn_matches_rule_on_random_values() {
    let (n, k) = (3, 384);
    let w: Vec<f32> = (0..n * k)
        .map(|i| bf16::from_f32(((i * 2654435761usize) % 1000) as f32 / 173.0 - 2.9).to_f32())
        .collect();
    let t = quantize_rtn(&w, n, k).unwrap();
    let q = t.unpack().unwrap();
    for r in 0..n {
        for g in 0..3 {
            let seg = &w[r * k + g * 128..r * k + g * 128 + 128];
            let amax = seg.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            let s = bf16::from_f32(amax / 7.0).to_f32();
            assert_eq!(t.scale[r * 3 + g].to_f32(), s);
            for (j, &x) in seg.iter().enumerate() {
                let want = (x / s).round_ties_even().clamp(-8.0, 7.0) as i8;
                assert_eq!(q[r * k + g * 128 + j], want);
            }
        }
    }
}
