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
        (Some(bytes), per) if per > 0 => usize::try_from(bytes / 2 / per as u64).unwrap_or(usize::MAX),
        _ => wanted,
    };
    wanted.min(fits).max(max_length)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_available_is_read_in_bytes() {
        let text = "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   2048 kB\n";
        assert_eq!(parse_mem_available(text), Some(2048 * 1024));
        assert_eq!(parse_mem_available("MemTotal: 5 kB\n"), None);
    }

    #[test]
    fn the_budget_follows_sessions_and_memory() {
        // Plenty of memory: every session at full length.
        assert_eq!(default_cache_tokens(16, 2048, 1000, Some(1 << 40)), 16 * 2048);
        // 64 MB available, 1 kB a token: half of it, 32768 tokens.
        assert_eq!(default_cache_tokens(64, 2048, 1000, Some(64_000_000)), 32_000);
        // Never below one full session.
        assert_eq!(default_cache_tokens(16, 2048, 1000, Some(1000)), 2048);
        assert_eq!(default_cache_tokens(16, 2048, 1000, None), 16 * 2048);
    }
}
