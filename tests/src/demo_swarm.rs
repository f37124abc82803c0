//! Swarms for the benchmarks: servers of equal shares of a model's blocks on
//! loopback, in this process (`corolla demo`'s layout is three of them).

use std::path::Path;

use corolla_server::RunningServer;

use crate::start_model_server;

/// `servers` servers of a model of `layers` blocks, the k-th holding blocks
/// `k * layers / servers..(k + 1) * layers / servers`, each with `flags`; the
/// first starts the swarm and the others join it. They re-announce every
/// 30 s, so announcements stay out of the figures.
pub async fn even_swarm(
    model: &Path,
    layers: usize,
    servers: usize,
    flags: &[&str],
) -> Vec<RunningServer> {
    let servers = servers.clamp(1, layers.max(1));
    let flags: Vec<&str> = ["--update-period", "30s"]
        .into_iter()
        .chain(flags.iter().copied())
        .collect();
    let blocks = |k: usize| format!("{}:{}", k * layers / servers, (k + 1) * layers / servers);
    let first = start_model_server(model, &blocks(0), None, &flags).await;
    let join = first.tcp_addr().map(|a| a.to_string());
    let mut started = vec![first];
    for k in 1..servers {
        started.push(start_model_server(model, &blocks(k), join.as_deref(), &flags).await);
    }
    started
}

/// `corolla demo`'s layout: three servers of a third of the blocks each.
pub async fn demo_swarm(model: &Path, layers: usize, flags: &[&str]) -> Vec<RunningServer> {
    even_swarm(model, layers, 3, flags).await
}

/// The first server's TCP address, where clients bootstrap.
pub fn bootstrap(servers: &[RunningServer]) -> anyhow::Result<libp2p::Multiaddr> {
    servers
        .first()
        .and_then(|s| s.tcp_addr().cloned())
        .ok_or_else(|| anyhow::anyhow!("the swarm's first server has no TCP address"))
}
