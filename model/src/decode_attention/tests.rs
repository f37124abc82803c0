use super::*;

/// One position at a time and one output value at a time: the order
/// every score and output is summed in.
fn attend_one_by_one(q: &[f32], keys: &[f32], values: &[f32], out: &mut [f32]) {
    let head_dim = q.len();
    let mut scores: Vec<f32> = keys
        .chunks_exact(head_dim)
        .map(|k| dot(q, k) * 0.125)
        .collect();
    softmax(&mut scores);
    for (&p, v) in scores.iter().zip(values.chunks_exact(head_dim)) {
        for (o, &x) in out.iter_mut().zip(v) {
            *o += p * x;
        }
    }
}

#[test]
fn the_softmax_exponential_is_close_to_libm_s() {
    let mut worst = 0f64;
    let mut x = 0f32;
    while x > -100.0 {
        let (got, want) = (exp_at_most_zero(x) as f64, (x as f64).exp());
        if want > 1e-37 {
            worst = worst.max(((got - want) / want).abs());
        } else {
            assert!(got < 1e-36, "e^{x} = {got}");
        }
        x -= 0.000_731;
    }
    assert!(
        worst < 4.0 * f32::EPSILON as f64,
        "relative error {worst:e}"
    );
    assert_eq!(exp_at_most_zero(0.0), 1.0);
    assert_eq!(exp_at_most_zero(f32::NEG_INFINITY), exp_at_most_zero(-87.0));
}

#[test]
fn several_sums_at_once_give_the_bits_of_one_at_a_time() {
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        (seed >> 40) as f32 / (1u64 << 24) as f32 * 4.0 - 2.0
    };
    for head_dim in [64, 80, 128, 12, 200] {
        for positions in [1, 3, 7, 8, 9, 17, 40, 70] {
            let keys: Vec<f32> = (0..positions * head_dim).map(|_| next()).collect();
            let values: Vec<f32> = (0..positions * head_dim).map(|_| next()).collect();
            let tile = Tile {
                keys: &keys,
                values: &values,
                head_dim,
                scale: 0.125,
            };
            // Queries as a prompt's rows see them (each one more
            // position), and one with a window, together in one tile.
            let seen: Vec<(usize, usize)> = (0..5)
                .map(|n| (0, positions.saturating_sub(n).max(1)))
                .chain([(positions / 2, positions)])
                .collect();
            let qs: Vec<Vec<f32>> = seen
                .iter()
                .map(|_| (0..head_dim).map(|_| next()).collect())
                .collect();
            let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            for plain in [false, true] {
                let mut outs = vec![vec![0f32; head_dim]; qs.len()];
                let mut queries: Vec<Query> = qs
                    .iter()
                    .zip(&seen)
                    .zip(outs.iter_mut())
                    .map(|((q, &(first, seen)), out)| Query {
                        q,
                        first,
                        seen,
                        out,
                    })
                    .collect();
                match plain {
                    true => tile.attend_plain(&mut queries, &mut Vec::new(), dots),
                    false => tile.attend(&mut queries, &mut Vec::new()),
                }
                for ((q, &(first, seen)), got) in qs.iter().zip(&seen).zip(&outs) {
                    let mut expected = vec![0f32; head_dim];
                    let (k, v) = (first * head_dim, seen * head_dim);
                    attend_one_by_one(q, &keys[k..v], &values[k..v], &mut expected);
                    assert_eq!(
                        bits(got),
                        bits(&expected),
                        "head_dim {head_dim}, {positions} positions, {first}..{seen}, plain {plain}"
                    );
                }
            }
        }
    }
}
