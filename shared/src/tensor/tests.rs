//! The codec round-trips, refuses every truncation and corruption, and bounds before allocating.

use super::*;
use proptest::prelude::*;

#[test]
fn non_finite_values_are_found_in_every_dtype() {
    let f32s = |v: &[f32]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let p = TensorPayload::new(WireDType::F32, vec![3], f32s(&[1.0, -2.0, 0.5])).unwrap();
    assert_eq!(p.first_non_finite(), None);
    let p = TensorPayload::new(WireDType::F32, vec![3], f32s(&[1.0, f32::NAN, 0.5])).unwrap();
    assert_eq!(p.first_non_finite(), Some(1));
    let halves = |v: &[half::f16]| v.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
    let p = TensorPayload::new(
        WireDType::F16,
        vec![2],
        halves(&[half::f16::ONE, half::f16::INFINITY]),
    )
    .unwrap();
    assert_eq!(p.first_non_finite(), Some(1));
    let p = TensorPayload::new(
        WireDType::BF16,
        vec![2],
        half::bf16::NAN
            .to_le_bytes()
            .into_iter()
            .chain(half::bf16::ONE.to_le_bytes())
            .collect(),
    )
    .unwrap();
    assert_eq!(p.first_non_finite(), Some(0));
    let a = TensorPayload::new(WireDType::F32, vec![2], f32s(&[4.0, 1.0])).unwrap();
    let b = TensorPayload::new(WireDType::F32, vec![2], f32s(&[4.0, 1.2])).unwrap();
    // RMS of a: sqrt(17 / 2).
    let d = a.max_difference_relative_to_rms(&b).unwrap();
    assert!((d - 0.2 / 8.5f64.sqrt()).abs() < 1e-6, "{d}");
    assert_eq!(a.max_difference_relative_to_rms(&p), None);
}

fn payload_strategy() -> impl Strategy<Value = TensorPayload> {
    (
        prop::sample::select(WireDType::ALL.to_vec()),
        prop::collection::vec(0usize..6, 0..4),
    )
        .prop_flat_map(|(dtype, shape)| {
            let len = shape.iter().product::<usize>() * dtype.size_in_bytes();
            (
                Just(dtype),
                Just(shape),
                prop::collection::vec(any::<u8>(), len),
            )
        })
        .prop_map(|(dtype, shape, data)| {
            TensorPayload::new(dtype, shape, data).expect("strategy builds consistent payloads")
        })
}

fn f32_payload(shape: Vec<usize>, values: &[f32]) -> TensorPayload {
    let data = values.iter().flat_map(|x| x.to_le_bytes()).collect();
    TensorPayload::new(WireDType::F32, shape, data).unwrap()
}

#[test]
fn int8_blocks_round_trip_within_half_a_step_of_each_block() {
    // Two blocks and a short third, with very different magnitudes.
    let values: Vec<f32> = (0..150)
        .map(|i| {
            let magnitude = if i < 64 { 100.0 } else { 0.01 };
            magnitude * ((i as f32) * 0.37).sin()
        })
        .collect();
    let p = f32_payload(vec![1, 3, 50], &values);
    let c = p.compressed(Compression::Int8Block64);
    assert_eq!(c.data.len(), 3 * 2 + 150);
    let bytes = c.encode();
    let view = TensorView::decode(&bytes, &Limits::DEFAULT).unwrap();
    assert_eq!(view.compression, Compression::Int8Block64);
    let back = view.to_owned().decompressed();
    assert_eq!(
        (back.dtype, back.shape.clone()),
        (WireDType::F32, p.shape.clone())
    );
    for (block, (a, b)) in values.chunks(64).zip(back.to_f32().chunks(64)).enumerate() {
        let absmax = a.iter().fold(0f32, |m, v| m.max(v.abs()));
        for (x, y) in a.iter().zip(b) {
            assert!(
                (x - y).abs() <= absmax / 127.0 * 0.51 + 1e-6,
                "block {block}: {x} vs {y}"
            );
        }
    }
    // Truncating sees through the compression.
    let mut cut = c.clone();
    cut.truncate_axis1(1);
    assert_eq!(cut.shape, vec![1, 1, 50]);
    assert_eq!(cut.decompressed().to_f32().len(), 50);
    assert_eq!(c.first_non_finite(), None);
    // A zero block stays zero.
    let zeros = f32_payload(vec![70], &[0.0; 70]).compressed(Compression::Int8Block64);
    assert!(zeros.decompressed().to_f32().iter().all(|v| *v == 0.0));
}

#[test]
fn a_compressed_length_is_checked_before_reading() {
    let p = f32_payload(vec![100], &[1.0; 100]).compressed(Compression::Int8Block64);
    let mut bytes = p.encode();
    // The data length field sits after the header and one dimension.
    let at = FIXED_HEADER + 8;
    bytes[at..at + 8].copy_from_slice(&400u64.to_le_bytes());
    let err = TensorView::decode(&bytes, &Limits::DEFAULT).unwrap_err();
    assert!(
        matches!(err, TensorCodecError::LengthMismatch { expected: 104, .. }),
        "{err}"
    );
}

#[test]
fn truncating_positions_keeps_each_batch_rows_prefix() {
    // [2, 3, 2] of f16 (2 bytes each): rows of 4 bytes.
    let data: Vec<u8> = (0..24).collect();
    let mut p = TensorPayload::new(WireDType::F16, vec![2, 3, 2], data).unwrap();
    p.truncate_axis1(2);
    assert_eq!(p.shape, vec![2, 2, 2]);
    let expected: Vec<u8> = (0..8).chain(12..20).collect();
    assert_eq!(p.data, expected);
    let mut single = TensorPayload::new(WireDType::F32, vec![1, 3, 1], vec![7; 12]).unwrap();
    single.truncate_axis1(5);
    assert_eq!(single.shape, vec![1, 3, 1]);
    single.truncate_axis1(1);
    assert_eq!(
        (single.shape.clone(), single.data.len()),
        (vec![1, 1, 1], 4)
    );
}

proptest! {
    #[test]
    fn round_trips(p in payload_strategy()) {
        let bytes = p.encode();
        prop_assert_eq!(bytes.len(), p.encoded_len());
        let view = TensorView::decode(&bytes, &Limits::DEFAULT).unwrap();
        prop_assert_eq!(view.to_owned(), p);
    }

    #[test]
    fn every_truncation_is_an_error(p in payload_strategy(), cut in any::<prop::sample::Index>()) {
        let bytes = p.encode();
        let len = cut.index(bytes.len());
        prop_assert!(TensorView::decode(&bytes[..len], &Limits::DEFAULT).is_err());
    }

    #[test]
    fn every_corrupted_byte_is_an_error(
        p in payload_strategy(),
        at in any::<prop::sample::Index>(),
        flip in 1u8..=255,
    ) {
        let mut bytes = p.encode();
        let i = at.index(bytes.len());
        bytes[i] ^= flip;
        prop_assert!(TensorView::decode(&bytes, &Limits::DEFAULT).is_err());
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..256)) {
        let _ = TensorView::decode(&bytes, &Limits::DEFAULT);
    }
}

#[test]
fn rejects_oversized_claims_before_allocating() {
    let mut bytes = Vec::new();
    bytes.extend_from_slice(MAGIC);
    bytes.extend_from_slice(&[VERSION, 0, 0, 2]);
    bytes.extend_from_slice(&(1u64 << 20).to_le_bytes());
    bytes.extend_from_slice(&(1u64 << 20).to_le_bytes());
    let err = TensorView::decode(&bytes, &Limits::DEFAULT).unwrap_err();
    assert!(matches!(err, TensorCodecError::TooLarge { .. }), "{err}");
}

#[test]
fn rejects_trailing_bytes() {
    let p = TensorPayload::new(WireDType::F16, vec![2], vec![1, 2, 3, 4]).unwrap();
    let mut bytes = p.encode();
    bytes.push(0);
    assert_eq!(
        TensorView::decode(&bytes, &Limits::DEFAULT),
        Err(TensorCodecError::TrailingBytes(1))
    );
}

#[test]
fn new_checks_length() {
    assert!(TensorPayload::new(WireDType::F32, vec![3], vec![0; 8]).is_err());
}
