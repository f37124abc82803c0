//! How much memory this machine can give: what sizes the KV-cache budget
//! when `--cache-tokens` is not given.

/// Bytes the kernel says can be taken without swapping (`MemAvailable`),
/// when it says so.
pub(crate) fn available_bytes() -> Option<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_mem_available(&meminfo)
}

fn parse_mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// The default cache budget in tokens: what `max_sessions` sessions of
/// `max_length` need, but no more than half of the memory available after
/// loading the weights, and room for at least one full session.
pub(crate) fn default_cache_tokens(
    max_sessions: usize,
    max_length: usize,
    bytes_per_token: usize,
    available: Option<u64>,
) -> usize {
    let wanted = max_sessions.saturating_mul(max_length);
    let fits = match (available, bytes_per_token) {
        (Some(bytes), per) if per > 0 => {
            usize::try_from(bytes / 2 / per as u64).unwrap_or(usize::MAX)
        }
        _ => wanted,
    };
    wanted.min(fits).max(max_length)
}

/// What `--num-blocks auto` fits: blocks of `block_bytes` each, each also
/// holding `cache_tokens` positions of `cache_bytes_per_token` KV cache,
/// within `limit` less a margin (a tenth, at least 256 MiB, for activations,
/// the runtime and the allocator). At least one block, at most `num_layers`.
pub(crate) fn blocks_that_fit(
    limit: u64,
    block_bytes: u64,
    cache_tokens: u64,
    cache_bytes_per_token: u64,
    num_layers: usize,
) -> usize {
    let margin = (limit / 10).max(256 << 20);
    let usable = limit.saturating_sub(margin);
    let per_block = block_bytes
        .saturating_add(cache_tokens.saturating_mul(cache_bytes_per_token))
        .max(1);
    usize::try_from(usable / per_block)
        .unwrap_or(usize::MAX)
        .clamp(1, num_layers.max(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_blocks_fit_weights_and_cache_in_the_limit() {
        let gib = 1u64 << 30;
        // 10 GiB less 1 GiB margin; 1 GiB of weights + 0.5 GiB of cache a block: 6.
        assert_eq!(blocks_that_fit(10 * gib, gib, 1 << 20, 512, 80), 6);
        // Everything fits: every layer.
        assert_eq!(blocks_that_fit(100 * gib, 1 << 20, 1000, 16, 30), 30);
        // Nothing fits: still one block, so the server serves something.
        assert_eq!(blocks_that_fit(gib / 2, gib, 0, 0, 80), 1);
    }

    #[test]
    fn mem_available_is_read_in_bytes() {
        let text = "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   2048 kB\n";
        assert_eq!(parse_mem_available(text), Some(2048 * 1024));
        assert_eq!(parse_mem_available("MemTotal: 5 kB\n"), None);
    }

    #[test]
    fn the_budget_follows_sessions_and_memory() {
        // Plenty of memory: every session at full length.
        assert_eq!(
            default_cache_tokens(16, 2048, 1000, Some(1 << 40)),
            16 * 2048
        );
        // 64 MB available, 1 kB a token: half of it, 32768 tokens.
        assert_eq!(
            default_cache_tokens(64, 2048, 1000, Some(64_000_000)),
            32_000
        );
        // Never below one full session.
        assert_eq!(default_cache_tokens(16, 2048, 1000, Some(1000)), 2048);
        assert_eq!(default_cache_tokens(16, 2048, 1000, None), 16 * 2048);
    }
}
